"""GEMM entry points, their launch configurations, and the host side of the GEMM kernels.

Every entry point computes into ``c`` ([M, N]) from ``a`` ([M, K]) and weights in
``nn.Linear``'s [N, K] layout, any strides (a transposed view is free):

  gemm(a, b, c)                          c (+)= a @ b^T + bias;  bias_grad = row sums of a
  gemm_act(a, b, c, act)                 c = act(a @ b^T + bias), preact = a @ b^T + bias
  gemm_dact(a, z, b, c, act)             c = round(a * act'(z)) @ b^T;  bias_grad likewise
  gemm_gated(a, b_gate, b_up, c, act)    c = round(act(gate)) * up, gate/up = a @ b^T + bias
  geglu_mlp_small(x, w_gate, w_up, w_down, out, act)
                                         out = gemm_gated(x, ...) @ w_down^T + bias_down,
                                         one launch, for at most MLP_MAX_TOKENS rows
FP8 (e4m3 weights with 128 x 128 block scales, transformers' FineGrainedFP8):
  quantize_fp8(x, q, s)                  q, s = x per row and 128 columns (e4m3, scales);
                                         with up and act: of round(act(x)) * up
  gemm_fp8(a, a_scale, b, b_scale, c)    c = (a, a_scale) @ (b, b_scale)^T + bias
  gemm_gated_fp8(a, a_scale, b_gate, gate_scale, b_up, up_scale, h, h_scale, act)
                                         h, h_scale = quantize(round(act(gate)) * up);
                                         a 16-bit, a_scale None: a quantized in the K loop
  geglu_mlp_small(..., scales=(gate_scale, up_scale, down_scale)) with e4m3 weights
  gemm_fp8_cublas(a, a_scale, b, b_scale, dtype)
                                         gemm_fp8's product by cuBLAS (fp8_cublas_applies)
  launch_gemm_fp8, launch_gemm_gated_fp8 the two FP8 GEMMs without their checks, for the
                                         FP8 MLP's operands (checked once per call upstream)

``act`` is an activation code: GELU (exact) or GELU_TANH. Rounding points are eager's
(gemm_kernels.py). Configurations come from tuning.py (per GPU and shape class); a
plan (configuration, grid, split, launcher) is cached per exact call signature in a
bounded BoundedCache, so a repeated call costs a dict lookup and the launch.
"""

from typing import NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .checks import (
    check_contiguous,
    check_fp8_gemm_a,
    check_fp8_gemm_scales,
    check_fp8_quantize_operands,
    check_fp8_row_scales,
    check_split_k_counters,
)
from .gemm_kernels import (
    FP8_BLOCK,
    geglu_mlp_kernel,
    gemm_kernel,
    gemm_tma_kernel,
    quantize_fp8_kernel,
)
from .launch import (
    INTERPRETED,
    SHARED_SCRATCH,
    BoundedCache,
    Launcher,
    cdiv,
    current_device_and_stream,
    has_cublas_fp8_blocks,
    has_tma,
    num_programs,
)
from .tuning import (
    FP8_QUANT_A_ROWS,
    MLP_MAX_TOKENS,
    GemmConfig,
    fp8_config,
    fp8_swap_ab,
    gemm_config,
    mlp_config,
    split_k,
    table,
)

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


