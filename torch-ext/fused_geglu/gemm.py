"""GEMM entry points and the host side of the GEMM kernels (gemm_kernels.py).

Every entry point computes into ``c`` ([M, N]) from ``a`` ([M, K]) and weights in
``nn.Linear``'s [N, K] layout, any strides (a transposed view is free):

  gemm(a, b, c)                          c (+)= a @ b^T + bias;  bias_grad = row sums of a
  gemm_act(a, b, c, act)                 c = act(a @ b^T + bias), preact = a @ b^T + bias
  gemm_dact(a, z, b, c, act)             c = round(a * act'(z)) @ b^T;  bias_grad likewise
  gemm_gated(a, b_gate, b_up, c, act)    c = round(act(gate)) * up, gate/up = a @ b^T + bias

``act`` is an activation code: GELU (exact) or GELU_TANH. Rounding points are eager's
(gemm_kernels.py). Configurations come from tuning.py (per GPU and shape class); a
plan (configuration, grid, split, launcher) is cached per exact call signature in a
bounded BoundedCache, so a repeated call costs a dict lookup and the launch. The TMA
descriptors, split-K scratch and row views here serve the FP8 GEMMs too (fp8/gemm.py).
"""

from typing import NamedTuple

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .checks import check_contiguous
from .gemm_kernels import gemm_kernel, gemm_tma_kernel
from .launch import (
    SHARED_SCRATCH,
    BoundedCache,
    Launcher,
    cdiv,
    has_tma,
    num_programs,
    stream_scratch,
)
from .tuning import GemmConfig, gemm_config, split_k

NO_ACT, GELU, GELU_TANH = 0, 1, 2


def gelu_code(approximate: str) -> int:
    """The activation code of ``F.gelu(approximate=approximate)``."""
    return GELU_TANH if approximate == "tanh" else GELU


