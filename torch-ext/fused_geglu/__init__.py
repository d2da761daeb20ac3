"""fused-geglu: Triton GeGLU kernels and drop-in layers for the Hugging Face kernels Hub."""

from . import layers
from .ops import geglu, gelu_and_mul, gelu_tanh_and_mul

__all__ = ["geglu", "gelu_and_mul", "gelu_tanh_and_mul", "layers"]
