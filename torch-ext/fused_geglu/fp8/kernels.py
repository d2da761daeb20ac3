"""FP8 kernels (device code): e4m3 operands with block scales, transformers' FineGrainedFP8
semantics. A weight [N, K] carries one fp32 scale per 128 x 128 block ([N/128, K/128]);
an activation one per row and 128 columns, stored K-block-major ([K/128, M]) so that a K
step loads one block's scales of a row tile contiguously. Each K step's fp32 product is
scaled by both before it is added (``scaled_dot``); activations are quantized as
``quantize_rows`` does (dynamic scales, round to nearest even, saturating).

  quantize_fp8_kernel     q, s = quantize_rows(x); with ACTIVATION of round(act(gate)) * up
  gemm_fp8_kernel         C = A @ B^T (+ bias), or GATED: C = geglu(gate, up); the portable
                          (pointer-load) kernel, with the decode forms below
  gemm_fp8_tma_kernel     the same products through TMA on a persistent grid (Hopper)
  geglu_mlp_fp8_kernel    the whole MLP of a few tokens in one launch (one_launch.py's
                          kernel with e4m3 weights)

gemm_fp8_kernel's flags:
  QUANT_OUT    (GATED, BLOCK_N = 128) h leaves as e4m3 with one scale per row and 128
               columns ([N/128, M]): the down projection's A, quantized as its own
               prologue would; ``ACT_BF16`` names h's dtype before quantization
  QUANT_A      A arrives in 16 bits and each K step quantizes its tile as
               quantize_fp8_kernel would: no separate launch
  SWAP_AB      each K step computes (B @ A^T), the weight tile as the MMA's rows: at
               decode sizes the tokens are too few for Hopper's e4m3 MMA (64 rows)
  B_TMA        the weights read through TMA descriptors ([BLOCK_N, BLOCK_K] boxes)
  STACKED      (GATED, SWAP_AB, B_TMA) one descriptor over both weights ([2, N, K]): each
               K step loads the gate and up tiles as one box and issues one MMA over both
               (UP_FIRST: up at the lower address)
  SPLIT_K      programs per output tile, reduced as gemm_kernel's (gemm_kernels.py)
  CLEAR        program 0 zeroes CLEAR int32 counters (a power of two) of a later SPLIT_K
               launch on the stream: in a CUDA graph they need no memset node of their own
The host side is fp8/gemm.py.
"""

import triton
import triton.language as tl

from ..activation import geglu_tile
from ..gemm_kernels import (
    DOT_IN_FP32,
    add_to_sums,
    dot,
    epilogue,
    grouped_tile,
    k_step_masks,
    one_launch_down_tile,
    one_launch_operands,
    one_launch_step,
    read_back_sums,
    split_k_program,
    split_k_reduce,
    tma_load,
)

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
def scaled_dot(
    a, b, acc, a_scale, b_scale, INPUT_PRECISION: tl.constexpr, SWAPPED: tl.constexpr
):
    """acc + (a @ b) * a_scale[:, None] * b_scale: one e4m3 K block's fp32 product, scaled
    by its rows' (activation) and its weight block's scales, in finegrained-fp8's order.
    SWAPPED: acc and the product transposed, acc + (b^T @ a^T) * a_scale[None, :] * b_scale
    (SWAP_AB: the same products and scalings)."""
    if SWAPPED:
        acc = acc + dot(b.T, a.T, None, INPUT_PRECISION) * a_scale[None, :] * b_scale
    else:
        acc = acc + dot(a, b, None, INPUT_PRECISION) * a_scale[:, None] * b_scale
    return acc


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
    """q, s = quantize_rows(x) per row and BLOCK_K columns, the scales K-block-major. With
    ACTIVATION, x is geglu_tile(gate, up) in the gate's dtype: the dual GEMM's h,
    quantized as its epilogue does (QUANT_OUT with ACT_BF16)."""
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