def tma_applies(M: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a GEMM with M rows of 16-bit operands takes the TMA kernel (when its operands
    are aligned). Decode shapes (M <= 64: weight streaming) and fp32 (not a performance
    target) take the portable kernel."""
    return M > 64 and dtype in _TMA_DTYPES and has_tma(device)


_TMA_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def tma_tiles_fill_gpu(M: int, N: int, K: int, dtype, device) -> bool:
    """Whether a single (not gated) TMA GEMM with M x N outputs has a tile for every program
    of its persistent grid (one per SM); with fewer, SMs idle (the kernel has no split-K)."""
    cfg = gemm_config(M, N, dtype, device, gated=False, tma=True, extra_tiles=False)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    return tiles >= num_programs(device)


def input_precision(dtype: torch.dtype) -> str:
    # fp32 operands follow PyTorch: tf32 tensor cores only when
    # torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision allow them.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


# Split-K: the partial tiles (overwritten by each launch) and one counter per tile (at
# most one per SM); the last program of each tile resets its own.
_SPLIT_K_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
SHARED_SCRATCH.append(_SPLIT_K_SCRATCH)


def tma_operand(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """``(view, transposed)`` with a unit last stride that a TMA descriptor can describe: ``t``
    itself or ``t.T``; None when neither is (TMA needs a 16-byte-aligned base and row stride)."""
    if t.data_ptr() % 16:
        return None
    (s0, s1), size = t.stride(), t.element_size()
    if s1 == 1 and s0 > 0 and s0 * size % 16 == 0:
        return t, False
    if s0 == 1 and s1 > 0 and s1 * size % 16 == 0:
        return t.t(), True
    return None


def stacked_weights(b, b_up, block_n, block_k, boxes):
    """One [2, N, K] descriptor over two [N, K] weights wherever they lie: its outer stride
    is the distance between them (TMA takes any 16-byte-aligned stride under 2^40 bytes),
    so the gate and up tiles arrive as one box (``boxes`` 2), or as two of one descriptor
    (1: the FP8 TMA kernel's, one dot per weight). Returns (descriptor, up_first) or
    None."""
    lo, hi, up_first = (
        (b, b_up, False) if b_up.data_ptr() > b.data_ptr() else (b_up, b, True)
    )
    gap = hi.data_ptr() - lo.data_ptr()
    operand = tma_operand(lo)
    if (
        operand is None
        or operand[1]
        or lo.stride() != hi.stride()
        or gap == 0
        or gap % 16
        or gap >= 1 << 40
    ):
        return None
    (n, k), es = lo.shape, lo.element_size()
    desc = TensorDescriptor(
        lo, [2, n, k], [gap // es, lo.stride(0), 1], [boxes, block_n, block_k]
    )
    return desc, up_first


def tma_descriptors(a, b, b_up, z, c, preacts, cfg: GemmConfig, boxes: int = 2):
    """(descriptors for A, B, Z (None without Z), C, the gated GEMM's stored gate and up
    (or the pointers ``preacts`` as they are); A_T, B_T, UP_FIRST) for the TMA kernel, or
    None when an operand is not TMA-compatible, A and Z disagree on orientation, or the
    gated GEMM's weights cannot share one descriptor (of ``boxes``: stacked_weights)."""
    ops = [tma_operand(t) for t in (a, b, c)]
    z_op = None if z is None else tma_operand(z)
    if None in ops or (z is not None and (z_op is None or z_op[1] != ops[0][1])):
        return None
    c_block = [cfg.block_m, cfg.block_n]
    if b_up is not None and preacts[0] is not None:  # contiguous, of C's size
        pre_ops = [tma_operand(t.view(c.shape)) for t in preacts]
        if None in pre_ops or pre_ops[0][1] or pre_ops[1][1]:
            return None
        preacts = [TensorDescriptor.from_tensor(t, c_block) for t, _ in pre_ops]
    (a_v, a_t), (b_v, b_t), (c_v, c_t) = ops
    if c_t:
        return None
    a_block = [cfg.block_k, cfg.block_m] if a_t else [cfg.block_m, cfg.block_k]
    up_first = False
    if b_up is not None:
        stacked = stacked_weights(b, b_up, cfg.block_n, cfg.block_k, boxes)
        if stacked is None:
            return None
        b_desc, up_first = stacked
    else:
        b_block = [cfg.block_k, cfg.block_n] if b_t else [cfg.block_n, cfg.block_k]
        b_desc = TensorDescriptor.from_tensor(b_v, b_block)
    a_desc = TensorDescriptor.from_tensor(a_v, a_block)
    z_desc = None if z is None else TensorDescriptor.from_tensor(z_op[0], a_block)
    c_desc = TensorDescriptor.from_tensor(c_v, c_block)
    return (a_desc, b_desc, z_desc, c_desc, *preacts), a_t, b_t, up_first


class Epilogue(NamedTuple):
    """The fused work of one GEMM (see gemm_kernels.py for the flags); built by keyword. A
    tuple: it keys the launch plans (hashed at C speed)."""

    activation: int = NO_ACT
    gated: bool = False
    store_preact: bool = False
    dact: int = NO_ACT
    bias_grad: bool = False
    accumulate: bool = False
    has_bias: bool = False

    def constexprs(self) -> dict:
        return {
            "HAS_BIAS": self.has_bias,
            "GATED": self.gated,
            "ACTIVATION": self.activation,
            "STORE_PREACT": self.store_preact,
            "DACT": self.dact,
            "BIAS_GRAD": self.bias_grad,
            "ACCUMULATE": self.accumulate,
        }


class _Plan:
    """What a call signature needs beyond its tensors: the configuration, the kernel's
    launchers and the split."""

    __slots__ = ("cfg", "constexprs", "launchers", "split", "tiles", "tma", "ws_numel")

    def __init__(self, M, N, K, dtype, device, epi: Epilogue, tma: bool):
        extra_tiles = (
            epi.dact != NO_ACT or epi.accumulate or (epi.store_preact and not epi.gated)
        )
        self.tma = tma
        self.cfg = cfg = gemm_config(M, N, dtype, device, epi.gated, tma, extra_tiles)
        self.tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        self.split = 1
        if not tma and M <= 64 and not epi.bias_grad:  # row sums: not split
            self.split = split_k(self.tiles, cdiv(K, cfg.block_k), num_programs(device))
        self.ws_numel = split_k_workspace(self.tiles, self.split, epi.gated, cfg)
        self.constexprs = {
            **epi.constexprs(),
            "INPUT_PRECISION": input_precision(dtype),
            **cfg.constexprs(),
        }
        if tma:
            self.launchers = {}  # (A_T, B_T, UP_FIRST, gap class) -> Launcher
        else:
            self.constexprs |= {"SPLIT_K": self.split, "EVEN_K": K % cfg.block_k == 0}
            self.launchers = Launcher(gemm_kernel, self.constexprs)

    def tma_launcher(self, a_t, b_t, up_first, b_desc) -> Launcher:
        return tma_launcher(self, gemm_tma_kernel, a_t, b_t, up_first, b_desc)


def split_k_workspace(tiles: int, split: int, gated: bool, cfg: GemmConfig) -> int:
    """The fp32 elements of a split-K launch's partial tiles (1 or 2 per tile and slice)."""
    return tiles * split * (2 if gated else 1) * cfg.block_m * cfg.block_n


def tma_launcher(plan, kernel, a_t, b_t, up_first, b_desc) -> Launcher:
    """``plan``'s launcher of a TMA ``kernel`` for its operands' orientations. The stacked
    weights' outer stride (their distance) varies between layers of one shape: its int
    class joins the key (what Triton may specialise descriptors on)."""
    outer = b_desc.strides[0]
    key = (a_t, b_t, up_first, outer % 16 == 0, outer == 1)
    launcher = plan.launchers.get(key)
    if launcher is None:
        flags = {"A_T": a_t, "B_T": b_t, "UP_FIRST": up_first}
        launcher = plan.launchers[key] = Launcher(kernel, {**plan.constexprs, **flags})
    return launcher


_PLANS = BoundedCache(1024)


def rows_of(t: torch.Tensor) -> tuple[int, int, tuple[int, int]]:
    """(rows, cols, (row stride, col stride)) of a 2-D operand, or of a contiguous [..., cols]
    one seen as 2-D rows (no view is made: the kernel reads pointers and strides)."""
    if t.dim() == 2:
        rows, cols = t.shape
        return rows, cols, t.stride()
    cols = t.shape[-1]
    return t.numel() // cols, cols, (cols, 1)


def _gemm(a, b, c, epi: Epilogue, b_up=None, bias=None, bias_up=None, preact=None,
          preact_up=None, z=None, bias_grad=None) -> None:  # fmt: skip
    """``a`` and ``c``: 2-D, or contiguous of any rank (seen as rows)."""
    M, K, stride_a = rows_of(a)
    N = b.shape[0]
    if M == 0 or N == 0:
        if bias_grad is not None:  # no output columns, but the row sums of A are owed
            if z is not None:
                approximate = "tanh" if epi.dact == GELU_TANH else "none"
                a = torch.ops.aten.gelu_backward(a, z, approximate=approximate)
            bias_grad.copy_(a.float().sum(1))
        return
    dtype, device = a.dtype, a.device
    none2 = (None, None)
    strides = (
        *stride_a, *b.stride(), *(none2 if b_up is None else b_up.stride()),
        *rows_of(c)[2], *(none2 if z is None else z.stride()),
        None if bias is None else bias.stride(0),
        None if bias_up is None else bias_up.stride(0),
    )  # fmt: skip
    key = (M, N, K, dtype, c.dtype, device, epi, strides)
    plan = _PLANS.get(key)
    if plan is None:
        tma = K > 0 and tma_applies(M, dtype, device)
        plan = _PLANS[key] = _Plan(M, N, K, dtype, device, epi, tma)
    if plan.tma:
        a2 = a if a.dim() == 2 else a.view(M, K)
        c2 = c if c.dim() == 2 else c.view(M, N)
        descs = tma_descriptors(a2, b, b_up, z, c2, (preact, preact_up), plan.cfg)
        if descs is not None:
            (a_d, b_d, z_d, c_d, pre_d, pre_up_d), a_t, b_t, up_first = descs
            launcher = plan.tma_launcher(a_t, b_t, up_first, b_d)
            grid = min(plan.tiles, num_programs(device))
            launcher(
                grid, a_d, b_d, z_d, c_d, bias, bias_up, pre_d, pre_up_d, bias_grad,
                M, N, K, *strides[-2:],
            )  # fmt: skip
            return
        # Hopper, but an operand TMA cannot describe: the portable kernel's plan.
        key = (*key, "portable")
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _Plan(M, N, K, dtype, device, epi, False)
    ws = counters = None
    if plan.split > 1:  # no split-K: its kernel takes no counters (None at every call)
        ws, counters = split_k_scratch(device, plan.ws_numel)
    plan.launchers(
        plan.tiles * plan.split, a, b, b_up, bias, bias_up, c, preact, preact_up, z,
        bias_grad, ws, counters, M, N, K, *strides,
    )  # fmt: skip


def split_k_scratch(device: torch.device, numel: int) -> tuple:
    """(fp32 workspace of at least ``numel``, zeroed counters, one per SM) for a split-K
    launch on the current stream (stream_scratch)."""
    return stream_scratch(_SPLIT_K_SCRATCH, device, numel, num_programs(device), False)


def gemm(
    a: torch.Tensor,  # [M, K]
    b: torch.Tensor,  # [N, K]
    c: torch.Tensor,  # [M, N]
    *,
    bias: torch.Tensor | None = None,  # [N]
    accumulate: bool = False,
    bias_grad: torch.Tensor | None = None,  # [M] fp32: row sums of a
) -> None:
    """c = a @ b^T + bias, or c += a @ b^T with ``accumulate``; ``bias_grad`` receives the
    row sums of ``a`` (with a = dY^T: the bias gradient of a weight-gradient GEMM)."""
    epi = Epilogue(
        bias_grad=bias_grad is not None,
        accumulate=accumulate,
        has_bias=bias is not None,
    )
    _gemm(a, b, c, epi, bias=bias, bias_grad=bias_grad)


def gemm_act(
    a: torch.Tensor,  # [M, K]
    b: torch.Tensor,  # [N, K]
    c: torch.Tensor,  # [M, N]
    activation: int,
    *,
    bias: torch.Tensor | None = None,  # [N]
    preact: torch.Tensor | None = None,  # [M, N] contiguous
) -> None:
    """c = act(a @ b^T + bias); ``preact`` receives the rounded a @ b^T + bias."""
    if preact is not None:
        check_contiguous("gemm_act", preact=preact)
    epi = Epilogue(
        activation=activation,
        store_preact=preact is not None,
        has_bias=bias is not None,
    )
    _gemm(a, b, c, epi, bias=bias, preact=preact)


def gemm_dact(
    a: torch.Tensor,  # [M, K]: dY
    z: torch.Tensor,  # [M, K]: the pre-activation Z (same orientation as a)
    b: torch.Tensor,  # [N, K]
    c: torch.Tensor,  # [M, N]
    activation: int,
    *,
    bias_grad: torch.Tensor | None = None,  # [M] fp32
) -> None:
    """c = round(a * act'(z)) @ b^T: the backward of a GEMM + activation, dZ formed in the
    prologue; ``bias_grad`` receives the row sums of round(a * act'(z))."""
    epi = Epilogue(dact=activation, bias_grad=bias_grad is not None)
    _gemm(a, b, c, epi, z=z, bias_grad=bias_grad)


def gemm_gated(
    a: torch.Tensor,  # [M, K]
    b_gate: torch.Tensor,  # [N, K]
    b_up: torch.Tensor,  # [N, K]
    c: torch.Tensor,  # [M, N]
    activation: int,
    *,
    bias_gate: torch.Tensor | None = None,  # [N]
    bias_up: torch.Tensor | None = None,  # [N]
    gate: torch.Tensor | None = None,  # [M, N] contiguous
    up: torch.Tensor | None = None,  # [M, N] contiguous
) -> None:
    """c = round(act(gate)) * up with gate = a @ b_gate^T + bias_gate, up = a @ b_up^T +
    bias_up (each rounded); ``gate``/``up`` receive them (what backward needs)."""
    if gate is not None or up is not None:
        check_contiguous("gemm_gated", gate=gate, up=up)
    epi = Epilogue(
        activation=activation,
        gated=True,
        store_preact=gate is not None,
        has_bias=bias_gate is not None,
    )
    _gemm(
        a, b_gate, c, epi, b_up=b_up, bias=bias_gate, bias_up=bias_up, preact=gate,
        preact_up=up,
    )  # fmt: skip
