"""GEMM kernels (device code): one Triton GEMM with fused prologue/epilogue.

    C = epilogue(A @ B^T [+ bias], A @ B_up^T [+ bias_up])

A is [M, K], each B is [N, K] (``nn.Linear``'s weight layout), every operand read through
its strides, so transposes are free. Constexpr flags select the fused work:
  GATED        a second weight B_up and a second fp32 accumulator: C = geglu(gate, up)
               with gate = A @ B^T (+ bias), up = A @ B_up^T (+ bias_up), eager's rounding
  ACTIVATION   0: none, 1: exact GeLU, 2: tanh GeLU, applied to the biased accumulator
               (GATED: the GeLU of the gate)
  STORE_PREACT also store the rounded pre-activation(s) (what backward needs)
  DACT         prologue: A <- round(A * act'(Z)) (act coded as ACTIVATION), Z read with
               A's strides (backward of a GEMM+activation: dZ never materialises)
  BIAS_GRAD    the programs of the first N-tile column also reduce A over K (rows of
               dY^T): the bias gradient inside the weight-gradient GEMM
  ACCUMULATE   C += result (a second product into dX)
  SPLIT_K      (portable kernel) programs per output tile, each summing a slice of K into
               an fp32 workspace; the last to finish adds the slices in a fixed order
               (deterministic) and applies the epilogue: decode shapes with fewer output
               tiles than SMs stream their weights with every SM

one_launch_mlp_kernel computes the whole GeGLU MLP of a few tokens in one launch.

The host sides are gemm.py and one_launch.py; the FP8 kernels (fp8/kernels.py) are built
from the helpers here.
"""

import triton
import triton.language as tl

from .activation import geglu_tile, gelu, gelu_grad
from .launch import INTERPRETED

# The interpreter multiplies 16-bit tl.dot operands in numpy, where bf16 is stored as raw
# integer bits: it would multiply the bits. Interpreted dots therefore take fp32 operands
# (exact products of the 16-bit values; GPUs also accumulate in fp32).
DOT_IN_FP32 = tl.constexpr(INTERPRETED)


