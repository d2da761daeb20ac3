"""One Triton GEMM with fused prologue/epilogue, and its launch-configuration table.

    C = epilogue(A @ B1^T [+ bias1], A @ B2^T [+ bias2])

A is [M, K], each B is [N, K] (``nn.Linear``'s weight layout), every operand read through
its strides, so transposes are free. Constexpr flags select the fused work:
  DUAL         second weight B2 and a second fp32 accumulator (GeGLU's gate/up pair)
  ACTIVATION   0: none, 1: exact GeLU, 2: tanh GeLU, applied to the biased accumulator;
               with DUAL, C = geglu(C1, C2) (gate = C1) with eager's rounding points
  STORE_PREACT also store the rounded pre-activation(s) (what backward needs)
  A_GRAD_ACT   prologue: A <- round(A * act'(Z)) (act coded as ACTIVATION), Z read with
               A's strides (backward of a GEMM+activation: dZ never materialises)
  SUM_A        the programs of the first N-tile column also reduce A over K (rows of
               dY^T), giving the bias gradient inside the weight-gradient GEMM
  ADD_C        C += result (accumulating a second product into dX)
  SPLIT_K      (portable kernel) programs per output tile, each summing a slice of K into
               an fp32 workspace; the last to finish adds the slices in a fixed order
               (deterministic) and applies the epilogue: decode shapes with fewer output
               tiles than SMs (the down projection) stream their weights with every SM
"""

import functools

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from .activation import INTERPRETED, cdiv, geglu_tile, gelu, gelu_grad

ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2}


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
def _grad_act_prologue(a, z, A_GRAD_ACT: tl.constexpr):
    # round(dY * act'(Z)), as eager's gelu_backward output, before the product.
    return (a.to(tl.float32) * gelu_grad(z.to(tl.float32), A_GRAD_ACT == 2)).to(a.dtype)


@triton.jit
def _epilogue(
    acc1,
    acc2,
    offs_m,
    offs_n,
    M,
    N,
    bias1_ptr,
    bias2_ptr,
    stride_bias1,
    stride_bias2,
    pre1_ptr,
    pre2_ptr,
    dtype: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
):
    """Bias, activation and pre-activation stores on the fp32 accumulators; returns the
    tile C receives (before ADD_C)."""
    mask_n = offs_n < N
    if HAS_BIAS:
        bias1 = tl.load(bias1_ptr + offs_n * stride_bias1, mask=mask_n)
        acc1 += bias1.to(tl.float32)[None, :]
        if DUAL:
            bias2 = tl.load(bias2_ptr + offs_n * stride_bias2, mask=mask_n)
            acc2 += bias2.to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    pre_offs = offs_m[:, None] * N + offs_n[None, :]
    if DUAL:
        # eager: gate = round(x Wg^T + bg), up = round(x Wu^T + bu), then geglu's rounding.
        gate = acc1.to(dtype)
        up = acc2.to(dtype)
        if STORE_PREACT:
            tl.store(pre1_ptr + pre_offs, gate, mask=mask)
            tl.store(pre2_ptr + pre_offs, up, mask=mask)
        return geglu_tile(
            gate.to(tl.float32), up.to(tl.float32), dtype, ACTIVATION == 2
        )
    elif ACTIVATION != 0:
        preact = acc1.to(dtype)
        if STORE_PREACT:
            tl.store(pre1_ptr + pre_offs, preact, mask=mask)
        return gelu(preact.to(tl.float32), ACTIVATION == 2).to(dtype)
    else:
        return acc1


