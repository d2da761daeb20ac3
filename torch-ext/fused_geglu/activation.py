"""GeGLU activation: the GeLU math shared by every kernel, and the elementwise kernels.

GeLU variants (``APPROX_TANH`` picks one at compile time):
  exact: gelu(x) = 0.5 * x * (1 + erf(x / sqrt(2)))
  tanh:  gelu(x) = 0.5 * x * (1 + tanh(u)) = x * sigmoid(2u),  u = k0 * (x + k1 * x^3),
         k0 = sqrt(2/pi), k1 = 0.044715 (the sigmoid form avoids 1 + tanh(u) cancelling)

Derivatives, with the product structure of PyTorch's ``gelu_backward`` so that NaN/Inf
propagate as in eager (e.g. ``0 * inf`` gives NaN there too):
  exact: gelu'(x) = 0.5 * (1 + erf(x / sqrt(2))) + x * exp(-x^2 / 2) / sqrt(2 pi)
  tanh:  t = tanh(k0 * (x + k1 x^3));
         gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) * k0 (1 + 3 k1 x^2)

Rounding follows transformers' eager ``act_fn(gate) * up``: the activation is rounded to
the input dtype before the multiply, and the product is rounded again; in backward the
product's gradient ``dy * up`` is rounded before ``gelu'`` is applied.
"""

import math

import torch
import triton
import triton.language as tl

