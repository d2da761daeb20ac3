"""GEMM kernels (device code): one Triton GEMM with fused prologue/epilogue.

    C = epilogue(A @ B^T [+ bias], A @ B_up^T [+ bias_up])

A is [M, K], each B is [N, K] (``nn.Linear``'s weight layout), every operand read through
its strides, so transposes are free. Constexpr flags select the fused work:
  GATED        a second weight B_up and a second fp32 accumulator (STACKED: one of twice
               the rows): C = geglu(gate, up)
               with gate = A @ B^T (+ bias), up = A @ B_up^T (+ bias_up), eager's rounding
  ACTIVATION   0: none, 1: exact GeLU, 2: tanh GeLU, applied to the biased accumulator
               (GATED: the GeLU of the gate)
  STORE_PREACT also store the rounded pre-activation(s) (what backward needs)
  DACT         prologue: A <- round(A * act'(Z)) (act coded as ACTIVATION), Z read with
               A's strides (backward of a GEMM+activation: dZ never materialises)
  BIAS_GRAD    the programs of the first N-tile column also reduce A over K (rows of
               dY^T): the bias gradient inside the weight-gradient GEMM
  ACCUMULATE   C += result (a second product into dX)
  FP8          A and B are e4m3 with block scales (``BLOCK_K`` = 128, the scale block): A's
               one per row and 128 columns ([K/128, M]), B's one per 128 x 128 block
               ([N/128, K/128]); each K step's fp32 product is scaled by both before it
               is added (transformers' FineGrainedFP8 semantics, ``quantize_rows``)
  QUANT_OUT    (FP8, GATED, BLOCK_N = 128) h leaves as e4m3 with one scale per row and
               128 columns ([N/128, M]): the down projection's A, quantized as its own
               prologue would; ``ACT_BF16`` names h's dtype before quantization
  QUANT_A      (FP8, portable kernel) A arrives in 16 bits and each K step quantizes its
               tile as quantize_fp8_kernel would (``quantize_rows``): no separate launch
  SWAP_AB      (portable kernel) each K step computes (B @ A^T), the weight tile as the
               MMA's rows: at decode sizes the tokens are too few for Hopper's e4m3 MMA
               (64 rows), which then runs with the weights' 64 or 128 rows instead (and
               FP8 down GEMMs of up to 512 rows, split-K where TMA tiles leave SMs idle)
  STACKED      (portable kernel: FP8, GATED, SWAP_AB, B_TMA) one descriptor over both
               weights ([2, N, K]): each K step loads the gate and up tiles as one box
               and issues one MMA over both, waited for once (two dots are waited for in
               turn), the same products and scalings (UP_FIRST: up at the lower address)
  SPLIT_K      (portable kernel) programs per output tile, each summing a slice of K into
               an fp32 workspace; the last to finish adds the slices in a fixed order
               (deterministic) and applies the epilogue: decode shapes with fewer output
               tiles than SMs stream their weights with every SM
  CLEAR        (portable kernel) program 0 zeroes CLEAR int32 counters (a power of two)
               of a later SPLIT_K launch on the stream: in a CUDA graph they need no
               memset node of their own
The host side (configurations, descriptors, launches) is gemm.py.
"""

import triton
import triton.language as tl

from .activation import geglu_tile, gelu, gelu_grad
from .launch import INTERPRETED

# The interpreter multiplies 16-bit tl.dot operands in numpy, where bf16 is stored as raw
# integer bits: it would multiply the bits. Interpreted dots therefore take fp32 operands
# (exact products of the 16-bit values; GPUs also accumulate in fp32).
DOT_IN_FP32 = tl.constexpr(INTERPRETED)

# e4m3's largest finite value, and the block of the FP8 scales (rows of 128 columns).
FP8_MAX = tl.constexpr(448.0)
FP8_BLOCK = 128


