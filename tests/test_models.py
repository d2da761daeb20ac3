"""Real transformers models from tiny configs (random weights, no downloads), kernelized
with our GeGLUMLP layer, against the eager model."""

import copy

import pytest
import torch
from conftest import HAS_GPU, ROOT
from kernels import (
    LocalLayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
)
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

TINY = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 136,  # a multiple of no tile size
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "gemma": (
        GemmaConfig,
        GemmaForCausalLM,
        GemmaMLP,
        {"hidden_act": "gelu_pytorch_tanh"},
    ),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma2MLP,
        {"hidden_activation": "gelu_pytorch_tanh"},
    ),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        Gemma3MLP,
        {"hidden_activation": "gelu_pytorch_tanh"},
    ),
}
for _, _, mlp_cls, _ in FAMILIES.values():
    replace_kernel_forward_from_hub(mlp_cls, "GeGLUMLP")


def tiny_model(family: str, device: str, **overrides):
    config_cls, model_cls, _, act = FAMILIES[family]
    config = config_cls(**{**TINY, **act, **overrides}, attn_implementation="eager")
    return model_cls(config).to(device).eval()


def kernelized(model, device: str, mode: Mode):
    mapping = {"GeGLUMLP": {device: LocalLayerRepository(ROOT, layer_name="GeGLUMLP")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        return kernelize(model, mode=mode, device=device)


def mlps(model):
    return [m for m in model.modules() if type(m).__name__.endswith("MLP")]


def assert_runs_our_layer(model):
    assert mlps(model), "no MLP found"
    for mlp in mlps(model):
        assert mlp.forward.__func__.__qualname__ == "GeGLUMLP.forward", (
            "kernelize kept the original forward"
        )


def inputs(device, batch=2, seq=11):
    return torch.randint(0, TINY["vocab_size"], (batch, seq), device=device)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu_new", "gelu"])
def test_inference_matches_eager(device, family, activation):
    key = "hidden_act" if family == "gemma" else "hidden_activation"
    eager = tiny_model(family, device, **{key: activation})
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    assert_runs_our_layer(ours)
    ids = inputs(device)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_match_eager(device, family):
    eager = tiny_model(family, device).train()
    ours = kernelized(copy.deepcopy(eager), device, Mode.TRAINING)
    assert_runs_our_layer(ours)
    ids = inputs(device)
    for model in (eager, ours):
        model(ids, labels=ids).loss.backward()
    for (name, p), q in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_half_precision_mlp_paths(fused_geglu, device, family):
    """16-bit plain projections where the TMA kernel runs (the interpreter, Hopper): in
    inference the layer is our dual GEMM + our down GEMM where its tiles fill the GPU (the
    profile names the ops); in training the dual GEMM too (then cuBLAS for the down
    projection and the backward GEMMs), elsewhere the projections + our activation.
    Both match the float64 module as closely as eager fp16 does, gradients included."""
    from reference import assert_close_to_ref

    dtype = torch.float16
    eager = mlps(tiny_model(family, device).to(dtype))[0]
    ours = mlps(kernelized(copy.deepcopy(tiny_model(family, device).to(dtype)), device, Mode.TRAINING))[0]  # fmt: skip
    ours.load_state_dict(eager.state_dict())
    ref = copy.deepcopy(eager).double()
    x = torch.randn(2, 80, TINY["hidden_size"], dtype=dtype, device=device)
    dy = torch.randn_like(x)

    def run(module, grad):
        xi = x.to(next(module.parameters()).dtype).clone().requires_grad_(grad)
        with torch.profiler.profile() as prof, torch.set_grad_enabled(grad):
            out = module(xi)
        if grad:
            out.backward(dy.to(out.dtype))
        grads = [xi.grad] + [p.grad for p in module.parameters()] if grad else []
        names = (e.name for e in prof.events() if "fused_geglu" in e.name)
        return out.detach(), grads, {name.split("::")[-1] for name in names}

    for module in (ours, ref, eager):
        module.zero_grad(set_to_none=True)
    (out, _, ops), (out64, _, _), (out16, _, _) = (
        run(m, False) for m in (ours, ref, eager)
    )
    # The expected route, by an independent table: the dual GEMM where the TMA kernel runs
    # (the interpreter, Hopper/Blackwell); 160 rows down to 64 columns are 5 tiles of 32 x
    # 64 for the interpreter's 4 programs (ours), 2 tiles of 128 x 256 for 132 SMs (cuBLAS).
    fused = not HAS_GPU or torch.cuda.get_device_capability()[0] in (9, 10)
    ours_down = not HAS_GPU
    assert ("geglu_linear" in ops) == fused and ("linear" in ops) == ours_down, sorted(
        ops
    )
    assert_close_to_ref(out, out64, out16)
    (out, grads, ops), (out64, grads64, _), (out16, grads16, _) = (run(m, True) for m in (ours, ref, eager))  # fmt: skip
    assert ("geglu_linear" in ops) == fused and ("geglu" in ops) != fused, sorted(ops)
    assert "linear" not in ops, sorted(ops)  # the down projection: cuBLAS in training
    assert_close_to_ref(out, out64, out16)
    for o, r, e in zip(grads, grads64, grads16):
        assert_close_to_ref(o, r, e)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_same_tokens(device, family):
    eager = tiny_model(family, device)
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    ids = inputs(device, batch=1, seq=5)
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_unsupported_activation_runs_own_forward(device):
    """A non-GeLU activation: the module's own forward (eager's logits) and a warning."""
    eager = tiny_model("gemma2", device, hidden_activation="silu")
    ours = kernelized(copy.deepcopy(eager), device, Mode.INFERENCE)
    ids = inputs(device)
    with pytest.warns(RuntimeWarning, match="SiLUActivation.*not a GeLU"):
        got = ours(ids).logits
    torch.testing.assert_close(got, eager(ids).logits, rtol=0, atol=0)


def test_saved_checkpoint_then_kernelize(device, tmp_path):
    """The load-time path a CPU user takes: from_pretrained of a safetensors checkpoint,
    then kernelize (transformers' use_kernels=True refuses the CPU; see the GPU test)."""
    eager = tiny_model("gemma3", device)
    eager.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").exists()
    loaded = Gemma3ForCausalLM.from_pretrained(tmp_path).to(device).eval()
    ours = kernelized(loaded, device, Mode.INFERENCE)
    assert_runs_our_layer(ours)
    ids = inputs(device)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4
        )


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_from_pretrained_use_kernels(device, family, tmp_path, monkeypatch):
    """transformers' load-time path: use_kernels=True with a KernelConfig, our checkout
    standing in for the Hub repository through LOCAL_KERNELS."""
    from transformers import KernelConfig

    monkeypatch.setenv("LOCAL_KERNELS", f"org/fused-geglu={ROOT}")
    eager = tiny_model(family, device)
    eager.save_pretrained(tmp_path)
    config = KernelConfig(
        kernel_mapping={"GeGLUMLP": ("org/fused-geglu:GeGLUMLP", {"revision": "main"})},
        inherit_mapping=False,
    )
    model_cls = FAMILIES[family][1]
    ours = model_cls.from_pretrained(
        tmp_path, use_kernels=True, kernel_config=config, device_map=device
    ).eval()
    assert_runs_our_layer(ours)
    ids = inputs(device)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4
        )
