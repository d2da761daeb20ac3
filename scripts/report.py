"""Profiling report of the Linear and GeGLU-MLP paths, eager against torch.compile, Liger
and ours, over a sweep of token counts. Per stage and token count: the kernels one call
launches, GPU time, host (CPU) time, bytes moved and FLOPs against measured ceilings,
torch.compile's frames compiled and compile time, and the first-call (cold-start) time.

Writes report.json, report.md (also printed), trace_<stage>.json (Chrome traces, at the
largest token count) and PNG charts to --out (default benchmarks/out/).

Usage: python scripts/report.py [--tokens 1 16 64] [--stages mlp_eager mlp_ours_dual_gemm]

On a GPU the defaults are Gemma-2B shapes in bfloat16. Without one, tiny float32 shapes run
in the Triton interpreter: times are CPU wall times, not GPU times; the profiler lists the
outermost aten/custom ops instead of GPU kernels; no ceilings, so no roofline fractions.
"""

import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    # Triton picks the interpreter when it is first imported (by the kernel, below).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import datetime
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch._dynamo
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if HAS_GPU else "cpu"
if HAS_GPU:  # Gemma-2B
    DEFAULTS = {"hidden": 2048, "intermediate": 16384, "dtype": "bfloat16"}
    DEFAULTS["tokens"] = [1, 16, 64, 512, 8192]
else:  # tiny: the interpreter is slow
    DEFAULTS = {"hidden": 64, "intermediate": 160, "dtype": "float32"}
    DEFAULTS["tokens"] = [1, 16, 64]
TIME_KEY = "gpu_ms" if HAS_GPU else "cpu_ms"
TIME_LABEL = (
    "GPU ms (median)" if HAS_GPU else "CPU ms (Triton interpreter wall time, not GPU)"
)
STAGES = {
    "linear_eager": "eager nn.Linear",
    "linear_compiled": "torch.compile nn.Linear",
    "linear_ours": "fused-geglu linear",
    "mlp_eager": "eager GeGLU MLP",
    "mlp_compiled": "torch.compile GeGLU MLP",
    "mlp_liger": "Liger GEGLU MLP",
    "mlp_ours_fused_act": "layers.GeGLUMLP (16-bit GPU inference: dual GEMM; else projections + fused geglu)",
    "mlp_ours_dual_gemm": "geglu_mlp (dual GEMM)",
}
# [tokens, intermediate] tensors that each MLP writes to memory and reads back: eager has
# gate, up, gelu(gate) and the product; fusing the activation leaves gate, up and the
# product; the dual GEMM only the product.
ROUND_TRIPS = {"mlp_eager": 4, "mlp_ours_dual_gemm": 1}


@dataclass
class Stage:
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    compiled: bool = False

    @property
    def family(self) -> str:
        return self.name.split("_")[0]


class GeGLUMLP(nn.Module):
    """The eager MLP, as transformers' GemmaMLP computes it."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def liger_mlp():
    try:
        from liger_kernel.transformers.geglu import LigerGEGLUMLP
    except ImportError:
        return None
    return LigerGEGLUMLP


def build_stages(names, ours, hidden, intermediate, dtype):
    """The stages to run, and a note for each one skipped."""
    with torch.device(DEVICE):
        lin = nn.Linear(hidden, intermediate).to(dtype).requires_grad_(False)
        mlp = GeGLUMLP(hidden, intermediate).to(dtype).requires_grad_(False)
    fns = {
        "linear_eager": lin,
        "linear_compiled": torch.compile(lin),
        "linear_ours": lambda x: ours.linear(x, lin.weight, lin.bias),
        "mlp_eager": mlp,
        "mlp_compiled": torch.compile(mlp),
        "mlp_ours_fused_act": types.MethodType(ours.layers.GeGLUMLP.forward, mlp),
        "mlp_ours_dual_gemm": lambda x: ours.geglu_mlp(
            x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        ),
    }
    liger_cls, notes = liger_mlp(), []
    if liger_cls is not None:
        config = types.SimpleNamespace(
            hidden_size=hidden,
            intermediate_size=intermediate,
            hidden_act="gelu_pytorch_tanh",
        )
        liger = liger_cls(config).to(DEVICE, dtype)
        liger.gate_proj, liger.up_proj, liger.down_proj = (
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        )
        fns["mlp_liger"] = liger
    elif "mlp_liger" in names:
        notes.append("mlp_liger skipped: liger_kernel is not importable")
    stages = [
        Stage(n, fns[n], compiled=n.endswith("_compiled")) for n in names if n in fns
    ]
    return stages, notes


def sync():
    if HAS_GPU:
        torch.cuda.synchronize()


def wall_ms(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def device_ms(fn, cudagraph: bool) -> tuple[float, str]:
    """Median time per call and how it was measured."""
    if not HAS_GPU:
        return statistics.median(wall_ms(fn) for _ in range(3)), "CPU wall, median of 3"
    from triton.testing import do_bench, do_bench_cudagraph

    # Replaying a CUDA graph, neither host time nor launch gaps pose as GPU time.
    if cudagraph:
        ms = do_bench_cudagraph(fn, rep=100, return_mode="median")
        return ms, "do_bench_cudagraph"
    return do_bench(fn, warmup=25, rep=100, return_mode="median"), "do_bench"


def host_us(fn, n: int = 50) -> float:
    """Host time per call: the launch loop's wall time, the GPU drained before and after."""
    sync()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / n * 1e6


