"""The public functions: argument checks, then the op (autograd.py) or the route (policy.py).

Every function runs under ``torch.compile(fullgraph=True)`` without graph breaks (the
kernels are custom ops, library.py), is differentiable where it returns a new tensor,
and raises an error naming shapes, dtypes and devices for an input it cannot compute.
"""

import torch

from . import autograd, library, policy
from .checks import (
    LINEAR_ACTIVATIONS,
    check_activation,
    check_approximate,
    check_down_projection,
    check_geglu_linear,
    check_gelu_and_mul,
    check_linear_shapes,
    check_tensors,
    given,
    is_dtensor,
)
from .fp8 import modules as fp8_modules
from .fp8.checks import check_geglu_mlp_fp8


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh"
) -> torch.Tensor:
    """``gelu(gate, approximate) * up``, differentiable; ``approximate`` is "tanh" or "none".

    ``gate`` and ``up``: ``[..., N]`` of one shape, dtype and device; any strides.
    """
    check_approximate("geglu", approximate)
    check_tensors("geglu", dtensors=True, gate=gate, up=up)
    if gate.dim() == 0 or up.dim() == 0:
        raise ValueError(
            f"geglu: gate and up must have at least one dimension, got shapes "
            f"{tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.shape != up.shape:
        raise ValueError(
            f"geglu: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if is_dtensor(gate) or is_dtensor(up):
        library.register_dtensor_rules()
    return autograd.geglu(gate, up, approximate)


def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """kernels-community ``activation`` semantics: ``out = gelu(x[..., :d]) * x[..., d:]``
    with exact (erf) GeLU, written into ``out`` (``[..., d]``), which is returned. Not
    differentiable (an ``x`` that requires grad raises): use ``geglu`` for that."""
    check_gelu_and_mul("gelu_and_mul", out, x)
    library.gelu_and_mul(out, x, "none")
    return out


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """As ``gelu_and_mul`` with the tanh approximation of GeLU."""
    check_gelu_and_mul("gelu_tanh_and_mul", out, x)
    library.gelu_and_mul(out, x, "tanh")
    return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` in one kernel: bias and activation in the epilogue.
    Where autograd records a call without an activation, ``F.linear`` (cuBLAS) runs: its
    backward is the faster one there (policy.py).

    x: [..., K]; weight: [N, K] (``nn.Linear`` layout, any strides); bias: [N];
    activation: None, "gelu" (exact) or "gelu_tanh". Differentiable in all three.
    """
    check_activation("linear", activation)
    check_tensors("linear", x=x, weight=weight, **given(bias=bias))
    check_linear_shapes("linear", x, weight, bias)
    return policy.linear(x, weight, bias, LINEAR_ACTIVATIONS[activation])


def geglu_linear(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    approximate: str = "tanh",
) -> torch.Tensor:
    """``gelu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)`` in one dual-GEMM kernel: each x
    tile is loaded once for both products and gate/up never reach HBM unless autograd
    needs them. Weights are [I, H] in any strides, so the halves of one fused [2I, H]
    weight (ModernBERT ``Wi``, diffusers ``GEGLU.proj``) are passed as row slices, no copy.
    """
    check_geglu_linear("geglu_linear", x, w_gate, w_up, b_gate, b_up, approximate)
    return autograd.geglu_linear(x, w_gate, w_up, b_gate, b_up, approximate)


def geglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    approximate: str = "tanh",
) -> torch.Tensor:
    """``down(gelu(gate(x)) * up(x))`` by the route the layers take (policy.py): in inference
    on Hopper-class GPUs the GeGLU dual GEMM, then the down projection (our GEMM with its
    bias in the epilogue where its tiles fill the GPU: two kernels), and for eager calls
    of 16 tokens or fewer the whole MLP in one kernel; in training, or elsewhere, the
    projections (cuBLAS) and the fused GeGLU activation."""
    check_geglu_linear(
        "geglu_mlp", x, w_gate, w_up, b_gate, b_up, approximate,
        w_down=w_down, **given(b_down=b_down),
    )  # fmt: skip
    check_down_projection("geglu_mlp", w_gate, w_down, b_down)
    return policy.geglu_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate)


def geglu_mlp_fp8(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    gate_scale: torch.Tensor,
    w_up: torch.Tensor,
    up_scale: torch.Tensor,
    w_down: torch.Tensor,
    down_scale: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    approximate: str = "tanh",
) -> torch.Tensor:
    """``down(gelu(gate(x)) * up(x))`` with transformers' ``FineGrainedFP8Config``
    projections (``FP8Linear``, block 128, dynamic activations), in inference.

    Weights are ``torch.float8_e4m3fn`` ([I, H], [I, H], [N, I]) with block scales
    ``weight_scale_inv`` of [ceil(out/128), ceil(in/128)] in float32 or float8_e8m0fnu:
    ``weight * scale`` per 128 x 128 block. x ([..., H], bfloat16 or float16) is quantized
    per token and 128 columns (scale = amax / 448) and so is h = round(gelu(gate)) * up;
    each projection's output is in x's dtype, its bias added in the epilogue. In eager
    calls of up to 16 tokens the whole MLP is one kernel; beyond, and in CUDA graphs, the
    dual GEMM quantizing h in its epilogue and the down GEMM, after x's quantization
    beyond 32 tokens (up to 32 the dual GEMM quantizes x itself).
    Not differentiable: an x that requires grad raises.
    """
    check_approximate("geglu_mlp_fp8", approximate)
    weights = {"w_gate": w_gate, "w_up": w_up, "w_down": w_down}
    scales = {"gate_scale": gate_scale, "up_scale": up_scale, "down_scale": down_scale}
    biases = {"b_gate": b_gate, "b_up": b_up, "b_down": b_down}
    check_geglu_mlp_fp8("geglu_mlp_fp8", x, weights, scales, biases)
    return fp8_modules.geglu_mlp_fp8(
        x, (w_gate, w_up, w_down), tuple(fp8_modules.fp8_scale(s) for s in scales.values()),
        (b_gate, b_up, b_down), approximate,
    )  # fmt: skip
