"""What the benchmarks and the profiling report share: the environment record, our kernel,
the timers (device, host, wall), the ceilings, the kernel lister, Liger, and one set of
peers per op (eager, torch.compile, Liger, ours) under one naming scheme.

Importing this module picks the Triton interpreter when there is no accelerator (Triton
reads TRITON_INTERPRET when it is first imported, which our kernel does). Scripts outside
benchmarks/ put this folder on sys.path first; the `kernels benchmark` runner loads
benchmark_*.py by file path, so they do too.
"""

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if not torch.accelerator.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# At this many tokens or fewer a call's GPU time is shorter than its host time: timed by
# CUDA-graph replay, so that launch gaps do not pose as kernel time.
GRAPH_TOKENS = 64


# --- environment ------------------------------------------------------------------------


def require_cuda(script: str) -> None:
    """Exit with status 2 and one line saying why, unless a CUDA GPU is visible."""
    if not HAS_GPU:
        print(f"{script} needs a CUDA GPU (none is visible here).", file=sys.stderr)
        sys.exit(2)


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def git_revision() -> str | None:
    """HEAD's short hash, ``-dirty`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def environment(ours=None) -> dict:
    """Where and with what a result was measured (JSON-ready)."""
    device = (
        torch.cuda.get_device_name()
        if HAS_GPU
        else f"CPU ({platform.machine()}), Triton interpreter"
    )
    env = {"date": datetime.date.today().isoformat(), "device": device}
    env |= {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("triton", "transformers", "kernels", "liger-kernel"):
        env[name.replace("-", "_")] = package_version(name)
    env["git"] = git_revision()
    if ours is not None:
        env["kernel"] = ours._ops.ops.name  # the build's op namespace
    return env


def results_path(env: dict, kind: str) -> Path:
    """benchmarks/results/<date>-<device>-<kind>.json."""
    return RESULTS / f"{env['date']}-{env['device'].replace(' ', '_')}-{kind}.json"


def load_ours():
    """Our kernel as users load it: the built tree (build/) through kernels."""
    if not (ROOT / "build").is_dir():
        print("build/ is missing: run `make build`", file=sys.stderr)
        sys.exit(1)
    from kernels import get_local_kernel

    return get_local_kernel(ROOT)


def liger():
    """Liger's GeGLU activation and MLP classes, or None when liger_kernel is absent."""
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.transformers.geglu import LigerGEGLUMLP
    except ImportError:
        return None
    return types.SimpleNamespace(gelu_mul=LigerGELUMulFunction, mlp=LigerGEGLUMLP)


# --- timers -----------------------------------------------------------------------------


def sync() -> None:
    if HAS_GPU:
        torch.cuda.synchronize()


def timed(fn):
    """``(fn(), wall ms)``, the GPU drained before and after."""
    sync()
    start = time.perf_counter()
    result = fn()
    sync()
    return result, (time.perf_counter() - start) * 1e3


def bench_ms(fn, graph: bool = False) -> float:
    """GPU time per call, median of triton.testing's do_bench; with ``graph``, of CUDA-graph
    replays (do_bench_cudagraph: no host time or launch gap in it)."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


_SPIN_CYCLES_PER_MS: list[float] = []


def queued_gpu_ms(fn, n: int = 20, rounds: int = 5) -> float:
    """GPU time per call with the host ahead of the GPU, for what a CUDA graph cannot
    capture (a training step: the graph replay of ModernBERT's failed on the H200 with
    cudaErrorStreamCaptureImplicit): a spin kernel (torch.cuda._sleep) holds the GPU while
    the host queues ``n`` calls, then events time the queued calls alone; the spin is made
    1.5x the host's time, and a round whose queuing outlasted it is discarded. The median
    of ``rounds``."""
    if not _SPIN_CYCLES_PER_MS:  # the spin kernel's clock, measured
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        sync()
        _SPIN_CYCLES_PER_MS.append(10_000_000 / start.elapsed_time(end))
    fn()
    _, host_ms = timed(lambda: [fn() for _ in range(n)])
    times = []
    for _ in range(rounds * 2):
        spin_ms = 1.5 * host_ms + 1.0
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        sync()
        queued = time.perf_counter()
        torch.cuda._sleep(int(spin_ms * _SPIN_CYCLES_PER_MS[0]))
        start.record()
        for _ in range(n):
            fn()
        end.record()
        queued = (time.perf_counter() - queued) * 1e3
        sync()
        if queued < spin_ms:
            times.append(start.elapsed_time(end) / n)
        else:
            host_ms = queued
        if len(times) == rounds:
            return statistics.median(times)
    raise RuntimeError(f"the host could not queue {n} calls ahead of the GPU")


def device_ms(fn, graph: bool) -> tuple[float, str]:
    """Median time per call and the timer's name; without a GPU, the CPU wall time."""
    if not HAS_GPU:
        return statistics.median(
            timed(fn)[1] for _ in range(3)
        ), "CPU wall, median of 3"
    return bench_ms(fn, graph), "do_bench_cudagraph" if graph else "do_bench"


