"""FP8 GEMM entry points and the host side of the FP8 kernels (fp8/kernels.py): e4m3
weights with 128 x 128 block scales, transformers' FineGrainedFP8.

  quantize_fp8(x, q, s)                  q, s = x per row and 128 columns (e4m3, scales);
                                         with up and act: of round(act(x)) * up
  gemm_fp8(a, a_scale, b, b_scale, c)    c = (a, a_scale) @ (b, b_scale)^T + bias
  gemm_gated_fp8(a, a_scale, b_gate, gate_scale, b_up, up_scale, h, h_scale, act)
                                         h, h_scale = quantize(round(act(gate)) * up);
                                         a 16-bit, a_scale None: a quantized in the K loop
  gemm_fp8_cublas(a, a_scale, b, b_scale, dtype)
                                         gemm_fp8's product by cuBLAS (fp8_cublas_applies)
  launch_gemm_fp8, launch_gemm_gated_fp8 the two FP8 GEMMs without their checks, for the
                                         FP8 MLP's operands (checked once per call upstream)

Launch configurations come from tuning.py (fp8_config, fp8_swap_ab); plans are cached per
call signature as gemm.py's, whose TMA descriptors and split-K scratch they share.
"""

from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..gemm import (
    GELU,
    GELU_TANH,
    NO_ACT,
    input_precision,
    rows_of,
    split_k_scratch,
    split_k_workspace,
    stacked_weights,
    tma_applies,
    tma_descriptors,
    tma_launcher,
    tma_operand,
)
from ..launch import INTERPRETED, BoundedCache, Launcher, cdiv, has_tma, num_programs
from ..tuning import (
    FP8_QUANT_A_ROWS,
    GemmConfig,
    fp8_config,
    fp8_swap_ab,
    split_k,
    table,
)
from .checks import (
    check_fp8_gemm_a,
    check_fp8_gemm_scales,
    check_fp8_quantize_operands,
    check_fp8_row_scales,
    check_split_k_counters,
)
from .kernels import (
    FP8_BLOCK,
    gemm_fp8_kernel,
    gemm_fp8_tma_kernel,
    quantize_fp8_kernel,
)