# Globals read inside @triton.jit must be constexpr; kernels write them right of a tensor
# (`x * C`): the interpreter's `C * x` wraps the tensor in a constexpr.
SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
INV_SQRT_2 = tl.constexpr(1.0 / math.sqrt(2.0))
INV_SQRT_2PI = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
GELU_TANH_K1 = tl.constexpr(0.044715)
# triton.jit picks the interpreter when a kernel is defined; read the knob once, here.
INTERPRETED = triton.knobs.runtime.interpret


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (triton.cdiv is a constexpr function in recent Triton,
    whose Python call costs microseconds per launch)."""
    return -(-a // b)


@triton.jit
def _sigmoid_2x(u):
    # sigmoid(2u) = (1 + tanh(u)) / 2, without the cancellation of 1 + tanh(u) for u << 0;
    # exp overflowing to inf gives exactly 0, never inf/inf = NaN.
    return 1.0 / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def gelu(x, APPROX_TANH: tl.constexpr):
    """GeLU of an fp32 tensor."""
    if APPROX_TANH:
        # 0.5 x (1 + tanh(u)) = x * sigmoid(2u)
        return x * _sigmoid_2x((x + x * x * x * GELU_TANH_K1) * SQRT_2_OVER_PI)
    else:
        return 0.5 * x * (1.0 + tl.erf(x * INV_SQRT_2))


@triton.jit
def gelu_grad(x, APPROX_TANH: tl.constexpr):
    """d gelu(x) / dx of an fp32 tensor (see the module docstring)."""
    if APPROX_TANH:
        x_sq = x * x
        u = (x + x_sq * x * GELU_TANH_K1) * SQRT_2_OVER_PI
        # 0.5 (1 + t) = s and 0.5 x (1 - t^2) = 2 x s (1 - s), with 1 - s = sigmoid(-2u).
        s = _sigmoid_2x(u)
        right_derivative = 2.0 * x * s * _sigmoid_2x(-u)
        inner_derivative = (x_sq * (3.0 * GELU_TANH_K1) + 1.0) * SQRT_2_OVER_PI
        return s + right_derivative * inner_derivative
    else:
        cdf = 0.5 * (1.0 + tl.erf(x * INV_SQRT_2))
        pdf = tl.exp(-0.5 * x * x) * INV_SQRT_2PI
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
def _geglu_fwd_kernel(
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
    # No eviction hint: evict_first measured 4% slower here (benchmarks/NOTES.md).
    gate = tl.load(gate_ptr + offs_g, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offs_u, mask=mask).to(tl.float32)
    out = geglu_tile(gate, up, out_ptr.dtype.element_ty, APPROX_TANH)
    tl.store(out_ptr + offs_o, out, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _geglu_bwd_kernel(
    dout_ptr,  # [M, N]
    gate_ptr,  # [M, N]
    up_ptr,  # [M, N]
    dgate_ptr,  # [M, N], contiguous
    dup_ptr,  # [M, N], contiguous
    M,
    N,
    stride_dm,
    stride_dn,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
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
    offs_o, _ = _tile_offsets(pid_m, pid_n, M, N, N, 1, BLOCK_M, BLOCK_N, INT64)
    dtype = dgate_ptr.dtype.element_ty
    dout = tl.load(dout_ptr + offs_d, mask=mask, eviction_policy="evict_first").to(
        tl.float32
    )
    gate = tl.load(gate_ptr + offs_g, mask=mask, eviction_policy="evict_first").to(
        tl.float32
    )
    up = tl.load(up_ptr + offs_u, mask=mask, eviction_policy="evict_first").to(
        tl.float32
    )
    # Recompute gelu(gate) instead of saving it: one read of gate serves both grads.
    act = gelu(gate, APPROX_TANH).to(dtype).to(tl.float32)
    dup = dout * act
    dact = (dout * up).to(dtype).to(tl.float32)
    dgate = dact * gelu_grad(gate, APPROX_TANH)
    tl.store(dgate_ptr + offs_o, dgate.to(dtype), mask=mask)
    tl.store(dup_ptr + offs_o, dup.to(dtype), mask=mask)


def _elementwise_config(n_cols: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for an [M, N] elementwise pass.

    A row tile spans up to 16 bytes x 32 lanes x 8 warps (2048 bf16 / 1024 fp32 columns),
    so every load is a 16-byte vector; rows are stacked until a program streams ~8192
    elements. For strided operands (contiguous ones take FLAT_BLOCK); H200, 8192 x 16384
    bf16 halves of one [M, 2N] tensor: within 1% of the best of four candidates
    (benchmarks/results/*-tune.json), and the best backward of seven in session 1's sweep.
    """
    vec = 16 // elem_bytes
    block_n = min(
        1 << (max(n_cols, 1) - 1).bit_length(), vec * 32 * 8
    )  # next power of 2
    block_m = max(1, 8192 // block_n)
    return block_m, block_n, 8


# Contiguous operands are processed as one long row in 1024-element tiles with 4 warps
# (two 16-byte vectors per thread in 16-bit dtypes): 0.189 ms forward on 8192 x 16384 bf16,
# copy rate, against 0.191-0.194 ms for row tiles (H200, benchmarks/results/*-tune.json).
# The interpreter pays per program, not per element: larger tiles there.
FLAT_BLOCK, FLAT_WARPS = (16384 if INTERPRETED else 1024), 4


def _elementwise_launch(*rows: torch.Tensor) -> tuple[tuple[int], dict]:
    """Grid and launch arguments for [M, N] views ``rows``: when all are contiguous, the
    caller passes them as one row (``flat``); otherwise row tiles through their strides."""
    M, N = rows[0].shape
    flat = all(t.is_contiguous() for t in rows)
    if flat:
        M, N = 1, M * N
        block_m, block_n, num_warps = 1, FLAT_BLOCK, FLAT_WARPS
        strides = [(0, 1)] * len(rows)
    else:
        block_m, block_n, num_warps = _elementwise_config(N, rows[0].element_size())
        strides = [t.stride() for t in rows]
    grid_m, grid_n = cdiv(M, block_m), cdiv(N, block_n)
    # Largest offset a program can form (masked lanes included) against int32's range.
    reach = max(
        grid_m * block_m * abs(sm) + grid_n * block_n * abs(sn) for sm, sn in strides
    )
    meta = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "INT64": reach >= 2**31,
        "num_warps": num_warps,
    }
    return (grid_m * grid_n,), (M, N, [s for st in strides for s in st]), meta


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """A 2-D [rows, cols] view of ``t`` over its leading dims, or None when their strides
    cannot be expressed as one row stride (e.g. a permuted batch)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """2-D rows of an input; copies only in the case ``_rows_view`` cannot express."""
    if t.shape[-1] == 0:
        return t.reshape(t.shape[:-1].numel(), 0)
    rows = _rows_view(t)
    return rows if rows is not None else t.reshape(-1, t.shape[-1])


def geglu_fwd(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, approximate: str
) -> None:
    """out = round(gelu(gate)) * up; the three tensors share a shape, ``out`` may be any view."""
    if gate.numel() == 0:
        return
    g, u, o = as_rows(gate), as_rows(up), _rows_view(out)
    if o is None:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        geglu_fwd(gate, up, tmp, approximate)
        out.copy_(tmp)
        return
    grid, (m, n, strides), meta = _elementwise_launch(g, u, o)
    _geglu_fwd_kernel[grid](
        g, u, o, m, n, *strides, APPROX_TANH=approximate == "tanh", **meta
    )  # fmt: skip


def geglu_bwd(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of out = gelu(gate) * up, both contiguous and shaped like ``gate``."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty_like(dgate)
    if gate.numel() == 0:
        return dgate, dup
    d, g, u = as_rows(dout), as_rows(gate), as_rows(up)
    M, N = g.shape
    # dgate is passed for the flat/int64 decisions only: the outputs are contiguous.
    grid, (m, n, strides), meta = _elementwise_launch(d, g, u, dgate.view(M, N))
    _geglu_bwd_kernel[grid](
        d, g, u, dgate, dup, m, n, *strides[:6], APPROX_TANH=approximate == "tanh", **meta
    )  # fmt: skip
    return dgate, dup