def interleaved(fns: dict, measure: Callable, rounds: int) -> dict[str, list]:
    """``{name: [measure(fn) per round]}``, each round measuring every function once, in
    turn, every other round in reverse order: the host's drift, the first-timed penalty
    and the GPU's state after the previous function (its clocks after a heavy one) reach
    all alike (timed one after the other, the first MLP training step read up to 0.23 ms
    slow; docs/decisions/0013-benchmark-method.md)."""
    times = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else reversed(order):
            times[name].append(measure(fn))
    return times


def interleaved_ms(fns: dict, rounds: int = 3) -> dict[str, tuple[float, list]]:
    """``{name: (median ms, each round's ms)}`` by bench_ms in interleaved rounds."""
    times = interleaved(fns, bench_ms, rounds)
    return {name: (statistics.median(t), t) for name, t in times.items()}


def host_us(fns: dict, n: int = 20, rounds: int = 15) -> dict[str, float]:
    """Host time per call: the median over interleaved rounds of an ``n``-call loop's wall
    time, the GPU drained before each loop. Short loops: one that fills the GPU's launch
    queue waits for the GPU and times it instead of the host."""

    def loop_us(fn) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    for fn in fns.values():
        fn()  # first calls compile
    times = interleaved(fns, loop_us, rounds)
    sync()
    return {name: statistics.median(t) for name, t in times.items()}


