"""`kernels benchmark .` workloads for the GeGLU MLP `down(gelu(gate(x)) * up(x))`: the
layer path (`layers.GeGLUMLP.forward` on transformers' GemmaMLP, what kernelize swaps in)
and `geglu_mlp` (both take the route of policy.py: in 16-bit inference on Hopper, the dual
GEMM and the down GEMM).

Each verify_ returns the eager MLP's result (transformers' GemmaMLP computation), which the
runner compares with self.out and times as the reference. On a GPU: Gemma-2B (hidden 2048,
intermediate 16384) in bfloat16. Without one: tiny float32 shapes in the Triton interpreter
(its cost grows with the shapes), chosen (bench_lib) before triton is imported.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by file path
from bench_lib import (  # also picks the interpreter without a GPU
    Workloads,
    eager_geglu_mlp,
)
from kernels.benchmark import Benchmark

# (tokens, hidden, intermediate)
SHAPES = {
    "gpu": {
        "small": (16, 2048, 16384),
        "medium": (512, 2048, 16384),
        "large": (8192, 2048, 16384),
    },
    "cpu": {"small": (4, 32, 64), "medium": (16, 64, 160), "large": (64, 64, 160)},
}


class MLPWorkloads(Workloads):
    """verify_ is the eager MLP for every subclass."""

    SHAPES = SHAPES

    def make(self, tokens: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
        self.x = torch.randn(tokens, hidden, device=self.device, dtype=dtype)
        # gate and up of std ~1; down scaled so outputs stay well under 1 (runner atol 1e-2).
        self.mlp = eager_geglu_mlp(hidden, inter).to(self.device, dtype)
        for name, n_in, scale in (
            ("gate_proj", hidden, 1.0),
            ("up_proj", hidden, 1.0),
            ("down_proj", inter, 0.125),
        ):
            proj = getattr(self.mlp, name).requires_grad_(False)
            proj.weight.normal_(0, scale / n_in**0.5)

    def reference(self):
        m = self.mlp
        return m.down_proj(m.act_fn(m.gate_proj(self.x)) * m.up_proj(self.x))


class GeGLUMLPLayerBenchmark(MLPWorkloads, Benchmark):
    """layers.GeGLUMLP.forward on transformers' GemmaMLP, as kernelize runs it (the
    route of policy.py)."""

    def run(self):
        self.out = self.kernel.layers.GeGLUMLP.forward(self.mlp, self.x)


class GeGLUMLPDualGemmBenchmark(MLPWorkloads, Benchmark):
    """geglu_mlp: the gate/up dual GEMM with the GeGLU epilogue, then the down GEMM."""

    def run(self):
        m = self.mlp
        self.out = self.kernel.geglu_mlp(
            self.x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
        )