def outermost_op(event) -> bool:
    """An aten or custom op that no other op called (CPU runs have no GPU kernels)."""
    if "::" not in event.name:
        return False
    parent = event.cpu_parent
    while parent is not None:
        if "::" in parent.name:
            return False
        parent = parent.cpu_parent
    return True


def launched(fn, trace: Path | None) -> Counter:
    """GPU kernels (on CPU: outermost ops) that one call runs, by name."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if HAS_GPU else [])
    with profile(activities=activities) as prof:
        fn()
        sync()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    if HAS_GPU:  # GPU events, less the GPU-side ranges of record_function annotations
        return Counter(
            e.name
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        )
    return Counter(e.name for e in prof.events() if outermost_op(e))


def traffic(stage: Stage, tokens: int, hidden: int, inter: int, itemsize: int):
    """(bytes, FLOPs) of one call: inputs read once, outputs written once, plus the
    intermediates that round-trip through memory between kernels; GEMM FLOPs only."""
    if stage.family == "linear":
        elems = tokens * hidden + inter * hidden + inter + tokens * inter
        return elems * itemsize, 2 * tokens * hidden * inter
    trips = ROUND_TRIPS.get(stage.name, 3)
    elems = 2 * tokens * hidden + 3 * inter * hidden + 2 * trips * tokens * inter
    return elems * itemsize, 6 * tokens * hidden * inter


def ceilings(dtype: torch.dtype) -> dict:
    """Copy bandwidth and an 8192^3 matmul in the report's dtype, measured now."""
    from triton.testing import do_bench

    src = torch.zeros(1 << 30, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = do_bench(functools.partial(dst.copy_, src), return_mode="median")
    a, b = (torch.randn(8192, 8192, dtype=dtype, device=DEVICE) for _ in range(2))
    mm_ms = do_bench(functools.partial(torch.matmul, a, b), return_mode="median")
    return {
        "copy_TBps": 2 * (1 << 30) * 2 / copy_ms / 1e9,
        "matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9,
        "matmul_dtype": str(dtype).removeprefix("torch."),
    }


def compile_state() -> tuple[int, float]:
    """Frames dynamo has compiled so far and the seconds it spent on them."""
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    seconds = torch._dynamo.utils.compilation_time_metrics.get(
        "_compile.compile_inner", []
    )
    return frames, sum(seconds)


def run_stage(stage, args, dtype, ceil, progress) -> dict:
    """Times, traffic and compile counts of one stage's rows; kernels come later
    (``list_kernels``)."""
    rows = {}
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, dtype=dtype, device=DEVICE)
        call = functools.partial(stage.fn, x)
        frames0, seconds0 = compile_state()
        row = {"tokens": tokens, "first_call_ms": wall_ms(call)}
        row[TIME_KEY], row["timer"] = device_ms(call, not args.no_cudagraph)
        if HAS_GPU:
            row["host_us"] = host_us(call)
        row["bytes"], row["flops"] = traffic(
            stage, tokens, args.hidden, args.intermediate, itemsize
        )
        if ceil is not None:
            seconds = row[TIME_KEY] / 1e3
            row["TBps"] = row["bytes"] / seconds / 1e12
            row["TFLOPs"] = row["flops"] / seconds / 1e12
            row["frac_bandwidth"] = row["TBps"] / ceil["copy_TBps"]
            row["frac_flops"] = row["TFLOPs"] / ceil["matmul_TFLOPs"]
            # The roofline time is the larger of the two: its ratio to the time taken.
            row["frac_roofline"] = max(row["frac_bandwidth"], row["frac_flops"])
        if stage.compiled:
            frames1, seconds1 = compile_state()
            row["frames_compiled"] = frames1 - frames0
            row["compile_s"] = seconds1 - seconds0
        rows[str(tokens)] = row
        progress.update()
    result = {
        "label": STAGES[stage.name],
        "cold_start_ms": rows[str(args.tokens[0])]["first_call_ms"],
        "trace": f"trace_{stage.name}.json",
        "rows": rows,
    }
    if stage.compiled:
        frames = sum(r["frames_compiled"] for r in rows.values())
        result |= {
            "frames_compiled": frames,
            "recompiles": max(frames - 1, 0),
            "compile_s": sum(r["compile_s"] for r in rows.values()),
        }
    return result


