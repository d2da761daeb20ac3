"""Drop-in ``forward`` replacements that ``kernels.kernelize`` swaps into models.

kernels' layer rules: no ``__init__``, no members but ``has_backward`` and
``can_torch_compile``; ``self`` is the original module, whose submodules are declared
here as annotations. Each forward has the signature of the forward it replaces.
"""

import torch
from torch import nn

from .ops import geglu, linear

# transformers' tanh-GeLU modules (ACT2FN "gelu_pytorch_tanh", "gelu_python_tanh",
# "gelu_new", "gelu_fast") all compute 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
_TANH_GELU_CLASSES = (
    "GELUTanh",
    "PytorchGELUTanh",
    "NewGELUActivation",
    "FastGELUActivation",
)
# ACT2FN "gelu" and "gelu_python": 0.5 x (1 + erf(x / sqrt(2))).
_EXACT_GELU_CLASSES = ("GELUActivation",)


def gelu_approximation(act_fn: nn.Module) -> str:
    """The ``approximate`` argument that reproduces ``act_fn`` exactly, or a ValueError."""
    name = type(act_fn).__name__
    if name in _TANH_GELU_CLASSES:
        return "tanh"
    if name in _EXACT_GELU_CLASSES:
        return "none"
    if isinstance(act_fn, nn.GELU):
        return act_fn.approximate
    raise ValueError(
        f"fused-geglu computes GeLU (exact or tanh) only; the module's activation "
        f"{name} ({act_fn!r}) is not one, so this layer must not replace it "
        f"(check config.hidden_activation / hidden_act)"
    )


class GeGLUMLP(nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Gemma, Gemma2, Gemma3 and any MLP
    with ``gate_proj``/``up_proj``/``down_proj`` and a GeLU-family ``act_fn``."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: nn.Module

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        approximate = gelu_approximation(self.act_fn)
        # The projections' own forwards (cuBLAS, or whatever wraps them: LoRA, quantised
        # linears) and our fused activation: on the H200 this beats geglu_mlp's dual GEMM
        # today (benchmarks/results/*-compare.json), so the layer takes it.
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x), approximate))


class Linear(nn.Module):
    """``nn.Linear``: ``input @ weight.T + bias`` with the bias in the GEMM epilogue."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)
