"""The GeGLU dual GEMM and the two-kernel MLP against float64 autograd."""

import copy
from functools import partial

import pytest
import reference
import torch
import torch.nn.functional as F
from conftest import HAS_GPU
from launches import spy_launches
from reference import (
    assert_all_close,
    assert_close_to_ref,
    cast,
    check_against_float64,
    eager_geglu_mlp,
    fwd_bwd,
)

# bf16 on the CPU: test_bf16_interpreted (the interpreter truncates to bf16: its error
# is not eager's at the shapes here)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])


def params(h, i, dtype, device, bias):
    wg = torch.randn(i, h, dtype=dtype, device=device) / h**0.5
    wu = torch.randn(i, h, dtype=dtype, device=device) / h**0.5
    wd = torch.randn(h, i, dtype=dtype, device=device) / i**0.5
    bs = (
        [torch.randn(n, dtype=dtype, device=device) for n in (i, i, h)]
        if bias
        else [None] * 3
    )
    return [wg, wu, wd, *bs]


@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_geglu_mlp(fused_geglu, device, tokens, dtype, bias, approximate):
    hidden, inter = 72, 200
    x = torch.randn(2, tokens, hidden, dtype=dtype, device=device)
    ps = params(hidden, inter, dtype, device, bias)
    dy = torch.randn(2, tokens, hidden, dtype=dtype, device=device)

    check_against_float64(
        partial(fused_geglu.geglu_mlp, approximate=approximate),
        partial(eager_geglu_mlp, approximate=approximate),
        [x, *ps],
        dy,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("gate_first", [True, False])
def test_fused_weight_halves(fused_geglu, device, monkeypatch, gate_first, dtype):
    """One [2I, H] weight (ModernBERT gate-first, diffusers up-first), passed as row
    slices: no copy, and gradients land in the right halves. In fp16 past 64 tokens the
    forward is the TMA kernel's stacked [2, I, H] box (where TMA runs), either order."""
    hidden, inter = 40, 96
    wi = torch.randn(2 * inter, hidden, dtype=dtype, device=device) / hidden**0.5
    wi.requires_grad_()
    bi = torch.randn(2 * inter, dtype=dtype, device=device, requires_grad=True)
    x = torch.randn(130, hidden, dtype=dtype, device=device)
    g, u = (
        (slice(0, inter), slice(inter, None))
        if gate_first
        else (slice(inter, None), slice(0, inter))
    )
    w_gate, w_up = wi[g], wi[u]
    assert w_gate.data_ptr() in (wi.data_ptr(), wi[inter:].data_ptr())
    launched = spy_launches(fused_geglu, monkeypatch)
    h = fused_geglu.geglu_linear(x, w_gate, w_up, bi[g], bi[u], approximate="none")
    tma = not HAS_GPU or torch.cuda.get_device_capability()[0] in (9, 10)
    expected = "gemm_tma_kernel" if dtype == torch.float16 and tma else "gemm_kernel"
    assert launched == [expected]
    h.float().square().sum().backward()

    def ref(wi, bi):
        proj = F.linear(x.to(wi.dtype), wi, bi)
        return F.gelu(proj[:, g]) * proj[:, u]

    wi64 = wi.detach().double().requires_grad_()
    bi64 = bi.detach().double().requires_grad_()
    out64 = ref(wi64, bi64)
    out64.square().sum().backward()
    wie = wi.detach().clone().requires_grad_()
    bie = bi.detach().clone().requires_grad_()
    eager = ref(wie, bie)
    eager.float().square().sum().backward()
    assert_close_to_ref(h, out64, eager)
    assert_close_to_ref(wi.grad, wi64.grad, wie.grad)
    assert_close_to_ref(bi.grad, bi64.grad, bie.grad)


def test_no_intermediates_without_grad(fused_geglu, device):
    """Inference stores neither gate nor up: the op returns empty pre-activations."""
    x = torch.randn(4, 32, device=device)
    wg, wu = torch.randn(64, 32, device=device), torch.randn(64, 32, device=device)
    with torch.no_grad():
        h, gate, up = fused_geglu.library.geglu_linear.op(
            x, wg, wu, None, None, "tanh", False
        )
    assert gate.numel() == 0 and up.numel() == 0 and h.shape == (4, 64)


def test_opcheck_and_compile(fused_geglu, device):
    x = torch.randn(3, 5, 24, device=device, requires_grad=True)
    wg = torch.randn(40, 24, device=device, requires_grad=True)
    wu = torch.randn(40, 24, device=device, requires_grad=True)
    bg = torch.randn(40, device=device, requires_grad=True)
    bu = torch.randn(40, device=device, requires_grad=True)
    args = (x, wg, wu, bg, bu)
    torch.library.opcheck(
        fused_geglu.library.geglu_linear.op,
        (*(t.detach() for t in args), "tanh", True),
    )
    torch._dynamo.reset()
    wd = torch.randn(24, 40, device=device, requires_grad=True)
    fn = torch.compile(fused_geglu.geglu_mlp, fullgraph=True)
    torch.testing.assert_close(fn(x, wg, wu, wd), fused_geglu.geglu_mlp(x, wg, wu, wd))
    # The compiled backward's gradients against float64, as closely as eager's.
    inputs, dy = [x, wg, wu, wd, bg, bu], torch.randn(3, 5, 24, device=device)
    assert_all_close(
        fwd_bwd(fn, inputs, dy),
        fwd_bwd(eager_geglu_mlp, cast(inputs, torch.float64), dy),
        fwd_bwd(eager_geglu_mlp, inputs, dy),
        what="compiled geglu_mlp (out, dx, dwg, dwu, dwd, dbg, dbu)",
    )


@pytest.mark.parametrize("tokens", [70, 200])
def test_layer_down_projection_route(fused_geglu, device, monkeypatch, tokens):
    """After the dual GEMM, the layer projects down with our GEMM where its tiles fill the
    GPU, else with the module itself (cuBLAS, which splits K); both give the module's
    result. In the interpreter (4 programs) 70 rows are 3 tiles, 200 rows 7."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    hidden, inter, dtype = 64, 136, torch.float16
    config = GemmaConfig(
        hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh"
    )
    mlp = GemmaMLP(config).to(device, dtype)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    launched = spy_launches(fused_geglu, monkeypatch)
    with torch.no_grad():
        out = fused_geglu.layers.GeGLUMLP.forward(mlp, x)
        eager = mlp(x)
        ref = copy.deepcopy(mlp).double()(x.double())
    # The expected route, by an independent table: the interpreter grid is 4 programs and
    # its tiles 32 x 64 (70 rows: 3 tiles, 200 rows: 7); an H200 has 132 SMs and 128 x 256
    # TMA tiles (1 or 2 tiles): the down projection is ours only at 200 rows, interpreted.
    ours_down = {(False, 70): False, (False, 200): True}.get((HAS_GPU, tokens), False)
    down = ["gemm_tma_kernel"] if ours_down else []
    assert launched == ["gemm_tma_kernel", *down]
    assert_close_to_ref(out, ref, eager)


@pytest.mark.parametrize("call", ["layer", "geglu_mlp"])
def test_small_training_calls_run_eager_ops(fused_geglu, device, monkeypatch, call):
    """training_kernel_min_elements (the tuning table's): below that many activation outputs (tokens x
    intermediate) a training call of Gemma's MLP (one F.gelu) or of ``geglu_mlp`` runs
    eager's ops, from that many our activation; the results and gradients are eager's."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    hidden, inter, tokens = 64, 136, 6
    config = GemmaConfig(
        hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh"
    )
    mlp = GemmaMLP(config).to(device)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    weights = [p.weight for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    ours = {
        "layer": lambda: fused_geglu.layers.GeGLUMLP.forward(mlp, x),
        "geglu_mlp": lambda: fused_geglu.geglu_mlp(x, *weights),
    }[call]
    inputs = [x, *weights]
    expected = mlp(x)
    expected_grads = torch.autograd.grad(expected.square().sum(), inputs)
    ours()  # a route made from the table before
    for threshold, small in ((tokens * inter + 1, True), (tokens * inter, False)):
        table = {"training_kernel_min_elements": threshold}
        with fused_geglu.tuning.use(device, **table):  # the route made before: replaced
            launched = spy_launches(fused_geglu, monkeypatch)
            got = ours()
            grads = torch.autograd.grad(got.square().sum(), inputs)
            assert bool(launched) != small, launched
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            for g, e in zip(grads, expected_grads):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


# --- The whole MLP in one launch (inference, at most ONE_LAUNCH_MAX_TOKENS tokens) -------------

ONE_LAUNCH_DTYPES = [torch.float16] + ([torch.bfloat16] if HAS_GPU else [])


def _scratch_is_zero(fused_geglu) -> bool:
    """The one-launch kernel leaves its fp32 sums and arrival count zero."""
    return all(
        not s.any() and not a.any() for s, a in fused_geglu.one_launch._SCRATCH.values()
    )


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("dtype", ONE_LAUNCH_DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_mlp_in_one_launch(fused_geglu, device, monkeypatch, tokens, dtype, bias, approximate):  # fmt: skip
    """Up to 16 tokens in inference the MLP is one kernel, within the rule of float64 (its
    fp32 sums over the intermediate columns are added in another order than eager's: the
    accumulation floor). Hidden 72 and intermediate 200 leave partial K, column and
    output tiles; the output starts as NaN (a missed element fails)."""
    hidden, inter = 72, 200
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    ps = params(hidden, inter, dtype, device, bias)
    launched = spy_launches(fused_geglu, monkeypatch)
    empty = fused_geglu.library.empty
    monkeypatch.setattr(
        fused_geglu.library,
        "empty",
        lambda like, *shape, dtype=None: empty(like, *shape, dtype=dtype).fill_(
            float("nan")
        ),
    )
    with torch.no_grad():
        out = fused_geglu.geglu_mlp(x, *ps, approximate=approximate)
        again = fused_geglu.geglu_mlp(x, *ps, approximate=approximate)
    assert launched == ["one_launch_mlp_kernel"] * 2
    assert _scratch_is_zero(fused_geglu)
    ref = eager_geglu_mlp(*cast([x, *ps], torch.float64), approximate=approximate)
    eager = eager_geglu_mlp(x, *ps, approximate=approximate)
    floor = reference.accumulation_floor(ref, inter)
    for result in (out, again):
        assert_close_to_ref(result, ref, eager, floor=floor, what="one-launch MLP")


@pytest.mark.parametrize("dtype", ONE_LAUNCH_DTYPES, ids=str)
def test_mlp_in_one_launch_every_row(fused_geglu, device, dtype):
    """Many launches of 2 to 16 rows in a row, over several programs and output tiles (the
    last one partial): every row of every output within the rule of float64. On the H200
    the last program's plain loads of the sums read zeros for some elements of rows past
    the first (most launches had some: docs/decisions/0003-one-launch-decode-mlp.md); the interpreter runs
    programs in turn and cannot race."""
    hidden, inter = 640, 1024
    wg, wu, wd, bg, bu, bd = params(hidden, inter, dtype, device, True)
    generator = torch.Generator().manual_seed(0)
    for launch in range(40 if HAS_GPU else 2):
        rows = int(torch.randint(2, 17, (), generator=generator))
        x = torch.randn(rows, hidden, dtype=dtype, device=device)
        out = torch.full((rows, hidden), float("nan"), dtype=dtype, device=device)
        fused_geglu.one_launch.one_launch_mlp(
            x, wg, wu, wd, out, fused_geglu.gemm.GELU_TANH, bias_gate=bg, bias_up=bu,
            bias_down=bd,
        )  # fmt: skip
        ref = eager_geglu_mlp(*cast([x, wg, wu, wd, bg, bu, bd], torch.float64))
        eager = eager_geglu_mlp(x, wg, wu, wd, bg, bu, bd)
        floor = reference.accumulation_floor(ref, inter)
        assert_close_to_ref(
            out, ref, eager, floor=floor, what=f"launch {launch}, {rows} rows"
        )
    assert _scratch_is_zero(fused_geglu)


def test_mlp_in_one_launch_other_output_width(fused_geglu, device, monkeypatch):
    """A down projection whose output width (40) is not the input's (72): the one launch
    writes every output column and no more (the output sits in a NaN buffer that must keep
    its tail), within the rule of float64."""
    hidden, inter, out_width, dtype = 72, 200, 40, torch.float16
    x = torch.randn(3, hidden, dtype=dtype, device=device)
    wg, wu, _, bg, bu, _ = params(hidden, inter, dtype, device, True)
    wd = torch.randn(out_width, inter, dtype=dtype, device=device) / inter**0.5
    bd = torch.randn(out_width, dtype=dtype, device=device)
    buffer = torch.full((3 * out_width + 64,), float("nan"), dtype=dtype, device=device)
    out = buffer[: 3 * out_width].view(3, out_width)
    launched = spy_launches(fused_geglu, monkeypatch)
    fused_geglu.one_launch.one_launch_mlp(
        x, wg, wu, wd, out, fused_geglu.gemm.GELU_TANH, bias_gate=bg, bias_up=bu,
        bias_down=bd,
    )  # fmt: skip
    with torch.no_grad():
        routed = fused_geglu.geglu_mlp(x, wg, wu, wd, bg, bu, bd)
    assert launched == ["one_launch_mlp_kernel"] * 2
    assert buffer[3 * out_width :].isnan().all()
    ref = eager_geglu_mlp(*cast([x, wg, wu, wd, bg, bu, bd], torch.float64))
    eager = eager_geglu_mlp(x, wg, wu, wd, bg, bu, bd)
    floor = reference.accumulation_floor(ref, inter)
    for result in (out, routed):
        assert_close_to_ref(
            result, ref, eager, floor=floor, what="one launch, 72 -> 40"
        )


def test_trainable_down_behind_frozen_projections(fused_geglu, device):
    """Frozen gate/up and an input without grad, a trainable down projection: the dual
    GEMM runs (nothing to differentiate there) and the down projection trains through
    cuBLAS; eager's gradient. 200 rows: where our GEMM would take the down projection in
    inference (test_layer_down_projection_route)."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    hidden, inter, dtype = 64, 136, torch.float16
    config = GemmaConfig(
        hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh"
    )
    mlp = GemmaMLP(config).to(device, dtype)
    mlp.gate_proj.requires_grad_(False)
    mlp.up_proj.requires_grad_(False)
    eager = copy.deepcopy(mlp)
    x = torch.randn(200, hidden, dtype=dtype, device=device)
    fused_geglu.layers.GeGLUMLP.forward(mlp, x).float().square().sum().backward()
    eager(x).float().square().sum().backward()
    ref = copy.deepcopy(eager).double()
    ref.down_proj.weight.grad = None
    ref(x.double()).square().sum().backward()
    assert_close_to_ref(
        mlp.down_proj.weight.grad, ref.down_proj.weight.grad, eager.down_proj.weight.grad,
        floor=reference.accumulation_floor(ref.down_proj.weight.grad, 200),
        what="down_proj.weight.grad",
    )  # fmt: skip


def test_mlp_one_launch_limits(fused_geglu, device, monkeypatch):
    """17 tokens, a recorded gradient, or deterministic algorithms: the two-kernel route
    (the dual GEMM, then cuBLAS), with the same result as the one launch's rule."""
    hidden, inter, dtype = 64, 96, torch.float16
    ps = params(hidden, inter, dtype, device, True)
    launched = spy_launches(fused_geglu, monkeypatch)
    with torch.no_grad():
        fused_geglu.geglu_mlp(torch.randn(17, hidden, dtype=dtype, device=device), *ps)
    assert launched == ["gemm_kernel"]
    launched.clear()
    x = torch.randn(3, hidden, dtype=dtype, device=device)
    with torch.no_grad():
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
            fused_geglu.geglu_mlp(x, *ps)
        assert launched == ["gemm_kernel"]
        launched.clear()
        fused_geglu.geglu_mlp(x, *ps)
    assert launched == ["one_launch_mlp_kernel"]
    launched.clear()
    fused_geglu.geglu_mlp(x, *(p.requires_grad_() for p in ps))
    assert "one_launch_mlp_kernel" not in launched
    # No intermediate columns: the output is the down projection's bias.
    out = torch.full((3, hidden), float("nan"), dtype=dtype, device=device)
    empty = torch.empty(0, hidden, dtype=dtype, device=device)
    down = torch.empty(hidden, 0, dtype=dtype, device=device)
    fused_geglu.one_launch.one_launch_mlp(
        x, empty, empty, down, out, 1, bias_down=ps[5]
    )
    assert torch.equal(out, ps[5].expand_as(out))
    with pytest.raises(ValueError, match="at most 16 rows"):
        out = torch.empty(17, hidden, dtype=dtype, device=device)
        fused_geglu.one_launch.one_launch_mlp(
            torch.randn(17, hidden, dtype=dtype, device=device), *ps[:3], out, 1
        )


def test_mlp_one_launch_op_compiles(fused_geglu, device):
    """The one-launch op's schema and fake, and torch.compile(fullgraph) over it; compiled
    ``geglu_mlp`` takes the two kernels (the route's rule) with the same result."""
    hidden, inter, dtype = 48, 80, torch.float16
    x = torch.randn(1, 2, hidden, dtype=dtype, device=device)
    ps = params(hidden, inter, dtype, device, True)
    op = fused_geglu.library.one_launch_mlp.op
    torch._dynamo.reset()
    with torch.no_grad():
        torch.library.opcheck(
            op, (x, *ps, "tanh"), test_utils=("test_schema", "test_faketensor")
        )
        compiled_op = torch.compile(lambda x: op(x, *ps, "tanh"), fullgraph=True)(x)
        compiled = torch.compile(fused_geglu.geglu_mlp, fullgraph=True)(x, *ps)
        ref = eager_geglu_mlp(*cast([x, *ps], torch.float64))
        eager = eager_geglu_mlp(x, *ps)
    floor = reference.accumulation_floor(ref, inter)
    assert_close_to_ref(compiled_op, ref, eager, floor=floor, what="compiled op")
    assert_close_to_ref(compiled, ref, eager, floor=floor, what="compiled geglu_mlp")


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("graph_max_tokens", [0, 1, 16])
def test_mlp_one_launch_cuda_graph(fused_geglu, device, monkeypatch, graph_max_tokens):
    """In a CUDA graph the route takes the one launch up to the table's
    ``one_launch_graph_max_tokens`` tokens (each value on every GPU, whatever its own
    table says) and the two kernels beyond; captured, it has its own zeroed sums, and each
    replay computes its new input's MLP (the sums left zero for the next) within the rule
    of float64. The output starts as NaN on every replay."""
    hidden, inter, dtype = 256, 1024, torch.bfloat16
    ps = params(hidden, inter, dtype, device, True)
    launched = spy_launches(fused_geglu, monkeypatch)
    use = fused_geglu.tuning.use(device, one_launch_graph_max_tokens=graph_max_tokens)
    with use, torch.no_grad():
        for tokens in (1, 2, 16):
            x = torch.randn(tokens, hidden, dtype=dtype, device=device)
            fused_geglu.geglu_mlp(x, *ps)  # eager: the one launch, compiled
            fused_geglu.geglu_linear(x, *ps[:2], *ps[3:5])  # the dual GEMM, compiled
            launched.clear()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                routed = fused_geglu.geglu_mlp(x, *ps)
            one = tokens <= graph_max_tokens
            assert launched == ["one_launch_mlp_kernel" if one else "gemm_kernel"]
            launched.clear()
            for _ in range(3):
                x.copy_(torch.randn_like(x))
                routed.fill_(float("nan"))
                graph.replay()
                ref = eager_geglu_mlp(x.double(), *cast(ps, torch.float64))
                floor = reference.accumulation_floor(ref, inter)
                what = f"{tokens} tokens, graph_max_tokens {graph_max_tokens}"
                assert_close_to_ref(
                    routed, ref, eager_geglu_mlp(x, *ps), floor=floor, what=what
                )
            assert launched == []
    assert _scratch_is_zero(fused_geglu)


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
def test_layer_one_launch_in_cuda_graph(fused_geglu, device, monkeypatch):
    """The layer's prepared one launch in a CUDA graph where the table takes it there (1
    token here): captured without an eager call before it (no cuBLAS handle made inside
    the capture: none needed), the direct launch recorded, its sums fresh and zeroed;
    replays on new inputs within the rule of float64."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    dtype, layer = torch.bfloat16, fused_geglu.layers.GeGLUMLP
    config = GemmaConfig(hidden_size=256, intermediate_size=1024, hidden_act="gelu_pytorch_tanh")  # fmt: skip
    mlp = GemmaMLP(config).to(device, dtype)
    reference_mlp = copy.deepcopy(mlp).double()
    launched = spy_launches(fused_geglu, monkeypatch)
    x = torch.randn(1, 1, 256, dtype=dtype, device=device)
    with fused_geglu.tuning.use(device, one_launch_graph_max_tokens=1), torch.no_grad():
        side = torch.cuda.Stream()  # warm-up on a side stream, as torch's docs ask
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer.forward(mlp, x)
        torch.cuda.current_stream().wait_stream(side)
        launched.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.forward(mlp, x)
        assert launched == ["one_launch_mlp_kernel"]
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            out.fill_(float("nan"))
            graph.replay()
            ref = reference_mlp(x.double())
            floor = reference.accumulation_floor(ref, 1024)
            assert_close_to_ref(out, ref, mlp(x), floor=floor, what="replay")
    assert _scratch_is_zero(fused_geglu)


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
def test_mlp_one_launch_graph_beside_eager_calls_on_another_stream(fused_geglu, device):
    """A captured one-launch op replayed on one stream while eager calls of it run on
    another, interleaved: the graph's scratch and each stream's are their own, so every
    result is its call's alone and the scratch is left zero."""
    hidden, inter, dtype = 256, 1024, torch.bfloat16
    ps = params(hidden, inter, dtype, device, True)
    op = fused_geglu.library.one_launch_mlp.op
    x_graph, x_eager = (
        torch.randn(t, hidden, dtype=dtype, device=device) for t in (1, 5)
    )
    with torch.no_grad():
        expected_graph = op(x_graph, *ps, "tanh").clone()
        expected_eager = op(x_eager, *ps, "tanh").clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(x_graph, *ps, "tanh")
        replay_stream, eager_stream = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        eager_outs = []
        for _ in range(20):
            with torch.cuda.stream(replay_stream):
                graph.replay()
            with torch.cuda.stream(eager_stream):
                eager_outs.append(op(x_eager, *ps, "tanh"))
        torch.cuda.synchronize()
    # fp32 sums in another order: at most one bf16 unit apart
    torch.testing.assert_close(out, expected_graph, atol=0, rtol=2**-7)
    for got in eager_outs:
        torch.testing.assert_close(got, expected_eager, atol=0, rtol=2**-7)
    assert _scratch_is_zero(fused_geglu)


def test_layer_one_launch_after_weights_change_in_place(
    fused_geglu, device, monkeypatch
):
    """The layer's prepared one launch follows its module: weights pruned in place
    (``weight.data`` a view of the same storage: the same pointer, a new shape), a
    non-contiguous input, a profiler (the op then runs under its record_function), and
    biases whose data is swapped in place (the launch holds their addresses)."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    dtype, layer = torch.float16, fused_geglu.layers.GeGLUMLP
    mlp = GemmaMLP(
        GemmaConfig(
            hidden_size=64, intermediate_size=96, hidden_act="gelu_pytorch_tanh"
        )
    ).to(device, dtype)
    launched = spy_launches(fused_geglu, monkeypatch)

    def check(x, what):
        with torch.no_grad():
            out = layer.forward(mlp, x)
            ref = copy.deepcopy(mlp).double()(x.double())
            floor = reference.accumulation_floor(ref, mlp.gate_proj.out_features)
            assert_close_to_ref(out, ref, mlp(x), floor=floor, what=what)
        assert launched == ["one_launch_mlp_kernel"], what
        launched.clear()

    check(torch.randn(2, 64, dtype=dtype, device=device), "before")
    for proj in (mlp.gate_proj, mlp.up_proj):
        proj.weight.data = proj.weight.data[:48]
    mlp.down_proj.weight.data = mlp.down_proj.weight.data[:, :48]
    check(torch.randn(2, 64, dtype=dtype, device=device), "pruned to 48 in place")

    # Biases (GemmaMLP's forward over biased projections) whose data is swapped in place:
    # the prepared launch holds their addresses, so the route must see the swap.
    shapes = {"gate_proj": (64, 48), "up_proj": (64, 48), "down_proj": (48, 64)}
    for name, (n_in, n_out) in shapes.items():
        old = getattr(mlp, name)
        new = torch.nn.Linear(n_in, n_out, device=device, dtype=dtype)
        new.weight.data = old.weight.data
        setattr(mlp, name, new)
    check(torch.randn(2, 64, dtype=dtype, device=device), "with biases")
    for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        proj.bias.data = torch.randn_like(proj.bias) * 4
    check(torch.randn(2, 64, dtype=dtype, device=device), "biases swapped in place")
    route = fused_geglu.module_route.module_route(mlp, fused_geglu.layers.GEMMA_MLP)
    launch = route.mlp_launch
    biases = [p.bias for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    assert launch.addresses[3:6] == tuple(b.data_ptr() for b in biases)
    check(torch.randn(64, 2, dtype=dtype, device=device).t(), "a transposed input")
    with torch.profiler.profile():
        check(torch.randn(2, 64, dtype=dtype, device=device), "under a profiler")


def test_layer_route_follows_later_changes(fused_geglu, device):
    """After a first call has cached the route (the one launch), the layer still computes
    the module's forward when a projection's parameter dict is replaced (as DeepSpeed's
    ZeRO does) and a new weight set in it, when a hook is registered on a projection (it
    fires in the layer's call), and when a projection's forward is patched on the
    instance: each change on a fresh module."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    layer, GEMMA_MLP = fused_geglu.layers.GeGLUMLP, fused_geglu.layers.GEMMA_MLP
    config = GemmaConfig(hidden_size=64, intermediate_size=96, hidden_act="gelu_pytorch_tanh")  # fmt: skip
    dtype = torch.float16  # the one launch's dtypes
    x = torch.randn(3, 64, device=device, dtype=dtype)
    seen = []

    def new_parameters(mlp):
        down = mlp.down_proj
        down._parameters = dict(down._parameters)
        down.weight = torch.nn.Parameter(torch.randn_like(down.weight))

    def hooked(mlp):
        mlp.gate_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape))

    def patched(mlp):
        up = mlp.up_proj
        up.forward = lambda t: torch.nn.functional.linear(t, up.weight, up.bias) * 2

    for change in (new_parameters, hooked, patched):
        mlp = GemmaMLP(config).to(device, dtype)
        with torch.no_grad():
            layer.forward(mlp, x)
            assert (
                fused_geglu.module_route.module_route(mlp, GEMMA_MLP).mlp_launch
                is not None
            )
            change(mlp)
            seen.clear()
            got = layer.forward(mlp, x)
            fired = len(seen)
            expected = type(mlp).forward(mlp, x)  # GemmaMLP's own, through the change
        torch.testing.assert_close(got, expected, msg=change.__name__)
        assert change is not hooked or fired, (
            "the hook did not fire in the layer's call"
        )


def test_layers_one_launch(fused_geglu, device, monkeypatch):
    """The layers take the one launch in inference at a few tokens, and keep the module's
    forward where a dropout between activation and down projection is active (T5 in
    training mode, here without autograd), with the module's result."""
    from transformers import GemmaConfig, T5Config
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    dtype = torch.float16
    gemma = GemmaMLP(
        GemmaConfig(
            hidden_size=64, intermediate_size=96, hidden_act="gelu_pytorch_tanh"
        )
    )
    t5 = T5DenseGatedActDense(
        T5Config(d_model=64, d_ff=96, feed_forward_proj="gated-gelu", dropout_rate=0.5)
    )
    x = torch.randn(1, 3, 64, dtype=dtype, device=device)
    launched = spy_launches(fused_geglu, monkeypatch)
    for module, layer in ((gemma, fused_geglu.layers.GeGLUMLP), (t5, fused_geglu.layers.T5GeGLUDense)):  # fmt: skip
        module = module.to(device, dtype).eval()
        with torch.no_grad():
            out = layer.forward(module, x)
            ref = copy.deepcopy(module).double()(x.double())
            assert_close_to_ref(
                out, ref, module(x), floor=reference.accumulation_floor(ref, 96)
            )
        assert launched == ["one_launch_mlp_kernel"], type(module).__name__
        launched.clear()
    t5.train()
    with torch.no_grad():
        torch.manual_seed(0)
        out = fused_geglu.layers.T5GeGLUDense.forward(t5, x)
        torch.manual_seed(0)  # the same dropout mask
        ref = t5(x)
    assert "one_launch_mlp_kernel" not in launched
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
