"""The other GeGLU families, from tiny configs (random weights, no downloads), kernelized
with their layers against eager: transformers' T5 (and MT5, UMT5) gated dense and
ModernBERT MLP, diffusers' GEGLU."""

import copy
import warnings

import pytest
import torch
from conftest import ROOT, run_python
from diffusers.models.activations import GEGLU
from diffusers.models.attention import FeedForward
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from kernels import (
    LocalLayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)
from torch import nn
from transformers import (
    ModernBertConfig,
    ModernBertForMaskedLM,
    MT5Config,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
)
from transformers.models.modernbert.modeling_modernbert import ModernBertMLP
from transformers.models.mt5.modeling_mt5 import MT5DenseGatedActDense
from transformers.models.t5.modeling_t5 import T5DenseGatedActDense
from transformers.models.umt5.modeling_umt5 import UMT5DenseGatedActDense

LAYER_NAMES = {
    T5DenseGatedActDense: "T5GeGLUDense",
    MT5DenseGatedActDense: "T5GeGLUDense",
    UMT5DenseGatedActDense: "T5GeGLUDense",
    ModernBertMLP: "ModernBertGeGLUMLP",
    GEGLU: "GEGLU",
}
for _cls, _name in LAYER_NAMES.items():
    replace_kernel_forward_from_hub(_cls, _name)

# diffusers' own deprecation, raised inside Transformer2DModel's forward.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`Transformer2DModelOutput` is deprecated:FutureWarning"
)

VOCAB = 96
T5_TINY = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 72,  # a multiple of no tile size
    "num_layers": 2,
    "num_decoder_layers": 1,
    "num_heads": 2,
    "feed_forward_proj": "gated-gelu",  # T5 v1.1: dense_act_fn "gelu_new" (tanh)
    "dropout_rate": 0.0,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
}
MODERNBERT_TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 40,  # Wi is [80, 32]
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "cls_token_id": 1,
    "sep_token_id": 2,
}


def tiny_t5(device, **overrides):
    config = T5Config(**{**T5_TINY, **overrides})
    return T5ForConditionalGeneration(config).to(device).eval()


def tiny_modernbert(device, **overrides):
    config = ModernBertConfig(
        **{**MODERNBERT_TINY, **overrides}, attn_implementation="eager"
    )
    return ModernBertForMaskedLM(config).to(device).eval()


def tiny_transformer2d(device, **overrides):
    """A Transformer2DModel block: attention, cross-attention, FeedForward(GEGLU)."""
    model = Transformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        norm_num_groups=4,
        cross_attention_dim=24,
        **overrides,
    )
    return model.to(device).eval()


def kernelized(model, device, mode):
    names = set(LAYER_NAMES.values())
    mapping = {n: {device: LocalLayerRepository(ROOT, layer_name=n)} for n in names}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        return kernelize(model, mode=mode, device=device)


def assert_runs_our_layer(model):
    found = [m for m in model.modules() if type(m) in LAYER_NAMES]
    assert found, "no GeGLU module found"
    for m in found:
        assert m.forward.__func__.__qualname__ == f"{LAYER_NAMES[type(m)]}.forward", (
            f"kernelize kept {type(m).__name__}'s original forward"
        )


def ids(device, batch=2, seq=9):
    return torch.randint(3, VOCAB, (batch, seq), device=device)


# A step of each family on fixed inputs: model -> (output to compare, scalar loss).
def t5_step(device):
    x, labels = ids(device), ids(device, seq=6)

    def step(model):
        out = model(input_ids=x, labels=labels)
        return out.logits, out.loss

    return step


def modernbert_step(device):
    x = ids(device)

    def step(model):
        out = model(input_ids=x, labels=x)
        return out.logits, out.loss

    return step


def transformer2d_step(device):
    x = torch.randn(2, 16, 4, 4, device=device)
    enc = torch.randn(2, 3, 24, device=device)

    def step(model):
        sample = model(x, encoder_hidden_states=enc).sample
        return sample, sample.square().mean()

    return step