def list_kernels(stage, result: dict, args, dtype, out: Path, progress) -> None:
    """The kernels each row's call launches, by the profiler, into ``result``'s rows; the
    largest row's trace into ``out``. Run after all timing: once a profiler session has
    run, CUPTI stays attached and every later kernel pays for it (the eager MLP, six
    kernels, timed 3-5% slower than in a process that never profiled)."""
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, dtype=dtype, device=DEVICE)
        last = tokens == args.tokens[-1]
        trace = out / f"trace_{stage.name}.json" if last else None
        kernels = launched(functools.partial(stage.fn, x), trace)
        row = result["rows"][str(tokens)]
        row["kernels_per_call"] = sum(kernels.values())
        row["kernels"] = dict(kernels.most_common())
        progress.update()


def fmt(value) -> str:
    """Integers as they are; floats to 3 significant digits, without exponents above 100."""
    if value is None:
        return "-"
    if isinstance(value, int) or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}"


def markdown(report: dict) -> str:
    env, cfg = report["env"], report["config"]
    lines = [
        f"# fused-geglu profiling report, {env['device']}",
        "",
        (
            f"{env['date']}; torch {env['torch']}, triton {env['triton']}, kernel "
            f"{env['kernel']}; hidden {cfg['hidden']}, intermediate "
            f"{cfg['intermediate']}, {cfg['dtype']}."
        ),
    ]
    if report["ceilings"]:
        c = report["ceilings"]
        lines.append(
            f"Ceilings measured now: copy {c['copy_TBps']:.2f} TB/s, 8192^3 "
            f"{c['matmul_dtype']} matmul {c['matmul_TFLOPs']:.0f} TFLOP/s."
        )
    lines += [f"- {note}" for note in report["notes"]]
    gpu = report["ceilings"] is not None
    per_call = "kernels/call" if HAS_GPU else "ops/call (CPU ops, not kernels)"
    head = ["stage", "tokens", per_call, TIME_LABEL]
    head += ["host µs"] if HAS_GPU else []
    head += ["MB moved", "GFLOP"]
    head += ["frac BW", "frac FLOP/s", "frac roofline"] if gpu else []
    head += ["first call ms", "frames compiled"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, stage in report["stages"].items():
        for row in stage["rows"].values():
            cells = [name, row["tokens"], row["kernels_per_call"], fmt(row[TIME_KEY])]
            cells += [fmt(row["host_us"])] if HAS_GPU else []
            cells += [fmt(row["bytes"] / 1e6), fmt(row["flops"] / 1e9)]
            if gpu:
                keys = ("frac_bandwidth", "frac_flops", "frac_roofline")
                cells += [f"{row[k]:.2f}" for k in keys]
            cells += [fmt(row["first_call_ms"]), fmt(row.get("frames_compiled"))]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    largest = report["config"]["tokens"][-1]
    launched_what = "kernels" if HAS_GPU else "ops"
    lines += [
        "",
        f"| stage | cold start ms | recompiles | compile s | {launched_what} at {largest} tokens |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, stage in report["stages"].items():
        kernels = stage["rows"][str(largest)]["kernels"]
        names = ", ".join(f"{k[:60]} x{n}" for k, n in kernels.items())
        cells = [f"{name}: {stage['label']}", fmt(stage["cold_start_ms"])]
        cells += [fmt(stage.get("recompiles")), fmt(stage.get("compile_s")), names]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def charts(report: dict, out: Path, prefix: str = "") -> list[str]:
    """PNG charts of ``report`` (also a committed one: its own time key) into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = report["config"]["tokens"]
    time_key, time_label = report["config"]["time_key"], report["config"]["time_label"]
    stages = report["stages"]
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / max(len(stages), 1)
    for i, (name, stage) in enumerate(stages.items()):
        times = [stage["rows"][str(t)][time_key] for t in tokens]
        ax.bar([j + i * width for j in range(len(tokens))], times, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))], tokens)
    ax.set(xlabel="tokens", ylabel=time_label, yscale="log", title="Time per call")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{prefix}time_per_stage.png", dpi=120)
    plt.close(fig)
    written = ["time_per_stage.png"]
    if report["ceilings"] is not None:
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, stage in stages.items():
            fracs = [stage["rows"][str(t)]["frac_roofline"] for t in tokens]
            ax.plot(tokens, fracs, marker="o", label=name)
        ax.set(xlabel="tokens", ylabel="fraction of roofline", xscale="log")
        ax.set(ylim=(0, 1.05), title="Achieved fraction of roofline")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{prefix}roofline_fraction.png", dpi=120)
        plt.close(fig)
        written.append("roofline_fraction.png")
    return written


def package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    parser.add_argument("--intermediate", type=int, default=DEFAULTS["intermediate"])
    parser.add_argument(
        "--dtype",
        default=DEFAULTS["dtype"],
        choices=["bfloat16", "float16", "float32"],
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULTS["tokens"])
    parser.add_argument(
        "--stages", nargs="+", default=list(STAGES), choices=list(STAGES)
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    parser.add_argument(
        "--fresh-caches",
        action="store_true",
        help="empty Triton and inductor caches, so first calls include all compilation",
    )
    parser.add_argument(
        "--no-cudagraph",
        action="store_true",
        help="time calls in a loop with do_bench, not by CUDA-graph replay",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.fresh_caches:
        caches = tempfile.mkdtemp(prefix="fused-geglu-report-")
        os.environ["TRITON_CACHE_DIR"] = f"{caches}/triton"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{caches}/inductor"
    if not (ROOT / "build").is_dir():
        print("build/ is missing: run `make build`", file=sys.stderr)
        return 1
    from kernels import get_local_kernel

    ours = get_local_kernel(ROOT)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    notes = [
        "Stages run in order in one process, all timed before the profiler lists "
        "their kernels (a profiled process runs later kernels slower); "
        "torch.compile with its defaults "
        "(automatic dynamic shapes); first calls include compilation unless the Triton "
        "and inductor disk caches already hold it"
        + (" (here they were emptied: --fresh-caches)." if args.fresh_caches else "."),
        (
            "Bytes: inputs read once, outputs written once, plus [tokens, intermediate] "
            "intermediates written and read back between kernels (eager MLP 4, dual "
            "GEMM 1, other MLPs 3); FLOPs: the GEMMs only."
        ),
    ]
    if HAS_GPU:
        env_device = torch.cuda.get_device_name()
        notes.append(
            "GPU ms: median of CUDA-graph replays (triton.testing.do_bench_cudagraph; "
            "a call timed in a loop with do_bench measures its host time wherever that "
            "exceeds its GPU time: here up to 512 tokens), or do_bench with "
            "--no-cudagraph. host µs: launch-loop wall time per call."
        )
        torch.ones(8, 8, device=DEVICE) @ torch.ones(8, 8, device=DEVICE)
        sync()  # CUDA context and cuBLAS handle exist before the first stage
    else:
        # OpenMP wake-ups otherwise dominate the tiny eager ops on a small shared machine.
        torch.set_num_threads(1)
        env_device = f"CPU ({platform.machine()}), Triton interpreter"
        notes.append(
            "No GPU: the Triton kernels run in the Triton interpreter on the CPU. Times "
            "are CPU wall times, not GPU times, and say nothing about GPU speed; "
            "'ops/call' lists the outermost aten/custom ops, not GPU kernels (inductor's "
            "fused C++ kernels are not listed); no ceilings, so no roofline fractions; "
            "one CPU thread."
        )
    stages, skipped = build_stages(
        args.stages, ours, args.hidden, args.intermediate, dtype
    )
    notes += skipped
    ceil = ceilings(dtype) if HAS_GPU else None
    report = {
        "env": {
            "date": datetime.date.today().isoformat(),
            "device": env_device,
            "torch": torch.__version__,
            "triton": package_version("triton"),
            "kernels": package_version("kernels"),
            "liger_kernel": package_version("liger-kernel"),
            "python": platform.python_version(),
            "kernel": ours._ops.ops.name,
        },
        "config": {
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "dtype": args.dtype,
            "tokens": args.tokens,
            "time_key": TIME_KEY,
            "time_label": TIME_LABEL,
        },
        "ceilings": ceil,
        "notes": notes,
        "stages": {},
    }
    failed = []
    # Each row twice: timed, then its kernels listed by the profiler.
    progress = tqdm(total=2 * len(stages) * len(args.tokens), desc="report", unit="run")
    with torch.no_grad(), progress:
        for stage in stages:
            progress.set_postfix_str(stage.name)
            try:
                report["stages"][stage.name] = run_stage(
                    stage, args, dtype, ceil, progress
                )
            except Exception as error:  # noqa: BLE001 - report the others, then fail
                failed.append(f"{stage.name}: {type(error).__name__}: {error}")
        for stage in stages:
            if stage.name not in report["stages"]:
                continue
            progress.set_postfix_str(f"{stage.name} kernels")
            try:
                list_kernels(
                    stage, report["stages"][stage.name], args, dtype, args.out, progress
                )
            except Exception as error:  # noqa: BLE001
                del report["stages"][stage.name]
                failed.append(f"{stage.name}: {type(error).__name__}: {error}")
    report["notes"] += [f"FAILED {f}" for f in failed]
    md = markdown(report)
    report["charts"] = charts(report, args.out)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "report.md").write_text(md)
    print(md)
    print(f"Wrote report.json, report.md, traces and charts to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
