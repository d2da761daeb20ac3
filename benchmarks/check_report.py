"""Checks a profiling report (scripts/report.py's report.json) against independent timings.

In a fresh process, every (stage, token count) row is timed again with
``triton.testing.do_bench``, by another route than the report's:
- rows the report timed by CUDA-graph replay (``do_bench_cudagraph``): a graph of enough
  calls to take about ``REPLAY_MS`` is captured here and do_bench times its replay (which
  also flushes L2 between replays), divided by the calls;
- rows the report timed with do_bench: do_bench again, on freshly built modules and inputs.

A row agrees when the report's time is within the noise of the independent one: the ratio
is within max(5%, (q80 - q20) / median) of 1, the quantiles being do_bench's.

Usage: python benchmarks/check_report.py benchmarks/out/report.json [--out check.json]
Exits 1 if a row disagrees.
"""

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import bench_lib as lib
import torch

# Per replay: do_bench's L2 flush and the graph's launch cost a few us, spread over the
# calls. With 10 calls per replay the 19 us GEMMs read 3-5% slower than the report's
# (docs/decisions/0013-benchmark-method.md); about 1 ms of calls per replay should make that under 1%.
REPLAY_MS = 1.0
MAX_REPLAY_CALLS = 200
MIN_TOLERANCE = 0.05


def quantiles(times: list[float]) -> tuple[float, float, float]:
    """(q20, median, q80) of per-call times."""
    q = statistics.quantiles(times, n=10, method="inclusive")
    return q[1], statistics.median(times), q[7]


def graph_replay_times(fn, reported_ms: float) -> list[float]:
    """Per-call ms of a captured graph of calls taking about ``REPLAY_MS`` (by the report's
    time), do_bench timing each replay."""
    from triton.testing import do_bench

    calls = max(1, min(MAX_REPLAY_CALLS, math.ceil(REPLAY_MS / reported_ms)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture (allocations, autotuning)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = do_bench(graph.replay, warmup=25, rep=200, return_mode="all")
    return [t / calls for t in times]


def plain_times(fn, reported_ms: float) -> list[float]:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="all")


def agreement(reported: float, times: list[float]) -> dict:
    """The independent timing's quantiles, the report's ratio to its median, and whether
    that ratio is within the noise."""
    q20, median, q80 = quantiles(times)
    tolerance = max(MIN_TOLERANCE, (q80 - q20) / median)
    ratio = reported / median
    return {
        "report_ms": reported,
        "independent_ms": median,
        "independent_q20_ms": q20,
        "independent_q80_ms": q80,
        "ratio": ratio,
        "tolerance": tolerance,
        "agrees": abs(ratio - 1) <= tolerance,
    }


def check(report: dict, ours, timers: dict | None = None) -> list[dict]:
    """One row per (stage, tokens) of ``report``; ``timers`` maps the report's timer name
    to a function of (call, the report's time) returning per-call times (the GPU routes
    above by default)."""
    timers = timers or {
        "do_bench_cudagraph": graph_replay_times,
        "do_bench": plain_times,
    }
    cfg = report["config"]
    dtype = getattr(torch, cfg["dtype"])
    time_key = cfg["time_key"]
    torch.manual_seed(1)  # other inputs than the report's (seed 0)
    stages, _ = lib.stages(
        list(report["stages"]), ours, cfg["hidden"], cfg["intermediate"], dtype
    )
    rows = []
    with torch.no_grad():
        for stage in stages:
            for tokens_key, reported in report["stages"][stage.name]["rows"].items():
                x = torch.randn(
                    int(tokens_key), cfg["hidden"], dtype=dtype, device=lib.DEVICE
                )
                fn = functools.partial(stage.fn, x)
                fn()  # compiles the torch.compile stages before timing
                times = timers[reported["timer"]](fn, reported[time_key])
                row = {"stage": stage.name, "tokens": int(tokens_key)}
                row["report_timer"] = reported["timer"]
                rows.append(row | agreement(reported[time_key], times))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("report", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lib.require_cuda("benchmarks/check_report.py")
    report = json.loads(args.report.read_text())
    ours = lib.load_ours()
    rows = check(report, ours)
    result = {
        "env": lib.environment(ours) | {"report_date": report["env"]["date"]},
        "method": __doc__.split("\n\n")[1],
        "rows": rows,
    }
    print(
        "| stage | tokens | report ms | independent ms | ratio | tolerance | agrees |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['stage']} | {r['tokens']} | {r['report_ms']:.4g} | "
            f"{r['independent_ms']:.4g} | {r['ratio']:.3f} | {r['tolerance']:.3f} | "
            f"{'yes' if r['agrees'] else 'NO'} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["agrees"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
