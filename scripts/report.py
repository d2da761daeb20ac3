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

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_lib as lib  # first: it picks the interpreter without a GPU
import torch
import torch._dynamo
from tqdm import tqdm

HAS_GPU = lib.HAS_GPU
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
# [tokens, intermediate] tensors that each MLP writes to memory and reads back: eager has
# gate, up, gelu(gate) and the product; fusing the activation leaves gate, up and the
# product; the dual GEMM only the product.
ROUND_TRIPS = {"mlp_eager": 4, "mlp_ours_dual_gemm": 1}


def traffic(stage: lib.Stage, tokens: int, hidden: int, inter: int, itemsize: int):
    """(bytes, FLOPs) of one call: inputs read once, outputs written once, plus the
    intermediates that round-trip through memory between kernels; GEMM FLOPs only."""
    if stage.op == "linear":
        elems = tokens * hidden + inter * hidden + inter + tokens * inter
        return elems * itemsize, 2 * tokens * hidden * inter
    trips = ROUND_TRIPS.get(stage.name, 3)
    elems = 2 * tokens * hidden + 3 * inter * hidden + 2 * trips * tokens * inter
    return elems * itemsize, 6 * tokens * hidden * inter


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
        x = torch.randn(tokens, args.hidden, dtype=dtype, device=lib.DEVICE)
        call = functools.partial(stage.fn, x)
        frames0, seconds0 = compile_state()
        row = {"tokens": tokens, "first_call_ms": lib.timed(call)[1]}
        row[TIME_KEY], row["timer"] = lib.device_ms(call, not args.no_cudagraph)
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
        "label": lib.STAGES[stage.name],
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


def host_times(stages, report: dict, args, dtype) -> None:
    """Host µs per call into every row: per token count, the stages in interleaved rounds
    (lib.host_us), so that the host's drift reaches them alike."""
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, dtype=dtype, device=lib.DEVICE)
        timed = [s for s in stages if s.name in report["stages"]]
        calls = {s.name: functools.partial(s.fn, x) for s in timed}
        for name, us in lib.host_us(calls).items():
            report["stages"][name]["rows"][str(tokens)]["host_us"] = us


def list_kernels(stage, result: dict, args, dtype, out: Path, progress) -> None:
    """The kernels each row's call launches, by the profiler, into ``result``'s rows; the
    largest row's trace into ``out``. Run after all timing: once a profiler session has
    run, CUPTI stays attached and every later kernel pays for it (the eager MLP, six
    kernels, timed 3-5% slower than in a process that never profiled)."""
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, dtype=dtype, device=lib.DEVICE)
        last = tokens == args.tokens[-1]
        trace = out / f"trace_{stage.name}.json" if last else None
        kernels = lib.launched(functools.partial(stage.fn, x), trace)
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
        "--stages", nargs="+", default=list(lib.STAGES), choices=list(lib.STAGES)
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
    ours = lib.load_ours()
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
        notes.append(
            "GPU ms: median of CUDA-graph replays (triton.testing.do_bench_cudagraph; "
            "a call timed in a loop with do_bench measures its host time wherever that "
            "exceeds its GPU time: here up to 512 tokens), or do_bench with "
            "--no-cudagraph. host µs: per token count, the stages in interleaved "
            "rounds of 20-call loops (median of 15), the GPU drained before each loop."
        )
        torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
        lib.sync()  # CUDA context and cuBLAS handle exist before the first stage
    else:
        # OpenMP wake-ups otherwise dominate the tiny eager ops on a small shared machine.
        torch.set_num_threads(1)
        notes.append(
            "No GPU: the Triton kernels run in the Triton interpreter on the CPU. Times "
            "are CPU wall times, not GPU times, and say nothing about GPU speed; "
            "'ops/call' lists the outermost aten/custom ops, not GPU kernels (inductor's "
            "fused C++ kernels are not listed); no ceilings, so no roofline fractions; "
            "one CPU thread."
        )
    stages, skipped = lib.stages(
        args.stages, ours, args.hidden, args.intermediate, dtype
    )
    notes += skipped
    ceil = lib.ceilings(dtype) if HAS_GPU else None
    report = {
        "env": lib.environment(ours),
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
        if HAS_GPU:
            host_times(stages, report, args, dtype)
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
    write(report, args.out)
    return 1 if failed else 0


def write(report: dict, out: Path) -> None:
    """report.json and report.md, then the charts (matplotlib is optional: without it, a
    note instead), then report.json again with their names."""
    md = markdown(report)
    report["charts"] = []
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(md)
    print(md)
    print(f"Wrote report.json, report.md and traces to {out}")
    try:
        report["charts"] = charts(report, out)
    except ImportError as error:
        print(f"No charts: {error} (pip install matplotlib)")
        return
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"Wrote charts to {out}: {', '.join(report['charts'])}")


if __name__ == "__main__":
    sys.exit(main())
