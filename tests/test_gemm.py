"""The bias/activation-epilogue linear against float64 autograd. bf16 GEMMs only on the
GPU: the interpreter multiplies raw bits for bf16 tl.dot."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_GPU
from launches import spy_launches
from reference import (
    CUDA_ONLY,
    accumulation_floor,
    assert_all_close,
    assert_close_to_ref,
    assert_same_bits,
    assert_within_erff_ulp,
    bias_grad_floor,
    bit_for_bit,
    cast,
    check_against_float64,
    eager_geglu,
    eager_linear,
    fwd_bwd,
    geglu_ref,
    poisoned,
)

# bf16 on the CPU: test_bf16_interpreted (the interpreter truncates to bf16: its error
# is not eager's at the shapes here)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])
ACTS = [None, "gelu", "gelu_tanh"]
# (M, N, K); (130, 136, 72) has the 16-byte-aligned rows that the TMA kernel needs. A
# long, uneven K: 4231 on a GPU; 1031 (prime) in the interpreter, whose cost grows with
# the programs it runs (4231 took 5 of the suite's minutes on 2 cores).
LONG_K = 4231 if HAS_GPU else 1031
SHAPES = [(1, 7, 129), (7, 129, 1), (129, 33, LONG_K), (70, 300, 64), (130, 136, 72)]


@pytest.mark.parametrize("mnk", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ACTS)
def test_linear_forward_backward(fused_geglu, device, mnk, dtype, bias, activation):
    """Our GEMMs forward and, with an activation, backward (without one, training is
    cuBLAS's: test_linear_training_without_activation_is_cublas), against float64."""
    m, n, k = mnk
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    dy = torch.randn(m, n, dtype=dtype, device=device)
    check_against_float64(
        partial(fused_geglu.linear, activation=activation),
        partial(eager_linear, activation=activation),
        [x, w, b],
        dy,
        needs_grad=None if activation else [False] * 3,
        floors=[0.0, 0.0, 0.0, bias_grad_floor(x, w, b, dy, activation)],
        terms=max(mnk),  # fp32 sums in another order than cuBLAS's
    )


def test_linear_training_without_activation_is_cublas(fused_geglu, device, monkeypatch):
    """Where autograd records ``linear`` or ``layers.Linear`` without an activation,
    ``F.linear`` runs (our backward measured slower): no Triton launch, eager's values
    and gradients exactly; without autograd, our GEMM."""
    x = torch.randn(5, 24, device=device, requires_grad=True)
    w = torch.randn(16, 24, device=device, requires_grad=True)
    b = torch.randn(16, device=device, requires_grad=True)
    module = torch.nn.Linear(24, 16).to(device)
    layer = fused_geglu.layers.Linear.forward.__get__(module)
    launched = spy_launches(fused_geglu, monkeypatch)
    for ours, eager in (
        (lambda: fused_geglu.linear(x, w, b), lambda: F.linear(x, w, b)),
        (lambda: layer(x), lambda: module(x)),
    ):
        y = ours()
        grads = torch.autograd.grad(
            y.square().sum(), (x, *module.parameters(), w, b), allow_unused=True
        )
        y_ref = eager()
        ref = torch.autograd.grad(
            y_ref.square().sum(), (x, *module.parameters(), w, b), allow_unused=True
        )
        assert launched == []
        assert torch.equal(y, y_ref)
        for g, r in zip(grads, ref):
            assert (g is None and r is None) or torch.equal(g, r)
    with torch.no_grad():
        fused_geglu.linear(x, w, b)
        layer(x)
    assert len(launched) == 2 and all(k.startswith("gemm") for k in launched)


def test_linear_cublas_rows(fused_geglu, device, monkeypatch, table_fields):
    """At the table's ``linear_cublas_rows`` an eager inference ``linear`` or
    ``layers.Linear`` without activation is ``F.linear``'s (no launch, eager's values
    exactly); outside them, with an activation or compiled, our GEMM."""
    table_fields(linear_cublas_rows=(17, 64))
    w = torch.randn(16, 24, device=device)
    b = torch.randn(16, device=device)
    module = torch.nn.Linear(24, 16).to(device)
    layer = fused_geglu.layers.Linear.forward.__get__(module)
    launched = spy_launches(fused_geglu, monkeypatch)
    with torch.no_grad():
        for shape in ((17, 24), (64, 24), (2, 20, 24)):
            x = torch.randn(shape, device=device)
            assert torch.equal(fused_geglu.linear(x, w, b), F.linear(x, w, b))
            assert torch.equal(layer(x), module(x))
        assert launched == []
        for rows in (16, 65):
            fused_geglu.linear(torch.randn(rows, 24, device=device), w, b)
        fused_geglu.linear(torch.randn(40, 24, device=device), w, b, "gelu")
        # Compiled: no branch on the rows (it would recompile), our GEMM.
        torch._dynamo.reset()
        compiled = torch.compile(
            lambda x: fused_geglu.linear(x, w, b), backend="eager", fullgraph=True
        )
        compiled(torch.randn(40, 24, device=device))
    assert len(launched) == 4 and all(k.startswith("gemm") for k in launched)


@pytest.mark.parametrize("aligned", [True, False])
def test_tma_and_portable_paths(fused_geglu, device, monkeypatch, aligned):
    """Where TMA runs (Hopper, the interpreter), 16-byte-aligned 16-bit operands take the TMA
    kernel in forward and both backward GEMMs; a misaligned x takes the portable one."""
    launched = spy_launches(fused_geglu, monkeypatch)
    dtype = torch.float16
    buf = torch.randn(130 * 72 + 1, dtype=dtype, device=device, requires_grad=True)
    x = (buf[:-1] if aligned else buf[1:]).view(130, 72)  # base offset of 2 bytes
    w = (torch.randn(136, 72, dtype=dtype, device=device) / 72**0.5).requires_grad_()
    b = torch.randn(136, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(130, 136, dtype=dtype, device=device)
    y = fused_geglu.linear(x, w, b, "gelu")
    grads = torch.autograd.grad(y, (x, w, b), dy)
    gelu = partial(eager_linear, activation="gelu")
    assert_all_close(
        [y, *grads],
        fwd_bwd(gelu, cast([x, w, b], torch.float64), dy),
        fwd_bwd(gelu, [x, w, b], dy),
        floors=[0.0, 0.0, 0.0, bias_grad_floor(x, w, b, dy, "gelu")],
    )
    # Where TMA runs, by an independent table: Hopper/Blackwell GPUs and the interpreter.
    tma = aligned and (not HAS_GPU or torch.cuda.get_device_capability()[0] in (9, 10))
    # forward, dX, dW (+ db); with a misaligned x, dX (dY @ W) may still take TMA.
    assert launched[0] == ("gemm_tma_kernel" if tma else "gemm_kernel")
    assert len(launched) == 3
    if tma:
        assert set(launched) == {"gemm_tma_kernel"}
    else:
        assert launched[2] == "gemm_kernel"


def test_dual_gemm_stored_gate_and_up(fused_geglu, device, monkeypatch):
    """The training dual GEMM's stored gate and up: through TMA stores where TMA runs and
    they are 16-byte aligned; a misaligned (contiguous) one sends the call to the portable
    kernel, which stores them too: F.linear's products within the rule either way (equal
    in the interpreter, where the two kernels' tiles are the same). A non-contiguous one
    is refused."""
    gemm, dtype = fused_geglu.gemm, torch.float16
    launched = spy_launches(fused_geglu, monkeypatch)
    x = torch.randn(130, 72, dtype=dtype, device=device)
    w_gate, w_up = (
        torch.randn(136, 72, dtype=dtype, device=device) / 72**0.5 for _ in "gu"
    )
    stored = []
    for offset in (0, 1):  # a base offset of 2 bytes: not TMA-compatible
        gate, up = (
            poisoned((130 * 136 + 1,), dtype, device)[offset:][: 130 * 136].view(
                130, 136
            )
            for _ in "gu"
        )
        h = poisoned((130, 136), dtype, device)
        gemm.gemm_gated(x, w_gate, w_up, h, gemm.GELU_TANH, gate=gate, up=up)
        stored.append((h, gate, up))
    tma = not HAS_GPU or torch.cuda.get_device_capability()[0] in (9, 10)
    assert launched == ["gemm_tma_kernel" if tma else "gemm_kernel", "gemm_kernel"]
    for h, gate, up in stored:
        for got, w in ((gate, w_gate), (up, w_up)):
            assert_close_to_ref(got, x.double() @ w.double().T, F.linear(x, w))
    (h0, g0, u0), (h1, g1, u1) = stored
    if not HAS_GPU:
        assert torch.equal(g0, g1) and torch.equal(u0, u1) and torch.equal(h0, h1)
    with pytest.raises(ValueError, match="must be contiguous"):
        gemm.gemm_gated(
            x, w_gate, w_up, h, gemm.GELU_TANH, gate=g0.T.contiguous().T, up=u0
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mnk",
    [(8192, 16384, 2048), (8192, 2048, 16384), (4096, 4096, 4096), (8192, 4096, 4096)],
)
def test_benchmarked_shapes_bf16(fused_geglu, mnk):
    """The shapes of the benchmark, in bf16 through the TMA kernel, with bias and the tanh
    epilogue (the 128x128 variants that store pre-activations and apply act' in the
    backward prologue), against float64 as closely as eager."""
    m, n, k = mnk
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    b = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    check_against_float64(
        partial(fused_geglu.linear, activation="gelu_tanh"),
        partial(eager_linear, activation="gelu_tanh"),
        [x, w, b],
        dy,
        floors=[0.0, 0.0, 0.0, bias_grad_floor(x, w, b, dy, "gelu_tanh")],
    )


def test_3d_and_strided_inputs(fused_geglu, device):
    """Leading dims, a column-sliced x and a transposed weight view: read through strides."""
    big = torch.randn(3, 5, 200, device=device)
    x = big[..., 10:110]  # row stride 200
    w = torch.randn(100, 48, device=device).t()  # [48, 100] with strides (1, 48)
    b = torch.randn(48, device=device)
    y = fused_geglu.linear(x, w, b, "gelu")
    assert y.shape == (3, 5, 48)
    ref = eager_linear(*cast([x, w, b], torch.float64), "gelu")
    assert_close_to_ref(y, ref, eager_linear(x, w, b, "gelu"))


def test_layer_kernelizes_nn_linear(fused_geglu, device):
    from conftest import ROOT
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(40, 24)
            self.proj.kernel_layer_name = (
                "Linear"  # what replace_kernel_forward_from_hub sets
            )

        def forward(self, x):
            return self.proj(x).relu()

    model = Block().to(device)
    x = torch.randn(4, 3, 40, device=device)
    expected = model(x)
    mapping = {"Linear": {device: LocalLayerRepository(ROOT, layer_name="Linear")}}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, device=device)
    assert model.proj.forward.__func__.__qualname__ == "Linear.forward"
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_opcheck_and_compile(fused_geglu, device):
    x = torch.randn(5, 33, device=device, requires_grad=True)
    w = torch.randn(17, 33, device=device, requires_grad=True)
    b = torch.randn(17, device=device, requires_grad=True)
    codes = {None: 0, "gelu": 1, "gelu_tanh": 2}
    for act in ACTS:
        args = (x.detach(), w.detach(), b.detach(), codes[act], act is not None)
        torch.library.opcheck(fused_geglu.library.linear.op, args)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w, b: fused_geglu.linear(x, w, b, "gelu_tanh"), fullgraph=True
    )
    torch.testing.assert_close(
        compiled(x, w, b), fused_geglu.linear(x, w, b, "gelu_tanh")
    )
    # The compiled backward's gradients against float64, as closely as eager's.
    eager, dy = (
        partial(eager_linear, activation="gelu_tanh"),
        torch.randn(5, 17, device=device),
    )
    assert_all_close(
        fwd_bwd(compiled, [x, w, b], dy),
        fwd_bwd(eager, cast([x, w, b], torch.float64), dy),
        fwd_bwd(eager, [x, w, b], dy),
        floors=[0.0, 0.0, 0.0, bias_grad_floor(x, w, b, dy, "gelu_tanh")],
        what="compiled linear (y, dx, dw, db)",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 200], ids=["portable", "tma"])