# M is specialised like N and K (== 1, % 16 == 0, other), as gemm_kernel's.
@triton.jit
def gemm_fp8_kernel(
    a_ptr,  # [M, K] e4m3, or 16-bit with QUANT_A
    b_ptr,  # [N, K] e4m3; B_TMA: its descriptor, [BLOCK_N, BLOCK_K] boxes (STACKED: [2, N, K])
    b_up_ptr,  # [N, K] (GATED), as b_ptr; None with STACKED
    bias_ptr,  # [N]
    bias_up_ptr,  # [N] (GATED)
    c_ptr,  # [M, N]: 16-bit, or e4m3 (QUANT_OUT)
    ws_ptr,  # fp32 [tiles, SPLIT_K, 1 or 2, BLOCK_M, BLOCK_N] (SPLIT_K > 1)
    counters_ptr,  # int32 [>= tiles], zero (SPLIT_K > 1)
    clear_ptr,  # int32 [CLEAR]: zeroed (CLEAR > 0)
    a_scale_ptr,  # fp32 [K/128, M] (not QUANT_A)
    b_scale_ptr,  # fp32 [N/128, K/128]
    b_up_scale_ptr,  # fp32, b_scale_ptr's strides (GATED)
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
    stride_bias,
    stride_bias_up,
    stride_bsn,
    stride_bsk,
    stride_cs,  # c_scale's block stride (QUANT_OUT; at least M)
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ACT_BF16: tl.constexpr,
    QUANT_A: tl.constexpr,
    SWAP_AB: tl.constexpr,
    B_TMA: tl.constexpr,
    STACKED: tl.constexpr,
    UP_FIRST: tl.constexpr,
    SPLIT_K: tl.constexpr,
    CLEAR: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scale block (128)
    GROUP_M: tl.constexpr,
):
    """Portable path: pointer (or B_TMA) loads, SPLIT_K programs per output tile (adjacent
    program ids: they finish together)."""
    if CLEAR > 0 and tl.program_id(0) == 0:
        tl.store(clear_ptr + tl.arange(0, CLEAR), tl.zeros((CLEAR,), dtype=tl.int32))
    c_dtype = c_ptr.dtype.element_ty
    if QUANT_OUT:
        dtype = tl.bfloat16 if ACT_BF16 else tl.float16
    else:
        dtype = c_dtype
    tile, split, pid_n, k_tiles, k_first, k_end, offs_m, offs_n, offs_k = (
        split_k_program(M, N, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    )
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    if not B_TMA:
        b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        if GATED:
            b_up_ptrs = (
                b_up_ptr + offs_n[None, :] * stride_bun + offs_k[:, None] * stride_buk
            )
    offs_k = tl.arange(0, BLOCK_K)

    if STACKED:  # both weights' rows as one product's, transposed (SWAP_AB)
        tl.static_assert(GATED and SWAP_AB)
        acc1 = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif SWAP_AB:  # the accumulators transposed until the loop ends
        acc1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Each K step's scales are loaded a step ahead, once the step before has used its own
    # (at the loop's end): one register each, the load in flight over the back edge.
    # Loaded before that use, each took a second register and a copy at the loop's end
    # that waited for the load; as plain loads in their step they were awaited after its
    # MMA (A's are a new row of L2 each step); two steps ahead broke Triton's pipeline.
    # The weights' next index is clamped to the last K block and A's next rows are
    # masked past the program's last step, by their bound (the interpreter cannot AND a
    # scalar condition into a block mask); the first loads are masked for an empty split.
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
        a_mask, b_mask = k_step_masks(mask_m, mask_n, offs_k, K - k * BLOCK_K, EVEN_K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        if STACKED:  # both weights' tiles as one box (zeros past their N rows)
            b = b_ptr.load([0, pid_n * BLOCK_N, k * BLOCK_K])
            b = b.reshape(2 * BLOCK_N, BLOCK_K).T
        elif B_TMA:  # the weight's [BLOCK_N, BLOCK_K] box, zeros past its edges
            b = tma_load(b_ptr, pid_n * BLOCK_N, k * BLOCK_K, False).T
        else:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if QUANT_A:
            a, a_scale = quantize_rows(a.to(tl.float32))
        else:
            a_scale = a_scale_next
        b_scale = b_scale_next
        if GATED:
            b_up_scale = b_up_scale_next
        if STACKED:  # one MMA over both: each weight's rows by its own block scale
            box0, box1 = (b_up_scale, b_scale) if UP_FIRST else (b_scale, b_up_scale)
            rows = tl.arange(0, 2 * BLOCK_N)[:, None]
            b_scale = tl.where(rows < BLOCK_N, box0, box1)
        acc1 = scaled_dot(a, b, acc1, a_scale, b_scale, INPUT_PRECISION, SWAP_AB)
        if GATED and not STACKED:
            if B_TMA:
                b_up = tma_load(b_up_ptr, pid_n * BLOCK_N, k * BLOCK_K, False).T
            else:
                b_up = tl.load(b_up_ptrs, mask=b_mask, other=0.0)
            acc2 = scaled_dot(
                a, b_up, acc2, a_scale, b_up_scale, INPUT_PRECISION, SWAP_AB
            )
            if not B_TMA:
                b_up_ptrs += BLOCK_K * stride_buk
        # the next step's scales, after this step's last use of its own
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
    acc1, acc2, is_last = split_k_reduce(
        acc1, acc2, ws_ptr, counters_ptr, tile, split, GATED, SPLIT_K, BLOCK_M, BLOCK_N
    )
    if is_last:
        out = epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias_ptr, bias_up_ptr, stride_bias,
            stride_bias_up, None, None, 0, 0, dtype, HAS_BIAS, GATED, ACTIVATION, False,
        )  # fmt: skip
        if QUANT_OUT:  # BLOCK_N = 128: this tile's columns are one scale block
            out, out_scale = quantize_rows(out.to(tl.float32))
            tl.store(c_scale_ptr + pid_n * stride_cs + offs_m, out_scale, mask=mask_m)
        mask = mask_m[:, None] & mask_n[None, :]
        c_offs = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptr + c_offs, out.to(c_dtype), mask=mask)