def fp8_weights_through_tma(M: int, b: torch.Tensor, b_up: torch.Tensor | None) -> bool:
    """Whether a decode FP8 GEMM (at most 64 rows: the portable kernel) reads its weights
    through TMA (B_TMA): where TMA can describe them as they lie, [N, K] rows of 16-byte
    multiples. Faster than pointer loads at 1 to 64 tokens on the H200: fewer instructions
    per byte streamed (benchmarks/NOTES.md)."""
    return (
        M <= 64
        and b.dtype == torch.float8_e4m3fn
        and has_tma(b.device)
        and _tma_rows(b)
        and (b_up is None or _tma_rows(b_up))
    )


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor describes ``t`` as it lies (not transposed)."""
    operand = _tma_operand(t)
    return operand is not None and not operand[1]


def tma_tiles_fill_gpu(M: int, N: int, K: int, dtype, device) -> bool:
    """Whether a single (not gated) TMA GEMM with M x N outputs has a tile for every program
    of its persistent grid (one per SM); with fewer, SMs idle (the kernel has no split-K)."""
    cfg = gemm_config(M, N, dtype, device, gated=False, tma=True, extra_tiles=False)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    return tiles >= num_programs(device)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 operands follow PyTorch: tf32 tensor cores only when
    # torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision allow them.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def stream_scratch(
    store: dict,
    device: torch.device,
    numel: int,
    counters: int,
    zeroed: bool,
    capturing: bool | None = None,
    stream: int | None = None,
) -> tuple:
    """(fp32 workspace of at least ``numel``, zeroed int32 counters), kept in ``store`` per
    (device, stream) and reused: launches on one stream run in order, and the kernels
    leave the counters zero (and a ``zeroed`` workspace zero) for the next. Inside a CUDA
    graph capture, fresh ones (memset nodes): the graph may replay on any stream, beside
    other work of the capture stream. ``capturing``: whether a capture is on, and
    ``stream``: the launch's (current_device_and_stream()), where the caller knows (None:
    asked here)."""
    workspace = torch.zeros if zeroed else torch.empty
    if capturing is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing:
        return (
            workspace(numel, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device),
        )
    key = (device, current_device_and_stream()[1] if stream is None else stream)
    scratch = store.get(key)
    if scratch is None or scratch[0].numel() < numel:
        counts = (
            torch.zeros(counters, dtype=torch.int32, device=device)
            if scratch is None
            else scratch[1]
        )
        scratch = workspace(numel, dtype=torch.float32, device=device), counts
        store[key] = scratch
    return scratch


# Split-K: the partial tiles (overwritten by each launch) and one counter per tile (at
# most one per SM); the last program of each tile resets its own.
_SPLIT_K_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
SHARED_SCRATCH.append(_SPLIT_K_SCRATCH)


def later_split_k_counters(device: torch.device) -> torch.Tensor:
    """Split-K counters, not initialised, for a launch that an earlier launch on the stream
    zeroes (gemm_gated_fp8's ``clear``, then gemm_fp8's ``counters``): where a fresh zeroed
    tensor would be a memset node of its own in a CUDA graph."""
    count = triton.next_power_of_2(num_programs(device))
    return torch.empty(count, dtype=torch.int32, device=device)


def _tma_operand(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
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


def _stacked_weights(b, b_up, block_n, block_k, boxes):
    """One [2, N, K] descriptor over two [N, K] weights wherever they lie: its outer stride
    is the distance between them (TMA takes any 16-byte-aligned stride under 2^40 bytes),
    so the gate and up tiles arrive as one box (``boxes`` 2), or as two of one descriptor
    (1: the FP8 TMA kernel's, one dot per weight). Returns (descriptor, up_first) or
    None."""
    lo, hi, up_first = (
        (b, b_up, False) if b_up.data_ptr() > b.data_ptr() else (b_up, b, True)
    )
    gap = hi.data_ptr() - lo.data_ptr()
    operand = _tma_operand(lo)
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


def _tma_descriptors(a, b, b_up, z, c, preacts, cfg: GemmConfig):
    """(descriptors for A, B, Z (None without Z), C, the gated GEMM's stored gate and up
    (or the pointers ``preacts`` as they are); A_T, B_T, UP_FIRST) for the TMA kernel, or
    None when an operand is not TMA-compatible, A and Z disagree on orientation, or the
    gated GEMM's weights cannot share one descriptor."""
    ops = [_tma_operand(t) for t in (a, b, c)]
    z_op = None if z is None else _tma_operand(z)
    if None in ops or (z is not None and (z_op is None or z_op[1] != ops[0][1])):
        return None
    c_block = [cfg.block_m, cfg.block_n]
    if b_up is not None and preacts[0] is not None:  # contiguous, of C's size
        pre_ops = [_tma_operand(t.view(c.shape)) for t in preacts]
        if None in pre_ops or pre_ops[0][1] or pre_ops[1][1]:
            return None
        preacts = [TensorDescriptor.from_tensor(t, c_block) for t, _ in pre_ops]
    (a_v, a_t), (b_v, b_t), (c_v, c_t) = ops
    if c_t:
        return None
    a_block = [cfg.block_k, cfg.block_m] if a_t else [cfg.block_m, cfg.block_k]
    up_first = False
    if b_up is not None:
        boxes = 1 if b.dtype == torch.float8_e4m3fn else 2
        stacked = _stacked_weights(b, b_up, cfg.block_n, cfg.block_k, boxes)
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
    fp8: bool = False
    quant_out: bool = False
    act_bf16: bool = False  # quant_out: h's dtype before quantization
    quant_a: bool = False  # fp8: a 16-bit A, quantized in the K loop (_Plan's QUANT_A)
    clear: int = 0  # a later split-K launch's counters zeroed here (the portable CLEAR)

    def constexprs(self) -> dict:
        return {
            "HAS_BIAS": self.has_bias,
            "GATED": self.gated,
            "ACTIVATION": self.activation,
            "STORE_PREACT": self.store_preact,
            "DACT": self.dact,
            "BIAS_GRAD": self.bias_grad,
            "ACCUMULATE": self.accumulate,
            "FP8": self.fp8,
            "QUANT_OUT": self.quant_out,
            "ACT_BF16": self.act_bf16,
        }


def stacked_stages(cfg: GemmConfig) -> int:
    """num_stages of a STACKED GEMM of configuration ``cfg``: Triton 3.6 loads its 3-D box a
    stage less ahead than two 2-D boxes; a stage more was the faster at 32-row tiles, not
    at 16 (exploration/2026-12-03T15-*-fp8-stacked-dual.json)."""
    return cfg.num_stages + (cfg.block_m == 32)


class _Plan:
    """What a call signature needs beyond its tensors: the configuration, the kernel's
    launchers and the split."""

    __slots__ = ("b_tma", "cfg", "constexprs", "launchers", "split", "stacks", "tiles",
                 "tma", "ws_numel")  # fmt: skip

    def __init__(self, M, N, K, dtype, device, epi: Epilogue, tma: bool, b_tma: bool):
        extra_tiles = (
            epi.dact != NO_ACT or epi.accumulate or (epi.store_preact and not epi.gated)
        )
        # swapped FP8 products (QUANT_A's among them) are the portable kernel's
        swap = epi.fp8 and fp8_swap_ab(M, N, epi.gated, epi.quant_a, device, b_tma)
        self.tma = tma = tma and not swap and not epi.clear
        self.b_tma = b_tma
        # A gated B_TMA GEMM reads both weights through one descriptor (STACKED) where it
        # quantizes x itself; with x quantized apart (33-64 tokens) that was slower.
        self.stacks = b_tma and epi.gated and epi.quant_a
        self.cfg = cfg = (
            fp8_config(M, epi.gated, tma, swap, b_tma)
            if epi.fp8
            else gemm_config(M, N, dtype, device, epi.gated, tma, extra_tiles)
        )
        self.tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
        self.split = 1
        if not tma and (M <= 64 or swap) and not epi.bias_grad:  # row sums: not split
            k_tiles = cdiv(K, cfg.block_k)
            # The swapped down GEMM's small tiles (40 KB of shared memory at 16 rows)
            # stream faster two per SM.
            per_sm = 2 if swap and not epi.gated else 1
            self.split = split_k(self.tiles, k_tiles, per_sm * num_programs(device))
        self.ws_numel = (
            self.tiles
            * self.split
            * (2 if epi.gated else 1)
            * cfg.block_m
            * cfg.block_n
        )
        self.constexprs = {
            **epi.constexprs(),
            "INPUT_PRECISION": _input_precision(dtype),
            **cfg.constexprs(),
        }
        if not tma:
            self.constexprs = {
                **self.constexprs,
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
            self.launchers = [Launcher(gemm_kernel, self.constexprs), None, None]
        else:
            self.launchers = {}  # (A_T, B_T, UP_FIRST, gap class) -> Launcher

    def stacked_launcher(self, up_first: bool) -> Launcher:
        """The portable kernel over both weights of a gated B_TMA GEMM in one descriptor
        (STACKED), in stacked_stages."""
        launcher = self.launchers[1 + up_first]
        if launcher is None:
            stages = stacked_stages(self.cfg)
            flags = {"STACKED": True, "UP_FIRST": up_first, "num_stages": stages}
            launcher = Launcher(gemm_kernel, {**self.constexprs, **flags})
            self.launchers[1 + up_first] = launcher
        return launcher

    def tma_launcher(self, a_t, b_t, up_first, b_desc) -> Launcher:
        # The stacked weights' outer stride (their distance) varies between layers of one
        # shape: its int class joins the key (what Triton may specialise descriptors on).
        outer = b_desc.strides[0]
        key = (a_t, b_t, up_first, outer % 16 == 0, outer == 1)
        launcher = self.launchers.get(key)
        if launcher is None:
            flags = {"A_T": a_t, "B_T": b_t, "UP_FIRST": up_first}
            constexprs = {**self.constexprs, **flags}
            launcher = self.launchers[key] = Launcher(gemm_tma_kernel, constexprs)
        return launcher


_PLANS = BoundedCache(1024)


def _rows(t: torch.Tensor) -> tuple[int, int, tuple[int, int]]:
    """(rows, cols, (row stride, col stride)) of a 2-D operand, or of a contiguous [..., cols]
    one seen as 2-D rows (no view is made: the kernel reads pointers and strides)."""
    if t.dim() == 2:
        rows, cols = t.shape
        return rows, cols, t.stride()
    cols = t.shape[-1]
    return t.numel() // cols, cols, (cols, 1)


def _gemm(a, b, c, epi: Epilogue, b_up=None, bias=None, bias_up=None, preact=None,
          preact_up=None, z=None, bias_grad=None, scales=(None,) * 4, clear=None,
          counters=None) -> None:  # fmt: skip
    """``a`` and ``c``: 2-D, or contiguous of any rank (seen as rows); ``scales``: FP8's
    (a_scale, b_scale, b_up_scale, c_scale); ``clear``: later_split_k_counters that this
    launch zeroes (``epi``'s clear: their number), and ``counters``: ones an earlier
    launch zeroed, for this launch's split-K."""
    M, K, stride_a = _rows(a)
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
        *_rows(c)[2], *(none2 if z is None else z.stride()),
        None if bias is None else bias.stride(0),
        None if bias_up is None else bias_up.stride(0),
        *(none2 if scales[1] is None else scales[1].stride()),
        None if scales[3] is None else scales[3].stride(0),
    )  # fmt: skip
    # c's dtype too: an FP8 GEMM's differs from a's (e4m3), and a launcher's kernel is
    # compiled for one output dtype
    b_tma = fp8_weights_through_tma(M, b, b_up)
    key = (M, N, K, dtype, c.dtype, device, epi, strides, b_tma)
    plan = _PLANS.get(key)
    if plan is None:
        tma = K > 0 and tma_applies(M, dtype, device)
        plan = _PLANS[key] = _Plan(M, N, K, dtype, device, epi, tma, b_tma)
    if plan.tma:
        a2 = a if a.dim() == 2 else a.view(M, K)
        c2 = c if c.dim() == 2 else c.view(M, N)
        descs = _tma_descriptors(a2, b, b_up, z, c2, (preact, preact_up), plan.cfg)
        if descs is not None:
            (a_d, b_d, z_d, c_d, pre_d, pre_up_d), a_t, b_t, up_first = descs
            launcher = plan.tma_launcher(a_t, b_t, up_first, b_d)
            grid = min(plan.tiles, num_programs(device))
            launcher(
                grid, a_d, b_d, z_d, c_d, bias, bias_up, pre_d, pre_up_d, bias_grad,
                *scales, M, N, K, *strides[-5:],
            )  # fmt: skip
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
        ws, counters = stream_scratch(
            _SPLIT_K_SCRATCH, device, plan.ws_numel, num_programs(device), False
        )
    else:  # counters an earlier launch zeroed (CLEAR); a fresh workspace
        ws = torch.empty(plan.ws_numel, dtype=torch.float32, device=device)
    launcher = plan.launchers[0]
    if plan.b_tma:
        box = [plan.cfg.block_n, plan.cfg.block_k]
        stacked = _stacked_weights(b, b_up, *box, 2) if plan.stacks else None
        if stacked is not None:  # both weights' tiles in one box, one MMA per K step
            b, up_first = stacked
            b_up = None
            launcher = plan.stacked_launcher(up_first)
        else:
            b = TensorDescriptor.from_tensor(b, box)
            b_up = None if b_up is None else TensorDescriptor.from_tensor(b_up, box)
    launcher(
        plan.tiles * plan.split, a, b, b_up, bias, bias_up, c, preact, preact_up, z,
        bias_grad, ws, counters, clear, *scales, M, N, K, *strides,
    )  # fmt: skip


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


# --- FP8 ----------------------------------------------------------------------------------

_QUANTIZE_PLANS = BoundedCache(256)


def quantize_fp8(
    x: torch.Tensor,  # [M, K] (2-D, or contiguous seen as rows); with ``up``, the gate
    q: torch.Tensor,  # [M, K] e4m3, contiguous
    s: torch.Tensor,  # [cdiv(K, 128), M] fp32, unit column stride, rows >= M apart
    *,
    up: torch.Tensor | None = None,  # [M, K], x's strides
    activation: int = NO_ACT,
) -> None:
    """q, s = x quantized per row and 128 columns (gemm_kernels.quantize_rows), the scales
    K-block-major: the A operand of gemm_fp8 / gemm_gated_fp8. With ``up`` and a GeLU
    ``activation``, x = round(act(x)) * up in x's dtype is quantized: the h that
    gemm_gated_fp8 hands over, from gate and up computed apart."""
    M, K, (stride_m, stride_k) = _rows(x)
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
    epi = Epilogue(has_bias=bias is not None, fp8=True)
    scales = (a_scale, b_scale, None, None)
    _gemm(a, b, c, epi, bias=bias, scales=scales, counters=counters)


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
    """h, h_scale = quantize_rows(round(act(gate)) * up) per row and 128 columns, with
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
        "gemm_gated_fp8", h_scale, cdiv(b_gate.shape[0], FP8_BLOCK), _rows(a)[0],
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
    epi = Epilogue(
        activation=activation, gated=True, has_bias=bias_gate is not None, fp8=True,
        quant_out=True, act_bf16=act_dtype == torch.bfloat16, quant_a=a_scale is None,
        clear=0 if clear is None else clear.numel(),
    )  # fmt: skip
    _gemm(
        a, b_gate, h, epi, b_up=b_up, bias=bias_gate, bias_up=bias_up,
        scales=(a_scale, gate_scale, up_scale, h_scale), clear=clear,
    )  # fmt: skip


# cuBLAS's 1 x 128 activation scales ([K/128, rows] seen transposed) must keep each K
# block's column 16-byte aligned: 65 rows were refused, padded strides too (torch's check).
FP8_CUBLAS_ROWS = 4


def fp8_cublas_applies(
    M: int, b: torch.Tensor, b_scale: torch.Tensor, bias, dtype: torch.dtype
) -> bool:
    """Whether cuBLAS computes an FP8 GEMM of M rows (``gemm_fp8_cublas``, its A's rows
    padded to a multiple of FP8_CUBLAS_ROWS): from the table's ``fp8_cublas_min_rows`` where it runs
    (has_cublas_fp8_blocks), 1.5x faster than our TMA kernel at 2048 to 8192 rows of
    Gemma-2B's down projection on the H200 (its K blocks' scaling overlaps the MMAs, where
    ours waits for each; benchmarks/NOTES.md). Without a bias, a 16-bit output, N a
    multiple of 128 and K of 512 (cuBLAS wants the weight scales' K blocks a multiple of
    4), a weight of 16-byte-aligned rows, contiguous weight scales."""
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


# --- The whole MLP in one launch (decode) ------------------------------------------------

# The one-launch MLP's fp32 sums [M, N] and its arrival count, both zero between launches
# (the last program of each launch zeroes them).
_MLP_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
SHARED_SCRATCH.append(_MLP_SCRATCH)
_MLP_PLANS = BoundedCache(256)


def geglu_mlp_small(
    x: torch.Tensor,  # [M, H], M <= MLP_MAX_TOKENS
    w_gate: torch.Tensor,  # [I, H]
    w_up: torch.Tensor,  # [I, H]
    w_down: torch.Tensor,  # [N, I]
    out: torch.Tensor,  # [M, N]
    activation: int,
    *,
    bias_gate: torch.Tensor | None = None,  # [I]
    bias_up: torch.Tensor | None = None,  # [I]
    bias_down: torch.Tensor | None = None,  # [N]
    scales: tuple | None = None,  # FP8: (gate_scale, up_scale, down_scale), fp32
) -> None:
    """out = round(h @ w_down^T + bias_down), h = round(act(gate)) * up as gemm_gated's:
    the whole GeGLU MLP in one launch (geglu_mlp_kernel). Its fp32 sums are added in an
    order that varies between launches. With ``scales``, e4m3 weights with 128 x 128
    block scales, and x and h quantized as gemm_fp8's A operands (geglu_mlp_fp8)."""
    M, H, stride_x = _rows(x)
    I, N = w_gate.shape[0], w_down.shape[0]
    if M > MLP_MAX_TOKENS:
        raise ValueError(
            f"geglu_mlp_small takes at most {MLP_MAX_TOKENS} rows, got x of shape "
            f"{tuple(x.shape)}"
        )
    if M == 0 or N == 0:
        return
    if I == 0:  # no intermediate columns (no programs): the down projection is its bias
        if bias_down is None:
            out.zero_()
        else:
            out.copy_(bias_down.expand_as(out))
        return
    strides = (
        *stride_x, *w_gate.stride(), *w_up.stride(), *w_down.stride(), *_rows(out)[2],
        None if bias_gate is None else bias_gate.stride(0),
        None if bias_up is None else bias_up.stride(0),
        None if bias_down is None else bias_down.stride(0),
        *_scale_strides(scales),
    )  # fmt: skip
    grid, launcher = _mlp_plan(M, H, I, N, x.dtype, x.device, activation, strides)
    sums, arrivals = stream_scratch(_MLP_SCRATCH, x.device, M * N, 1, True)
    launcher(
        grid, x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, out, sums,
        arrivals, *(scales or (None,) * 3), M, H, I, N, *strides,
    )  # fmt: skip