def test_direct_launch(fused_geglu, device, monkeypatch, tokens):
    """After the first launch of a specialisation (through JITFunction.run, or a
    precompiled kernel found for it), gemm launches the compiled kernel directly, and each
    call computes from its own operands; a new token count compiles or looks up again,
    and a misaligned operand always goes through JITFunction.run."""
    gemm, kernels = fused_geglu.gemm, fused_geglu.gemm_kernels
    runs = []  # launches through JITFunction.run or a precompiled kernel found
    for kernel in (kernels.gemm_kernel, kernels.gemm_tma_kernel):
        spy = lambda *a, _run=kernel.run, **k: runs.append(1) or _run(*a, **k)
        monkeypatch.setattr(kernel, "run", spy)
    precompiled = fused_geglu.precompiled

    def find(*a, _find=precompiled.find, **k):
        found = _find(*a, **k)
        if found is not None:
            runs.append(1)
        return found

    monkeypatch.setattr(precompiled, "find", find)
    monkeypatch.setattr(gemm, "_PLANS", fused_geglu.launch.BoundedCache(1024))
    hidden, inter, dtype = 256, 384, torch.bfloat16
    w_gate, w_up = (
        torch.randn(inter, hidden, dtype=dtype, device=device) / hidden**0.5
        for _ in range(2)
    )

    def check(x):
        h = poisoned((x.shape[0], inter), dtype, device)
        gemm.gemm_gated(x, w_gate, w_up, h, gemm.GELU_TANH)
        eager = eager_geglu(F.linear(x, w_gate), F.linear(x, w_up), "tanh")
        ref = geglu_ref(
            x.double() @ w_gate.double().T, x.double() @ w_up.double().T, "tanh"
        )
        assert_close_to_ref(h, ref, eager)

    for expected_runs in (1, 1, 1):  # new inputs of one shape: one JITFunction.run
        check(torch.randn(tokens, hidden, dtype=dtype, device=device))
        assert len(runs) == expected_runs
    assert len(gemm._PLANS) == 1
    check(torch.randn(tokens + 1, hidden, dtype=dtype, device=device))
    assert len(runs) == 2 and len(gemm._PLANS) == 2
    buf = torch.randn(tokens * hidden + 1, dtype=dtype, device=device)
    for expected_runs in (3, 4):  # 2 bytes off 16-byte alignment: never direct
        check(buf[1:].view(tokens, hidden))
        assert len(runs) == expected_runs