@triton.jit
def _split_k_reduce(
    acc1, acc2, ws_ptr, counters_ptr, tile, split,
    DUAL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Stores this program's partial tile(s) in the workspace and counts it in; the last of
    the tile's SPLIT_K programs gets the sums over the slices, in slice order, and
    ``is_last``. It also resets the tile's counter, so the counters are zero again for the
    next launch (in CUDA graphs too)."""
    accs: tl.constexpr = 2 if DUAL else 1
    size: tl.constexpr = BLOCK_M * BLOCK_N
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    ws_tile = ws_ptr + tile.to(tl.int64) * (SPLIT_K * accs * size)
    tl.store(ws_tile + split * (accs * size) + offs, acc1)
    if DUAL:
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
            if DUAL:
                acc2 += tl.load(
                    ws_tile + s * (accs * size) + size + offs, cache_modifier=".cg"
                )
        tl.atomic_xchg(counters_ptr + tile, 0)
    return acc1, acc2, is_last


# M is specialised like N and K (== 1, % 16 == 0, other): at most three compilations per
# configuration across token counts, and the divisibility lets masked loads of transposed
# operands vectorise.
@triton.jit
def _gemm_kernel(
    a_ptr,  # [M, K]
    b1_ptr,  # [N, K]
    b2_ptr,  # [N, K] (DUAL)
    bias1_ptr,  # [N]
    bias2_ptr,  # [N] (DUAL)
    c_ptr,  # [M, N]
    pre1_ptr,  # [M, N] contiguous (STORE_PREACT)
    pre2_ptr,  # [M, N] contiguous (STORE_PREACT and DUAL)
    z_ptr,  # [M, K] (A_GRAD_ACT)
    sum_a_ptr,  # [M] fp32 (SUM_A)
    ws_ptr,  # fp32 [tiles, SPLIT_K, 1 or 2, BLOCK_M, BLOCK_N] (SPLIT_K > 1)
    counters_ptr,  # int32 [>= tiles], zero (SPLIT_K > 1)
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_b1n,
    stride_b1k,
    stride_b2n,
    stride_b2k,
    stride_cm,
    stride_cn,
    stride_zm,
    stride_zk,
    stride_bias1,
    stride_bias2,
    HAS_BIAS: tl.constexpr,
    DUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    A_GRAD_ACT: tl.constexpr,  # 0, or the ACTIVATION code whose derivative A gets
    SUM_A: tl.constexpr,
    ADD_C: tl.constexpr,
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
    b1_ptrs = b1_ptr + offs_n[None, :] * stride_b1n + offs_k[:, None] * stride_b1k
    if DUAL:
        b2_ptrs = b2_ptr + offs_n[None, :] * stride_b2n + offs_k[:, None] * stride_b2k
    if A_GRAD_ACT != 0:
        z_ptrs = z_ptr + offs_m[:, None] * stride_zm + offs_k[None, :] * stride_zk
    offs_k = tl.arange(0, BLOCK_K)

    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(k_first, k_end):
        if EVEN_K:
            a_mask = mask_m[:, None]
            b_mask = mask_n[None, :]
        else:
            k_mask = offs_k < K - k * BLOCK_K
            a_mask = mask_m[:, None] & k_mask[None, :]
            b_mask = mask_n[None, :] & k_mask[:, None]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        b1 = tl.load(b1_ptrs, mask=b_mask, other=0.0)
        if A_GRAD_ACT != 0:
            a = _grad_act_prologue(
                a, tl.load(z_ptrs, mask=a_mask, other=0.0), A_GRAD_ACT
            )
            z_ptrs += BLOCK_K * stride_zk
        if SUM_A and pid_n == 0:
            row_sum += tl.sum(a.to(tl.float32), axis=1)
        acc1 = tl.dot(a, b1, acc1, input_precision=INPUT_PRECISION)
        if DUAL:
            b2 = tl.load(b2_ptrs, mask=b_mask, other=0.0)
            acc2 = tl.dot(a, b2, acc2, input_precision=INPUT_PRECISION)
            b2_ptrs += BLOCK_K * stride_b2k
        a_ptrs += BLOCK_K * stride_ak
        b1_ptrs += BLOCK_K * stride_b1k

    if SUM_A and pid_n == 0:  # (SPLIT_K == 1)
        tl.store(sum_a_ptr + offs_m, row_sum, mask=mask_m)
    if SPLIT_K > 1:
        acc1, acc2, is_last = _split_k_reduce(
            acc1, acc2, ws_ptr, counters_ptr, tile, split, DUAL, SPLIT_K, BLOCK_M, BLOCK_N
        )  # fmt: skip
    else:
        is_last = True
    if is_last:
        out = _epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias1_ptr, bias2_ptr, stride_bias1,
            stride_bias2, pre1_ptr, pre2_ptr, dtype, HAS_BIAS, DUAL, ACTIVATION, STORE_PREACT,
        )  # fmt: skip
        mask = mask_m[:, None] & mask_n[None, :]
        c_offs = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        if ADD_C:
            out = out.to(tl.float32) + tl.load(c_ptr + c_offs, mask=mask).to(tl.float32)
        tl.store(c_ptr + c_offs, out.to(dtype), mask=mask)


@triton.jit
def _tma_load(desc, off_rows, off_k, TRANSPOSED: tl.constexpr):
    # A [rows, K] tile; a TRANSPOSED descriptor describes the operand's transpose [K, rows].
    if TRANSPOSED:
        return desc.load([off_k, off_rows]).T
    else:
        return desc.load([off_rows, off_k])


@triton.jit
def _gemm_tma_kernel(
    a_desc,  # A [M, K], or A^T [K, M] when A_T
    b_desc,  # B [N, K], or B^T [K, N] when B_T; DUAL: [2, N, K] over both weights
    z_desc,  # Z like A (A_GRAD_ACT)
    c_desc,  # C [M, N]
    bias1_ptr,
    bias2_ptr,
    pre1_ptr,
    pre2_ptr,
    sum_a_ptr,
    M,
    N,
    K,
    stride_bias1,
    stride_bias2,
    HAS_BIAS: tl.constexpr,
    DUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PREACT: tl.constexpr,
    A_GRAD_ACT: tl.constexpr,
    SUM_A: tl.constexpr,
    ADD_C: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    UP_FIRST: tl.constexpr,  # DUAL: b_desc[0] holds B2 (up), b_desc[1] B1 (gate)
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Hopper path: TMA tile loads and stores (the copy engine zero-fills and clips the
    edges, so no masks), and a persistent grid whose flattened loop prefetches the next
    tile's operands during this tile's epilogue. DUAL loads the gate and up tiles as one
    [2, BLOCK_N, BLOCK_K] box and issues one 2*BLOCK_N-wide dot: two dots per step were
    25% slower (benchmarks/NOTES.md)."""
    dtype = c_desc.dtype
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if DUAL:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            off_k = k * BLOCK_K
            a = _tma_load(a_desc, off_m, off_k, A_T)
            if A_GRAD_ACT != 0:
                a = _grad_act_prologue(
                    a, _tma_load(z_desc, off_m, off_k, A_T), A_GRAD_ACT
                )
            if SUM_A and pid_n == 0:
                row_sum += tl.sum(a.to(tl.float32), axis=1)
            if DUAL:
                b = b_desc.load([0, off_n, off_k]).reshape(2 * BLOCK_N, BLOCK_K)
            else:
                b = _tma_load(b_desc, off_n, off_k, B_T)
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)

        if DUAL:
            first, second = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
            if UP_FIRST:
                acc1, acc2 = second, first
            else:
                acc1, acc2 = first, second
        else:
            acc1, acc2 = acc, acc
        offs_m = off_m.to(tl.int64) + tl.arange(0, BLOCK_M)
        offs_n = off_n.to(tl.int64) + tl.arange(0, BLOCK_N)
        if SUM_A and pid_n == 0:
            tl.store(sum_a_ptr + offs_m, row_sum, mask=offs_m < M)
        out = _epilogue(
            acc1, acc2, offs_m, offs_n, M, N, bias1_ptr, bias2_ptr, stride_bias1,
            stride_bias2, pre1_ptr, pre2_ptr, dtype, HAS_BIAS, DUAL, ACTIVATION, STORE_PREACT,
        )  # fmt: skip
        if ADD_C:
            out = out.to(tl.float32) + c_desc.load([off_m, off_n]).to(tl.float32)
        c_desc.store([off_m, off_n], out.to(dtype))


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 operands follow PyTorch: tf32 tensor cores only when
    # torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision allow them.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _gemm_config(
    M: int, N: int, K: int, dtype: torch.dtype, dual: bool, tma: bool, extra_tiles: bool
) -> dict:
    """Launch configuration by shape class (the one place it is chosen), from the H200 sweep
    in benchmarks/results/*-tune.json (Gemma-2B shapes, bf16).

    Interpreter: moderate tiles (numpy does the work; fewer programs run faster).
    M <= 64 (decode): weight streaming; one row tile holds every token so each weight
    tile is read once; narrow outputs (fewer tiles than SMs) split K (_split_k).
    TMA (Hopper/Blackwell, 16-bit, M > 64): 128x256x64 tiles, 8 warps, 3 stages (4
    overflow shared memory); dual: a 128x(2x128) accumulator. ``extra_tiles`` (the
    backward's A_GRAD_ACT prologue reads Z, ADD_C reads C, a single GEMM stores its
    pre-activation): 128x128 tiles, chosen to fit 3 stages in 227 KB, not swept.
    Portable: 128x128x64 tiles, 4 stages (single) / two 128x128 accumulators, 3 stages
    (dual). fp32 operands halve BLOCK_K to fit shared memory.
    """
    if INTERPRETED:
        return {
            "BLOCK_M": 32,
            "BLOCK_N": 64,
            "BLOCK_K": 32,
            "GROUP_M": 4,
            "num_warps": 4,
            "num_stages": 1,
        }
    wide = dtype != torch.float32
    if M <= 16:
        block_n, block_k, warps = (128, 128, 8) if dual else (64, 128, 4)
        return {
            "BLOCK_M": 16,
            "BLOCK_N": block_n,
            "BLOCK_K": block_k if wide else block_k // 2,
            "GROUP_M": 1,
            "num_warps": warps,
            "num_stages": 4 if wide else 3,
        }
    if M <= 64:  # one row tile covers all tokens: each weight tile is read once
        return {
            "BLOCK_M": 32 if M <= 32 else 64,
            "BLOCK_N": 32 if dual and N <= 4096 else 64,
            "BLOCK_K": 128 if wide else 64,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4 if wide else 3,
        }
    if tma and extra_tiles:  # a Z tile per stage or a C tile to add: 128x128 fits
        return {
            "BLOCK_M": 128,
            "BLOCK_N": 128,
            "BLOCK_K": 64,
            "GROUP_M": 8,
            "num_warps": 4,
            "num_stages": 3,
        }
    if tma:  # 16-bit operands only
        return {
            "BLOCK_M": 128,
            "BLOCK_N": 128 if dual else 256,
            "BLOCK_K": 64,
            "GROUP_M": 16 if dual else 8,
            "num_warps": 8,
            "num_stages": 3,
        }
    return {
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 64 if wide else 32,
        "GROUP_M": 8,
        "num_warps": 8 if dual else 4,
        "num_stages": 3 if dual else 4,
    }


