"""`kernels benchmark .` workloads for `linear`: `x @ weight.T + bias` with the bias (and
optionally a GeLU) in the GEMM epilogue.

Each verify_ returns eager PyTorch's result (cuBLAS `F.linear` on a GPU), which the runner
compares with self.out and times as the reference. On a GPU: Gemma-2B projection shapes in
bfloat16. Without one: tiny float32 shapes in the Triton interpreter (bf16 `tl.dot` is not
supported there), chosen (bench_lib) before triton is imported.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by file path
from bench_lib import Workloads  # also picks the interpreter without a GPU
from kernels.benchmark import Benchmark

# (M tokens, N out features, K in features)
SHAPES = {
    "gpu": {
        "small": (16, 16384, 2048),
        "medium": (4096, 4096, 4096),
        "large": (8192, 16384, 2048),
    },
    "cpu": {"small": (4, 48, 32), "medium": (16, 64, 64), "large": (64, 160, 64)},
}


class LinearWorkloads(Workloads):
    SHAPES = SHAPES

    def make(self, m: int, n: int, k: int, dtype: torch.dtype) -> None:
        # Outputs of std ~0.13 stay under 1, so a bf16 ulp is below the runner's atol (1e-2).
        self.x = torch.randn(m, k, device=self.device, dtype=dtype)
        self.weight = torch.randn(n, k, device=self.device, dtype=dtype) * (
            0.125 / k**0.5
        )
        self.bias = torch.randn(n, device=self.device, dtype=dtype) * 0.05


class LinearBiasBenchmark(LinearWorkloads, Benchmark):
    def run(self):
        self.out = self.kernel.linear(self.x, self.weight, self.bias)

    def reference(self):
        return F.linear(self.x, self.weight, self.bias)


class LinearBiasGeluTanhBenchmark(LinearWorkloads, Benchmark):
    """Bias and tanh GeLU both in the epilogue; eager runs the GeLU as a second kernel."""

    def run(self):
        self.out = self.kernel.linear(self.x, self.weight, self.bias, "gelu_tanh")

    def reference(self):
        return F.gelu(F.linear(self.x, self.weight, self.bias), approximate="tanh")