def _scale_strides(scales: tuple | None) -> tuple:
    """geglu_mlp_kernel's scale strides: the gate's (the up's are the same) and the down's."""
    if scales is None:
        return (None,) * 4
    return (*scales[0].stride(), *scales[2].stride())


def _mlp_plan(M, H, I, N, dtype, device, activation: int, strides: tuple) -> tuple:
    """(grid, launcher) of geglu_mlp_kernel; ``strides``: its stride arguments, None for
    an absent bias or, without FP8, for the scales' (the last four)."""
    key = (M, H, I, N, dtype, device, activation, strides)
    plan = _MLP_PLANS.get(key)
    if plan is None:
        if device.type == "cuda":
            # Eager calls of up to MLP_MAX_TOKENS rows take this one launch and never
            # reach cuBLAS; a CUDA graph captured after them runs the down projection
            # there (route.down_projection), and cuBLAS cannot create its handle inside
            # a capture (this launch is never planned in one): created now, as an eager
            # warm-up of the module's own forward would have.
            with torch.cuda.device(device):
                torch.cuda.current_blas_handle()
        fp8 = strides[-1] is not None
        cfg = mlp_config(I, dtype, device, fp8)
        constexprs = {
            "HAS_BIAS": strides[-7] is not None,
            "HAS_DOWN_BIAS": strides[-5] is not None,
            "ACTIVATION": activation,
            "FP8": fp8,
            "EVEN_K": H % cfg["BLOCK_K"] == 0,
            "INPUT_PRECISION": _input_precision(dtype),
            "BLOCK_M": MLP_MAX_TOKENS,  # one row tile holds every token
            **cfg,
        }
        plan = _MLP_PLANS[key] = (
            cdiv(I, cfg["BLOCK_I"]),
            Launcher(geglu_mlp_kernel, constexprs),
        )
    return plan


