"""transformers' ``FP8Linear`` projections in a GeGLU MLP: their operands in the form the FP8
kernels reproduce, and the layers' FP8 path."""

import torch
from torch import nn

from .. import autograd, library
from ..checks import PLAIN_TENSORS, kernels_run_on, transforms_active
from ..gemm import gelu_code
from ..one_launch import OneLaunchMLP, one_launch_fits
from ..policy import one_launch_runs
from ..reproduction import Family, hooked, is_identity_dropout
from . import mlp
from .checks import FP8_ACT_DTYPES, FP8_SCALE_DTYPES, FP8_WEIGHT_DTYPE, fp8_scale_shape


def fp8_scale(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as the kernels read them: fp32 (e8m0 decoded: powers of two, exact)."""
    return scale if scale.dtype == torch.float32 else scale.float()


def geglu_mlp_fp8(x, weights: tuple, scales: tuple, biases: tuple, approximate: str):
    """The FP8 MLP by the policy's route (arguments checked; ``scales`` fp32). The gate's and
    the up's scales are read with one stride: made contiguous where theirs differ."""
    s_gate, s_up, s_down = scales
    if s_gate.stride() != s_up.stride():
        s_gate, s_up = s_gate.contiguous(), s_up.contiguous()
    (w_gate, w_up, w_down), (b_gate, b_up, b_down) = weights, biases
    return mlp.geglu_mlp_fp8(
        x, w_gate, s_gate, w_up, s_up, w_down, s_down, b_gate, b_up, b_down,
        approximate, one_launch_runs(x, fp8=True),
    )  # fmt: skip


def fp8_linear_operands(m: nn.Module) -> tuple | None:
    """``(weight, block scales, bias)`` of transformers' ``FP8Linear`` (the class itself)
    in the form the FP8 kernels reproduce: a 2-D e4m3 weight, 128 x 128 block scales
    (fp32 or e8m0), dynamic activation scales, no hooks or instance-level forward; else
    None (per-tensor or static scales, other blocks: its own forward)."""
    cls = type(m)
    if (
        cls.__name__ != "FP8Linear"
        or not cls.__module__.startswith("transformers.")
        or hooked(m)
        or "forward" in m.__dict__
        or getattr(m, "activation_scheme", None) != "dynamic"
        or tuple(getattr(m, "block_size", None) or ()) != (128, 128)
    ):
        return None
    params = m._parameters
    weight, scale, bias = (
        params.get(n) for n in ("weight", "weight_scale_inv", "bias")
    )
    if (
        type(weight) not in PLAIN_TENSORS
        or weight.dtype != FP8_WEIGHT_DTYPE
        or weight.dim() != 2
        or type(scale) not in PLAIN_TENSORS
        or scale.dtype not in FP8_SCALE_DTYPES
        or tuple(scale.shape) != fp8_scale_shape(weight)
        or scale.device != weight.device
        or not (bias is None or (type(bias) in PLAIN_TENSORS and bias.device == weight.device))
    ):  # fmt: skip
        return None
    return weight, scale, bias


def fp8_route_operands(projections: tuple, down: nn.Module | None, family: Family):
    """The FP8 route's ((w_gate, w_up, w_down), fp32 scales, biases) where every projection
    is an FP8Linear the kernels take (a fused one split at a 128-row block boundary),
    else None."""
    if down is None:
        return None
    operands = tuple(fp8_linear_operands(p) for p in (*projections, down))
    if not all(operands):
        return None
    if len(projections) == 2:
        (w_gate, s_gate, b_gate), (w_up, s_up, b_up), (w_down, s_down, b_down) = (
            operands
        )
    else:
        (weight, scale, bias), (w_down, s_down, b_down) = operands
        if weight.shape[0] % 256:  # the halves must start on a scale block
            return None
        g = family.gate_half
        w, s = weight.chunk(2), scale.chunk(2)
        b = (None, None) if bias is None else bias.chunk(2)
        w_gate, w_up, s_gate, s_up, b_gate, b_up = (
            w[g],
            w[1 - g],
            s[g],
            s[1 - g],
            b[g],
            b[1 - g],
        )
    if (
        w_gate.shape != w_up.shape
        or w_down.shape[1] != w_gate.shape[0]
        or (b_gate is None) != (b_up is None)
    ):
        return None
    scales = tuple(fp8_scale(t).detach() for t in (s_gate, s_up, s_down))
    return (w_gate, w_up, w_down), scales, (b_gate, b_up, b_down)


def fp8_output(route, x: torch.Tensor, dropout: nn.Module | None):
    """``mlp_output`` for FP8Linear projections: the FP8 kernels, where they reproduce the
    module's forward: no gradient for x or a bias (FP8Linear's own forward serves
    training), x of the biases' 16-bit dtype, size and device, no autocast or torch.func
    transform, an identity dropout."""
    (w_gate, w_up, w_down), scales, biases = route.fp8
    compiling = torch.compiler.is_compiling()
    if (
        not (compiling or type(x) is torch.Tensor)
        or x.dtype not in FP8_ACT_DTYPES
        or x.dim() == 0
        or x.shape[-1] != w_gate.shape[1]
        or x.device != w_gate.device
        or not kernels_run_on(x.device)
        or autograd.needs_grad(x, *biases)  # FP8Linear's own forward records it
        or any(b is not None and b.dtype is not x.dtype for b in biases)
        or torch.is_autocast_enabled(x.device.type)
        or not (compiling or not transforms_active())
        or not (dropout is None or is_identity_dropout(dropout))
    ):
        return None
    if (
        not compiling
        and x.is_contiguous()
        and one_launch_fits(x)  # eager, outside a capture: the prepared launch
        and w_gate.numel()
        and w_down.shape[0]
        and scales[0].stride() == scales[1].stride()
        and not library.profiler_enabled()
    ):
        launch = route.fp8_launches.get(x.dtype)
        if launch is None:
            launch = route.fp8_launches[x.dtype] = OneLaunchMLP(
                w_gate, w_up, w_down, *biases, gelu_code(route.approximate), scales,
                x.dtype,
            )  # fmt: skip
        return launch(x)
    return geglu_mlp_fp8(x, (w_gate, w_up, w_down), scales, biases, route.approximate)