@triton.jit
def gemm_fp8_tma_kernel(
    a_desc,  # A [M, K] e4m3, or A^T [K, M] when A_T
    b_desc,  # B [N, K], or B^T [K, N] when B_T; GATED: [2, N, K] over both weights
    c_desc,  # C [M, N]: 16-bit, or e4m3 (QUANT_OUT)
    bias_ptr,
    bias_up_ptr,
    a_scale_ptr,  # as gemm_fp8_kernel's
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
    stride_cs,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    ACT_BF16: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    UP_FIRST: tl.constexpr,  # GATED: b_desc[0] holds B_up, b_desc[1] B
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Hopper path, as gemm_tma_kernel's (persistent grid, TMA loads and stores). GATED
    takes the two weight tiles as two boxes of one descriptor and issues two dots, each
    product scaled by its weight's block scale (one number): faster from 256 rows than one
    wide product scaled by a vector of columns' scales."""
    c_dtype = c_desc.dtype
    if QUANT_OUT:
        dtype = tl.bfloat16 if ACT_BF16 else tl.float16
    else:
        dtype = c_dtype
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATED:
            acc_second = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            a = tma_load(a_desc, off_m, off_k, A_T)
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
                acc = scaled_dot(
                    a, b.T, acc, a_scale, first_scale, INPUT_PRECISION, False
                )
                b = b_desc.load([1, off_n, off_k]).reshape(BLOCK_N, BLOCK_K)
                acc_second = scaled_dot(
                    a, b.T, acc_second, a_scale, second_scale, INPUT_PRECISION, False
                )
            else:
                b = tma_load(b_desc, off_n, off_k, B_T)
                acc = scaled_dot(a, b.T, acc, a_scale, b_scale, INPUT_PRECISION, False)
        if GATED and UP_FIRST:
            acc1, acc2 = acc_second, acc
        elif GATED:
            acc1, acc2 = acc, acc_second
        else:
            acc1, acc2 = acc, acc
        offs_m = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        out = epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias_ptr, bias_up_ptr, stride_bias,
            stride_bias_up, None, None, off_m, off_n, dtype, HAS_BIAS, GATED, ACTIVATION,
            False,
        )  # fmt: skip
        if QUANT_OUT:  # BLOCK_N = 128: this tile's columns are one scale block
            out, out_scale = quantize_rows(out.to(tl.float32))
            tl.store(
                c_scale_ptr + pid_n * stride_cs + offs_m, out_scale, mask=offs_m < M
            )
        c_desc.store([off_m, off_n], out.to(c_dtype))