# Split-K: each program sums at least this many K-tiles (shorter loops barely pipeline).
_MIN_K_TILES_PER_SPLIT = 4
_MAX_SPLIT_K = 8


def _split_k(tiles: int, k_tiles: int, programs: int) -> int:
    """Programs per output tile for a decode GEMM: doubled while the grid stays within one
    program per SM. Gemma-2B's down projection, 32 tiles of 64 columns, split 4: 21-23 us
    at 1 to 16 tokens against 29-31 unsplit, 25 against 28 (split 2, 32-column tiles) at 64
    (H200, CUDA-graph replay; cuBLAS 20-23, also split-K; benchmarks/NOTES.md)."""
    split = 1
    while (
        split < _MAX_SPLIT_K
        and 2 * split * tiles <= programs
        and k_tiles >= 2 * split * _MIN_K_TILES_PER_SPLIT
    ):
        split *= 2
    return split


# Split-K tile counters per (device, stream), zero between launches: the last program of
# each tile resets its own. Launches on one stream run in order, so they share them.
_SPLIT_K_COUNTERS: dict[tuple, torch.Tensor] = {}


def _split_k_counters(device: torch.device) -> torch.Tensor:
    """Zeroed counters for a split launch, one per SM (a split launch has fewer tiles)."""
    size = _num_programs(device)
    if device.type != "cuda":
        key = (device, 0)
    elif torch.cuda.is_current_stream_capturing():
        # A graph's own (a memset node): it may replay on any stream, beside other work
        # of the capture stream, and counters made during a capture are zeroed only by
        # that graph's replays.
        return torch.zeros(size, dtype=torch.int32, device=device)
    else:
        key = (device, driver.active.get_current_stream(device.index))
    counters = _SPLIT_K_COUNTERS.get(key)
    if counters is None:
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        _SPLIT_K_COUNTERS[key] = counters
    return counters


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """Whether the TMA kernel runs here: data-center Hopper and Blackwell GPUs (compute
    capability 9.x, 10.x: the 227 KB of shared memory its tiles assume), and the
    interpreter (so that CPU tests cover that path too)."""
    if INTERPRETED:
        return device.type == "cpu"
    return (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device)[0] in (9, 10)
    )