@triton.jit
def _to_e4m3(x):
    """fp32 -> e4m3, rounding to nearest even and saturating at +-448 (the GPU's
    ``cvt.rn.satfinite``). The interpreter's conversion carries no rounding into the
    exponent (125.3 -> 64): there x is first rounded in fp32 onto the e4m3 grid, where
    its conversion is exact: ulp = 2^(max(e, -6) - 3), and (|x| + 2^23 ulp) - 2^23 ulp
    rounds |x| to a multiple of ulp, to even."""
    if DOT_IN_FP32:
        exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        ulp_exponent = tl.maximum(exponent, -6) - 3
        magic = ((ulp_exponent + 23 + 127) << 23).to(tl.float32, bitcast=True)
        magnitude = tl.minimum((tl.abs(x) + magic) - magic, FP8_MAX)
        x = tl.where(x < 0, -magnitude, magnitude)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_rows(a):
    """(e4m3 q, fp32 s) of an fp32 tile, one scale per row: s = max|a| / 448 and
    q = round(a / max(s, 1e-12)), so q * s ~ a. transformers' dynamic FP8 activations
    (the finegrained-fp8 kernels' inline quantization), per 128-column block."""
    s = tl.max(tl.abs(a), axis=1) / FP8_MAX
    return _to_e4m3(a / tl.maximum(s, 1e-12)[:, None]), s


@triton.jit
def quantize_fp8_kernel(
    x_ptr,  # [M, K]; with ACTIVATION, the gate
    up_ptr,  # [M, K] of x's strides (ACTIVATION), or None
    q_ptr,  # [M, K] e4m3, contiguous
    s_ptr,  # [cdiv(K, BLOCK_K), >= M] fp32, unit column stride
    M,
    K,
    stride_xm,
    stride_xk,
    stride_sk,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scale block (128)
    ACTIVATION: tl.constexpr,  # 0, or a GeLU code: x = round(act(gate)) * up first
):
    """q, s = quantize_rows(x) per row and BLOCK_K columns; the scales K-block-major, so a
    GEMM step loads one block's scales of BLOCK_M rows contiguously. With ACTIVATION, x is
    geglu_tile(gate, up) in the gate's dtype: the dual GEMM's h, quantized as its epilogue
    does (QUANT_OUT with ACT_BF16)."""
    k_blocks = tl.cdiv(K, BLOCK_K)
    pid_m, pid_k = tl.program_id(0) // k_blocks, tl.program_id(0) % k_blocks
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask = mask_m[:, None] & (offs_k < K)[None, :]
    offs = offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ACTIVATION != 0:
        up = tl.load(up_ptr + offs, mask=mask, other=0.0)
        x = geglu_tile(x.to(tl.float32), up.to(tl.float32), x.dtype, ACTIVATION == 2)
    q, s = quantize_rows(x.to(tl.float32))
    tl.store(q_ptr + offs_m[:, None] * K + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + pid_k * stride_sk + offs_m, s, mask=mask_m)


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr):
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _scaled_dot(
    a, b, acc, a_scale, b_scale, INPUT_PRECISION: tl.constexpr, SWAPPED: tl.constexpr
):
    """acc + (a @ b) * a_scale[:, None] * b_scale: one e4m3 K block's fp32 product, scaled
    by its rows' (activation) and its weight block's scales, in finegrained-fp8's order.
    SWAPPED: acc and the product transposed, acc + (b^T @ a^T) * a_scale[None, :] * b_scale
    (SWAP_AB: the same products and scalings)."""
    if SWAPPED:
        acc = acc + _dot(b.T, a.T, None, INPUT_PRECISION) * a_scale[None, :] * b_scale
    else:
        acc = acc + _dot(a, b, None, INPUT_PRECISION) * a_scale[:, None] * b_scale
    return acc


@triton.jit
def _grouped_tile(
    pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr
):
    # Walk GROUP_M row-tiles down a column of tiles before moving right, so the B tiles
    # a group shares stay in L2 (Triton tutorial 03).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows
    pid_n = (pid % group_size) // rows
    return pid_m, pid_n


@triton.jit
def _k_step_masks(mask_m, mask_n, offs_k, k_left, EVEN_K: tl.constexpr):
    """Masks of one K step's [BLOCK_M, BLOCK_K] row tile and [BLOCK_K, BLOCK_N] weight
    tile; ``k_left``: the K columns from this step on (no K mask when K divides evenly)."""
    # One return: Triton's code generator goes on past a return in a constexpr branch, and
    # every return it meets must have one type (tests/test_compile.py).
    if EVEN_K:
        row_mask, weight_mask = mask_m[:, None], mask_n[None, :]
    else:
        k_mask = offs_k < k_left
        row_mask = mask_m[:, None] & k_mask[None, :]
        weight_mask = mask_n[None, :] & k_mask[:, None]
    return row_mask, weight_mask


@triton.jit
def _dact_prologue(a, z, DACT: tl.constexpr):
    # round(dY * act'(Z)), as eager's gelu_backward output, before the product.
    return (a.to(tl.float32) * gelu_grad(z.to(tl.float32), DACT == 2)).to(a.dtype)


