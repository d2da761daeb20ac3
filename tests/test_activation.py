"""The GeGLU activation kernels against float64 references."""

import pytest
import torch
from reference import (
    CUDA_ONLY,
    assert_close_to_ref,
    assert_same_bits,
    assert_within_erff_ulp,
    bit_for_bit,
    cast,
    check_against_float64,
    eager_geglu,
    fwd_bwd,
    geglu_ref,
    poisoned,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
APPROX = ["tanh", "none"]
SHAPES = [(1, 1), (7, 13), (3, 5, 129), (9, 41, 4231), (2, 1, 1, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_geglu_forward(fused_geglu, device, shape, dtype, approximate):
    gate = torch.randn(shape, dtype=dtype, device=device) * 3
    up = torch.randn(shape, dtype=dtype, device=device)
    out = fused_geglu.geglu(gate, up, approximate)
    assert out.shape == gate.shape and out.dtype == dtype
    eager = eager_geglu(gate, up, approximate)
    assert_close_to_ref(out, geglu_ref(gate, up, approximate), eager)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_geglu_backward(fused_geglu, device, dtype, approximate):
    shape = (5, 3, 1031)
    gate = (torch.randn(shape, device=device) * 3).to(dtype)
    up = torch.randn(shape, dtype=dtype, device=device)
    dout = torch.randn(shape, dtype=dtype, device=device)
    check_against_float64(
        lambda g, u: fused_geglu.geglu(g, u, approximate),
        lambda g, u: eager_geglu(g, u, approximate),
        [gate, up],
        dout,
    )


def test_strided_and_expanded_inputs(fused_geglu, device):
    """Row strides, a transposed view and a zero-stride (expand) input, no copies needed."""
    base = torch.randn(64, 300, device=device)
    gate = base[:, 17:217]  # row stride 300
    up_t = torch.randn(200, 64, device=device).t()  # column stride 64
    up_e = torch.randn(1, 200, device=device).expand(64, 200)  # row stride 0
    for up in (up_t, up_e):
        for approximate in APPROX:
            out = fused_geglu.geglu(gate, up, approximate)
            ref = geglu_ref(gate, up, approximate)
            assert_close_to_ref(out, ref, eager_geglu(gate, up, approximate))


def test_strided_backward(fused_geglu, device):
    base = torch.randn(33, 2, 257, device=device)
    gate = base[:, 0].clone().requires_grad_()
    up_base = torch.randn(33, 2, 257, device=device, requires_grad=True)
    up = up_base[:, 1]
    dout = torch.randn(257, 33, device=device).t()  # non-contiguous incoming gradient
    fused_geglu.geglu(gate, up, "tanh").backward(dout)
    _, *ref = fwd_bwd(eager_geglu, cast([gate, up], torch.float64), dout)
    _, *eager = fwd_bwd(eager_geglu, [gate, up], dout)
    assert_close_to_ref(gate.grad, ref[0], eager[0])
    assert_close_to_ref(up_base.grad[:, 1], ref[1], eager[1])
    assert (up_base.grad[:, 0] == 0).all()


def test_row_tiles(fused_geglu, device):
    """Strided operands' tiles: a power of two at most 16 bytes x 256 lanes wide, about
    8192 elements per program, and no more than 1/8 of the last tile's lanes idle where a
    tile of 256 columns or more allows it (else the fewest idle): ModernBERT's 1152-wide
    halves take 256 columns, SD's 2560 take 512, Gemma's 16384 the widest."""
    dev = torch.device(device)
    per_program = fused_geglu.tuning.table(dev).row_tile_elements

    def config(n, elem):
        return fused_geglu.tuning.row_tile_config(n, elem, dev)

    for elem in (2, 4):
        widest = 16 // elem * 256
        for n in [*range(1, 600), *range(600, 20000, 37), 1152, 2560, 13824, 16384]:
            block_m, block_n, warps = config(n, elem)
            assert block_n & (block_n - 1) == 0 and block_n <= widest, (n, elem)
            assert block_m == max(1, per_program // block_n) and warps == 8, (n, elem)
            padded = -(-n // block_n) * block_n
            if block_n >= 256 and 8 * (padded - n) > padded:
                # no candidate from 256 columns up leaves fewer lanes idle
                for b in (256, 512, 1024, 2048):
                    if b <= widest:
                        assert -(-n // b) * b - n >= padded - n, (n, elem, b)
    assert config(1152, 2)[1] == 256 and config(2560, 2)[1] == 512
    assert config(16384, 2)[1] == 2048 and config(16384, 4)[1] == 1024


@pytest.mark.parametrize("width", [1152, 2560])
def test_strided_halves_at_family_widths(fused_geglu, device, width, table_fields):
    """The halves of one projection output (ModernBERT, SD GEGLU) at their real widths
    (the row tiles chosen for them), forward and backward, under the row tiles of every
    shipped table."""
    tiles = sorted({t.row_tile_elements for t in fused_geglu.tuning.SHIPPED.values()})
    for row_tile_elements in tiles:
        table_fields(row_tile_elements=row_tile_elements)
        both = torch.randn(24, 2 * width, device=device, dtype=torch.bfloat16) * 2
        gate, up = both[:, :width], both[:, width:]
        out = fused_geglu.geglu(gate, up, "none")
        eager = eager_geglu(gate, up, "none")
        assert_close_to_ref(out, geglu_ref(gate, up, "none"), eager)
        leaf = both.clone().requires_grad_()
        dout = torch.randn(24, width, device=device, dtype=torch.bfloat16)
        fused_geglu.geglu(leaf[:, :width], leaf[:, width:], "none").backward(dout)
        _, *ref = fwd_bwd(eager_geglu, cast([gate, up], torch.float64), dout)
        _, *eager = fwd_bwd(eager_geglu, [gate, up], dout)
        assert_close_to_ref(leaf.grad[:, :width], ref[0], eager[0])
        assert_close_to_ref(leaf.grad[:, width:], ref[1], eager[1])


@pytest.mark.parametrize("shape", [(0, 16), (4, 0), (2, 0, 8)], ids=str)
def test_empty(fused_geglu, device, shape):
    gate = torch.randn(shape, device=device, requires_grad=True)
    up = torch.randn(shape, device=device, requires_grad=True)
    out = fused_geglu.geglu(gate, up)
    assert out.shape == shape
    out.sum().backward()
    assert gate.grad.shape == shape and up.grad.shape == shape


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "fn, approximate", [("gelu_and_mul", "none"), ("gelu_tanh_and_mul", "tanh")]
)
def test_gelu_and_mul(fused_geglu, device, dtype, fn, approximate):
    """kernels-community `activation` semantics: x = [..., 2d], gate first, out written in place."""
    x = torch.randn(3, 7, 2 * 521, dtype=dtype, device=device) * 2
    out = poisoned((3, 7, 521), dtype, device)
    result = getattr(fused_geglu, fn)(out, x)
    assert result is out
    gate, up = x[..., :521], x[..., 521:]
    eager = eager_geglu(gate, up, approximate)
    assert_close_to_ref(out, geglu_ref(gate, up, approximate), eager)


def test_gelu_and_mul_into_strided_out(fused_geglu, device):
    x = torch.randn(6, 2 * 100, device=device)
    big = poisoned((6, 150), torch.float32, device)
    out = big[:, 25:125]
    fused_geglu.gelu_and_mul(out, x)
    gate, up = x[:, :100], x[:, 100:]
    assert_close_to_ref(out, geglu_ref(gate, up, "none"), eager_geglu(gate, up, "none"))
    assert big[:, :25].isnan().all() and big[:, 125:].isnan().all(), (
        "wrote outside the view"
    )
    permuted = poisoned((100, 6, 3), torch.float32, device).permute(1, 2, 0)[
        :, :2
    ]  # no single row stride
    x3 = torch.randn(6, 2, 200, device=device)
    fused_geglu.gelu_tanh_and_mul(permuted, x3)
    gate, up = x3[..., :100], x3[..., 100:]
    assert_close_to_ref(
        permuted, geglu_ref(gate, up, "tanh"), eager_geglu(gate, up, "tanh")
    )


def test_new_token_count_does_not_recompile(fused_geglu, device):
    """The token count is a runtime argument: no new JIT specialisation when it changes."""
    kernel = fused_geglu.activation.geglu_fwd_kernel
    if not hasattr(kernel, "device_caches"):
        pytest.skip("the interpreter keeps no compilation cache")
    fused_geglu.geglu(
        torch.randn(5, 256, device=device), torch.randn(5, 256, device=device)
    )
    before = sum(len(c[0]) for c in kernel.device_caches.values())
    for m in (1, 16, 17, 1000, 4097):
        fused_geglu.geglu(
            torch.randn(m, 256, device=device), torch.randn(m, 256, device=device)
        )
    assert sum(len(c[0]) for c in kernel.device_caches.values()) == before


def test_opcheck(fused_geglu, device):
    gate = torch.randn(4, 33, device=device, requires_grad=True)
    up = torch.randn(4, 33, device=device, requires_grad=True)
    for approximate in APPROX:
        # The kernel ops are not differentiable themselves (autograd.py wraps them).
        library = fused_geglu.library
        torch.library.opcheck(
            library.geglu.op, (gate.detach(), up.detach(), approximate)
        )
        dout = torch.randn(4, 33, device=device)
        torch.library.opcheck(
            library.geglu_grad.op, (dout, gate.detach(), up.detach(), approximate)
        )
        g, u = gate.detach().clone(), up.detach().clone()
        torch.library.opcheck(library.geglu_grad_in_place.op, (dout, g, u, approximate))
    x = torch.randn(4, 66, device=device)
    torch.library.opcheck(
        fused_geglu.library.gelu_and_mul.op,
        (torch.empty(4, 33, device=device), x, "tanh"),
    )
    # One tensor's halves, contiguous and transposed (strided halves), either half the gate.
    for y in (torch.randn(4, 66, device=device), torch.randn(66, 4, device=device).t()):
        for gate_half in (0, 1):
            library = fused_geglu.library
            torch.library.opcheck(library.geglu_halves.op, (y, gate_half, "tanh"))
            dout = torch.randn(4, 33, device=device)
            torch.library.opcheck(
                library.geglu_halves_grad.op, (dout, y, gate_half, "none")
            )


def test_torch_compile_fullgraph(fused_geglu, device):
    torch._dynamo.reset()

    def f(gate, up, x):
        out = torch.empty(x.shape[0], x.shape[1] // 2, device=x.device)
        return fused_geglu.geglu(gate, up, "none") * 2, fused_geglu.gelu_tanh_and_mul(
            out, x
        )

    compiled = torch.compile(f, fullgraph=True)
    gate = torch.randn(8, 40, device=device, requires_grad=True)
    up = torch.randn(8, 40, device=device, requires_grad=True)
    x = torch.randn(8, 80, device=device)
    (a, b), (ea, eb) = compiled(gate, up, x), f(gate, up, x)
    torch.testing.assert_close(a, ea)
    torch.testing.assert_close(b, eb)
    a.sum().backward()
    grads = gate.grad.clone(), up.grad.clone()
    gate.grad = up.grad = None
    ea.sum().backward()
    torch.testing.assert_close(grads[0], gate.grad)
    torch.testing.assert_close(grads[1], up.grad)


def _every_value(dtype, device, copies=4):
    """Every 16-bit pattern of ``dtype`` ``copies`` times, or 2^22 float32s: random bit
    patterns (every exponent, NaN, Inf, subnormals) and randn * 4."""
    if dtype == torch.float32:
        n = 1 << 21
        bits = torch.randint(
            -(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device
        )
        return torch.cat([bits.view(torch.float32), torch.randn(n, device=device) * 4])
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device)
    return bits.to(torch.int16).view(dtype).repeat(copies)


@pytest.mark.gpu
@CUDA_ONLY
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_bit_for_bit_eager_on_gpu(fused_geglu, dtype, approximate):
    """On the GPU the activation is eager's ``F.gelu(gate) * up`` and its autograd bit for
    bit, forward and backward, over every fp16/bf16 value (docs/numerics.md). The exact
    GeLU calls ``erff``: without the libdevice of torch's CUDA toolkit, Triton's own may
    differ from it by one ulp, and so may our results, by at most one ulp."""
    gate = _every_value(dtype, "cuda")
    up = torch.randn(gate.shape, device="cuda").to(dtype)
    dy = torch.randn(gate.shape, device="cuda").to(dtype)
    ours = fwd_bwd(lambda g, u: fused_geglu.geglu(g, u, approximate), [gate, up], dy)
    eager = fwd_bwd(lambda g, u: eager_geglu(g, u, approximate), [gate, up], dy)
    halves = "gelu_tanh_and_mul" if approximate == "tanh" else "gelu_and_mul"
    from_halves = torch.empty(1, gate.numel(), dtype=dtype, device="cuda")
    getattr(fused_geglu, halves)(from_halves, torch.cat([gate, up]).view(1, -1))
    ours.append(from_halves.view(-1))
    eager.append(eager[0])
    for name, a, b in zip(("out", "d gate", "d up", halves), ours, eager):
        if bit_for_bit(fused_geglu, approximate):
            assert_same_bits(a, b, f"{dtype} {approximate} {name}")
        else:
            assert_within_erff_ulp(a, b, gate, up, dy, name)
