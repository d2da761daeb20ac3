"""The FP8 MLP as a ``torch.library`` custom op (library.py's KernelOp): which FP8 kernels
compute it at each size, and the operands they hand each other (docs/decisions/0007,
0008). Inference only (in training an FP8Linear runs its own forward):
- eager calls of at most ONE_LAUNCH_MAX_TOKENS tokens: the whole MLP in one launch (in a
  CUDA graph the two kernels below take less GPU time);
- else the dual GEMM handing h to the down GEMM quantized, x quantized in the dual GEMM
  up to FP8_QUANT_A_ROWS tokens (two kernels), by a kernel of its own beyond (three);
  the down GEMM swapped and split where the TMA kernel's tiles would leave SMs idle
  (tuning.fp8_swap_ab), cuBLAS's block-scaled GEMM from the table's
  ``fp8_cublas_min_rows`` on Hopper (gemm.fp8_cublas_applies), the TMA kernel between;
- where cuBLAS's GEMM applies to all three projections, gate and up are its too, and one
  kernel forms and quantizes h between (faster than our dual GEMM there: Triton waits for
  each K block's MMA before scaling it).
"""

import math

import torch

from ..gemm import gelu_code, tma_applies
from ..launch import cdiv
from ..library import KernelOp, empty, rows_operand
from ..one_launch import one_launch_mlp
from ..tuning import FP8_QUANT_A_ROWS
from .gemm import (
    FP8_CUBLAS_ROWS,
    fp8_cublas_applies,
    gemm_fp8_cublas,
    later_split_k_counters,
    launch_gemm_fp8,
    launch_gemm_gated_fp8,
    quantize_fp8,
)
from .kernels import FP8_BLOCK


def _geglu_mlp_fp8(x, w_gate, gate_scale, w_up, up_scale, w_down, down_scale, b_gate,
                   b_up, b_down, approximate, one_launch):  # fmt: skip
    """The FP8 MLP (arguments checked by the caller, so its GEMMs launch unchecked; fp32
    block scales; gate_scale and up_scale of one stride): in one launch (``one_launch``:
    at most ONE_LAUNCH_MAX_TOKENS rows); all three products by cuBLAS
    where fp8_cublas_applies to each (prefill on Hopper: _geglu_mlp_fp8_cublas); or x
    quantized (inside the dual GEMM up to FP8_QUANT_A_ROWS rows), the dual GEMM handing h
    over quantized, and the down GEMM (cuBLAS's where fp8_cublas_applies: h's rows then
    padded to a multiple of FP8_CUBLAS_ROWS, the padding's products discarded)."""
    m, hidden, i = math.prod(x.shape[:-1]), x.shape[-1], w_gate.shape[0]
    n = w_down.shape[0]
    x2, act = rows_operand(x), gelu_code(approximate)
    if one_launch:
        out = empty(x, *x.shape[:-1], n)
        one_launch_mlp(
            x2, w_gate, w_up, w_down, out, act, bias_gate=b_gate, bias_up=b_up,
            bias_down=b_down, scales=(gate_scale, up_scale, down_scale),
        )  # fmt: skip
        return out
    fp8 = torch.float8_e4m3fn
    cublas = fp8_cublas_applies(m, w_down, down_scale, b_down, x.dtype)
    # cuBLAS's rows: padded to a multiple of FP8_CUBLAS_ROWS, the padding's products
    # (never written rows) discarded
    rows = cdiv(m, FP8_CUBLAS_ROWS) * FP8_CUBLAS_ROWS if cublas else m
    if cublas and all(
        fp8_cublas_applies(m, w, s, b, x.dtype)
        for w, s, b in ((w_gate, gate_scale, b_gate), (w_up, up_scale, b_up))
    ):
        return _geglu_mlp_fp8_cublas(
            x, x2, m, rows, w_gate, gate_scale, w_up, up_scale, w_down, down_scale, act
        )
    if m <= FP8_QUANT_A_ROWS:  # the dual GEMM quantizes x in its K loop
        x_q, x_scale = x2, None
    else:
        x_q = empty(x, m, hidden, dtype=fp8)
        x_scale = empty(x, cdiv(hidden, FP8_BLOCK), m, dtype=torch.float32)
        quantize_fp8(x2, x_q, x_scale)
    h = empty(x, rows, i, dtype=fp8)
    h_scale = empty(x, cdiv(i, FP8_BLOCK), rows, dtype=torch.float32)
    h_out, h_scale_out = (h[:m], h_scale[:, :m]) if rows > m else (h, h_scale)
    # In a CUDA graph, zeroed split-K counters for the down GEMM would be a memset node
    # of their own: the dual GEMM zeroes them, where it runs the portable kernel anyway.
    counters = None
    if (
        not cublas
        and not tma_applies(m, x.dtype, x.device)
        and x.is_cuda
        and torch.cuda.is_current_stream_capturing()
    ):
        counters = later_split_k_counters(x.device)
    launch_gemm_gated_fp8(
        x_q, x_scale, w_gate, gate_scale, w_up, up_scale, h_out, h_scale_out, act,
        x.dtype, bias_gate=b_gate, bias_up=b_up, clear=counters,
    )  # fmt: skip
    if cublas:
        out = gemm_fp8_cublas(h, h_scale, w_down, down_scale, x.dtype)
        return out[:m].view(*x.shape[:-1], n)
    out = empty(x, *x.shape[:-1], n)
    launch_gemm_fp8(h, h_scale, w_down, down_scale, out, bias=b_down, counters=counters)
    return out