class MLPLaunch:
    """``geglu_mlp_small`` for one module's weights, with what depends only on them worked
    out once: a call on a contiguous ``x`` of 1 to MLP_MAX_TOKENS rows, in the weights'
    dtype (FP8: ``dtype``) and on their device, outside a CUDA graph capture (the
    caller's checks: route.mlp_output's and _fp8_output's), allocates the output and
    launches. The layers' decode path, where the host time of a call is the cost."""

    __slots__ = ("activation", "addresses", "device", "device_index", "device_type",
                 "dtype", "hidden", "operands", "plans", "scales", "sizes",
                 "strides")  # fmt: skip

    def __init__(self, w_gate, w_up, w_down, b_gate, b_up, b_down, activation: int,
                 scales: tuple | None = None, dtype: torch.dtype | None = None):  # fmt: skip
        """``scales`` and ``dtype`` (x's) for e4m3 weights, as geglu_mlp_small's."""
        (I, H), N = w_gate.shape, w_down.shape[0]
        self.operands = (w_gate, w_up, w_down, b_gate, b_up, b_down)
        self.scales = scales or (None,) * 3
        # The operands' and scales' addresses, for the direct launch, where all are
        # 16-byte aligned (None otherwise): valid while the route stands (it watches
        # their data pointers), the tensors kept alive by ``operands`` and ``scales``.
        addresses = tuple(
            None if t is None else t.data_ptr() for t in (*self.operands, *self.scales)
        )
        aligned = all(a is None or a % 16 == 0 for a in addresses)
        self.addresses = addresses if aligned else None
        self.dtype, self.device, self.activation = (
            dtype or w_gate.dtype,
            w_gate.device,
            activation,
        )
        self.device_type = self.device.type  # what the route's autocast check asks
        self.device_index = w_gate.get_device()  # -1 on the CPU (the interpreter)
        self.hidden, self.sizes = H, (H, I, N)
        # Every stride argument after x's (H, 1): the weights', out's (N, 1), the biases',
        # the scales'.
        self.strides = (
            *w_gate.stride(), *w_up.stride(), *w_down.stride(), N, 1,
            *(None if b is None else b.stride(0) for b in (b_gate, b_up, b_down)),
            *_scale_strides(scales),
        )  # fmt: skip
        self.plans = {}  # rows -> (grid, launcher): at most MLP_MAX_TOKENS entries

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        device, stream = current_device_and_stream()
        if device != self.device_index:
            # Triton launches on the current device; with the model spread over GPUs
            # (device_map="auto") it may not be the weights'.
            with torch.cuda.device(self.device):
                return self(x)
        H, I, N = self.sizes
        M = x.numel() // H
        # empty_like: x's shape when N == H (the usual down projection), fewer steps
        out = torch.empty_like(x) if N == H else x.new_empty((*x.shape[:-1], N))
        plan = self.plans.get(M)
        if plan is None:
            fixed = (self.dtype, self.device, self.activation, (H, 1, *self.strides))
            plan = self.plans[M] = _mlp_plan(M, H, I, N, *fixed)
        grid, launcher = plan
        sums, arrivals = stream_scratch(
            _MLP_SCRATCH, self.device, M * N, 1, True, capturing=False, stream=stream
        )
        sizes = (M, H, I, N, H, 1, *self.strides)
        # out and the scratch come from the allocator (aligned)
        addresses = self.addresses
        if not (
            addresses is not None
            and not x.data_ptr() & 15
            and launcher.launch_aligned(
                grid,
                device,
                stream,
                (x, *addresses[:6], out, sums, arrivals, *addresses[6:], *sizes),
            )
        ):
            launcher(grid, x, *self.operands, out, sums, arrivals, *self.scales, *sizes)
        return out