def ceilings(dtype: torch.dtype = torch.bfloat16) -> dict:
    """Copy bandwidth (2 GiB) and an 8192^3 matmul in ``dtype``, measured now."""
    src = torch.zeros(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    a, b = (torch.randn(8192, 8192, dtype=dtype, device="cuda") for _ in range(2))
    mm_ms = bench_ms(lambda: a @ b)
    return {
        "copy_TBps": 2 * src.numel() * src.element_size() / copy_ms / 1e9,
        "matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9,
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


# --- kernel lister ----------------------------------------------------------------------


def outermost_op(event) -> bool:
    """An aten or custom op that no other op called."""
    if "::" not in event.name:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if "::" in parent.name:
            return False
        parent = parent.cpu_parent
    return True


def kernel_counts(events, gpu: bool) -> Counter:
    """GPU kernels by name among profiler events, less the GPU-side ranges of
    record_function (user) annotations, which are not kernels; without a GPU, the
    outermost aten/custom ops."""
    from torch.autograd import DeviceType

    if gpu:
        return Counter(
            e.name
            for e in events
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        )
    return Counter(e.name for e in events if outermost_op(e))


def launched(fn, trace: Path | None = None) -> Counter:
    """The kernels (without a GPU: outermost ops) one call of ``fn`` runs, by name; a
    Chrome trace to ``trace``. Profile after timing: once a profiler session has run,
    every later kernel in the process runs slower (docs/decisions/0013-benchmark-method.md)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if HAS_GPU else [])
    with profile(activities=activities) as prof:
        fn()
        sync()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return kernel_counts(prof.events(), HAS_GPU)


def kernel_list(fn) -> dict:
    """``{"kernels_per_call", "kernels"}`` of one call, for a result row."""
    counts = launched(fn)
    return {"kernels_per_call": counts.total(), "kernels": dict(counts.most_common())}


# --- peers ------------------------------------------------------------------------------


def eager_geglu_mlp(hidden: int, intermediate: int) -> nn.Module:
    """The eager MLP: transformers' GemmaMLP itself (tanh GeLU), whose forward our layer
    reproduces (a look-alike class would run its own forward)."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = GemmaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        hidden_act="gelu_pytorch_tanh",
    )
    return GemmaMLP(config)


def activation_peers(ours, approximate: str = "tanh") -> dict[str, Callable]:
    """``gelu(gate, approximate) * up`` as functions of (gate, up)."""

    def eager(gate, up):
        return F.gelu(gate, approximate=approximate) * up

    peers = {"eager": eager, "compile": torch.compile(eager)}
    lib = liger()
    if lib is not None and approximate == "tanh":  # Liger's is tanh-GeLU only
        peers["liger"] = lib.gelu_mul.apply
    peers["ours"] = lambda gate, up: ours.geglu(gate, up, approximate)
    return peers


def linear_peers(ours, linear: nn.Linear) -> dict[str, Callable]:
    """``linear(x)`` as functions of x (eager is cuBLAS; Liger has no linear)."""
    return {
        "eager": linear,
        "compile": torch.compile(linear),
        "ours": lambda x: ours.linear(x, linear.weight, linear.bias),
    }


def liger_mlp(mlp: nn.Module) -> nn.Module | None:
    """Liger's GeGLU MLP on ``mlp``'s projections (GemmaMLP's names), or None when
    liger_kernel is absent."""
    lib = liger()
    if lib is None:
        return None
    gate = mlp.gate_proj
    config = types.SimpleNamespace(
        hidden_size=gate.in_features,
        intermediate_size=gate.out_features,
        hidden_act="gelu_pytorch_tanh",
    )
    module = lib.mlp(config).to(gate.weight.device, gate.weight.dtype)
    module.gate_proj, module.up_proj, module.down_proj = (
        gate,
        mlp.up_proj,
        mlp.down_proj,
    )
    return module


def mlp_peers(ours, mlp: nn.Module, dynamic: bool | None = None) -> dict:
    """The MLP as functions of x, all on ``mlp``'s projections: ours as the layer
    kernelize installs (``ours_layer``), as ``geglu_mlp`` (``ours_dual_gemm``) and as
    cuBLAS projections around our ``geglu`` (``ours_fused_activation``)."""
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    peers = {"eager": mlp, "compile": torch.compile(mlp, dynamic=dynamic)}
    if (liger_peer := liger_mlp(mlp)) is not None:
        peers["liger"] = liger_peer
    peers["ours_layer"] = types.MethodType(ours.layers.GeGLUMLP.forward, mlp)
    peers["ours_dual_gemm"] = lambda x: ours.geglu_mlp(
        x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias
    )
    peers["ours_fused_activation"] = lambda x: down(ours.geglu(gate(x), up(x), "tanh"))
    return peers


@dataclass
class Stage:
    """One op with one peer, as the profiling report names it: ``<op>_<peer>``."""

    op: str
    peer: str
    fn: Callable[[torch.Tensor], torch.Tensor]

    @property
    def name(self) -> str:
        return f"{self.op}_{self.peer}"

    @property
    def compiled(self) -> bool:
        return self.peer == "compile"


STAGES = {
    "linear_eager": "eager nn.Linear (cuBLAS)",
    "linear_compile": "torch.compile nn.Linear",
    "linear_ours": "fused-geglu linear",
    "mlp_eager": "eager GeGLU MLP",
    "mlp_compile": "torch.compile GeGLU MLP",
    "mlp_liger": "Liger GEGLU MLP",
    "mlp_ours_layer": "layers.GeGLUMLP (16-bit GPU inference: dual GEMM; else projections + fused geglu)",
    "mlp_ours_dual_gemm": "geglu_mlp (the layer's route, on raw weights)",
    "mlp_ours_fused_activation": "cuBLAS projections + fused geglu",
}


def stages(names, ours, hidden: int, intermediate: int, dtype) -> tuple[list, list]:
    """The named stages (Linear and MLP peers of one size, without gradients), and a note
    for each one that cannot run here."""
    if unknown := set(names) - set(STAGES):
        raise ValueError(f"unknown stages {sorted(unknown)}; known: {list(STAGES)}")
    with torch.device(DEVICE):
        lin = nn.Linear(hidden, intermediate).to(dtype).requires_grad_(False)
        mlp = eager_geglu_mlp(hidden, intermediate).to(dtype).requires_grad_(False)
    peers = {"linear": linear_peers(ours, lin), "mlp": mlp_peers(ours, mlp)}
    built = [Stage(op, p, fn) for op, fns in peers.items() for p, fn in fns.items()]
    built = {s.name: s for s in built}
    notes = [
        f"{n} skipped: liger_kernel is not importable" for n in names if n not in built
    ]
    return [built[n] for n in names if n in built], notes


# --- `kernels benchmark` workloads ------------------------------------------------------


class Workloads:
    """setup_/benchmark_/verify_ of the small, medium and large workloads for the
    `kernels benchmark` runner: setup_ calls ``make(*SHAPES[gpu or cpu][workload],
    dtype=...)`` (bfloat16 on a GPU; float32 in the interpreter, which lacks bf16
    ``tl.dot``), benchmark_ ``run()`` (sets self.out), verify_ ``reference()``. Not
    ``setup``: kernels' Benchmark calls that one with no workload."""

    seed = 0
    SHAPES: dict[str, dict[str, tuple]]

    def setup_workload(self, workload: str) -> None:
        gpu = self.device != "cpu"
        shape = self.SHAPES["gpu" if gpu else "cpu"][workload]
        self.make(*shape, dtype=torch.bfloat16 if gpu else torch.float32)

    def setup_small(self):
        self.setup_workload("small")

    def benchmark_small(self):
        self.run()

    def verify_small(self):
        return self.reference()

    def setup_medium(self):
        self.setup_workload("medium")

    def benchmark_medium(self):
        self.run()

    def verify_medium(self):
        return self.reference()

    def setup_large(self):
        self.setup_workload("large")

    def benchmark_large(self):
        self.run()

    def verify_large(self):
        return self.reference()
