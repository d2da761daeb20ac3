"""`kernels benchmark .` workloads for the GeGLU activation: `gelu_and_mul` and
`gelu_tanh_and_mul` (kernels-community activation semantics) and `geglu`.

Each verify_ returns eager PyTorch's result, which the runner compares with self.out and
times as the reference. On a GPU: Gemma-2B's intermediate size (16384) in bfloat16. Without
one: tiny float32 shapes in the Triton interpreter, chosen here before triton is imported.
"""

import os

import torch
import torch.nn.functional as F

if not torch.accelerator.is_available():  # no accelerator: Triton only interprets
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.benchmark import Benchmark

# (tokens, d): gate and up are [tokens, d].
SHAPES = {
    "gpu": {"small": (16, 16384), "medium": (1024, 16384), "large": (8192, 16384)},
    "cpu": {"small": (4, 64), "medium": (16, 128), "large": (64, 256)},
}


class Workloads:
    """setup_/benchmark_/verify_ of the small, medium and large workloads, from the
    subclass's run() (sets self.out) and reference()."""

    seed = 0

    def make(self, workload: str) -> None:
        gpu = self.device != "cpu"
        tokens, d = SHAPES["gpu" if gpu else "cpu"][workload]
        dtype = torch.bfloat16 if gpu else torch.float32
        # |gelu(gate) * up| < 1, so one bf16 ulp stays under the runner's atol of 1e-2.
        self.gate = torch.rand(tokens, d, device=self.device, dtype=dtype) * 6 - 3
        self.up = torch.rand(tokens, d, device=self.device, dtype=dtype) * 0.6 - 0.3
        self.x = torch.cat([self.gate, self.up], dim=-1)  # [tokens, 2d] for *_and_mul
        self.out = torch.empty_like(self.gate)

    def setup_small(self):
        self.make("small")

    def benchmark_small(self):
        self.run()

    def verify_small(self):
        return self.reference()

    def setup_medium(self):
        self.make("medium")

    def benchmark_medium(self):
        self.run()

    def verify_medium(self):
        return self.reference()

    def setup_large(self):
        self.make("large")

    def benchmark_large(self):
        self.run()

    def verify_large(self):
        return self.reference()


class GeluAndMulBenchmark(Workloads, Benchmark):
    def run(self):
        self.kernel.gelu_and_mul(self.out, self.x)

    def reference(self):
        return F.gelu(self.gate) * self.up


class GeluTanhAndMulBenchmark(Workloads, Benchmark):
    def run(self):
        self.kernel.gelu_tanh_and_mul(self.out, self.x)

    def reference(self):
        return F.gelu(self.gate, approximate="tanh") * self.up


class GeGLUBenchmark(Workloads, Benchmark):
    """`geglu` on separate gate and up tensors, as layers.GeGLUMLP calls it."""

    def run(self):
        self.out = self.kernel.geglu(self.gate, self.up)

    def reference(self):
        return F.gelu(self.gate, approximate="tanh") * self.up