@triton.jit
def dot(a, b, acc, INPUT_PRECISION: tl.constexpr):
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def grouped_tile(
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
def k_step_masks(mask_m, mask_n, offs_k, k_left, EVEN_K: tl.constexpr):
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
def dact_prologue(a, z, DACT: tl.constexpr):
    # round(dY * act'(Z)), as eager's gelu_backward output, before the product.
    return (a.to(tl.float32) * gelu_grad(z.to(tl.float32), DACT == 2)).to(a.dtype)


@triton.jit
def epilogue(
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
def split_k_program(
    M, N, K, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """A portable GEMM program's share: (output tile, K slice, the tile's column, K tiles
    in all, this program's K tiles [k_first, k_end), and the offsets of its rows, columns
    and first K step). SPLIT_K programs per output tile, adjacent program ids."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = split * per_split
    k_end = min(k_first + per_split, k_tiles)
    pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = k_first.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tile, split, pid_n, k_tiles, k_first, k_end, offs_m, offs_n, offs_k


@triton.jit
def split_k_reduce(
    acc1, acc2, ws_ptr, counters_ptr, tile, split,
    GATED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Stores this program's partial tile(s) in the workspace and counts it in; the last of
    the tile's SPLIT_K programs gets the sums over the slices, in slice order, and
    ``is_last``. It also resets the tile's counter, so the counters are zero again for the
    next launch (in CUDA graphs too). SPLIT_K 1: the accumulators as they are, is_last."""
    is_last = True
    if SPLIT_K > 1:
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
                acc1 += tl.load(
                    ws_tile + s * (accs * size) + offs, cache_modifier=".cg"
                )
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
    a_ptr,  # [M, K]
    b_ptr,  # [N, K]
    b_up_ptr,  # [N, K] (GATED)
    bias_ptr,  # [N]
    bias_up_ptr,  # [N] (GATED)
    c_ptr,  # [M, N]
    preact_ptr,  # [M, N] contiguous (STORE_PREACT)
    preact_up_ptr,  # [M, N] contiguous (STORE_PREACT and GATED)
    z_ptr,  # [M, K] (DACT)
    bias_grad_ptr,  # [M] fp32 (BIAS_GRAD)
    ws_ptr,  # fp32 [tiles, SPLIT_K, 1 or 2, BLOCK_M, BLOCK_N] (SPLIT_K > 1)
    counters_ptr,  # int32 [>= tiles], zero (SPLIT_K > 1)
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
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    DACT: tl.constexpr,  # 0, or the ACTIVATION code whose derivative A gets
    BIAS_GRAD: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Portable path: pointer loads through any strides, SPLIT_K programs per output tile
    (adjacent program ids: they finish together)."""
    dtype = c_ptr.dtype.element_ty
    tile, split, pid_n, _, k_first, k_end, offs_m, offs_n, offs_k = split_k_program(
        M, N, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M
    )
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Masked loads, not clamped indices: clamping hides the contiguity of a transposed
    # operand (dY^T, X^T in backward) from the compiler and kills vectorisation.
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    if GATED:
        b_up_ptrs = (
            b_up_ptr + offs_n[None, :] * stride_bun + offs_k[:, None] * stride_buk
        )
    if DACT != 0:
        z_ptrs = z_ptr + offs_m[:, None] * stride_zm + offs_k[None, :] * stride_zk
    offs_k = tl.arange(0, BLOCK_K)

    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(k_first, k_end):
        a_mask, b_mask = k_step_masks(mask_m, mask_n, offs_k, K - k * BLOCK_K, EVEN_K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        if DACT != 0:
            a = dact_prologue(a, tl.load(z_ptrs, mask=a_mask, other=0.0), DACT)
            z_ptrs += BLOCK_K * stride_zk
        if BIAS_GRAD and pid_n == 0:
            row_sum += tl.sum(a.to(tl.float32), axis=1)
        acc1 = dot(a, b, acc1, INPUT_PRECISION)
        if GATED:
            b_up = tl.load(b_up_ptrs, mask=b_mask, other=0.0)
            acc2 = dot(a, b_up, acc2, INPUT_PRECISION)
            b_up_ptrs += BLOCK_K * stride_buk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if BIAS_GRAD and pid_n == 0:  # (SPLIT_K == 1)
        tl.store(bias_grad_ptr + offs_m, row_sum, mask=mask_m)
    acc1, acc2, is_last = split_k_reduce(
        acc1, acc2, ws_ptr, counters_ptr, tile, split, GATED, SPLIT_K, BLOCK_M, BLOCK_N
    )
    if is_last:
        out = epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias_ptr, bias_up_ptr, stride_bias,
            stride_bias_up, preact_ptr, preact_up_ptr, 0, 0, dtype, HAS_BIAS, GATED, ACTIVATION,
            STORE_PREACT,
        )  # fmt: skip
        mask = mask_m[:, None] & mask_n[None, :]
        c_offs = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        if ACCUMULATE:
            out = out.to(tl.float32) + tl.load(c_ptr + c_offs, mask=mask).to(tl.float32)
        tl.store(c_ptr + c_offs, out.to(dtype), mask=mask)


@triton.jit
def tma_load(desc, off_rows, off_k, TRANSPOSED: tl.constexpr):
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
    M,
    N,
    K,
    stride_bias,
    stride_bias_up,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    DACT: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    ACCUMULATE: tl.constexpr,
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
    slower (docs/decisions/0001-tma-persistent-gemm.md)."""
    dtype = c_desc.dtype
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if GATED:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            a = tma_load(a_desc, off_m, off_k, A_T)
            if DACT != 0:
                a = dact_prologue(a, tma_load(z_desc, off_m, off_k, A_T), DACT)
            if BIAS_GRAD and pid_n == 0:
                row_sum += tl.sum(a.to(tl.float32), axis=1)
            if GATED:
                b = b_desc.load([0, off_n, off_k]).reshape(2 * BLOCK_N, BLOCK_K)
                acc = dot(a, b.T, acc, INPUT_PRECISION)
            else:
                b = tma_load(b_desc, off_n, off_k, B_T)
                acc = dot(a, b.T, acc, INPUT_PRECISION)

        if GATED:
            first, second = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
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
        out = epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias_ptr, bias_up_ptr, stride_bias,
            stride_bias_up, preact_ptr, preact_up_ptr, off_m, off_n, dtype, HAS_BIAS, GATED,
            ACTIVATION, STORE_PREACT, GATED and STORE_PREACT,
        )  # fmt: skip
        if ACCUMULATE:
            out = out.to(tl.float32) + c_desc.load([off_m, off_n]).to(tl.float32)
        c_desc.store([off_m, off_n], out.to(dtype))


@triton.jit
def one_launch_operands(
    x_ptr, w_gate_ptr, w_up_ptr, M, I, stride_xm, stride_xk, stride_gn, stride_gk,
    stride_un, stride_uk, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A one-launch MLP program's rows, intermediate columns and first K step: (offs_m,
    offs_i, offs_k, mask_m, mask_i, and the x, W_gate and W_up tile pointers)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_i = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    g_ptrs = w_gate_ptr + offs_i[None, :] * stride_gn + offs_k[:, None] * stride_gk
    u_ptrs = w_up_ptr + offs_i[None, :] * stride_un + offs_k[:, None] * stride_uk
    return offs_m, offs_i, offs_k, offs_m < M, offs_i < I, x_ptrs, g_ptrs, u_ptrs


@triton.jit
def one_launch_step(x_ptrs, g_ptrs, u_ptrs, mask_m, mask_i, offs_k, k_left,
                    EVEN_K: tl.constexpr):  # fmt: skip
    """One K step's x, W_gate and W_up tiles (``k_left``: the K columns from it on)."""
    x_mask, w_mask = k_step_masks(mask_m, mask_i, offs_k, k_left, EVEN_K)
    a = tl.load(x_ptrs, mask=x_mask, other=0.0)
    w_gate = tl.load(g_ptrs, mask=w_mask, other=0.0)
    w_up = tl.load(u_ptrs, mask=w_mask, other=0.0)
    return a, w_gate, w_up


@triton.jit
def one_launch_down_tile(d_ptrs, offs_n, mask_i, n_left):
    """A down-projection step's W_down tile ([BLOCK_I, BLOCK_N] of the program's rows of
    h) and its column mask (``n_left``: the output columns from this step on)."""
    mask_n = offs_n < n_left
    return tl.load(d_ptrs, mask=mask_i[:, None] & mask_n[None, :], other=0.0), mask_n


@triton.jit
def add_to_sums(sums_ptrs, part, mask_m, mask_n):
    """Adds a program's [M, BLOCK_N] partial down product into the fp32 sums (relaxed
    atomics: read_back_sums orders them)."""
    tl.atomic_add(
        sums_ptrs, part, mask=mask_m[:, None] & mask_n[None, :], sem="relaxed"
    )


@triton.jit
def read_back_sums(
    sums_ptr, arrivals_ptr, bias_down_ptr, out_ptr, offs_m, mask_m, N, stride_bias_down,
    stride_om, stride_on, dtype: tl.constexpr, HAS_DOWN_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_FINAL: tl.constexpr,
):  # fmt: skip
    """A one-launch MLP's end: counts this program in; the last to arrive rounds the fp32
    ``sums`` into ``out`` (with b_down) and zeroes them and the arrival count again for the
    next launch, BLOCK_FINAL columns at a time (each exchange waits for its round trip to
    L2: few and wide)."""
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
            # of their additions missing (docs/decisions/0003-one-launch-decode-mlp.md).
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


# M is specialised as in gemm_kernel; the sizes H, I and N too.
@triton.jit
def one_launch_mlp_kernel(
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
    HAS_BIAS: tl.constexpr,
    HAS_DOWN_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
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
    (atomics); the last program to arrive rounds them into ``out`` (read_back_sums).
    Every weight byte is read once, by one launch. The order of the fp32 additions varies
    between launches (not bitwise reproducible)."""
    dtype = out_ptr.dtype.element_ty
    offs_m, offs_i, offs_k, mask_m, mask_i, x_ptrs, g_ptrs, u_ptrs = one_launch_operands(
        x_ptr, w_gate_ptr, w_up_ptr, M, I, stride_xm, stride_xk, stride_gn, stride_gk,
        stride_un, stride_uk, BLOCK_M, BLOCK_I, BLOCK_K,
    )  # fmt: skip
    acc_gate = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for k in range(tl.cdiv(H, BLOCK_K)):
        a, w_gate, w_up = one_launch_step(
            x_ptrs, g_ptrs, u_ptrs, mask_m, mask_i, offs_k, H - k * BLOCK_K, EVEN_K
        )
        acc_gate = dot(a, w_gate, acc_gate, INPUT_PRECISION)
        acc_up = dot(a, w_up, acc_up, INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_gk
        u_ptrs += BLOCK_K * stride_uk
    # Columns past I have zero weights and biases: h = gelu(0) * 0 = 0 there.
    h = epilogue(
        acc_gate, acc_up, offs_m, offs_i, M, I, bias_gate_ptr, bias_up_ptr, stride_bias_gate,
        stride_bias_up, None, None, 0, 0, dtype, HAS_BIAS, True, ACTIVATION, False,
    )  # fmt: skip

    offs_n = tl.arange(0, BLOCK_N)
    d_ptrs = w_down_ptr + offs_n[None, :] * stride_dn + offs_i[:, None] * stride_dk
    sums_ptrs = sums_ptr + offs_m[:, None] * N + offs_n[None, :]
    for n in range(tl.cdiv(N, BLOCK_N)):
        w_down, mask_n = one_launch_down_tile(d_ptrs, offs_n, mask_i, N - n * BLOCK_N)
        part = dot(
            h, w_down, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), INPUT_PRECISION
        )
        add_to_sums(sums_ptrs, part, mask_m, mask_n)
        d_ptrs += BLOCK_N * stride_dn
        sums_ptrs += BLOCK_N
    read_back_sums(
        sums_ptr, arrivals_ptr, bias_down_ptr, out_ptr, offs_m, mask_m, N,
        stride_bias_down, stride_om, stride_on, dtype, HAS_DOWN_BIAS, BLOCK_M, BLOCK_FINAL,
    )  # fmt: skip
