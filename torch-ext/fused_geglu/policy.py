"""The route policy, used by ``geglu_mlp`` and by every layer: which kernel computes each
part of a GeGLU MLP, and when a layer must leave a module to its own forward.

Measured on the H200, the sizes in the tuning tables on the H100 too (docs/decisions/0002,
0003, 0006, 0009):
- gate/up: the dual GEMM (one kernel) where the TMA kernel runs, for 16-bit operands: in
  inference gate and up never reach memory; in training it stores them for backward,
  which writes their gradients over them and runs cuBLAS (autograd.GeGLULinear).
  Elsewhere the projections (cuBLAS) and the fused activation.
- down: after the dual GEMM, our GEMM where its tiles fill the GPU (the MLP is then two
  kernels); otherwise cuBLAS, which splits K. Under torch.compile always cuBLAS: a branch
  on the token count would recompile.
- linear (``linear``, ``layers.Linear``, and no activation): in training cuBLAS, whose
  backward was faster on every measured shape; in inference our GEMM, but cuBLAS at the
  tuning table's ``linear_cublas_rows`` (decode sizes where it measured faster; not under
  torch.compile, where a branch on the token count would recompile).
- the activation in training: ours, except below the tuning table's
  ``training_kernel_min_elements`` outputs where the module's GeLU is one PyTorch op:
  there eager's ops (the module's own forward) cost less host time than our autograd
  Function saves GPU time.
- decode (at most ONE_LAUNCH_MAX_TOKENS tokens, inference, where the dual GEMM runs), eager
  calls: the whole MLP in one launch (one_launch.py), for less host time than the two
  kernels at somewhat more GPU time. In a CUDA graph or under torch.compile the host time
  is not spent per call, so the two kernels run there, except in captures of up to the
  table's ``one_launch_graph_max_tokens`` tokens (16-bit weights), where the one launch
  measured faster on that GPU; and with ``torch.use_deterministic_algorithms(True)``,
  since the one launch's fp32 sums are atomic.
- FP8 (transformers' ``FP8Linear`` projections): fp8/mlp.py.

A layer runs our kernels only where they reproduce the module's forward (reproduction.py,
module_route.py). Anywhere else it runs the module's own forward and warns once, naming the
reason.
"""

import math

import torch
import torch.nn.functional as F

from . import autograd
from .checks import is_dtensor
from .gemm import NO_ACT, tma_applies, tma_tiles_fill_gpu
from .launch import has_tma
from .one_launch import one_launch_fits
from .tuning import table


def eager_activation_pays(outputs: int, *tensors) -> bool:
    """Whether a one-op GeLU's activation of ``outputs`` elements over ``tensors`` runs
    eager's ops (the table's ``training_kernel_min_elements``): a small call that
    autograd records."""
    least = table(tensors[0].device).training_kernel_min_elements
    return outputs < least and autograd.needs_grad(*tensors)


def fuse_projections(x: torch.Tensor) -> bool:
    """Whether the dual GEMM computes gelu(gate) * up for ``x`` (see the module docstring);
    under autocast the projections' own forwards choose the dtype."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return False
    device = x.device
    return (
        has_tma(device)
        and not is_dtensor(x)
        and not torch.is_autocast_enabled(device.type)
    )


def linear(x, weight, bias, activation: int) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` by the policy (arguments already checked): our GEMM with
    its epilogue, except for a call without an activation where autograd records it or
    at the table's ``linear_cublas_rows``. There cuBLAS (``F.linear``) runs: its forward
    and backward were the faster on every measured training shape
    (docs/decisions/0006-training-routes.md), its forward at those decode rows, and
    without an activation there is no epilogue to fuse."""
    if activation == NO_ACT and (
        autograd.needs_grad(x, weight, bias) or cublas_rows(x)
    ):
        return F.linear(x, weight, bias)
    return autograd.linear(x, weight, bias, activation)


def cublas_rows(x: torch.Tensor) -> bool:
    """Whether an eager inference call's rows are the table's ``linear_cublas_rows``."""
    if torch.compiler.is_compiling():
        return False
    fewest, most = table(x.device).linear_cublas_rows
    return fewest <= math.prod(x.shape[:-1]) <= most


def one_launch_runs(x: torch.Tensor, fp8: bool) -> bool:
    """Whether one launch computes the MLP of ``x`` where the dual GEMM (16-bit) or the FP8
    kernels would run (see the module docstring): not compiled, few tokens, atomics
    allowed; in a CUDA graph capture only up to the table's
    ``one_launch_graph_max_tokens`` rows of 16-bit weights."""
    if torch.compiler.is_compiling():
        return False
    graph_max_tokens = 0 if fp8 else table(x.device).one_launch_graph_max_tokens
    return one_launch_fits(x, graph_max_tokens)


def down_projection(h, weight, bias, fused: bool) -> torch.Tensor:
    """``h @ weight.T + bias`` by the kernel the policy picks (h is 2-D or more)."""
    if fused and not torch.compiler.is_compiling() and h.shape[-1] == weight.shape[1]:
        m = math.prod(h.shape[:-1])
        n, k = weight.shape
        if tma_applies(m, h.dtype, h.device) and tma_tiles_fill_gpu(
            m, n, k, h.dtype, h.device
        ):
            return linear(h, weight, bias, NO_ACT)  # a trainable down weight: cuBLAS
    return F.linear(h, weight, bias)


def geglu_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate):
    """``down(gelu(gate(x)) * up(x))`` by the policy's route (arguments already checked)."""
    training = autograd.needs_grad(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    outputs = math.prod(x.shape[:-1]) * w_gate.shape[0]
    if training and outputs < table(x.device).training_kernel_min_elements:
        h = autograd.geglu_formula(
            F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), approximate
        )
        return F.linear(h, w_down, b_down)
    fused = fuse_projections(x)
    if fused and not training and one_launch_runs(x, fp8=False):
        return autograd.one_launch_mlp(
            x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate
        )
    if fused:
        h = autograd.geglu_linear(x, w_gate, w_up, b_gate, b_up, approximate)
    else:
        gate, up = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
        h = autograd.geglu(gate, up, approximate, owned=True)
    return down_projection(h, w_down, b_down, fused)