def fp8_weights_through_tma(M: int, b: torch.Tensor, b_up: torch.Tensor | None) -> bool:
    """Whether a decode FP8 GEMM (at most 64 rows: the portable kernel) reads its weights
    through TMA (B_TMA): where TMA can describe them as they lie, [N, K] rows of 16-byte
    multiples. Faster than pointer loads at 1 to 64 tokens on the H200: fewer instructions
    per byte streamed (docs/decisions/0007-fp8-decode.md)."""
    return (
        M <= 64
        and b.dtype == torch.float8_e4m3fn
        and has_tma(b.device)
        and _tma_rows(b)
        and (b_up is None or _tma_rows(b_up))
    )


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor describes ``t`` as it lies (not transposed)."""
    operand = tma_operand(t)
    return operand is not None and not operand[1]


def later_split_k_counters(device: torch.device) -> torch.Tensor:
    """Split-K counters, not initialised, for a launch that an earlier launch on the stream
    zeroes (gemm_gated_fp8's ``clear``, then gemm_fp8's ``counters``): where a fresh zeroed
    tensor would be a memset node of its own in a CUDA graph."""
    count = triton.next_power_of_2(num_programs(device))
    return torch.empty(count, dtype=torch.int32, device=device)


class FP8Epilogue(NamedTuple):
    """The fused work of one FP8 GEMM (fp8/kernels.py's flags); built by keyword, keys the
    launch plans."""

    activation: int = NO_ACT
    gated: bool = False
    has_bias: bool = False
    quant_out: bool = False
    act_bf16: bool = False  # quant_out: h's dtype before quantization
    quant_a: bool = False  # a 16-bit A, quantized in the K loop (QUANT_A)
    clear: int = 0  # a later split-K launch's counters zeroed here (CLEAR)

    def constexprs(self) -> dict:
        return {
            "HAS_BIAS": self.has_bias,
            "GATED": self.gated,
            "ACTIVATION": self.activation,
            "QUANT_OUT": self.quant_out,
            "ACT_BF16": self.act_bf16,
        }


def stacked_stages(cfg: GemmConfig) -> int:
    """num_stages of a STACKED GEMM of configuration ``cfg``: Triton 3.6 loads its 3-D box a
    stage less ahead than two 2-D boxes; a stage more was the faster at 32-row tiles, not
    at 16 (docs/decisions/0007-fp8-decode.md)."""
    return cfg.num_stages + (cfg.block_m == 32)


class _Plan:
    """What an FP8 call signature needs beyond its tensors: the configuration, the kernel's
    launchers and the split."""

    __slots__ = ("b_tma", "cfg", "constexprs", "launchers", "split", "stacks", "tiles",
                 "tma", "ws_numel")  # fmt: skip

    def __init__(
        self, M, N, K, dtype, device, epi: FP8Epilogue, tma: bool, b_tma: bool
    ):
        # swapped products (QUANT_A's among them) are the portable kernel's
        swap = fp8_swap_ab(M, N, epi.gated, epi.quant_a, device, b_tma)
        self.tma = tma = tma and not swap and not epi.clear
        self.b_tma = b_tma
        # A gated B_TMA GEMM reads both weights through one descriptor (STACKED) where it
        # quantizes x itself; with x quantized apart (33-64 tokens) that was slower.
        self.stacks = b_tma and epi.gated and epi.quant_a
        self.cfg = cfg = fp8_config(M, epi.gated, tma, swap, b_tma)
        self.tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        self.split = 1
        if not tma and (M <= 64 or swap):
            # The swapped down GEMM's small tiles (40 KB of shared memory at 16 rows)
            # stream faster two per SM.
            per_sm = 2 if swap and not epi.gated else 1
            k_tiles = cdiv(K, cfg.block_k)
            self.split = split_k(self.tiles, k_tiles, per_sm * num_programs(device))
        self.ws_numel = split_k_workspace(self.tiles, self.split, epi.gated, cfg)
        self.constexprs = {
            **epi.constexprs(),
            "INPUT_PRECISION": input_precision(dtype),
            **cfg.constexprs(),
        }
        if tma:
            self.launchers = {}  # (A_T, B_T, UP_FIRST, gap class) -> Launcher
            return
        self.constexprs |= {
            "QUANT_A": epi.quant_a,
            "SWAP_AB": swap,
            "B_TMA": b_tma,
            "STACKED": False,
            "UP_FIRST": False,
            "SPLIT_K": self.split,
            "CLEAR": epi.clear,
            "EVEN_K": K % cfg.block_k == 0,
        }
        # [unstacked, STACKED, STACKED and UP_FIRST] (the last two made when needed)
        self.launchers = [Launcher(gemm_fp8_kernel, self.constexprs), None, None]

    def stacked_launcher(self, up_first: bool) -> Launcher:
        """The portable kernel over both weights of a gated B_TMA GEMM in one descriptor
        (STACKED), in stacked_stages."""
        launcher = self.launchers[1 + up_first]
        if launcher is None:
            stages = stacked_stages(self.cfg)
            flags = {"STACKED": True, "UP_FIRST": up_first, "num_stages": stages}
            launcher = Launcher(gemm_fp8_kernel, {**self.constexprs, **flags})
            self.launchers[1 + up_first] = launcher
        return launcher


_PLANS = BoundedCache(1024)


def _gemm_fp8(a, b, c, epi: FP8Epilogue, scales: tuple, b_up=None, bias=None,
              bias_up=None, clear=None, counters=None) -> None:  # fmt: skip
    """``a`` and ``c``: 2-D, or contiguous of any rank (seen as rows); ``scales``: (a_scale,
    b_scale, b_up_scale, c_scale); ``clear``: later_split_k_counters that this launch
    zeroes (``epi``'s clear: their number), and ``counters``: ones an earlier launch
    zeroed, for this launch's split-K."""
    M, K, stride_a = rows_of(a)
    N = b.shape[0]
    if M == 0 or N == 0:
        return
    dtype, device = a.dtype, a.device
    none2 = (None, None)
    strides = (
        *stride_a, *b.stride(), *(none2 if b_up is None else b_up.stride()),
        *rows_of(c)[2], None if bias is None else bias.stride(0),
        None if bias_up is None else bias_up.stride(0), *scales[1].stride(),
        None if scales[3] is None else scales[3].stride(0),
    )  # fmt: skip
    # c's dtype too: it differs from a's (e4m3 h), and a launcher's kernel is compiled
    # for one output dtype
    b_tma = fp8_weights_through_tma(M, b, b_up)
    key = (M, N, K, dtype, c.dtype, device, epi, strides, b_tma)
    plan = _PLANS.get(key)
    if plan is None:
        tma = K > 0 and tma_applies(M, dtype, device)
        plan = _PLANS[key] = _Plan(M, N, K, dtype, device, epi, tma, b_tma)
    if plan.tma:
        a2 = a if a.dim() == 2 else a.view(M, K)
        c2 = c if c.dim() == 2 else c.view(M, N)
        descs = tma_descriptors(a2, b, b_up, None, c2, none2, plan.cfg, boxes=1)
        if descs is not None:
            (a_d, b_d, _, c_d, _, _), a_t, b_t, up_first = descs
            launcher = tma_launcher(plan, gemm_fp8_tma_kernel, a_t, b_t, up_first, b_d)
            grid = min(plan.tiles, num_programs(device))
            launcher(
                grid, a_d, b_d, c_d, bias, bias_up, *scales, M, N, K, *strides[-5:]
            )
            return
        # Hopper, but an operand TMA cannot describe: the portable kernel's plan.
        key = (*key, "portable")
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _Plan(M, N, K, dtype, device, epi, False, b_tma)
    ws = None
    if plan.split == 1:  # no split-K: its kernel takes no counters (None at every call)
        counters = None
    elif counters is None:
        ws, counters = split_k_scratch(device, plan.ws_numel)
    else:  # counters an earlier launch zeroed (CLEAR); a fresh workspace
        ws = torch.empty(plan.ws_numel, dtype=torch.float32, device=device)
    launcher = plan.launchers[0]
    if plan.b_tma:
        box = [plan.cfg.block_n, plan.cfg.block_k]
        stacked = stacked_weights(b, b_up, *box, 2) if plan.stacks else None
        if stacked is not None:  # both weights' tiles in one box, one MMA per K step
            b, up_first = stacked
            b_up = None
            launcher = plan.stacked_launcher(up_first)
        else:
            b = TensorDescriptor.from_tensor(b, box)
            b_up = None if b_up is None else TensorDescriptor.from_tensor(b_up, box)
    launcher(
        plan.tiles * plan.split, a, b, b_up, bias, bias_up, c, ws, counters, clear,
        *scales, M, N, K, *strides,
    )  # fmt: skip


_QUANTIZE_PLANS = BoundedCache(256)


def quantize_fp8(
    x: torch.Tensor,  # [M, K] (2-D, or contiguous seen as rows); with ``up``, the gate
    q: torch.Tensor,  # [M, K] e4m3, contiguous
    s: torch.Tensor,  # [cdiv(K, 128), M] fp32, unit column stride, rows >= M apart
    *,
    up: torch.Tensor | None = None,  # [M, K], x's strides
    activation: int = NO_ACT,
) -> None:
    """q, s = x quantized per row and 128 columns (fp8/kernels.py quantize_rows), the scales
    K-block-major: the A operand of gemm_fp8 / gemm_gated_fp8. With ``up`` and a GeLU
    ``activation``, x = round(act(x)) * up in x's dtype is quantized: the h that
    gemm_gated_fp8 hands over, from gate and up computed apart."""
    M, K, (stride_m, stride_k) = rows_of(x)
    if activation not in (NO_ACT, GELU, GELU_TANH) or (up is None) != (
        activation == NO_ACT
    ):
        raise ValueError(
            f"quantize_fp8: up and a GeLU activation (codes {GELU}, {GELU_TANH}) come "
            f"together; got up {'None' if up is None else tuple(up.shape)}, activation "
            f"{activation!r}"
        )
    check_fp8_quantize_operands("quantize_fp8", x, up, q, s, M, K)
    if M == 0 or K == 0:
        return
    block_m = 16 if INTERPRETED else 32
    # What Triton specialises the int arguments on: one compiled kernel per launcher.
    key = (
        x.dtype,
        x.device,
        activation,
        *((v == 1, v % 16 == 0) for v in (M, K, stride_m, stride_k, s.stride(0))),
    )
    launcher = _QUANTIZE_PLANS.get(key)
    if launcher is None:
        launcher = _QUANTIZE_PLANS[key] = Launcher(
            quantize_fp8_kernel,
            {
                "BLOCK_M": block_m,
                "BLOCK_K": FP8_BLOCK,
                "ACTIVATION": activation,
                "num_warps": 4,
                "num_stages": 1,
            },
        )
    grid = cdiv(M, block_m) * cdiv(K, FP8_BLOCK)
    launcher(grid, x, up, q, s, M, K, stride_m, stride_k, s.stride(0))


def gemm_fp8(
    a: torch.Tensor,  # [M, K] e4m3
    a_scale: torch.Tensor,  # [cdiv(K, 128), M] fp32, rows M apart
    b: torch.Tensor,  # [N, K] e4m3
    b_scale: torch.Tensor,  # [cdiv(N, 128), cdiv(K, 128)] fp32
    c: torch.Tensor,  # [M, N], 16-bit
    *,
    bias: torch.Tensor | None = None,  # [N]
    counters: torch.Tensor | None = None,  # later_split_k_counters, zeroed by then
) -> None:
    """c = (a * a_scale) @ (b * b_scale)^T + bias, each scale over its 128-wide blocks;
    the fp32 product of each K block is scaled as it is added. ``counters``: a split-K's,
    zeroed by an earlier launch (gemm_gated_fp8's ``clear``); unused where the plan does
    not split K."""
    check_fp8_gemm_a("gemm_fp8", a, a_scale, max_16_bit_rows=0)
    check_fp8_gemm_scales("gemm_fp8", a, a_scale, b, b_scale)
    check_split_k_counters(
        "gemm_fp8", "counters", counters, a.device, num_programs(a.device)
    )
    launch_gemm_fp8(a, a_scale, b, b_scale, c, bias=bias, counters=counters)


def launch_gemm_fp8(a, a_scale, b, b_scale, c, *, bias=None, counters=None) -> None:
    """gemm_fp8 without its checks, for operands already in the form it checks: the FP8
    MLP's (library), whose weights and scales were checked once per call of the op or
    when the layer's route was built, and whose quantized activations it allocates."""
    epi = FP8Epilogue(has_bias=bias is not None)
    scales = (a_scale, b_scale, None, None)
    _gemm_fp8(a, b, c, epi, scales, bias=bias, counters=counters)


def gemm_gated_fp8(
    a: torch.Tensor,  # [M, K] e4m3, or 16-bit (M <= FP8_QUANT_A_ROWS)
    a_scale: torch.Tensor | None,  # [cdiv(K, 128), M] fp32, rows M apart, or None
    b_gate: torch.Tensor,  # [N, K] e4m3
    gate_scale: torch.Tensor,  # [cdiv(N, 128), cdiv(K, 128)] fp32
    b_up: torch.Tensor,  # [N, K] e4m3
    up_scale: torch.Tensor,  # gate_scale's shape and strides
    h: torch.Tensor,  # [M, N] e4m3, contiguous
    h_scale: torch.Tensor,  # [cdiv(N, 128), M] fp32, rows at least M apart
    activation: int,
    act_dtype: torch.dtype,  # the 16-bit dtype gate, up and h are rounded in
    *,
    bias_gate: torch.Tensor | None = None,  # [N]
    bias_up: torch.Tensor | None = None,  # [N]
    clear: torch.Tensor | None = None,  # later_split_k_counters
) -> None:
    """h, h_scale = quantizerows_of(round(act(gate)) * up) per row and 128 columns, with
    gate/up the FP8 products as gemm_fp8's, rounded to ``act_dtype``: what the down
    projection's FP8 GEMM reads. A 16-bit ``a`` is quantized in the K loop as
    quantize_fp8 would (the same q and scales): one launch fewer at decode sizes.
    ``clear``: counters the launch zeroes for the down GEMM's split-K (the portable kernel
    then runs)."""
    check_fp8_gemm_a("gemm_gated_fp8", a, a_scale, max_16_bit_rows=FP8_QUANT_A_ROWS)
    check_fp8_gemm_scales(
        "gemm_gated_fp8", a, a_scale, b_gate, gate_scale, (b_up, up_scale), "gate_scale"
    )
    check_fp8_row_scales(
        "gemm_gated_fp8", h_scale, cdiv(b_gate.shape[0], FP8_BLOCK), rows_of(a)[0],
        a.device, "h_scale", padded=True,
    )  # fmt: skip
    check_split_k_counters("gemm_gated_fp8", "clear", clear, a.device, 1)
    launch_gemm_gated_fp8(
        a, a_scale, b_gate, gate_scale, b_up, up_scale, h, h_scale, activation, act_dtype,
        bias_gate=bias_gate, bias_up=bias_up, clear=clear,
    )  # fmt: skip


def launch_gemm_gated_fp8(a, a_scale, b_gate, gate_scale, b_up, up_scale, h, h_scale,
                          activation: int, act_dtype: torch.dtype, *, bias_gate=None,
                          bias_up=None, clear=None) -> None:  # fmt: skip
    """gemm_gated_fp8 without its checks (launch_gemm_fp8's reason)."""
    epi = FP8Epilogue(
        activation=activation, gated=True, has_bias=bias_gate is not None, quant_out=True, act_bf16=act_dtype == torch.bfloat16, quant_a=a_scale is None,
        clear=0 if clear is None else clear.numel(),
    )  # fmt: skip
    _gemm_fp8(
        a, b_gate, h, epi, (a_scale, gate_scale, up_scale, h_scale), b_up=b_up,
        bias=bias_gate, bias_up=bias_up, clear=clear,
    )  # fmt: skip


# Per device, read once (as launch.py's device facts).
_HAS_CUBLAS_FP8_BLOCKS: dict[torch.device, bool] = {}


def has_cublas_fp8_blocks(device: torch.device) -> bool:
    """Whether torch's ``_scaled_mm`` runs cuBLAS's GEMM with 1 x 128 and 128 x 128 block
    scales here: a Hopper GPU (compute capability 9.0, the one measured), a torch built
    with CUDA 12.9 or later (earlier builds refuse block-wise scales) that has the
    block-wise scaling types."""
    blocks = _HAS_CUBLAS_FP8_BLOCKS.get(device)
    if blocks is None:
        cuda = torch.version.cuda
        blocks = (
            not INTERPRETED
            and device.type == "cuda"
            and torch.version.hip is None
            and cuda is not None
            and tuple(int(v) for v in cuda.split(".")[:2]) >= (12, 9)
            and hasattr(torch.nn.functional, "scaled_mm")
            and hasattr(
                getattr(torch.nn.functional, "ScalingType", None), "BlockWise1x128"
            )
            and torch.cuda.get_device_capability(device) == (9, 0)
        )
        _HAS_CUBLAS_FP8_BLOCKS[device] = blocks
    return blocks


# cuBLAS's 1 x 128 activation scales ([K/128, rows] seen transposed) must keep each K
# block's column 16-byte aligned: 65 rows were refused, padded strides too (torch's check).
FP8_CUBLAS_ROWS = 4


def fp8_cublas_applies(
    M: int, b: torch.Tensor, b_scale: torch.Tensor, bias, dtype: torch.dtype
) -> bool:
    """Whether cuBLAS computes an FP8 GEMM of M rows (``gemm_fp8_cublas``, its A's rows
    padded to a multiple of FP8_CUBLAS_ROWS): from the table's ``fp8_cublas_min_rows``
    where it runs (has_cublas_fp8_blocks), faster than our TMA kernel on Gemma-2B's down
    projection at prefill sizes (its K blocks' scaling overlaps the MMAs, where ours waits
    for each; docs/decisions/0008-fp8-prefill-cublas.md). Without a bias, a 16-bit
    output, N a multiple of 128 and K of 512 (cuBLAS wants the weight scales' K blocks a
    multiple of 4), a weight of 16-byte-aligned rows, contiguous weight scales."""
    N, K = b.shape
    return (
        M >= table(b.device).fp8_cublas_min_rows
        and bias is None
        and dtype in (torch.bfloat16, torch.float16)
        and N % FP8_BLOCK == 0
        and K % (4 * FP8_BLOCK) == 0
        and b.stride(1) == 1  # b^T column-major, as cuBLAS reads it
        and b.stride(0) % 16 == 0
        and b.data_ptr() % 16 == 0
        and b_scale.is_contiguous()
        and has_cublas_fp8_blocks(b.device)
    )


def gemm_fp8_cublas(
    a: torch.Tensor,  # [M, K] e4m3, M a multiple of FP8_CUBLAS_ROWS
    a_scale: torch.Tensor,  # [cdiv(K, 128), M] fp32, contiguous
    b: torch.Tensor,  # [N, K] e4m3
    b_scale: torch.Tensor,  # [N/128, K/128] fp32, contiguous
    dtype: torch.dtype,
) -> torch.Tensor:
    """gemm_fp8's (a * a_scale) @ (b * b_scale)^T by cuBLAS's block-scaled GEMM, the scales
    in our layouts seen transposed (no copies of ours; torch copied small scale tensors
    at some test shapes, not at Gemma-2B's), into a new [M, N] tensor of ``dtype``.
    torch._scaled_mm reads the block-wise scaling from the scales' shapes; its result
    equals F.scaled_mm's (BlockWise1x128, BlockWise128x128) at a fifth less host time."""
    return torch._scaled_mm(a, b.T, a_scale.T, b_scale.T, out_dtype=dtype)
