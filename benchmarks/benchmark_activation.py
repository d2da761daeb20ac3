"""`kernels benchmark .` workloads for the GeGLU activation: `gelu_and_mul` and
`gelu_tanh_and_mul` (kernels-community activation semantics) and `geglu`.

Each verify_ returns eager PyTorch's result, which the runner compares with self.out and
times as the reference. On a GPU: Gemma-2B's intermediate size (16384) in bfloat16. Without
one: tiny float32 shapes in the Triton interpreter, chosen (bench_lib) before triton is imported.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by file path
from bench_lib import Workloads  # also picks the interpreter without a GPU
from kernels.benchmark import Benchmark

# (tokens, d): gate and up are [tokens, d].
SHAPES = {
    "gpu": {"small": (16, 16384), "medium": (1024, 16384), "large": (8192, 16384)},
    "cpu": {"small": (4, 64), "medium": (16, 128), "large": (64, 256)},
}


class ActivationWorkloads(Workloads):
    SHAPES = SHAPES

    def make(self, tokens: int, d: int, dtype: torch.dtype) -> None:
        # |gelu(gate) * up| < 1, so one bf16 ulp stays under the runner's atol of 1e-2.
        self.gate = torch.rand(tokens, d, device=self.device, dtype=dtype) * 6 - 3
        self.up = torch.rand(tokens, d, device=self.device, dtype=dtype) * 0.6 - 0.3
        self.x = torch.cat([self.gate, self.up], dim=-1)  # [tokens, 2d] for *_and_mul
        self.out = torch.empty_like(self.gate)


class GeluAndMulBenchmark(ActivationWorkloads, Benchmark):
    def run(self):
        self.kernel.gelu_and_mul(self.out, self.x)

    def reference(self):
        return F.gelu(self.gate) * self.up


class GeluTanhAndMulBenchmark(ActivationWorkloads, Benchmark):
    def run(self):
        self.kernel.gelu_tanh_and_mul(self.out, self.x)

    def reference(self):
        return F.gelu(self.gate, approximate="tanh") * self.up


class GeGLUBenchmark(ActivationWorkloads, Benchmark):
    """`geglu` on separate gate and up tensors, as layers.GeGLUMLP calls it."""

    def run(self):
        self.out = self.kernel.geglu(self.gate, self.up)

    def reference(self):
        return F.gelu(self.gate, approximate="tanh") * self.up
