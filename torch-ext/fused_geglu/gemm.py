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
"""

import torch
import triton
import triton.language as tl

from .activation import INTERPRETED, geglu_tile, gelu, gelu_grad

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
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    dtype = c_ptr.dtype.element_ty
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
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

    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
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
            z = tl.load(z_ptrs, mask=a_mask, other=0.0)
            # round(dY * act'(Z)), as eager's gelu_backward output, before the product.
            a = (a.to(tl.float32) * gelu_grad(z.to(tl.float32), A_GRAD_ACT == 2)).to(
                a.dtype
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

    if SUM_A and pid_n == 0:
        tl.store(sum_a_ptr + offs_m, row_sum, mask=mask_m)
    if HAS_BIAS:
        bias1 = tl.load(bias1_ptr + offs_n * stride_bias1, mask=mask_n)
        acc1 += bias1.to(tl.float32)[None, :]
        if DUAL:
            bias2 = tl.load(bias2_ptr + offs_n * stride_bias2, mask=mask_n)
            acc2 += bias2.to(tl.float32)[None, :]

    mask = mask_m[:, None] & mask_n[None, :]
    c_offs = offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    pre_offs = offs_m[:, None] * N + offs_n[None, :]
    if DUAL:
        # eager: gate = round(x Wg^T + bg), up = round(x Wu^T + bu), then geglu's rounding.
        gate = acc1.to(dtype)
        up = acc2.to(dtype)
        if STORE_PREACT:
            tl.store(pre1_ptr + pre_offs, gate, mask=mask)
            tl.store(pre2_ptr + pre_offs, up, mask=mask)
        out = geglu_tile(gate.to(tl.float32), up.to(tl.float32), dtype, ACTIVATION == 2)
    elif ACTIVATION != 0:
        preact = acc1.to(dtype)
        if STORE_PREACT:
            tl.store(pre1_ptr + pre_offs, preact, mask=mask)
        out = gelu(preact.to(tl.float32), ACTIVATION == 2).to(dtype)
    else:
        out = acc1
    if ADD_C:
        out = out.to(tl.float32) + tl.load(c_ptr + c_offs, mask=mask).to(tl.float32)
    tl.store(c_ptr + c_offs, out.to(dtype), mask=mask)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 operands follow PyTorch: tf32 tensor cores only when
    # torch.backends.cuda.matmul.allow_tf32 / set_float32_matmul_precision allow them.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _gemm_config(M: int, N: int, K: int, dtype: torch.dtype, dual: bool) -> dict:
    """Launch configuration by shape class (the one place it is chosen), from the H200 sweep
    in benchmarks/results/*-tune.json (Gemma-2B shapes, bf16).

    Interpreter: moderate tiles (numpy does the work; fewer programs run faster).
    M <= 64 (decode): weight streaming; one row tile holds every token so each weight
    tile is read once; narrow N tiles for narrow outputs so that there are more programs
    than SMs, long K tiles to keep weight loads in flight.
    Otherwise 128x128x64 tiles, 4 stages (single) / two 128x128 accumulators, 3 stages
    (dual); fp32 operands halve BLOCK_K to fit shared memory.
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
        if dual:
            block_n, block_k, warps = 128, 128, 8
        elif N <= 4096:
            block_n, block_k, warps = 16, 256, 4
        else:
            block_n, block_k, warps = 64, 128, 4
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
            "BLOCK_N": 32 if N <= 4096 else 64,
            "BLOCK_K": 128 if wide else 64,
            "GROUP_M": 1,
            "num_warps": 4,
            "num_stages": 4 if wide else 3,
        }
    return {
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 64 if wide else 32,
        "GROUP_M": 8,
        "num_warps": 8 if dual else 4,
        "num_stages": 3 if dual else 4,
    }


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
    cfg = _gemm_config(M, N, K, a.dtype, dual)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    b2_ = b2 if dual else b1
    z = grad_act_of if grad_act is not None else a
    _gemm_kernel[grid](
        a, b1, b2_, bias1 if bias1 is not None else c, bias2 if bias2 is not None else c, c,
        preact1 if preact1 is not None else c, preact2 if preact2 is not None else c,
        z, sum_a if sum_a is not None else c,
        M, N, K, *a.stride(), *b1.stride(), *b2_.stride(), *c.stride(), *z.stride(),
        bias1.stride(0) if bias1 is not None else 0, bias2.stride(0) if bias2 is not None else 0,
        HAS_BIAS=bias1 is not None,
        DUAL=dual,
        ACTIVATION=ACTIVATIONS[activation],
        STORE_PREACT=preact1 is not None,
        A_GRAD_ACT=ACTIVATIONS[grad_act],
        SUM_A=sum_a is not None,
        ADD_C=add_c,
        EVEN_K=K % block_k == 0,
        INPUT_PRECISION=_input_precision(a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