@triton.jit
def _epilogue(
    acc1,
    acc2,
    offs_m,
    offs_n,
    M,
    N,
    bias_ptr,
    bias_up_ptr,
    stride_bias,
    stride_bias_up,
    preact_ptr,
    preact_up_ptr,
    off_m,
    off_n,
    dtype: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    PREACT_TMA: tl.constexpr = False,
):
    """Bias, activation and pre-activation stores on the fp32 accumulators; returns the
    tile C receives (before ACCUMULATE). ``PREACT_TMA`` (GATED): ``preact_ptr`` and
    ``preact_up_ptr`` are TMA descriptors, written at the tile's corner (off_m, off_n)
    asynchronously, while the next tile's main loop runs."""
    mask_n = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=mask_n, other=0.0)
        acc1 += bias.to(tl.float32)[None, :]
        if GATED:
            bias_up = tl.load(
                bias_up_ptr + offs_n * stride_bias_up, mask=mask_n, other=0.0
            )
            acc2 += bias_up.to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    pre_offs = offs_m[:, None] * N + offs_n[None, :]
    if GATED:
        # eager: gate = round(x Wg^T + bg), up = round(x Wu^T + bu), then geglu's rounding.
        gate = acc1.to(dtype)
        up = acc2.to(dtype)
        if STORE_PREACT:
            if PREACT_TMA:
                preact_ptr.store([off_m, off_n], gate)
                preact_up_ptr.store([off_m, off_n], up)
            else:
                tl.store(preact_ptr + pre_offs, gate, mask=mask)
                tl.store(preact_up_ptr + pre_offs, up, mask=mask)
        return geglu_tile(
            gate.to(tl.float32), up.to(tl.float32), dtype, ACTIVATION == 2
        )
    elif ACTIVATION != 0:
        preact = acc1.to(dtype)
        if STORE_PREACT:
            tl.store(preact_ptr + pre_offs, preact, mask=mask)
        return gelu(preact.to(tl.float32), ACTIVATION == 2).to(dtype)
    else:
        return acc1