def _geglu_mlp_fp8_cublas(x, x2, m, rows, w_gate, gate_scale, w_up, up_scale, w_down,
                          down_scale, act):  # fmt: skip
    """The FP8 MLP's three products by cuBLAS's block-scaled GEMM (prefill sizes on Hopper,
    fp8_cublas_applies for all three): x quantized, gate and up apart (rounded to x's
    dtype, as gemm_gated_fp8 rounds them), h = round(act(gate)) * up quantized in one
    kernel, the down product; over ``rows`` (m padded), the padding rows (never written)
    in their own rows of every product, discarded at the end."""
    fp8, f32 = torch.float8_e4m3fn, torch.float32
    hidden, i = x2.shape[-1], w_gate.shape[0]
    x_q = empty(x, rows, hidden, dtype=fp8)
    x_scale = empty(x, cdiv(hidden, FP8_BLOCK), rows, dtype=f32)
    quantize_fp8(x2, x_q[:m], x_scale[:, :m])
    gate = gemm_fp8_cublas(x_q, x_scale, w_gate, gate_scale, x.dtype)
    up = gemm_fp8_cublas(x_q, x_scale, w_up, up_scale, x.dtype)
    h = empty(x, rows, i, dtype=fp8)
    h_scale = empty(x, cdiv(i, FP8_BLOCK), rows, dtype=f32)
    quantize_fp8(gate[:m], h[:m], h_scale[:, :m], up=up[:m], activation=act)
    del gate, up  # 2 x rows x i in x's dtype: freed before the down product's output
    out = gemm_fp8_cublas(h, h_scale, w_down, down_scale, x.dtype)
    return out[:m].view(*x.shape[:-1], w_down.shape[0])


geglu_mlp_fp8 = KernelOp(
    "geglu_mlp_fp8",
    "(Tensor x, Tensor w_gate, Tensor gate_scale, Tensor w_up, Tensor up_scale,"
    " Tensor w_down, Tensor down_scale, Tensor? b_gate, Tensor? b_up, Tensor? b_down,"
    " str approximate, bool one_launch) -> Tensor",
    _geglu_mlp_fp8,
    lambda x, w_gate, gate_scale, w_up, up_scale, w_down, *rest: empty(
        x, *x.shape[:-1], w_down.shape[0]
    ),
)