# M is specialised as in gemm_kernel; the sizes H, I and N too.
@triton.jit
def one_launch_mlp_fp8_kernel(
    x_ptr,  # [M, H], 16-bit
    w_gate_ptr,  # [I, H] e4m3
    w_up_ptr,  # [I, H] e4m3
    w_down_ptr,  # [N, I] e4m3
    bias_gate_ptr,  # [I] (HAS_BIAS)
    bias_up_ptr,  # [I] (HAS_BIAS)
    bias_down_ptr,  # [N] (HAS_DOWN_BIAS)
    out_ptr,  # [M, N]
    sums_ptr,  # fp32 [M, N], zero; left zero
    arrivals_ptr,  # int32 [1], zero; left zero
    gate_scale_ptr,  # fp32 [I/128, H/128]
    up_scale_ptr,  # fp32, gate_scale_ptr's strides
    down_scale_ptr,  # fp32 [N/128, I/128]
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
    EVEN_K: tl.constexpr,  # H % BLOCK_K == 0
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= M: every token in one row tile
    BLOCK_I: tl.constexpr,  # the scale block (128), as BLOCK_K and BLOCK_N
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_FINAL: tl.constexpr,
):
    """one_launch_mlp_kernel (gemm_kernels.py) with e4m3 weights: x is quantized per row
    and 128 columns as it is read, and h as the program forms it (its BLOCK_I columns are
    one scale block): transformers' FP8Linear inputs. The products are swapped
    (gemm_fp8_kernel's SWAP_AB and QUANT_A: the same gate, up and down products)."""
    dtype = out_ptr.dtype.element_ty
    offs_m, offs_i, offs_k, mask_m, mask_i, x_ptrs, g_ptrs, u_ptrs = one_launch_operands(
        x_ptr, w_gate_ptr, w_up_ptr, M, I, stride_xm, stride_xk, stride_gn, stride_gk,
        stride_un, stride_uk, BLOCK_M, BLOCK_I, BLOCK_K,
    )  # fmt: skip
    acc_gate = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
    for k in range(tl.cdiv(H, BLOCK_K)):
        a, w_gate, w_up = one_launch_step(
            x_ptrs, g_ptrs, u_ptrs, mask_m, mask_i, offs_k, H - k * BLOCK_K, EVEN_K
        )
        a, a_scale = quantize_rows(a.to(tl.float32))
        block = tl.program_id(0) * stride_gsn + k * stride_gsk
        acc_gate = scaled_dot(
            a, w_gate, acc_gate, a_scale, tl.load(gate_scale_ptr + block),
            INPUT_PRECISION, True,
        )  # fmt: skip
        acc_up = scaled_dot(
            a,
            w_up,
            acc_up,
            a_scale,
            tl.load(up_scale_ptr + block),
            INPUT_PRECISION,
            True,
        )
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_gk
        u_ptrs += BLOCK_K * stride_uk
    # Columns past I have zero weights and biases: h = gelu(0) * 0 = 0 there.
    h = epilogue(
        acc_gate.T, acc_up.T, offs_m, offs_i, M, I, bias_gate_ptr, bias_up_ptr,
        stride_bias_gate, stride_bias_up, None, None, 0, 0, dtype, HAS_BIAS, True,
        ACTIVATION, False,
    )  # fmt: skip
    h, h_scale = quantize_rows(h.to(tl.float32))

    offs_n = tl.arange(0, BLOCK_N)
    d_ptrs = w_down_ptr + offs_n[None, :] * stride_dn + offs_i[:, None] * stride_dk
    sums_ptrs = sums_ptr + offs_m[:, None] * N + offs_n[None, :]
    for n in range(tl.cdiv(N, BLOCK_N)):
        w_down, mask_n = one_launch_down_tile(d_ptrs, offs_n, mask_i, N - n * BLOCK_N)
        down_scale = tl.load(
            down_scale_ptr + n * stride_dsn + tl.program_id(0) * stride_dsk
        )
        # swapped, as gemm_fp8_kernel's down GEMM: the weight tile the e4m3 MMA's rows
        part = scaled_dot(
            h, w_down, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), h_scale,
            down_scale, INPUT_PRECISION, True,
        ).T  # fmt: skip
        add_to_sums(sums_ptrs, part, mask_m, mask_n)
        d_ptrs += BLOCK_N * stride_dn
        sums_ptrs += BLOCK_N
    read_back_sums(
        sums_ptr, arrivals_ptr, bias_down_ptr, out_ptr, offs_m, mask_m, N,
        stride_bias_down, stride_om, stride_on, dtype, HAS_DOWN_BIAS, BLOCK_M, BLOCK_FINAL,
    )  # fmt: skip