FAMILIES = {
    "t5": (tiny_t5, t5_step, {}),
    "modernbert": (tiny_modernbert, modernbert_step, {"mlp_bias": False}),
    "modernbert-bias": (tiny_modernbert, modernbert_step, {"mlp_bias": True}),
    "diffusers": (tiny_transformer2d, transformer2d_step, {}),
}


def family_models(family, device, mode, **overrides):
    build, step, defaults = FAMILIES[family]
    eager = build(device, **{**defaults, **overrides})
    ours = kernelized(copy.deepcopy(eager), device, mode)
    assert_runs_our_layer(ours)
    return eager, ours, step(device)


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_matches_eager(device, family):
    eager, ours, step = family_models(family, device, Mode.INFERENCE)
    with torch.no_grad():
        expected, got = step(eager)[0], step(ours)[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_match_eager(device, family):
    eager, ours, step = family_models(family, device, Mode.TRAINING)
    for model in (eager, ours):
        step(model.train())[1].backward()
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("family", "dropout"),
    [
        ("t5", {"dropout_rate": 0.3}),
        ("modernbert", {"mlp_dropout": 0.3}),
        ("diffusers", {"dropout": 0.3}),
    ],
)
def test_train_mode_dropout_draws_the_same_random_numbers(device, family, dropout):
    """Same seed, same masks: our layers apply the original dropout module at the same
    point, so every dropout of the model (ours and those after it) draws what eager's did.
    A different mask anywhere would move the outputs by O(1), not 1e-4."""
    eager, ours, step = family_models(family, device, Mode.TRAINING, **dropout)
    outputs = []
    for model in (eager.train(), ours.train()):
        torch.manual_seed(1234)
        outputs.append(step(model)[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-4, atol=1e-4)


def gated_dense(module_cls, config_cls, dense_act_fn="gelu_new"):
    config = config_cls(**T5_TINY)
    config.dense_act_fn = dense_act_fn  # the configs derive it from feed_forward_proj
    return module_cls(config)


@pytest.mark.parametrize(
    ("module_cls", "config_cls", "dense_act_fn"),
    [
        (T5DenseGatedActDense, T5Config, "gelu"),  # exact GeLU
        (MT5DenseGatedActDense, MT5Config, "gelu_new"),
        (UMT5DenseGatedActDense, UMT5Config, "gelu_new"),
    ],
)
def test_gated_dense_modules(device, module_cls, config_cls, dense_act_fn):
    eager = gated_dense(module_cls, config_cls, dense_act_fn).to(device)
    ours = kernelized(copy.deepcopy(eager), device, Mode.TRAINING)
    assert_runs_our_layer(ours)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    expected, got = eager(x), ours(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    (dx_eager,) = torch.autograd.grad(expected.square().sum(), x)
    (dx_ours,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(dx_ours, dx_eager, rtol=1e-4, atol=1e-5)


def test_t5_wo_kept_in_float32(device):
    """As the original: an fp16 GeGLU output meets an fp32 ``wo`` (transformers'
    ``_keep_in_fp32_modules``) and is cast to fp32 before it."""
    eager = gated_dense(T5DenseGatedActDense, T5Config).to(device).half()
    eager.wo.float()
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    x = torch.randn(2, 5, 32, device=device, dtype=torch.float16)
    with torch.no_grad():
        expected, got = eager(x), ours(x)
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)


class _ScaledLinear(nn.Linear):
    """Stands for a LoRA or quantised linear: not a plain nn.Linear, its own forward."""

    def forward(self, x):
        return super().forward(x) * 0.5


class _OpNames:
    """Records the names of our ops that run (from the profiler: eager calls skip the
    dispatcher but keep the op's name in profiles)."""

    def __enter__(self):
        self.names = set()
        self._prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        )
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        for event in self._prof.events():
            if event.name.startswith("_fused_geglu_"):
                self.names.add(event.name.split("::")[-1].split(".")[0])


# Each family's module alone (input width 32), and its (gate) projection's name.
MODULES = {
    "t5": (lambda: gated_dense(T5DenseGatedActDense, T5Config), "wi_0"),
    "modernbert": (
        lambda: ModernBertMLP(ModernBertConfig(**MODERNBERT_TINY, mlp_bias=True)),
        "Wi",
    ),
    "diffusers": (lambda: GEGLU(32, 40), "proj"),
}
# The activation op each family's layer runs: one projection's halves take geglu_halves,
# whose backward returns the projection's gradient whole (no concatenation).
ACTIVATION_OP = {
    "t5": "geglu",
    "modernbert": "geglu_halves",
    "diffusers": "geglu_halves",
}


def wrap_projection(module, name):
    plain = getattr(module, name)
    wrapped = _ScaledLinear(
        plain.in_features, plain.out_features, plain.bias is not None
    ).to(plain.weight.device)
    wrapped.load_state_dict(plain.state_dict())
    setattr(module, name, wrapped)


@pytest.mark.parametrize("projection", ["plain", "wrapped", "hooked"])
@pytest.mark.parametrize("family", MODULES)
def test_projections_keep_their_forwards(device, family, projection):
    """Every projection (plain, a subclass such as LoRA or a quantised linear, a hooked one)
    runs its own forward, then our fused activation: the layers never read a weight
    behind a module's back."""
    build, name = MODULES[family]
    eager = build().to(device)
    if projection == "wrapped":
        wrap_projection(eager, name)
    ours = kernelized(copy.deepcopy(eager), device, Mode.TRAINING)
    if projection == "hooked":  # accelerate's offloading loads the weight in such hooks
        for m in (eager, ours):
            getattr(m, name).register_forward_pre_hook(lambda mod, args: None)
    x = torch.randn(2, 5, 32, device=device)
    with _OpNames() as ops:
        got = ours(x)
    torch.testing.assert_close(got, eager(x), rtol=1e-4, atol=1e-4)
    assert ACTIVATION_OP[family] in ops.names, sorted(ops.names)
    assert "geglu_linear" not in ops.names, sorted(ops.names)


# The activation's outputs per row of x in MODULES' modules, and the family whose GeLU is
# a formula of several ops (T5's gelu_new) rather than one F.gelu.
ACTIVATION_WIDTH = {"t5": 72, "modernbert": 40, "diffusers": 40}
FORMULA_GELU = {"t5"}


@pytest.mark.parametrize("projection", ["plain", "wrapped"])
@pytest.mark.parametrize("family", MODULES)
def test_small_training_calls_run_eager_ops(
    fused_geglu, monkeypatch, device, family, projection
):
    """training_kernel_min_elements (the tuning table's): a training call with fewer activation outputs
    runs eager's ops where the module's GeLU is one F.gelu (ModernBERT's, diffusers'),
    and our activation from that many on; with T5's gelu_new (several ops) ours at every
    size. Plain projections (the module's own forward) and wrapped ones (eager's
    activation after their forwards) alike; gradients equal eager's."""
    build, name = MODULES[family]
    eager = build().to(device)
    if projection == "wrapped":
        wrap_projection(eager, name)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    outputs = 10 * ACTIVATION_WIDTH[family]
    projected = []  # the layer's own path past the route (plain projections skip it)
    real = fused_geglu.layers.geglu_projections
    monkeypatch.setattr(
        fused_geglu.layers,
        "geglu_projections",
        lambda *args: projected.append(1) or real(*args),
    )
    ours = kernelized(copy.deepcopy(eager), device, Mode.TRAINING)
    ours(x)  # a route made from the table before: the table's change must replace it
    for threshold, small in ((outputs + 1, True), (outputs, False)):
        table = {"training_kernel_min_elements": threshold}
        with fused_geglu.tuning.use(device, **table):
            for q in ours.parameters():
                q.grad = None
            projected.clear()
            with _OpNames() as ops:
                got = ours(x)
                got.square().sum().backward()
            runs_ours = not small or family in FORMULA_GELU
            assert bool(projected) == (runs_ours or projection == "wrapped")
            expected = eager(x)
            expected.square().sum().backward()
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            for (n, p), q in zip(eager.named_parameters(), ours.parameters()):
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-4, msg=n)
                p.grad = None
            assert (ACTIVATION_OP[family] in ops.names) == runs_ours, sorted(ops.names)
            x.grad = None
            with torch.no_grad(), _OpNames() as ops:  # inference: ours at every size
                ours(x)
            assert ops.names, "inference ran none of our ops"


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("family", MODULES)
def test_functional_call_over_parameters(device, family, transform):
    """torch.func over a kernelized module's parameters (functional_call under grad or
    vmap, as per-sample-gradient tools use it): the parameters are the transform's
    tensors, which the kernels cannot read, so the module runs its own forward, warning
    why; eager's results. A plain call afterwards runs our kernels again."""
    build, _ = MODULES[family]
    eager = build().to(device)
    ours = kernelized(copy.deepcopy(eager), device, Mode.TRAINING)
    x = torch.randn(3, 5, 32, device=device)
    ours(x)  # a route made with the module's own parameters
    params = {k: v.detach() for k, v in eager.named_parameters()}
    name = next(k for k in params if k.endswith("weight"))

    def run(model):
        if transform == "grad":
            loss = lambda p: torch.func.functional_call(model, p, (x,)).square().sum()
            return torch.func.grad(loss)(params)
        stacked = torch.stack([params[name], 2 * params[name]])
        one = lambda w: torch.func.functional_call(model, {**params, name: w}, (x,))
        return {"out": torch.func.vmap(one)(stacked)}

    expected = run(eager)
    with pytest.warns(RuntimeWarning, match="torch.func transform tensors"):
        got = run(ours)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)
    with torch.no_grad(), _OpNames() as ops:
        ours(x)
    assert ops.names, "a plain call after the transform ran none of our ops"