@triton.jit
def _split_k_reduce(
    acc1, acc2, ws_ptr, counters_ptr, tile, split,
    GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Stores this program's partial tile(s) in the workspace and counts it in; the last of
    the tile's SPLIT_K programs gets the sums over the slices, in slice order, and
    ``is_last``. It also resets the tile's counter, so the counters are zero again for the
    next launch (in CUDA graphs too)."""
    accs: tl.constexpr = 2 if GATED else 1
    size: tl.constexpr = BLOCK_M * BLOCK_N
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    ws_tile = ws_ptr + tile.to(tl.int64) * (SPLIT_K * accs * size)
    tl.store(ws_tile + split * (accs * size) + offs, acc1)
    if GATED:
        tl.store(ws_tile + split * (accs * size) + size + offs, acc2)
    # Every thread's stores, then one release at GPU scope; the last program's acquire
    # makes all slices visible to it (loads through L2: .cg).
    tl.debug_barrier()
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
    is_last = arrived == SPLIT_K - 1
    if is_last:
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc1 += tl.load(ws_tile + s * (accs * size) + offs, cache_modifier=".cg")
            if GATED:
                acc2 += tl.load(
                    ws_tile + s * (accs * size) + size + offs, cache_modifier=".cg"
                )
        tl.atomic_xchg(counters_ptr + tile, 0)
    return acc1, acc2, is_last


# M is specialised like N and K (== 1, % 16 == 0, other): at most three compilations per
# configuration across token counts, and the divisibility lets masked loads of transposed
# operands vectorise.
@triton.jit
def gemm_kernel(
    a_ptr,  # [M, K] (FP8: e4m3, or 16-bit with QUANT_A)
    b_ptr,  # [N, K]; B_TMA: its descriptor, [BLOCK_N, BLOCK_K] boxes (STACKED: [2, N, K])
    b_up_ptr,  # [N, K] (GATED), as b_ptr; None with STACKED
    bias_ptr,  # [N]
    bias_up_ptr,  # [N] (GATED)
    c_ptr,  # [M, N]
    preact_ptr,  # [M, N] contiguous (STORE_PREACT)
    preact_up_ptr,  # [M, N] contiguous (STORE_PREACT and GATED)
    z_ptr,  # [M, K] (DACT)
    bias_grad_ptr,  # [M] fp32 (BIAS_GRAD)
    ws_ptr,  # fp32 [tiles, SPLIT_K, 1 or 2, BLOCK_M, BLOCK_N] (SPLIT_K > 1)
    counters_ptr,  # int32 [>= tiles], zero (SPLIT_K > 1)
    clear_ptr,  # int32 [CLEAR]: zeroed (CLEAR > 0)
    a_scale_ptr,  # fp32 [K/128, M] (FP8, not QUANT_A)
    b_scale_ptr,  # fp32 [N/128, K/128] (FP8)
    b_up_scale_ptr,  # fp32, b_scale_ptr's strides (FP8 and GATED)
    c_scale_ptr,  # fp32 [N/128, M] (QUANT_OUT), rows stride_cs apart
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_bun,
    stride_buk,
    stride_cm,
    stride_cn,
    stride_zm,
    stride_zk,
    stride_bias,
    stride_bias_up,
    stride_bsn,
    stride_bsk,
    stride_cs,  # c_scale's block stride (QUANT_OUT; at least M)
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    DACT: tl.constexpr,  # 0, or the ACTIVATION code whose derivative A gets
    BIAS_GRAD: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ACT_BF16: tl.constexpr,
    QUANT_A: tl.constexpr,
    SWAP_AB: tl.constexpr,
    B_TMA: tl.constexpr,  # B (and B_up) through TMA: FP8 decode's weight streams
    STACKED: tl.constexpr,  # B_TMA, GATED: b_ptr describes both weights, [2, N, K]
    UP_FIRST: tl.constexpr,  # STACKED: b_ptr[0] holds B_up, b_ptr[1] B
    SPLIT_K: tl.constexpr,
    CLEAR: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Portable path: pointer loads through any strides, SPLIT_K programs per output tile
    (adjacent program ids: they finish together)."""
    if CLEAR > 0 and tl.program_id(0) == 0:
        tl.store(clear_ptr + tl.arange(0, CLEAR), tl.zeros((CLEAR,), dtype=tl.int32))
    c_dtype = c_ptr.dtype.element_ty
    if QUANT_OUT:
        dtype = tl.bfloat16 if ACT_BF16 else tl.float16
    else:
        dtype = c_dtype
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = split * per_split  # this program's K-tiles: [k_first, k_end)
    k_end = min(k_first + per_split, k_tiles)
    pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_first.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Masked loads, not clamped indices: clamping hides the contiguity of a transposed
    # operand (dY^T, X^T in backward) from the compiler and kills vectorisation.
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if not B_TMA:
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        if GATED:
            b_up_ptrs = (
                b_up_ptr + offs_n[None, :] * stride_bun + offs_k[:, None] * stride_buk
            )
    if DACT != 0:
        z_ptrs = z_ptr + offs_m[:, None] * stride_zm + offs_k[None, :] * stride_zk
    offs_k = tl.arange(0, BLOCK_K)

    if STACKED:  # both weights' rows as one product's, transposed (SWAP_AB)
        tl.static_assert(FP8 and GATED and SWAP_AB)
        acc1 = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif SWAP_AB:  # the accumulators transposed until the loop ends
        acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if FP8:
        # Each K step's scales are loaded a step ahead, once the step before has used its
        # own (at the loop's end): one register each, the load in flight over the back
        # edge. Loaded before that use, each took a second register and a copy at the
        # loop's end that waited for the load; as plain loads in their step they were
        # awaited after its MMA (A's are a new row of L2 each step); two steps ahead broke
        # Triton's pipeline. The weights' next index is clamped to the last K block
        # and A's next rows are masked past the program's last step, by their bound (the
        # interpreter cannot AND a scalar condition into a block mask); the first loads
        # are masked for an empty split.
        has_steps = k_first < k_end
        tile_row = (pid_n * BLOCK_N // BLOCK_K) * stride_bsn  # its weight-scale row
        first = min(k_first, k_tiles - 1) * stride_bsk
        b_scale_row = b_scale_ptr + tile_row
        b_scale_next = tl.load(b_scale_row + first, mask=has_steps, other=0.0)
        if GATED:
            b_up_scale_row = b_up_scale_ptr + tile_row
            b_up_scale_next = tl.load(b_up_scale_row + first, mask=has_steps, other=0.0)
        if not QUANT_A:
            a_scale_next = tl.load(
                a_scale_ptr + k_first * M + offs_m,
                mask=offs_m < tl.where(has_steps, M, 0),
                other=0.0,
            )
    for k in range(k_first, k_end):
        a_mask, b_mask = _k_step_masks(mask_m, mask_n, offs_k, K - k * BLOCK_K, EVEN_K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if STACKED:  # both weights' tiles as one box (zeros past their N rows)
            b = b_ptr.load([0, pid_n * BLOCK_N, k * BLOCK_K])
            b = b.reshape(2 * BLOCK_N, BLOCK_K).T
        elif B_TMA:  # the weight's [BLOCK_N, BLOCK_K] box, zeros past its edges
            b = _tma_load(b_ptr, pid_n * BLOCK_N, k * BLOCK_K, False).T
        else:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if DACT != 0:
            a = _dact_prologue(a, tl.load(z_ptrs, mask=a_mask, other=0.0), DACT)
            z_ptrs += BLOCK_K * stride_zk
        if BIAS_GRAD and pid_n == 0:
            row_sum += tl.sum(a.to(tl.float32), axis=1)
        if FP8:
            if QUANT_A:
                a, a_scale = quantize_rows(a.to(tl.float32))
            else:
                a_scale = a_scale_next
            b_scale = b_scale_next
            if GATED:
                b_up_scale = b_up_scale_next
            if STACKED:  # one MMA over both: each weight's rows by its own block scale
                box0, box1 = (
                    (b_up_scale, b_scale) if UP_FIRST else (b_scale, b_up_scale)
                )
                rows = tl.arange(0, 2 * BLOCK_N)[:, None]
                b_scale = tl.where(rows < BLOCK_N, box0, box1)
            acc1 = _scaled_dot(a, b, acc1, a_scale, b_scale, INPUT_PRECISION, SWAP_AB)
        else:
            acc1 = _dot(a, b, acc1, INPUT_PRECISION)
        if GATED and not STACKED:
            if B_TMA:
                b_up = _tma_load(b_up_ptr, pid_n * BLOCK_N, k * BLOCK_K, False).T
            else:
                b_up = tl.load(b_up_ptrs, mask=b_mask, other=0.0)
            if FP8:
                acc2 = _scaled_dot(
                    a, b_up, acc2, a_scale, b_up_scale, INPUT_PRECISION, SWAP_AB
                )
            else:
                acc2 = _dot(a, b_up, acc2, INPUT_PRECISION)
            if not B_TMA:
                b_up_ptrs += BLOCK_K * stride_buk
        if FP8:  # the next step's scales, after this step's last use of its own
            next_block = min(k + 1, k_tiles - 1) * stride_bsk
            if not QUANT_A:
                a_scale_next = tl.load(
                    a_scale_ptr + (k + 1) * M + offs_m,
                    mask=offs_m < tl.where(k + 1 < k_end, M, 0),
                    other=0.0,
                )
            b_scale_next = tl.load(b_scale_row + next_block)
            if GATED:
                b_up_scale_next = tl.load(b_up_scale_row + next_block)
        a_ptrs += BLOCK_K * stride_ak
        if not B_TMA:
            b_ptrs += BLOCK_K * stride_bk

    if STACKED:
        halves = acc1.T.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1)  # the box's order
        if UP_FIRST:
            acc2, acc1 = halves.split()
        else:
            acc1, acc2 = halves.split()
    elif SWAP_AB:
        acc1 = acc1.T
        acc2 = acc2.T
    if BIAS_GRAD and pid_n == 0:  # (SPLIT_K == 1)
        tl.store(bias_grad_ptr + offs_m, row_sum, mask=mask_m)
    if SPLIT_K > 1:
        acc1, acc2, is_last = _split_k_reduce(
            acc1, acc2, ws_ptr, counters_ptr, tile, split, GATED, SPLIT_K, BLOCK_M, BLOCK_N
        )  # fmt: skip
    else:
        is_last = True
    if is_last:
        out = _epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias_ptr, bias_up_ptr, stride_bias,
            stride_bias_up, preact_ptr, preact_up_ptr, 0, 0, dtype, HAS_BIAS, GATED, ACTIVATION,
            STORE_PREACT,
        )  # fmt: skip
        if QUANT_OUT:  # BLOCK_N = 128: this tile's columns are one scale block
            out, out_scale = quantize_rows(out.to(tl.float32))
            tl.store(c_scale_ptr + pid_n * stride_cs + offs_m, out_scale, mask=mask_m)
        mask = mask_m[:, None] & mask_n[None, :]
        c_offs = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        if ACCUMULATE:
            out = out.to(tl.float32) + tl.load(c_ptr + c_offs, mask=mask).to(tl.float32)
        tl.store(c_ptr + c_offs, out.to(c_dtype), mask=mask)


@triton.jit
def _tma_load(desc, off_rows, off_k, TRANSPOSED: tl.constexpr):
    # A [rows, K] tile; a TRANSPOSED descriptor describes the operand's transpose [K, rows].
    if TRANSPOSED:
        return desc.load([off_k, off_rows]).T
    else:
        return desc.load([off_rows, off_k])


@triton.jit
def gemm_tma_kernel(
    a_desc,  # A [M, K], or A^T [K, M] when A_T
    b_desc,  # B [N, K], or B^T [K, N] when B_T; GATED: [2, N, K] over both weights
    z_desc,  # Z like A (DACT)
    c_desc,  # C [M, N]
    bias_ptr,
    bias_up_ptr,
    preact_ptr,
    preact_up_ptr,
    bias_grad_ptr,
    a_scale_ptr,  # as gemm_kernel's (FP8, QUANT_OUT)
    b_scale_ptr,
    b_up_scale_ptr,
    c_scale_ptr,
    M,
    N,
    K,
    stride_bias,
    stride_bias_up,
    stride_bsn,
    stride_bsk,
    stride_cs,  # c_scale's block stride (QUANT_OUT; at least M)
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    DACT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ACT_BF16: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    UP_FIRST: tl.constexpr,  # GATED: b_desc[0] holds B2 (up), b_desc[1] B1 (gate)
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Hopper path: TMA tile loads and stores (the copy engine zero-fills and clips the
    edges, so no masks), and a persistent grid whose flattened loop prefetches the next
    tile's operands during this tile's epilogue. GATED loads the gate and up tiles as one
    [2, BLOCK_N, BLOCK_K] box and issues one 2*BLOCK_N-wide dot: two dots per step were
    25% slower (benchmarks/NOTES.md). FP8 takes the two tiles as two boxes and issues
    two dots, each product scaled by its weight's block scale (one number): faster from
    256 rows than one wide product scaled by a vector of columns' scales."""
    c_dtype = c_desc.dtype
    if QUANT_OUT:
        dtype = tl.bfloat16 if ACT_BF16 else tl.float16
    else:
        dtype = c_dtype
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if GATED and not FP8:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED and FP8:
            acc_second = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            a = _tma_load(a_desc, off_m, off_k, A_T)
            if DACT != 0:
                a = _dact_prologue(a, _tma_load(z_desc, off_m, off_k, A_T), DACT)
            if BIAS_GRAD and pid_n == 0:
                row_sum += tl.sum(a.to(tl.float32), axis=1)
            if FP8:
                rows = off_m + tl.arange(0, BLOCK_M)
                a_scale = tl.load(a_scale_ptr + k * M + rows, mask=rows < M, other=0.0)
                b_block = (off_n // BLOCK_K) * stride_bsn + k * stride_bsk
                b_scale = tl.load(b_scale_ptr + b_block)
                if GATED:  # one dot per weight, each with its block's scale
                    up_scale = tl.load(b_up_scale_ptr + b_block)
                    first_scale, second_scale = (
                        (up_scale, b_scale) if UP_FIRST else (b_scale, up_scale)
                    )
                    b = b_desc.load([0, off_n, off_k]).reshape(BLOCK_N, BLOCK_K)
                    acc = _scaled_dot(
                        a, b.T, acc, a_scale, first_scale, INPUT_PRECISION, False
                    )
                    b = b_desc.load([1, off_n, off_k]).reshape(BLOCK_N, BLOCK_K)
                    acc_second = _scaled_dot(
                        a,
                        b.T,
                        acc_second,
                        a_scale,
                        second_scale,
                        INPUT_PRECISION,
                        False,
                    )
                else:
                    b = _tma_load(b_desc, off_n, off_k, B_T)
                    acc = _scaled_dot(
                        a, b.T, acc, a_scale, b_scale, INPUT_PRECISION, False
                    )
            elif GATED:
                b = b_desc.load([0, off_n, off_k]).reshape(2 * BLOCK_N, BLOCK_K)
                acc = _dot(a, b.T, acc, INPUT_PRECISION)
            else:
                b = _tma_load(b_desc, off_n, off_k, B_T)
                acc = _dot(a, b.T, acc, INPUT_PRECISION)

        if GATED:
            if FP8:
                first, second = acc, acc_second
            else:
                first, second = (
                    acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
                )
            if UP_FIRST:
                acc1, acc2 = second, first
            else:
                acc1, acc2 = first, second
        else:
            acc1, acc2 = acc, acc
        offs_m = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        if BIAS_GRAD and pid_n == 0:
            tl.store(bias_grad_ptr + offs_m, row_sum, mask=offs_m < M)
        out = _epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias_ptr, bias_up_ptr, stride_bias,
            stride_bias_up, preact_ptr, preact_up_ptr, off_m, off_n, dtype, HAS_BIAS, GATED,
            ACTIVATION, STORE_PREACT, GATED and STORE_PREACT,
        )  # fmt: skip
        if QUANT_OUT:  # BLOCK_N = 128: this tile's columns are one scale block
            out, out_scale = quantize_rows(out.to(tl.float32))
            tl.store(
                c_scale_ptr + pid_n * stride_cs + offs_m, out_scale, mask=offs_m < M
            )
        if ACCUMULATE:
            out = out.to(tl.float32) + c_desc.load([off_m, off_n]).to(tl.float32)
        c_desc.store([off_m, off_n], out.to(c_dtype))


# M is specialised as in gemm_kernel; the sizes H, I and N too.
@triton.jit
def geglu_mlp_kernel(
    x_ptr,  # [M, H]
    w_gate_ptr,  # [I, H]
    w_up_ptr,  # [I, H]
    w_down_ptr,  # [N, I]
    bias_gate_ptr,  # [I] (HAS_BIAS)
    bias_up_ptr,  # [I] (HAS_BIAS)
    bias_down_ptr,  # [N] (HAS_DOWN_BIAS)
    out_ptr,  # [M, N]
    sums_ptr,  # fp32 [M, N], zero; left zero
    arrivals_ptr,  # int32 [1], zero; left zero
    gate_scale_ptr,  # fp32 [I/128, H/128] (FP8)
    up_scale_ptr,  # fp32, gate_scale_ptr's strides (FP8)
    down_scale_ptr,  # fp32 [N/128, I/128] (FP8)
    M,
    H,
    I,
    N,
    stride_xm,
    stride_xk,
    stride_gn,
    stride_gk,
    stride_un,
    stride_uk,
    stride_dn,
    stride_dk,
    stride_om,
    stride_on,
    stride_bias_gate,
    stride_bias_up,
    stride_bias_down,
    stride_gsn,
    stride_gsk,
    stride_dsn,
    stride_dsk,
    HAS_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    FP8: tl.constexpr,  # e4m3 weights, 128 x 128 block scales; every tile 128 wide
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= M: every token in one row tile
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_FINAL: tl.constexpr,  # the last program's columns per atomic exchange
):
    """The whole GeGLU MLP of a few tokens in one launch, for decode:
        out = round(h @ W_down^T + b_down),  h = round(act(gate)) * up (gemm_kernel's GATED)
    Program p owns the intermediate columns [p BLOCK_I, (p+1) BLOCK_I): it streams those
    rows of W_gate and W_up, forms its slice of h in registers, multiplies it by the
    matching columns of W_down and adds the [M, N] partial product into fp32 ``sums``
    (atomics). The last program to arrive rounds the sums into ``out`` (with b_down) and
    zeroes them again for the next launch, BLOCK_FINAL columns at a time (each exchange
    waits for its round trip to L2: few and wide). Every weight byte is read once, by one
    launch.
    The order of the fp32 additions varies between launches (not bitwise reproducible).
    FP8: x is quantized per row and 128 columns as it is read, and h as the program forms
    it (its BLOCK_I = 128 columns are one scale block): transformers' FP8Linear inputs."""
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_i = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_i = offs_i < I
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_gate_ptr + offs_i[None, :] * stride_gn + offs_k[:, None] * stride_gk
    u_ptrs = w_up_ptr + offs_i[None, :] * stride_un + offs_k[:, None] * stride_uk
    # FP8: swapped products (gemm_kernel's SWAP_AB and QUANT_A: the same gate and up)
    if FP8:
        acc_gate = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
    else:
        acc_gate = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for k in range(tl.cdiv(H, BLOCK_K)):
        x_mask, w_mask = _k_step_masks(mask_m, mask_i, offs_k, H - k * BLOCK_K, EVEN_K)
        a = tl.load(x_ptrs, mask=x_mask, other=0.0)
        w_gate = tl.load(g_ptrs, mask=w_mask, other=0.0)
        w_up = tl.load(u_ptrs, mask=w_mask, other=0.0)
        if FP8:
            a, a_scale = quantize_rows(a.to(tl.float32))
            block = tl.program_id(0) * stride_gsn + k * stride_gsk
            acc_gate = _scaled_dot(
                a, w_gate, acc_gate, a_scale, tl.load(gate_scale_ptr + block),
                INPUT_PRECISION, True,
            )  # fmt: skip
            acc_up = _scaled_dot(
                a, w_up, acc_up, a_scale, tl.load(up_scale_ptr + block),
                INPUT_PRECISION, True,
            )  # fmt: skip
        else:
            acc_gate = _dot(a, w_gate, acc_gate, INPUT_PRECISION)
            acc_up = _dot(a, w_up, acc_up, INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_gk
        u_ptrs += BLOCK_K * stride_uk
    if FP8:
        acc_gate = acc_gate.T
        acc_up = acc_up.T
    # Columns past I have zero weights and biases: h = gelu(0) * 0 = 0 there.
    h = _epilogue(
        acc_gate, acc_up, offs_m, offs_i, M, I, bias_gate_ptr, bias_up_ptr, stride_bias_gate,
        stride_bias_up, None, None, 0, 0, dtype, HAS_BIAS, True, ACTIVATION, False,
    )  # fmt: skip
    if FP8:
        h, h_scale = quantize_rows(h.to(tl.float32))

    offs_n = tl.arange(0, BLOCK_N)
    d_ptrs = w_down_ptr + offs_n[None, :] * stride_dn + offs_i[:, None] * stride_dk
    sums_ptrs = sums_ptr + offs_m[:, None] * N + offs_n[None, :]
    for n in range(tl.cdiv(N, BLOCK_N)):
        mask_n = offs_n < N - n * BLOCK_N
        w_down = tl.load(d_ptrs, mask=mask_i[:, None] & mask_n[None, :], other=0.0)
        if FP8:
            down_scale = tl.load(
                down_scale_ptr + n * stride_dsn + tl.program_id(0) * stride_dsk
            )
            # swapped, as gemm_kernel's down GEMM: the weight tile the e4m3 MMA's rows
            part = _scaled_dot(
                h, w_down, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), h_scale,
                down_scale, INPUT_PRECISION, True,
            ).T  # fmt: skip
        else:
            part = _dot(
                h,
                w_down,
                tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
                INPUT_PRECISION,
            )
        tl.atomic_add(
            sums_ptrs, part, mask=mask_m[:, None] & mask_n[None, :], sem="relaxed"
        )
        d_ptrs += BLOCK_N * stride_dn
        sums_ptrs += BLOCK_N
    # Every thread's additions, then one release at GPU scope; the last program's acquire
    # makes all of them visible to it.
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        offs_final = tl.arange(0, BLOCK_FINAL)
        for n in range(tl.cdiv(N, BLOCK_FINAL)):
            cols = n * BLOCK_FINAL + offs_final
            mask = mask_m[:, None] & (cols < N)[None, :]
            # The sums, read and zeroed for the next launch in one atomic exchange (of
            # their bits: the interpreter exchanges integers only). A load and a store of
            # zeros here (.cg or volatile) read zeros for some elements on the H200, all
            # of their additions missing (benchmarks/NOTES.md).
            sums_tile = sums_ptr + offs_m[:, None] * N + cols[None, :]
            total = tl.atomic_xchg(
                sums_tile.to(tl.pointer_type(tl.int32)),
                tl.zeros((BLOCK_M, BLOCK_FINAL), dtype=tl.int32), mask=mask,
                sem="relaxed",
            ).to(tl.float32, bitcast=True)  # fmt: skip
            total = tl.where(mask, total, 0.0)  # masked lanes hold no sum
            if HAS_DOWN_BIAS:
                bias = tl.load(bias_down_ptr + cols * stride_bias_down, mask=cols < N)
                total += bias.to(tl.float32)[None, :]
            out_offs = offs_m[:, None] * stride_om + cols[None, :] * stride_on
            tl.store(out_ptr + out_offs, total.to(dtype), mask=mask)
        tl.atomic_xchg(arrivals_ptr, 0)