def tma_applies(M: int, a: torch.Tensor) -> bool:
    """Whether a GEMM with M rows of 16-bit ``a`` takes the TMA kernel (when its operands
    are aligned). Decode shapes (M <= 64: weight streaming) and fp32 (not a performance
    target) take the portable kernel."""
    return M > 64 and a.dtype in (torch.float16, torch.bfloat16) and _has_tma(a.device)


# Launch flags -> the pipeline depth that fitted in shared memory, after a launch had to
# retry with fewer stages (a GPU with less shared memory, a variant the table misjudges).
_STAGES_THAT_FIT: dict[tuple, int] = {}
# Launch key -> (compiled kernel, the constexprs' values in parameter order).
_COMPILED: dict[tuple, tuple] = {}


def _launch_hooks_set() -> bool:
    """Whether a profiler (e.g. proton) hooks Triton's launches: JITFunction.run calls them."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _launch(
    kernel, grid: int, descs: tuple, ptrs: tuple, ints: tuple, flags: dict
) -> None:
    """``kernel[(grid,)](*descs, *ptrs, *ints, **flags)``, the kernel's parameters being
    in that order: TMA descriptors, pointers (None where unused), ints (None where
    unused), then constexprs.

    JITFunction.run binds and specialises every argument and hashes the result on each
    call: 28 us of the H200 host's time per launch against 12 us for the compiled
    launcher alone. Triton's specialisation is a function of the constexprs and options,
    the ints' values (== 1, % 16, int32 range), each tensor's dtype and 16-byte alignment
    and each descriptor's dtype, shape, strides and block. With those equal and every
    pointer aligned, JITFunction.run would pick the same compiled kernel: it is then
    launched directly. The first launch of a key (or any launch with a misaligned
    pointer, under the interpreter or a launch hook) goes through JITFunction.run, with
    the table's num_stages or the most that compile within shared memory.
    """
    flags_key = tuple(flags.values())
    direct = isinstance(kernel, JITFunction) and not _launch_hooks_set()
    key = None
    if direct and all(p is None or p.data_ptr() % 16 == 0 for p in ptrs):
        key = (
            id(kernel),  # a JITFunction hashes its source's hash under a lock
            driver.active.get_current_device(),
            flags_key,
            ints,
            tuple(None if p is None else p.dtype for p in ptrs),
            tuple(
                None
                if d is None
                else (d.base.dtype, *d.shape, *d.strides, *d.block_shape, d.padding)
                for d in descs
            ),
        )
        compiled = _COMPILED.get(key)
        if compiled is not None:
            binary, constexprs = compiled
            device = key[1]
            stream = driver.active.get_current_stream(device)
            binary.run(
                grid, 1, 1, stream, binary.function, binary.packed_metadata, None, None,
                None, *descs, *ptrs, *ints, *constexprs,
            )  # fmt: skip
            return
    stages = _STAGES_THAT_FIT.get(flags_key, flags["num_stages"])
    while True:
        try:
            binary = kernel[(grid,)](
                *descs, *ptrs, *ints, **{**flags, "num_stages": stages}
            )
        except triton.runtime.errors.OutOfResources:
            if stages == 1:
                raise
            stages -= 1
            _STAGES_THAT_FIT[flags_key] = stages
            continue
        break
    if key is not None:
        params = [p.name for p in kernel.params if p.is_constexpr]
        _COMPILED[key] = (binary, tuple(flags[name] for name in params))


def tma_fills_gpu(M: int, N: int, K: int, a: torch.Tensor) -> bool:
    """Whether a single TMA GEMM with M x N outputs has a tile for every program of its
    persistent grid (one per SM). With fewer, SMs idle, as the kernel has no split-K:
    Gemma-2B's down projection at 512 tokens is 32 tiles for 132 SMs, and the MLP ran at
    0.52 of its roofline there, eager at 0.68 (benchmarks/results/*-report.json)."""
    cfg = _gemm_config(M, N, K, a.dtype, dual=False, tma=True, extra_tiles=False)
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    return tiles >= _num_programs(a.device)


def dual_gemm_is_fast(x: torch.Tensor) -> bool:
    """Whether the GeGLU dual GEMM beats two cuBLAS projections + the fused activation for
    activations ``x``: 16-bit operands where the TMA kernel runs (H200 measurements in
    benchmarks/results/*-compare.json; the portable two-dot kernel loses at 8192 tokens)."""
    return x.dtype in (torch.float16, torch.bfloat16) and _has_tma(x.device)


@functools.cache
def _num_programs(device: torch.device) -> int:
    """Persistent-grid width: one program per SM (a few under the interpreter)."""
    if INTERPRETED:
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


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


def _stacked_weights(b1, b2, block_n, block_k):
    """One [2, N, K] descriptor over two [N, K] weights wherever they lie: its outer stride
    is the distance between them (TMA addresses any 16-byte-aligned stride), so the gate and
    up tiles arrive as one box. Returns (descriptor, up_first) or None."""
    lo, hi, up_first = (
        (b1, b2, False) if b2.data_ptr() > b1.data_ptr() else (b2, b1, True)
    )
    gap = hi.data_ptr() - lo.data_ptr()
    operand = _tma_operand(lo)
    if (
        operand is None
        or operand[1]
        or lo.stride() != hi.stride()
        or gap == 0
        or gap % 16
    ):
        return None
    (n, k), es = lo.shape, lo.element_size()
    desc = TensorDescriptor(
        lo, [2, n, k], [gap // es, lo.stride(0), 1], [2, block_n, block_k]
    )
    return desc, up_first


def _tma_descriptors(a, b1, b2, z, c, block_m, block_n, block_k):
    """(descriptors for A, B, Z (None without Z), C; A_T, B_T, UP_FIRST) for the TMA kernel,
    or None when an operand is not TMA-compatible, A and Z disagree on orientation, or the
    dual GEMM's weights cannot share one descriptor."""
    ops = [_tma_operand(t) for t in (a, b1, c)]
    z_op = None if z is None else _tma_operand(z)
    if None in ops or (z is not None and (z_op is None or z_op[1] != ops[0][1])):
        return None
    (a_v, a_t), (b_v, b_t), (c_v, c_t) = ops
    if c_t:
        return None
    a_block = [block_k, block_m] if a_t else [block_m, block_k]
    up_first = False
    if b2 is not None:
        stacked = _stacked_weights(b1, b2, block_n, block_k)
        if stacked is None:
            return None
        b_desc, up_first = stacked
    else:
        b_desc = TensorDescriptor.from_tensor(
            b_v, [block_k, block_n] if b_t else [block_n, block_k]
        )
    a_desc = TensorDescriptor.from_tensor(a_v, a_block)
    z_desc = None if z is None else TensorDescriptor.from_tensor(z_op[0], a_block)
    c_desc = TensorDescriptor.from_tensor(c_v, [block_m, block_n])
    return (a_desc, b_desc, z_desc, c_desc), a_t, b_t, up_first


def gemm(
    a: torch.Tensor,  # [M, K]
    b1: torch.Tensor,  # [N, K]
    c: torch.Tensor,  # [M, N], written (or added to, with add_c)
    *,
    b2: torch.Tensor | None = None,  # [N, K]: dual GEMM with a GeGLU epilogue
    bias1: torch.Tensor | None = None,  # [N]
    bias2: torch.Tensor | None = None,  # [N]
    activation: str | None = None,  # None, "gelu", "gelu_tanh"
    preact1: torch.Tensor
    | None = None,  # [M, N] contiguous: store pre-activations here
    preact2: torch.Tensor | None = None,
    grad_act: str | None = None,  # prologue A <- A * grad_act'(Z) ...
    grad_act_of: torch.Tensor | None = None,  # ... of Z [M, K]
    sum_a: torch.Tensor | None = None,  # [M] fp32: row sums of (the prologue's) A
    add_c: bool = False,
) -> None:
    M, K = a.shape
    N = b1.shape[0]
    if M == 0 or N == 0:
        if sum_a is not None:  # no output columns, but the row sums of A are still owed
            if grad_act is not None:
                approximate = "tanh" if grad_act == "gelu_tanh" else "none"
                a = torch.ops.aten.gelu_backward(
                    a, grad_act_of, approximate=approximate
                )
            sum_a.copy_(a.float().sum(1))
        return
    dual = b2 is not None
    z = grad_act_of if grad_act is not None else None
    tma = K > 0 and tma_applies(M, a)
    # Tiles beyond A, B and C in shared memory: Z (the A_GRAD_ACT prologue), C read back
    # (ADD_C), the pre-activation relayout (single GEMM with an activation, training).
    extra_tiles = z is not None or add_c or (preact1 is not None and not dual)
    cfg = _gemm_config(M, N, K, a.dtype, dual, tma, extra_tiles)
    descs = (
        _tma_descriptors(
            a, b1, b2, z, c, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        )
        if tma
        else None
    )
    flags = {
        "HAS_BIAS": bias1 is not None,
        "DUAL": dual,
        "ACTIVATION": ACTIVATIONS[activation],
        "STORE_PREACT": preact1 is not None,
        "A_GRAD_ACT": ACTIVATIONS[grad_act],
        "SUM_A": sum_a is not None,
        "ADD_C": add_c,
    }
    # Unused operands are None: Triton compiles them out, and the launch skips them.
    bias_strides = (
        None if bias1 is None else bias1.stride(0), None if bias2 is None else bias2.stride(0)
    )  # fmt: skip
    if descs is not None:
        (a_d, b_d, z_d, c_d), a_t, b_t, up_first = descs
        flags |= {"A_T": a_t, "B_T": b_t, "UP_FIRST": up_first}
        flags |= {"INPUT_PRECISION": _input_precision(a.dtype), **cfg}
        tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
        _launch(
            _gemm_tma_kernel, min(tiles, _num_programs(a.device)), (a_d, b_d, z_d, c_d),
            (bias1, bias2, preact1, preact2, sum_a), (M, N, K, *bias_strides), flags,
        )  # fmt: skip
        return
    if tma:  # Hopper, but an operand TMA cannot describe: the portable tiles
        cfg = _gemm_config(M, N, K, a.dtype, dual, False, extra_tiles)
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    split = 1
    if M <= 64 and sum_a is None:  # decode shapes; SUM_A's row sums are not split
        split = _split_k(tiles, cdiv(K, cfg["BLOCK_K"]), _num_programs(a.device))
    ws = counters = None
    if split > 1:
        accs = 2 if dual else 1
        ws_size = tiles * split * accs * cfg["BLOCK_M"] * cfg["BLOCK_N"]
        ws = torch.empty(ws_size, dtype=torch.float32, device=a.device)
        counters = _split_k_counters(a.device)
    flags |= {"SPLIT_K": split, "EVEN_K": K % cfg["BLOCK_K"] == 0}
    flags |= {"INPUT_PRECISION": _input_precision(a.dtype), **cfg}
    none2 = (None, None)
    ptrs = (a, b1, b2, bias1, bias2, c, preact1, preact2, z, sum_a, ws, counters)
    ints = (
        M, N, K, *a.stride(), *b1.stride(), *(none2 if b2 is None else b2.stride()),
        *c.stride(), *(none2 if z is None else z.stride()), *bias_strides,
    )  # fmt: skip
    _launch(_gemm_kernel, tiles * split, (), ptrs, ints, flags)