def test_autocast_keeps_eager_casts(device):
    """Under autocast the projections run through it (as eager), then our activation."""
    eager = gated_dense(T5DenseGatedActDense, T5Config).to(device)
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    x = torch.randn(2, 5, 32, device=device)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    with torch.no_grad(), torch.autocast(device, dtype=dtype), _OpNames() as ops:
        expected, got = eager(x), ours(x)
    assert got.dtype == expected.dtype == dtype
    assert "geglu_linear" not in ops.names and "geglu" in ops.names
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    ("family", "overrides", "flag"),
    [
        ("t5", {"feed_forward_proj": "gated-silu"}, "feed_forward_proj"),
        ("modernbert", {"hidden_activation": "silu"}, "hidden_activation"),
    ],
)
def test_unsupported_activation_runs_own_forward(device, family, overrides, flag):
    """A non-GeLU activation: the module's own forward, eager's result, and a warning that
    names the activation."""
    eager, ours, step = family_models(family, device, Mode.INFERENCE, **overrides)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="SiLUActivation.*not a GeLU"):
            got = step(ours)[0]
        torch.testing.assert_close(got, step(eager)[0], rtol=0, atol=0)


def test_geglu_scale_argument_warns_as_diffusers(device):
    eager = GEGLU(32, 40).to(device)
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    x = torch.randn(2, 5, 32, device=device)
    messages = []
    for module in (eager, ours):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = module(x, scale=0.5)
        messages.append([(w.category, str(w.message)) for w in caught])
    assert messages[1] == messages[0] and messages[0][0][0] is FutureWarning
    torch.testing.assert_close(out, eager(x), rtol=1e-4, atol=1e-4)


