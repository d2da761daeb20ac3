"""fused-geglu: Triton GeGLU kernels and drop-in layers for the Hugging Face kernels Hub."""

from . import layers
from .integration import kernelize_mlps
from .ops import (
    geglu,
    geglu_linear,
    geglu_mlp,
    geglu_mlp_fp8,
    gelu_and_mul,
    gelu_tanh_and_mul,
    linear,
)

__all__ = [
    "geglu",
    "geglu_linear",
    "geglu_mlp",
    "geglu_mlp_fp8",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "kernelize_mlps",
    "layers",
    "linear",
]
