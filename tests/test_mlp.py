"""The GeGLU dual GEMM and the two-kernel MLP against float64 autograd."""

import copy
from functools import partial

import pytest
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
