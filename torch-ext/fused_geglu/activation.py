"""GeGLU activation (device code): the GeLU math shared by every kernel, and the elementwise
kernels. Their host side is elementwise.py.

GeLU variants (``APPROX_TANH`` picks one at compile time):
  exact: gelu(x) = 0.5 * x * (1 + erf(x / sqrt(2)))
  tanh:  gelu(x) = 0.5 * x * (1 + tanh(u)),  u = k0 * (x + k1 * x^3),
         k0 = sqrt(2/pi), k1 = 0.044715
Derivatives:
  exact: gelu'(x) = 0.5 * (1 + erf(x / sqrt(2))) + x * exp(-x^2 / 2) / sqrt(2 pi)
  tanh:  t = tanh(u); gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) * k0 (1 + 3 k1 x^2)

On the GPU these are PyTorch's CUDA ``gelu`` / ``gelu_backward`` expressions term for term,
with the same constants (rounded to fp32 as C++ folds them), the same libdevice functions
(``tanhf``, ``erff``, ``expf``) and the compile options of ``launch.COMPILE_OPTIONS``
(Triton contracts ``a * b + c`` into an FMA where nvcc does): their results equal eager's
bit for bit (docs/numerics.md). The interpreter has no libdevice; there tanh-GeLU is the
sigmoid form ``x * sigmoid(2u)``, which does not cancel in ``1 + tanh(u)`` for x << 0.

Rounding follows transformers' eager ``act_fn(gate) * up``: the activation is rounded to
the input dtype before the multiply, and the product is rounded again; in backward the
product's gradient ``dy * up`` is rounded before ``gelu'`` is applied.
"""

import math
import struct

import triton
import triton.language as tl
from triton.language.extra import libdevice

# libdevice exists only in compiled kernels: the interpreter takes the portable forms.
EAGER_MATH = tl.constexpr(not triton.knobs.runtime.interpret)


def _f32(value: float) -> float:
    """``value`` rounded to fp32, as C++ folds PyTorch's constexpr opmath_t constants."""
    return struct.unpack("f", struct.pack("f", value))[0]


# Globals read inside @triton.jit must be constexpr; kernels write them right of a tensor
# (`x * C`): the interpreter's `C * x` wraps the tensor in a constexpr.
# Each as PyTorch's CUDA kernels write it: M_SQRT2 * M_2_SQRTPI * 0.5 and so on.
SQRT_2_OVER_PI = tl.constexpr(_f32(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5))
INV_SQRT_2 = tl.constexpr(_f32(1.0 / math.sqrt(2.0)))
INV_SQRT_2PI = tl.constexpr(_f32(2.0 / math.sqrt(math.pi) / math.sqrt(2.0) * 0.5))
GELU_TANH_K1 = tl.constexpr(_f32(0.044715))
# 3 * k1 folded in fp32 (exact in double, then rounded once).
GELU_TANH_3K1 = tl.constexpr(_f32(3.0 * _f32(0.044715)))


@triton.jit
def _sigmoid_2x(u):
    # sigmoid(2u) = (1 + tanh(u)) / 2, without the cancellation of 1 + tanh(u) for u << 0;
    # exp overflowing to inf gives exactly 0, never inf/inf = NaN.
    return 1.0 / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def _tanh_inner(x):
    # u = k0 * (x + k1 * x^3), with x^3 = (x * x) * x; x + k1 x^3 contracts to one FMA.
    return (x + x * x * x * GELU_TANH_K1) * SQRT_2_OVER_PI


@triton.jit
def gelu(x, APPROX_TANH: tl.constexpr):
    """GeLU of an fp32 tensor."""
    if APPROX_TANH:
        if EAGER_MATH:
            return (x * 0.5) * (1.0 + libdevice.tanh(_tanh_inner(x)))
        else:
            return x * _sigmoid_2x(_tanh_inner(x))
    else:
        if EAGER_MATH:
            return (x * 0.5) * (1.0 + libdevice.erf(x * INV_SQRT_2))
        else:
            return (x * 0.5) * (1.0 + tl.erf(x * INV_SQRT_2))


@triton.jit
def gelu_grad(x, APPROX_TANH: tl.constexpr):
    """d gelu(x) / dx of an fp32 tensor (see the module docstring)."""
    if APPROX_TANH:
        x_sq = x * x
        inner_derivative = (1.0 + x_sq * GELU_TANH_3K1) * SQRT_2_OVER_PI
        if EAGER_MATH:
            t = libdevice.tanh((x + x_sq * x * GELU_TANH_K1) * SQRT_2_OVER_PI)
            # left_derivative + left * tanh_derivative * inner_derivative
            return (1.0 + t) * 0.5 + (x * 0.5) * (1.0 - t * t) * inner_derivative
        else:
            # 0.5 (1 + t) = s and 0.5 x (1 - t^2) = 2 x s (1 - s), 1 - s = sigmoid(-2u).
            u = _tanh_inner(x)
            s = _sigmoid_2x(u)
            return s + 2.0 * x * s * _sigmoid_2x(-u) * inner_derivative
    else:
        if EAGER_MATH:
            cdf = (1.0 + libdevice.erf(x * INV_SQRT_2)) * 0.5
            pdf = libdevice.exp(x * -0.5 * x) * INV_SQRT_2PI
        else:
            cdf = (1.0 + tl.erf(x * INV_SQRT_2)) * 0.5
            pdf = tl.exp(x * -0.5 * x) * INV_SQRT_2PI
        return cdf + x * pdf