def test_feed_forward_geglu(device):
    eager = FeedForward(32, inner_dim=40, activation_fn="geglu").to(device)
    ours = kernelized(copy.deepcopy(eager), device, Mode.TRAINING)
    assert_runs_our_layer(ours)
    x = torch.randn(2, 5, 32, device=device)
    for model in (eager, ours):
        model(x).square().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", MODULES)
def test_torch_compile_fullgraph(device, family):
    """Mode.TORCH_COMPILE: the layers (and their plain-linear checks) trace without
    graph breaks; forward and input gradient as eager."""
    torch._dynamo.reset()
    eager = MODULES[family][0]().to(device).eval()
    ours = kernelized(copy.deepcopy(eager), device, Mode.TRAINING | Mode.TORCH_COMPILE)
    compiled = torch.compile(ours, fullgraph=True)
    x = torch.randn(2, 5, 32, device=device, requires_grad=True)
    expected, got = eager(x), compiled(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    (dx_eager,) = torch.autograd.grad(expected.square().sum(), x)
    (dx_ours,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(dx_ours, dx_eager, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_torch_compile_fullgraph_first_call_of_a_process():
    """The first call of a fresh process traced by torch.compile(fullgraph=True): the
    launch table is looked up while tracing (the GPU's properties, which Dynamo folds),
    no graph break."""
    script = f"""
        import copy, torch
        from pathlib import Path
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
        from kernels import replace_kernel_forward_from_hub
        from transformers import GemmaConfig
        from transformers.models.gemma.modeling_gemma import GemmaMLP

        replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
        config = GemmaConfig(hidden_size=64, intermediate_size=128)
        eager = GemmaMLP(config).to("cuda", torch.bfloat16)
        ours = copy.deepcopy(eager)
        layer = LocalLayerRepository(Path({str(ROOT)!r}), layer_name="GeGLUMLP")
        with use_kernel_mapping({{"GeGLUMLP": {{"cuda": layer}}}}, inherit_mapping=False):
            kernelize(ours, mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cuda")
        x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            got = torch.compile(ours, fullgraph=True)(x)
            torch.testing.assert_close(got, eager(x), rtol=2e-2, atol=2e-2)
    """
    result = run_python(script, no_network=True, HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr[-3000:]


def test_t5_greedy_generate_same_tokens(device):
    eager = tiny_t5(device)
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    x = ids(device, batch=1, seq=5)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "output_scores": True}
    got, expected = (
        m.generate(x, return_dict_in_generate=True, **kwargs) for m in (ours, eager)
    )
    assert torch.equal(got.sequences, expected.sequences)
    # A random tiny model repeats one token; the scores still check every decode step.
    for ours_step, eager_step in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(ours_step, eager_step, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["t5", "modernbert-bias"])
def test_saved_checkpoint_then_kernelize(device, family, tmp_path):
    """The load-time path a CPU user takes: from_pretrained of a safetensors checkpoint,
    then kernelize. T5 loads in fp16, so ``_keep_in_fp32_modules`` keeps ``wo`` in fp32."""
    build, step, defaults = FAMILIES[family]
    build(device, **defaults).save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists()
    model_cls = T5ForConditionalGeneration if family == "t5" else ModernBertForMaskedLM
    dtype = torch.float16 if family == "t5" else torch.float32
    eager = model_cls.from_pretrained(tmp_path, dtype=dtype).to(device).eval()
    if family == "t5":
        wo = eager.encoder.block[0].layer[1].DenseReluDense.wo
        assert wo.weight.dtype == torch.float32
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    assert_runs_our_layer(ours)
    step = step(device)
    with torch.no_grad():
        expected, got = step(eager)[0], step(ours)[0]
    # fp16: logits up to ~5 in this model, where one fp16 ulp is 4e-3.
    tol = 1e-2 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["t5", "modernbert-bias"])
def test_from_pretrained_use_kernels(device, family, tmp_path, monkeypatch):
    """transformers' load-time path: use_kernels=True with a KernelConfig, our checkout
    standing in for the Hub repository through LOCAL_KERNELS."""
    from transformers import KernelConfig

    monkeypatch.setenv("LOCAL_KERNELS", f"org/fused-geglu={ROOT}")
    build, step, defaults = FAMILIES[family]
    eager = build(device, **defaults)
    eager.save_pretrained(tmp_path)
    name = "T5GeGLUDense" if family == "t5" else "ModernBertGeGLUMLP"
    config = KernelConfig(
        kernel_mapping={name: (f"org/fused-geglu:{name}", {"revision": "main"})},
        inherit_mapping=False,
    )
    model_cls = type(eager)
    ours = model_cls.from_pretrained(
        tmp_path, use_kernels=True, kernel_config=config, device_map=device
    ).eval()
    assert_runs_our_layer(ours)
    step = step(device)
    with torch.no_grad():
        expected, got = step(eager)[0], step(ours)[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_route_fingerprint_is_a_compile_time_constant(fused_geglu):
    """route._reproduces carries the mark torch.compiler.assume_constant_result sets."""
    marked = torch.compiler.assume_constant_result(lambda: None)
    marks = {k for k in vars(marked) if k.startswith("_dynamo")}
    assert marks and all(
        getattr(fused_geglu.reproduction._reproduces, k) for k in marks
    )