# Decode shapes with fewer output tiles than half the SMs: K is split (under the
# interpreter the grid counts 4 SMs; on the H200 the down projection of Gemma-2B).
SPLIT_SHAPES = [(1, 64, 1000), (5, 40, 1200), (16, 100, 2047)]
SPLIT_SHAPES_GPU = [(1, 2048, 16384), (16, 2048, 16384), (7, 300, 5000)]


def split_k_of(fused_geglu, a, n, dual):
    tuning, m, k = fused_geglu.tuning, *a.shape
    cfg = tuning.gemm_config(m, n, a.dtype, a.device, dual, False, False)
    tiles = tuning.cdiv(m, cfg.block_m) * tuning.cdiv(n, cfg.block_n)
    return tuning.split_k(
        tiles, tuning.cdiv(k, cfg.block_k), tuning.num_programs(a.device)
    )


@pytest.mark.parametrize(
    "mnk", SPLIT_SHAPES + (SPLIT_SHAPES_GPU if HAS_GPU else []), ids=str
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", ["bias_gelu", "dual_bias", "add_c", "dual_preact"])
def test_split_k(fused_geglu, device, mnk, dtype, variant):
    """Split-K against float64: every epilogue after the reduction, an uneven last slice
    (K not a multiple of the slices' tiles); bitwise the same on a second launch (the
    slices are added in a fixed order); the tile counters back at zero."""
    gemm = fused_geglu.gemm
    m, n, k = mnk
    dual = variant.startswith("dual")
    a = torch.randn(m, k, dtype=dtype, device=device)
    b1, b2 = (torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(2))
    bias1, bias2 = (torch.randn(n, dtype=dtype, device=device) for _ in range(2))
    assert split_k_of(fused_geglu, a, n, dual) > 1
    c0 = torch.randn(m, n, dtype=dtype, device=device)
    pre = None
    if variant == "bias_gelu":
        launch = lambda c: gemm.gemm_act(a, b1, c, gemm.GELU, bias=bias1)
        ref = F.gelu(F.linear(a.double(), b1.double(), bias1.double()))
        eager = F.gelu(F.linear(a, b1, bias1))
    elif variant == "add_c":
        launch = lambda c: gemm.gemm(a, b1, c, accumulate=True)
        ref = c0.double() + a.double() @ b1.double().T
        eager = c0 + F.linear(a, b1)
    else:
        gate, up = F.linear(a, b1, bias1), F.linear(a, b2, bias2)
        ref = geglu_ref(
            F.linear(a.double(), b1.double(), bias1.double()),
            F.linear(a.double(), b2.double(), bias2.double()),
            "tanh",
        )
        eager = eager_geglu(gate, up, "tanh")
        if variant == "dual_preact":
            pre = [poisoned((m, n), dtype, device) for _ in range(2)]
        launch = lambda c: gemm.gemm_gated(
            a, b1, b2, c, gemm.GELU_TANH, bias_gate=bias1, bias_up=bias2,
            gate=pre and pre[0], up=pre and pre[1],
        )  # fmt: skip
    outs = []
    for _ in range(2):
        c = c0.clone() if variant == "add_c" else poisoned((m, n), dtype, device)
        launch(c)
        outs.append(c)
    # fp32: K-long sums in another order than cuBLAS's (split-K's slices are one).
    assert_close_to_ref(outs[0], ref, eager, floor=accumulation_floor(ref, k))
    assert torch.equal(outs[0], outs[1])
    if pre is not None:
        for out, w, bias, eager_pre in (
            (pre[0], b1, bias1, gate),
            (pre[1], b2, bias2, up),
        ):
            ref_pre = F.linear(a.double(), w.double(), bias.double())
            floor = accumulation_floor(ref_pre, k)
            assert_close_to_ref(out, ref_pre, eager_pre, floor=floor)
    for _, counters in gemm._SPLIT_K_SCRATCH.values():
        assert not counters.any()


@pytest.mark.gpu
def test_split_k_cuda_graph_and_streams(fused_geglu, device):
    """A captured split-K launch replays correctly with new inputs, and launches on two
    streams at once count on separate counters."""
    gemm = fused_geglu.gemm
    m, n, k, dtype = 1, 2048, 16384, torch.bfloat16
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    a = torch.randn(m, k, dtype=dtype, device=device)
    assert split_k_of(fused_geglu, a, n, False) > 1
    c = poisoned((m, n), dtype, device)
    gemm.gemm(a, w, c)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.gemm(a, w, c)
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        c.fill_(float("nan"))
        graph.replay()
        assert_close_to_ref(c, a.double() @ w.double().T, F.linear(a, w))
    streams = [torch.cuda.Stream() for _ in range(2)]
    xs = [torch.randn(m, k, dtype=dtype, device=device) for _ in streams]
    cs = [poisoned((m, n), dtype, device) for _ in streams]
    torch.cuda.synchronize()
    for _ in range(20):
        for s, x, out in zip(streams, xs, cs):
            with torch.cuda.stream(s):
                gemm.gemm(x, w, out)
    torch.cuda.synchronize()
    for x, out in zip(xs, cs):
        assert_close_to_ref(out, x.double() @ w.double().T, F.linear(x, w))
    for _, counters in gemm._SPLIT_K_SCRATCH.values():
        assert not counters.any()


@pytest.mark.parametrize("op", ["linear", "geglu_linear", "geglu_mlp"])
def test_bf16_interpreted(fused_geglu, device, op):
    """bf16 GEMMs are right on every device, the interpreter too (it used to multiply
    bf16's raw bits in tl.dot): within a few bf16 ulps of float64, as eager is."""
    m, k, n = 37, 96, 80
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    w = [
        torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5
        for _ in range(2)
    ]
    w_down = torch.randn(k, n, dtype=torch.bfloat16, device=device) / n**0.5
    x64, w64, wd64 = x.double(), [t.double() for t in w], w_down.double()
    if op == "linear":
        out, ref = fused_geglu.linear(x, w[0]), x64 @ w64[0].T
    else:
        h = geglu_ref(x64 @ w64[0].T, x64 @ w64[1].T, "tanh")
        if op == "geglu_linear":
            out, ref = fused_geglu.geglu_linear(x, *w), h
        else:
            out, ref = fused_geglu.geglu_mlp(x, *w, w_down), h @ wd64.T
    # bf16 has 8 significant bits: 4 ulps of the output's scale bound two truncations and
    # the fp32 accumulation.
    tol = 4 * 2.0**-8 * ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= tol


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("tokens", [16, 1 << 18], ids=["decode", "tma"])
def test_epilogues_bit_for_bit_eager_on_gpu(fused_geglu, dtype, approximate, tokens):
    """The GEMM epilogues' GeLU is the activation's (test_activation.py): with weights that
    pick one input column each, the accumulators hold gate and up exactly, and ``linear``'s
    and ``geglu_linear``'s outputs are eager's bits: over every finite 16-bit gate value
    at once (TMA kernel), or over 64 calls of 16 random ones (the decode kernel)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda")
    every = bits.to(torch.int16).view(dtype).repeat(4)
    x = torch.zeros(every.numel(), 8, dtype=dtype, device="cuda")
    x[:, 0] = every
    x[:, 1] = torch.randn(every.numel(), device="cuda").to(dtype)
    x = x[x[:, 0].isfinite()]  # up = gate * 0 + up * 1 would be NaN for gate = inf
    x = x[torch.randperm(x.shape[0], device="cuda")]
    w_gate = torch.zeros(8, 8, dtype=dtype, device="cuda")
    w_up = torch.zeros_like(w_gate)
    w_gate[:, 0] = w_up[:, 1] = 1  # every output column: gate = x[:, 0], up = x[:, 1]
    act = "gelu_tanh" if approximate == "tanh" else "gelu"
    for rows in x.split(tokens)[: 64 if tokens == 16 else None]:
        pairs = {
            "linear": (
                fused_geglu.linear(rows, w_gate, activation=act),
                F.gelu(F.linear(rows, w_gate), approximate=approximate),
            ),
            "geglu_linear": (
                fused_geglu.geglu_linear(rows, w_gate, w_up, approximate=approximate),
                F.gelu(F.linear(rows, w_gate), approximate=approximate)
                * F.linear(rows, w_up),
            ),
        }
        for name, (ours, eager) in pairs.items():
            if bit_for_bit(fused_geglu, approximate):
                assert_same_bits(ours, eager, f"{name} {dtype} {approximate}")
            else:
                gate, up = rows[:, :1].expand_as(ours), rows[:, 1:2].expand_as(ours)
                assert_within_erff_ulp(ours, eager, gate, up, torch.ones_like(up), name)