@triton.jit
def geglu_tile(gate, up, OUT_DTYPE: tl.constexpr, APPROX_TANH: tl.constexpr):
    """round(round(gelu(gate)) * up) for fp32 tiles: eager's rounding points."""
    act = gelu(gate, APPROX_TANH).to(OUT_DTYPE).to(tl.float32)
    return (act * up).to(OUT_DTYPE)


@triton.jit
def _tile_ids(N, BLOCK_N: tl.constexpr):
    # A 1-D grid, row-major over tiles: a contiguous tensor viewed as one long row needs
    # more column tiles than grid axis 1 allows (65535).
    grid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    return pid // grid_n, pid % grid_n


@triton.jit
def _tile_offsets(
    pid_m,
    pid_n,
    M,
    N,
    stride_m,
    stride_n,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT64: tl.constexpr,
):
    # int64 only when an offset can pass 2^31 (the launcher decides): int32 index math is
    # cheaper, int64 keeps rows * stride from wrapping on huge tensors.
    if INT64:
        pid_m = pid_m.to(tl.int64)
        pid_n = pid_n.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    return offs_m[:, None] * stride_m + offs_n[None, :] * stride_n, mask


@triton.jit(do_not_specialize=["M"])
def geglu_fwd_kernel(
    gate_ptr,  # [M, N]
    up_ptr,  # [M, N]
    out_ptr,  # [M, N]
    M,
    N,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    stride_om,
    stride_on,
    APPROX_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT64: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(N, BLOCK_N)
    offs_g, mask = _tile_offsets(
        pid_m, pid_n, M, N, stride_gm, stride_gn, BLOCK_M, BLOCK_N, INT64
    )
    offs_u, _ = _tile_offsets(
        pid_m, pid_n, M, N, stride_um, stride_un, BLOCK_M, BLOCK_N, INT64
    )
    offs_o, _ = _tile_offsets(
        pid_m, pid_n, M, N, stride_om, stride_on, BLOCK_M, BLOCK_N, INT64
    )
    # No eviction hint: evict_first was slower here (docs/decisions/0005-activation-tiles.md).
    gate = tl.load(gate_ptr + offs_g, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offs_u, mask=mask).to(tl.float32)
    out = geglu_tile(gate, up, out_ptr.dtype.element_ty, APPROX_TANH)
    tl.store(out_ptr + offs_o, out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def geglu_bwd_kernel(
    dout_ptr,  # [M, N]
    gate_ptr,  # [M, N]
    up_ptr,  # [M, N]
    dgate_ptr,  # [M, N]: a new tensor, or gate itself (in place: each element is read
    dup_ptr,  # [M, N]: ... before it is written, by the same program), likewise up
    M,
    N,
    stride_dm,
    stride_dn,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    stride_dgm,
    stride_dgn,
    stride_dum,
    stride_dun,
    APPROX_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INT64: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(N, BLOCK_N)
    offs_d, mask = _tile_offsets(
        pid_m, pid_n, M, N, stride_dm, stride_dn, BLOCK_M, BLOCK_N, INT64
    )
    offs_g, _ = _tile_offsets(
        pid_m, pid_n, M, N, stride_gm, stride_gn, BLOCK_M, BLOCK_N, INT64
    )
    offs_u, _ = _tile_offsets(
        pid_m, pid_n, M, N, stride_um, stride_un, BLOCK_M, BLOCK_N, INT64
    )
    offs_dg, _ = _tile_offsets(
        pid_m, pid_n, M, N, stride_dgm, stride_dgn, BLOCK_M, BLOCK_N, INT64
    )
    offs_du, _ = _tile_offsets(
        pid_m, pid_n, M, N, stride_dum, stride_dun, BLOCK_M, BLOCK_N, INT64
    )
    dtype = dgate_ptr.dtype.element_ty
    # No eviction hints: evict_first on these loads was slower
    # (docs/decisions/0005-activation-tiles.md).
    dout = tl.load(dout_ptr + offs_d, mask=mask).to(tl.float32)
    gate = tl.load(gate_ptr + offs_g, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offs_u, mask=mask).to(tl.float32)
    # Recompute gelu(gate) instead of saving it: one read of gate serves both grads.
    act = gelu(gate, APPROX_TANH).to(dtype).to(tl.float32)
    dup = dout * act
    dact = (dout * up).to(dtype).to(tl.float32)
    dgate = dact * gelu_grad(gate, APPROX_TANH)
    tl.store(dgate_ptr + offs_dg, dgate.to(dtype), mask=mask)
    tl.store(dup_ptr + offs_du, dup.to(dtype), mask=mask)
