"""Regenerate the measured results from the committed JSON in benchmarks/results/, one
section per GPU. For each kind of result the newest file of each GPU counts (its GPU is the
JSON's env["device"]): *-compare.json (benchmarks/compare.py; a run with --only renders
only the parts it measured) and, when committed, *-compare-training.json,
*-compare-mlp.json, *-compare-linear.json and *-compare-activation-linear.json (the newest
of each Triton version), *-tune-decode.json,
*-e2e.json, *-fp8.json, *-families.json (compare.py --only families), *-distributed.json
(benchmarks/distributed.py), *-report.json (scripts/report.py), *-sweep-8192.json (GEMM
tile sweeps at 8192 tokens, the newest of each Triton version) and *-sweep-decode.json.

Two files each hold one generated block, between the `<!-- results:start -->` and
`<!-- results:end -->` markers: README.md a summary (a few rows per GPU), docs/results.md
every table. `make results` runs it; --check only reports drift. Every table is headed by
the GPU, the date and the versions its JSON records.

Every number is the JSON's, rounded one way: milliseconds to 3 decimals, or 3 significant
digits below 0.1 ms; fractions to 2 decimals; µs and MiB to integers.
"""

import argparse
import json
import math
import re
import sys
import textwrap
from datetime import datetime
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS_DOC = ROOT / "docs" / "results.md"
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"
# compare.py's MLP forward+backward runs at this many tokens.
FWD_BWD_TOKENS = 8192
PEERS = {
    "ours": "fused-geglu `geglu`",
    "ours_gelu_tanh_and_mul": "fused-geglu `gelu_tanh_and_mul`",
    "ours_layer": "fused-geglu `GeGLUMLP` layer",
    "ours_dual_gemm": "fused-geglu `geglu_mlp` function",
    "ours_fused_activation": "cuBLAS + fused activation",
    "eager": "eager",
    "compile": "torch.compile",
    "liger": "Liger",
}


# Keys of results written before benchmarks/bench_lib.py named every peer one way.
RENAMED = {
    "gpu": "device",
    "bf16_matmul_TFLOPs": "matmul_TFLOPs",
    "cublas": "eager",
    "mm_then_add": "eager_mm_then_add",
    "ours_vs_cublas": "ours_vs_eager",
}


def renamed(value):
    """Parsed JSON with its older keys under today's names (RENAMED)."""
    if isinstance(value, dict):
        return {RENAMED.get(k, k): renamed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [renamed(v) for v in value]
    return value


def load(path: Path) -> dict:
    return renamed(json.loads(path.read_text()))


@cache
def device_of(path: Path) -> str:
    """The GPU a result was measured on: its env["device"], else its file name's
    (``<date>-<device, spaces as _>-<kind>.json``)."""
    env = load(path).get("env", {})
    if env.get("device"):
        return env["device"]
    return path.name.split("-")[3].replace("_", " ")


def results(kind: str, device: str | None = None) -> list[Path]:
    """The ``*-<kind>.json`` files, oldest first (by name: names start with the date),
    of one GPU, or of all."""
    paths = sorted(RESULTS.glob(f"*-{kind}.json"))
    return [p for p in paths if device is None or device_of(p) == device]


def newest(kind: str, device: str | None = None) -> Path | None:
    """The newest ``*-<kind>.json`` of ``device`` (of any GPU: None)."""
    paths = results(kind, device)
    return paths[-1] if paths else None


def measured_at(path: Path) -> str:
    """The date (and UTC hour, where the name has one) that starts a result's name."""
    return re.match(r"\d{4}-\d\d-\d\d(T\d\d)?", path.name).group(0)


def newest_families(device: str) -> Path | None:
    """The newest run of the families' feed-forwards on ``device``: a
    ``*-families.json`` or a comparison that measured them (on a tie, the comparison)."""
    paths = results("families", device)
    paths += [p for p in results("compare", device) if "families" in load(p)]
    return max(paths, key=measured_at, default=None)


def gpus() -> list[str]:
    """The GPUs with a comparison (compare.py), in the order of their first one."""
    return list(dict.fromkeys(device_of(p) for p in results("compare")))


VERSIONS = {"torch": "torch", "triton": "Triton", "kernels": "kernels"}
VERSIONS |= {"transformers": "transformers"}


def stamp(*envs: dict, extra: tuple[str, ...] = ()) -> str:
    """What heads a table: ``GPU, date (torch, Triton, kernels and transformers
    versions)`` from the JSON's env (several: the values that differ joined by "and";
    a version the JSON does not record, said so) and ``extra`` inside the parentheses."""

    def value(key: str) -> str:
        values = dict.fromkeys(str(e.get(key) or "not recorded") for e in envs)
        return " and ".join(values)

    versions = [f"{label} {value(key)}" for key, label in VERSIONS.items()]
    return f"{value('device')}, {value('date')} ({', '.join([*versions, *extra])})"


def ms(value: float | None) -> str:
    """3 decimals; below 0.1 ms, 3 significant digits."""
    if value is None:
        return "-"
    return f"{value:.{max(3, 2 - math.floor(math.log10(value)))}f}"


def frac(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def paragraph(text: str) -> list[str]:
    """Wrapped at 90 columns, never inside a `code span`."""
    parts = text.split("`")
    parts[1::2] = [p.replace(" ", "\0") for p in parts[1::2]]
    lines = textwrap.wrap(
        "`".join(parts), width=90, break_on_hyphens=False, break_long_words=False
    )
    return [line.replace("\0", " ") for line in lines] + [""]


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FLOOR = (
    "floor: the larger of the three GEMMs' FLOPs at the run's measured matmul rate "
    "and the three weights' bytes at its copy rate"
)


def mlp_floor_ms(mlp: dict, tokens: int, ceil: dict) -> float:
    """The Gemma MLP's floor at ``tokens`` (FLOOR), ms."""
    h, i = mlp["hidden"], mlp["intermediate"]
    flops_ms = 3 * 2 * tokens * h * i / (ceil["matmul_TFLOPs"] * 1e9)
    bytes_ms = 3 * h * i * DTYPE_BYTES[mlp["dtype"]] / (ceil["copy_TBps"] * 1e9)
    return max(flops_ms, bytes_ms)


def mlp_forward_table(mlp: dict, key: str, fmt, ceil: dict | None = None) -> list[str]:
    """The MLP forward's ``key`` by token count and peer, each ``fmt``-ed; the token
    counts measured without it are left out (no table at all: []). With ``ceil``, the
    floor (FLOOR) and our layer's fraction of it."""
    peers = list(next(iter(mlp["forward"].values())))
    head = ["tokens"] + [PEERS[p] for p in peers]
    head += ["floor", "layer: fraction of floor"] if ceil else []
    rows = []
    for tokens, row in mlp["forward"].items():
        if key not in row[peers[0]]:
            continue
        cells = [tokens] + [fmt(row[p][key]) for p in peers]
        if ceil:
            floor = mlp_floor_ms(mlp, int(tokens), ceil)
            cells += [ms(floor), frac(floor / row["ours_layer"][key])]
        rows.append(cells)
    return table(head, rows) + [""] if rows else []


def linear_table(rows: list[dict], head: list[str]) -> list[str]:
    """compare.py's Linear rows: ms of ours, eager, torch.compile (and `mm` then `+ bias`
    where timed), then our speed over eager's."""
    peers = ("ours", "eager", "compile", "eager_mm_then_add")
    cells = [
        [f"{r['M']}, {r['N']}, {r['K']}"]
        + [ms(r[p]["ms"]) for p in peers if p in r]
        + [frac(r["ours_vs_eager"])]
        for r in rows
    ]
    return table(head, cells) + [""]


# compare.py's sections, in its order; a run with --only has some of them.
COMPARE_SECTIONS = ("activation", "linear", "mlp", "training", "families", "host")


def compare_command(result: dict) -> str:
    """The compare.py command that wrote ``result``: --only for a subset of sections."""
    measured = [s for s in COMPARE_SECTIONS if s in result]
    only = (
        f" --only {' '.join(measured)}" if len(measured) < len(COMPARE_SECTIONS) else ""
    )
    return f"python benchmarks/compare.py{only}"


def compare_section(path: Path, result: dict) -> list[str]:
    """compare.py's tables, those of the sections it measured."""
    env, ceil = result["env"], result["ceilings"]
    tune = path.with_name(path.name.replace("-compare.json", "-tune.json"))
    peers = f"liger-kernel {env['liger_kernel']}" if env["liger_kernel"] else "no Liger"
    text = (
        f"Measured on one {stamp(env, extra=(peers,))}, every peer in the same run, "
        f"medians of `triton.testing.do_bench` (CUDA-graph replay for 64 tokens or "
        f"fewer). Source: `{path.relative_to(ROOT)}`, made by `{compare_command(result)}`"
    )
    if env.get("note"):
        text += f"; {env['note']}"
    if tune != path and tune.exists():
        text += (
            f"; launch tables chosen from `{tune.relative_to(ROOT)}` "
            f"(`benchmarks/tune.py`)"
        )
    text += (
        f". Ceilings measured in that run: copy {ceil['copy_TBps']:.2f} TB/s, 8192^3 "
        f"bf16 matmul {ceil['matmul_TFLOPs']:.0f} TFLOP/s."
    )
    lines = paragraph(text)
    if "activation" in result:
        lines += activation_section(result["activation"])
    if "linear" in result:
        lines += linear_section(result["linear"])
    if "mlp" in result:
        lines += mlp_section(result["mlp"], ceil)
    if "training" in result:
        lines += training_section(result["training"])
    if "host" in result:
        lines += host_section(result["host"])
    if "families" in result:
        lines += paragraph(
            "Each family's feed-forward, inference, bf16: GPU time by CUDA-graph "
            "replay, host time per call beside it:"
        )
        lines += families_table(result["families"])
    return lines


def activation_section(act: dict) -> list[str]:
    m, n = act["shape"]
    lines = [f"GeGLU activation, {m} x {n}, {act['dtype']}, {act['approximate']}:", ""]
    rows = [
        [PEERS[name], ms(r["fwd_ms"]), frac(r.get("fwd_frac_of_copy"))]
        + [ms(r.get("fwd_bwd_ms"))]
        for name, r in act["rows"].items()
    ]
    head = ["", "forward ms", "forward, fraction of copy bandwidth"]
    return lines + table(head + ["forward+backward ms"], rows) + [""]


def linear_section(lin: dict) -> list[str]:
    # compare.py's linear section runs in bfloat16 and does not record it.
    lines = ["Linear with bias, bfloat16, forward ms (M tokens x N out x K in):", ""]
    head = ["M, N, K", "fused-geglu `linear`", "cuBLAS `F.linear`", "torch.compile"]
    speed = "`linear` speed / cuBLAS's"
    lines += linear_table(lin["forward"], head + ["`mm` then `+ bias`", speed])
    if "fwd_bwd" in lin:
        title = "forward+backward ms (x, weight and bias trainable)"
        lines += [f"Linear with bias, bfloat16, {title}:", ""]
        lines += linear_table(lin["fwd_bwd"], head + [speed])
    else:  # written when compare.py timed one shape: fwd_bwd_<MxNxK>_bias_ms
        key = next(k for k in lin if k.startswith("fwd_bwd_"))
        shape, fb = key.split("_")[2].replace("x", " x "), lin[key]
        lines += paragraph(
            f"Linear forward+backward with bias at {shape}: fused-geglu "
            f"{ms(fb['ours'])} ms, eager {ms(fb['eager'])} ms."
        )
    return lines


def mlp_section(mlp: dict, ceil: dict) -> list[str]:
    """The Gemma-2B MLP: forward ms with its floor, host µs, forward+backward."""
    title = f"Gemma-2B MLP (hidden {mlp['hidden']}, intermediate {mlp['intermediate']})"
    lines = paragraph(f"{title}, {mlp['dtype']}, forward ms; {FLOOR}:")
    lines += mlp_forward_table(mlp, "ms", ms, ceil)
    if host := mlp_forward_table(mlp, "host_us", lambda us: f"{us:.0f}"):
        lines += ["Host (CPU) time per MLP forward, µs:", "", *host]
    parts = [
        f"{PEERS[p]} {ms(r['ms'])} ms ({r['peak_extra_MiB']:.0f} MiB)"
        for p, r in mlp["fwd_bwd"].items()
    ]
    lines += paragraph(
        f"MLP forward+backward at {FWD_BWD_TOKENS} tokens (peak extra memory in "
        f"parentheses): " + ", ".join(parts) + "."
    )
    return lines


def training_section(training: dict) -> list[str]:
    """compare.py's training step per family: ms (peak extra MiB) per peer."""
    peers = list(dict.fromkeys(p for r in training.values() for p in r if p in PEERS))
    lines = paragraph(
        "Training step (forward and backward, input and parameters trainable, dropout "
        "p = 0), bfloat16, each family's feed-forward at one real size (the frozen row: "
        "only the input trainable): ms, and peak extra MiB in parentheses; "
        "interleaved rounds, medians."
    )
    names = PEERS | {"ours": "fused-geglu layer"}
    head = [""] + [names[p] for p in peers]

    def rows(steps: dict, cell) -> list[list[str]]:
        return [
            [f"{name} ({r['tokens']} tokens)"]
            + [cell(r[p]) if p in r else "-" for p in peers]
            for name, r in steps.items()
        ]

    lines += table(
        head, rows(training, lambda c: f"{ms(c['ms'])} ({c['peak_extra_MiB']:.0f})")
    )
    gpu_timed = {
        n: r
        for n, r in training.items()
        if any("gpu_ms" in r[p] for p in peers if p in r)
    }
    if not gpu_timed:
        return lines + [""]
    lines += [""] + paragraph(
        "The same steps' GPU time, ms, with the host ahead (20 steps queued behind a "
        "spin kernel: what a step costs where a model's queue keeps the GPU busy), and "
        "for steps under 1 ms the host time per step, µs, in parentheses (20-step "
        "loops, interleaved rounds, medians): the ms above is about the larger of the "
        "two."
    )

    def gpu_cell(c: dict) -> str:
        if "gpu_ms" not in c:
            return "-"
        return ms(c["gpu_ms"]) + (f" ({c['host_us']:.0f})" if "host_us" in c else "")

    return lines + table(head, rows(gpu_timed, gpu_cell)) + [""]


def commit_of(env: dict) -> str:
    """The package tree a run measured: the commit its JSON names (``source_commit`` where
    the device's own git metadata was not the tree's)."""
    return env.get("source_commit") or env["git"]


def training_rerun_section(path: Path, result: dict) -> list[str]:
    """compare.py --only training, run with or after the newest comparison."""
    env = result["env"]
    note = f"; {env['note']}" if env.get("note") else ""
    lines = paragraph(
        f"Training rows measured in a run of their own, {stamp(env)}, at {commit_of(env)} "
        f"(every peer in the same run{note}). Source: `{path.relative_to(ROOT)}`."
    )
    return lines + training_section(result["training"])


def host_section(host: dict) -> list[str]:
    """compare.py's host µs per call of every public op and layer."""
    shape = host["shape"]
    ops = {op: r for op, r in host.items() if op not in ("shape", "dtype")}
    peers = list(dict.fromkeys(p for r in ops.values() for p in r))
    lines = paragraph(
        f"Host (CPU) time per call, µs, {shape['tokens']} token, hidden "
        f"{shape['hidden']}, intermediate {shape['intermediate']} (layers of the "
        f"families at their sizes), {host['dtype']}: interleaved rounds of 20-call loops, "
        f"median. `ours` is the op or layer named in the row."
    )
    rows = [
        [op] + [f"{r[p]:.0f}" if p in r else "-" for p in peers]
        for op, r in ops.items()
    ]
    return lines + table(["op or layer"] + peers, rows) + [""]


def families_section(path: Path, result: dict) -> list[str]:
    """compare.py --only families: each family's layer against its eager module."""
    env = result["env"]
    lines = paragraph(
        f"Each family's feed-forward, inference, bf16, {stamp(env)}: GPU time by "
        f"CUDA-graph replay, host time per call beside it. Source: "
        f"`{path.relative_to(ROOT)}`, made by `python benchmarks/compare.py --only families`."
    )
    return lines + families_table(result["families"])


def families_table(families: dict) -> list[str]:
    """Each family's layer against its eager module: GPU ms, speed-up, host µs."""
    rows = [
        [name, f"{r['tokens']} x {r['hidden']}", ms(r["eager_ms"]), ms(r["ours_ms"]),
         f"{r['speedup']:.2f}x", f"{r['eager_host_us']:.0f}", f"{r['ours_host_us']:.0f}"]
        for name, r in families.items()
    ]  # fmt: skip
    head = ["module", "tokens x hidden", "eager ms", "fused-geglu ms", "speed-up"]
    head += ["eager host µs", "fused-geglu host µs"]
    return table(head, rows) + [""]


def distributed_section(path: Path, result: dict) -> list[str]:
    """benchmarks/distributed.py: a kernelized model against eager on several GPUs."""
    env, model = result["env"], result["model"]
    lines = paragraph(
        f"Distributed, {env['world_size']} x {stamp(env)}: a Gemma model with Gemma-2B's layer shapes, {model['num_hidden_layers']} layers, "
        f"{model['num_key_value_heads']} key/value heads, bf16, "
        f"{model['tokens_per_rank']} tokens per rank. Source: `{path.relative_to(ROOT)}`, "
        f"made by `torchrun --nproc_per_node 2 benchmarks/distributed.py`."
    )
    names = {
        "tp_forward": 'tensor parallel (`tp_plan="auto"`), forward',
        "tp_training_step": "tensor parallel, training step (AdamW)",
        "fsdp_training_step": "FSDP2 `fully_shard`, training step (AdamW)",
    }
    rows = [
        [label, ms(r["eager"]["ms"]), ms(r["kernelized"]["ms"]), f"{r['speedup']:.2f}x",
         f"{r['eager']['peak_extra_MiB']:.0f}", f"{r['kernelized']['peak_extra_MiB']:.0f}"]
        for key, label in names.items()
        if (r := result.get(key))
    ]  # fmt: skip
    head = ["run", "eager ms", "kernelized ms", "speed-up"]
    head += ["eager peak MiB", "kernelized peak MiB"]
    return lines + table(head, rows) + [""]


def report_section(path: Path, report: dict, link_root: str = "") -> list[str]:
    """The profiling report's per-stage table (scripts/report.py's JSON); chart links
    start with ``link_root``, the way from the rendered file to the repository root."""
    env, cfg = report["env"], report["config"]
    lines = paragraph(
        f"Profiling report, {stamp(env)}, hidden {cfg['hidden']}, intermediate "
        f"{cfg['intermediate']}, {cfg['dtype']}. Source: `{path.relative_to(ROOT)}`, "
        f"made by `python scripts/report.py`."
    )
    gpu = report["ceilings"] is not None
    head = ["stage", "tokens", "kernels/call" if gpu else "ops/call", cfg["time_label"]]
    head += ["host µs", "fraction of roofline"] if gpu else []
    head += ["first call ms", "recompiles"]
    rows = []
    for name, stage in report["stages"].items():
        for row in stage["rows"].values():
            cells = [name, row["tokens"], row["kernels_per_call"]]
            cells += [ms(row[cfg["time_key"]])]
            if gpu:
                cells += [f"{row['host_us']:.0f}", frac(row["frac_roofline"])]
            cells += [ms(row["first_call_ms"]), stage.get("recompiles", "-")]
            rows.append(cells)
    lines += table(head, rows) + [""]
    folder = path.parent.relative_to(ROOT)
    charts = report.get("charts", [])
    lines += [f"![{c}]({link_root}{folder}/{path.stem}-{c})" for c in charts]
    lines += [""] if report.get("charts") else []
    check = path.with_name(f"{path.stem}-check.json")
    if check.exists():
        lines += check_section(check, json.loads(check.read_text()))
    return lines


def check_section(path: Path, check: dict) -> list[str]:
    """benchmarks/check_report.py's verdict on the report beside it."""
    rows = check["rows"]
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    agree = sum(r["agrees"] for r in rows)
    return paragraph(
        f"Independent timings (`benchmarks/check_report.py`, another process, "
        f"`triton.testing.do_bench` by another route, {check['env']['date']}): {agree} of "
        f"{len(rows)} rows agree within the noise; the largest deviation is "
        f"{abs(worst['ratio'] - 1):.1%} ({worst['stage']}, {worst['tokens']} tokens: "
        f"{ms(worst['report_ms'])} against {ms(worst['independent_ms'])} ms). Source: "
        f"`{path.relative_to(ROOT)}`."
    )


E2E_MODELS = {
    "ours_two_kernels": "fused-geglu, two kernels at decode",
    "free_mlp": "MLPs of zero cost (the ceiling)",
}
# gemm.one_launch_config's choice, as tune.py's decode sweep names it.
DECODE_CONFIG = "(128, 128, 256, 8, 3)"
E2E_TASKS = {
    "prefill": "prefill, ms",
    "generate": "`generate()`, default cache, ms per token",
    "generate_static_cache": "`generate()`, static cache (compiled step), ms per token",
}


def e2e_section(path: Path, result: dict) -> list[str]:
    """The end-to-end rows: eager against kernelized, and the other models of the run;
    then the logits' agreement."""
    model, args = result["model"], result["args"]
    others = [k[: -len("_ms")] for k in result["rows"][0] if k.endswith("_ms")]
    others = [name for name in others if name not in ("eager", "ours")]
    lines = paragraph(
        f"{stamp(result['env'])}: Gemma-2B-shaped model ({model['num_hidden_layers']} "
        f"layers, bf16), eager and kernelized, {args['rounds']} interleaved rounds "
        f"(`{path.relative_to(ROOT)}`, `benchmarks/e2e.py`):"
    )
    head = ["", "eager", "fused-geglu", "speed-up", "per round", "tokens equal"]
    head += [f"{E2E_MODELS.get(name, name)}: speed-up" for name in others]
    rows = []
    for row in result["rows"]:
        equal = row.get("tokens_equal_eager")
        rows.append(
            [E2E_TASKS[row["task"]], f"{row['eager_ms']:.2f}", f"{row['ours_ms']:.2f}",
             f"{row['speedup']:.3f}x", f"{row['speedup_median_of_rounds']:.3f}x",
             "-" if equal is None else ("yes" if equal else "no")]
            + [f"{row[f'{name}_speedup']:.3f}x" for name in others]
        )  # fmt: skip
    lines += table(head, rows) + [""]
    if "logits_agreement" in result:  # none before 2026-12-01T20
        checks = [
            f"{a['tokens']} tokens ({a['positions']} positions): largest difference "
            f"{a['max_abs_diff_over_max_abs']:.2%} of eager's largest logit, argmax equal "
            f"at {a['argmax_equal_fraction']:.0%}"
            for a in result["logits_agreement"]
        ]
        lines += paragraph(
            "Logits against eager's, one forward each: " + "; ".join(checks) + "."
        )
    return lines


# The decode rows README.md shows (docs/results.md: all).
def decode_section(path: Path, result: dict) -> list[str]:
    """The decode MLP's GPU time in one kernel (eager calls) and in two (CUDA graphs,
    torch.compile), from tune.py's decode sweep: the configuration the table uses (an
    older sweep's ``decode_mlp``: DECODE_CONFIG; tune.py's ``decode``: the candidate it
    chose, with the token counts a CUDA graph computes in one kernel)."""
    if "decode" in result:
        sweep = result["decode"]
        config = sweep["chosen"]
        decode = {t: row for t, row in sweep.items() if t.isdigit()}
        most = sweep["one_launch_graph_max_tokens"]
        upto = f"{most} token{'s' if most > 1 else ''}"
        graphs = f"CUDA graphs two (one up to {upto}), " if most else "CUDA graphs "
    else:
        decode, config, graphs = result["decode_mlp"], DECODE_CONFIG, "CUDA graphs "
    fp8 = all("fp8_one_kernel" in row for row in decode.values())
    rows = []
    for tokens, row in decode.items():
        cells = [
            tokens,
            ms(row[config]),
            ms(row["two_kernels"]),
            ms(row["eager"]),
        ]
        if fp8:
            cells += [ms(row["fp8_one_kernel"]), ms(row["fp8_three_kernels"])]
        rows.append(cells)
    lines = paragraph(
        f"Gemma-2B decode MLP, {stamp(result['env'])}, GPU ms by CUDA-graph replay "
        f"(`{path.relative_to(ROOT)}`): eager calls run one kernel (half the host time), "
        f"{graphs}and torch.compile two:"
    )
    head = [
        "tokens",
        "one kernel (eager calls)",
        "two kernels (graphs, compile)",
        "eager",
    ]
    if fp8:
        head += ["FP8, one kernel", "FP8, three kernels"]
    return lines + table(head, rows) + [""]


FP8_PATHS = {
    "fp8_transformers": "FP8, transformers (finegrained-fp8 Triton)",
    "fp8_ours": "FP8, fused-geglu",
    "bf16_eager": "bf16, eager",
    "bf16_ours": "bf16, fused-geglu",
}


README_FP8_TOKENS = (1, 16, 64, 8192)


def fp8_section(path: Path, result: dict, brief: bool = False) -> list[str]:
    """The FP8 MLP against transformers' FP8 path and the bf16 MLPs, forward GPU ms;
    ``brief`` (README): the table of its speeds alone, no sources."""
    ceilings, rows = result["ceilings"], result["forward"]
    if brief:
        names = [n for n in FP8_PATHS if n in rows[0]["ms"]]
        lines = paragraph(
            f"{stamp(result['env'])}: FP8 Gemma-2B MLP, forward ms (graph replay to 64 "
            f"tokens, then eager calls):"
        )
        cells = [
            [str(r["tokens"]), *(ms(r["ms"][n]) for n in names)]
            for r in rows
            if r["tokens"] in README_FP8_TOKENS
        ]
        return lines + table(["tokens", *(FP8_PATHS[n] for n in names)], cells) + [""]
    floor_ms = ceilings["fp8_weight_bytes"] / ceilings["copy_TBps"] / 1e9
    lines = paragraph(
        f"{stamp(result['env'])}: Gemma-2B MLP with `FineGrainedFP8Config` projections "
        f"(e4m3, 128 x 128 blocks, "
        f"dynamic activations), forward ms: CUDA-graph replay up to 64 tokens (a graph "
        f"runs our dual GEMM and down GEMM, where an eager call of up to 16 tokens runs "
        f"the one kernel counted below), beyond that eager calls by do_bench (where the "
        f"host's time per call exceeds the GPU's, it is what they show) "
        f"(`{path.relative_to(ROOT)}`, `benchmarks/fp8.py`; DeepGEMM not measured). FP8 "
        f"weight-streaming floor {floor_ms * 1e3:.1f} us at {ceilings['copy_TBps']:.2f} TB/s; "
        f"`torch._scaled_mm` e4m3 {ceilings['fp8_scaled_mm_TFLOPs']:.0f} TFLOP/s:"
    )
    names = [n for n in FP8_PATHS if n in rows[0]["ms"]]
    head = [
        "tokens",
        *(FP8_PATHS[n] for n in names),
        "fused-geglu FP8 launches (memsets included), eager call",
    ]
    if "fp8_transformers" in names:
        head.append("FP8 speed-up over transformers")
    table_rows = []
    for row in rows:
        cells = [str(row["tokens"]), *(ms(row["ms"][n]) for n in names)]
        cells.append(str(row["kernels"]["fp8_ours"]["kernels_per_call"]))
        if "fp8_transformers" in names:
            cells.append(
                f"{row['ms']['fp8_transformers'] / row['ms']['fp8_ours']:.2f}x"
            )
        table_rows.append(cells)
    lines += table(head, table_rows) + [""]
    errors = result.get("errors_vs_float64", {})
    if errors:
        parts = [
            f"{t} tokens: ours {e['fp8_ours']:.4g}"
            + (
                f" (the kernels a CUDA graph runs {e['fp8_ours_kernels']:.4g})"
                if "fp8_ours_kernels" in e
                else ""
            )
            + (
                f", transformers {e['fp8_transformers']:.4g}"
                if "fp8_transformers" in e
                else ""
            )
            for t, e in errors.items()
        ]
        lines += paragraph(
            "Largest error against float64 of the same quantized model: "
            + "; ".join(parts)
            + "."
        )
    if gemma := result.get("tiny_gemma"):
        lines += paragraph(
            f"A tiny Gemma saved and reloaded with `FineGrainedFP8Config`, kernelized: "
            f"next-token argmax equal to the unkernelized model's at "
            f"{gemma['argmax_agreement']:.1%} of {gemma['positions']} positions (largest "
            f"logit difference {gemma['max_abs_logit_diff']:.3g})."
        )
    return lines


def raw(path: Path) -> dict:
    """A result's JSON as written (no RENAMED: the sweeps name cuBLAS "cublas")."""
    return json.loads(path.read_text())


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(v) for v in version.split("."))


def version_key(path: Path) -> tuple[int, ...]:
    return version_tuple(raw(path)["env"]["triton"])


def newest_per_triton(device: str, *kinds: str) -> list[Path]:
    """The newest ``*-<kind>.json`` of each kind and Triton version on ``device``, by
    version."""
    newest_of = {
        (kind, raw(p)["env"]["triton"]): p
        for kind in kinds
        for p in results(kind, device)
    }
    return sorted(newest_of.values(), key=version_key)


# compare.py runs of some sections, kept beside the full comparison by what they measured.
PARTIAL_COMPARES = ("compare-activation-linear", "compare-linear", "compare-mlp")


def our_times(result: dict) -> dict[str, float]:
    """Our GPU ms per row of a comparison: the activation's, Linear's and the MLP
    layer's, forward and forward+backward, those it measured."""
    times = {}
    for key, label in (("fwd_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
        if key in (act := result.get("activation", {}).get("rows", {}).get("ours", {})):
            times[f"activation, {label}"] = act[key]
    for key, label in (("forward", "forward"), ("fwd_bwd", "forward+backward")):
        for r in result.get("linear", {}).get(key, []):
            times[f"Linear {r['M']} x {r['N']} x {r['K']}, {label}"] = r["ours"]["ms"]
    mlp = result.get("mlp", {})
    for tokens, row in mlp.get("forward", {}).items():
        count = f"{tokens} token{'' if tokens == '1' else 's'}"
        times[f"MLP layer, {count}, forward"] = row["ours_layer"]["ms"]
    if "fwd_bwd" in mlp:
        times["MLP layer, 8192 tokens, forward+backward"] = mlp["fwd_bwd"][
            "ours_layer"
        ]["ms"]
    return times


def triton_change_section(device: str) -> list[str]:
    """Our rows on ``device`` under each newer Triton version against Triton 3.6.0's: the
    newer version's newest run of the row against the 3.6.0 run of it nearest in time
    (the same lease where there was one) of the same package tree."""
    # {Triton version: [(when, package tree, {row: ms}, path)]}
    runs: dict[str, list[tuple[datetime, str, dict[str, float], Path]]] = {}
    kinds = ("compare", *PARTIAL_COMPARES)
    for path in (path for kind in kinds for path in results(kind, device)):
        result = load(path)
        env = result["env"]
        runs.setdefault(env["triton"], []).append(
            (
                datetime.fromisoformat(measured_at(path)),
                commit_of(env),
                our_times(result),
                path,
            )
        )
    base = runs.pop("3.6.0", [])
    lines = []
    for version in sorted(runs, key=version_tuple):
        body, sources = [], set()
        rows = dict.fromkeys(row for *_, times, _ in runs[version] for row in times)
        for row in rows:
            when, tree, times, path = max(
                (r for r in runs[version] if row in r[2]), key=lambda r: r[0]
            )
            pairs = [r for r in base if row in r[2] and r[1] == tree]
            if not pairs:
                continue
            _, _, old, old_path = min(pairs, key=lambda r: abs(r[0] - when))
            sources |= {path, old_path}
            ratio = times[row] / old[row]
            body.append([row, ms(old[row]), ms(times[row]), f"{ratio:.3f}"])
        if body:
            lines += paragraph(
                f"{device}: our GPU time by Triton version, ms: Triton {version}'s newest "
                f"run of each row against the Triton 3.6.0 run nearest in time (above 1: "
                f"slower). Sources: "
                + ", ".join(f"`{p.relative_to(ROOT)}`" for p in sorted(sources))
                + "."
            )
            head = ["row", "Triton 3.6.0", f"Triton {version}", f"{version} / 3.6.0"]
            lines += table(head, body) + [""]
    return lines


FIRST_CALL_MODES = {
    "eager": "eager",
    "compile": "torch.compile",
    "liger": "Liger",
    "ours": "layer, precompiled",
    "ours_jit": "layer, Triton's JIT",
}


def first_call_rows(result: dict):
    """(mode, label, row) of each mode that ran in a first-call result, in table order."""
    for mode, label in FIRST_CALL_MODES.items():
        row = result.get(mode)
        if row and "error" not in row:
            yield mode, label, row


def first_call_section(paths: list[Path]) -> list[str]:
    """First calls in a fresh process with empty Triton and Inductor caches, per Triton
    version: each token count's first call and the new token counts' sum, ms."""
    lines = []
    for path in paths:
        result = raw(path)
        tokens = [str(t) for t in result["tokens"]]
        count = len(result["eager"]["new_sizes"])
        lines += paragraph(
            f"{stamp(result['env'])}: the first call of a fresh process with empty "
            f"Triton and Inductor caches at each token count, then {count} new token "
            f"counts (sum), Gemma-2B MLP, bf16, ms (`benchmarks/first_call.py`):"
        )
        rows = [
            [label, *(f"{row['first_call_ms'][t]:.1f}" for t in tokens),
             f"{row['new_sizes_total_ms']:.1f}",
             "yes" if row["triton_driver_started"] else "no"]
            for mode, label, row in first_call_rows(result)
        ]  # fmt: skip
        head = ["first call at", *tokens, f"{count} new", "Triton's driver started"]
        lines += table(head, rows) + [""]
        if generate := result.get("generate"):
            lines += generate_lines(generate)
    return lines


def generate_lines(generate: dict) -> list[str]:
    """The first greedy generate() of the Gemma-2B-shaped model, each mode in its own fresh
    process, and the median of three after it."""
    lines = paragraph(
        f"The first greedy `generate()` of a fresh process ({generate['prompt_tokens']}"
        f"-token prompt, {generate['new_tokens']} new tokens, the Gemma-2B-shaped "
        f"GemmaForCausalLM of `benchmarks/e2e.py`, random weights), then the median of "
        f"three more, ms:"
    )
    rows = [
        [label, f"{row['first_generate_ms']:.0f}", f"{row['warm_generate_ms']:.0f}",
         "-" if mode == "eager" or "tokens_equal_eager" not in row
         else ("yes" if row["tokens_equal_eager"] else "no")]
        for mode, label, row in first_call_rows(generate)
    ]  # fmt: skip
    head = ["model", "first generate()", "later (median)", "tokens equal eager's"]
    return lines + table(head, rows) + [""]


def sweep_8192_section(paths: list[Path]) -> list[str]:
    """The 8192-token GEMM sweeps by Triton version: our dual GEMM (gate and up) and down
    GEMM at the launch table's tiles against cuBLAS, ``geglu_mlp`` against the eager
    MLP, and the fastest tile swept."""
    sweeps = [raw(p) for p in paths]
    sources = ", ".join(f"`{p.relative_to(ROOT)}`" for p in paths)
    lines = paragraph(
        f"{stamp(*(s['env'] for s in sweeps))}: the Gemma-2B MLP's GEMMs at 8192 tokens "
        f"by Triton version, bf16, ms, eager calls: our kernels at the launch table's "
        f"tiles (the sweep's `None`) against cuBLAS (`F.linear`; gate and up: two calls) "
        f"and `geglu_mlp` against the eager MLP ({sources}):"
    )
    head = ["Triton", "dual GEMM (gate, up)", "cuBLAS gate + up", "down GEMM"]
    head += ["cuBLAS down", "`geglu_mlp`", "eager MLP"]
    head += [
        "dual GEMM, fastest other tile swept",
        "down GEMM, fastest other tile swept",
    ]
    rows = []
    for s in sweeps:
        dual, down = s["dual/8192"], s["down/8192"]
        cells = [s["env"]["triton"], ms(dual["None"]), ms(dual["cublas_x2"])]
        cells += [ms(down["None"]), ms(down["cublas"]), ms(s["mlp_fn"])]
        cells += [ms(s["mlp_eager"])]
        for sweep in (dual, down):
            tiles = {k: v for k, v in sweep.items() if k.startswith("(")}
            tiles = {k: v for k, v in tiles.items() if isinstance(v, float)}
            best = min(tiles, key=tiles.get)
            cells.append(f"{ms(tiles[best])} {best}")
        rows.append(cells)
    return lines + table(head, rows) + [""]


def sweep_decode_section(path: Path) -> list[str]:
    """The decode sweep at the launch tables' tiles: the whole-MLP kernel at up to 16
    tokens, our dual and down GEMMs, cuBLAS's down projection and ``geglu_mlp`` beyond,
    against the weight-streaming floor."""
    result = raw(path)
    floor = result["floor_us"] / 1e3
    lines = paragraph(
        f"Gemma-2B decode MLP, {stamp(result['env'])}, bf16, GPU ms by CUDA-graph replay, "
        f"the launch tables' tiles (`None` in `{path.relative_to(ROOT)}`, beside the other "
        f"tiles swept): the one kernel for the whole MLP that eager calls of 16 tokens or "
        f"fewer run; at more tokens our dual GEMM, our down GEMM, cuBLAS's down "
        f"projection and `geglu_mlp`. Floor: the three weights' bytes at the run's copy "
        f"rate ({result['ceilings']['copy_TBps']:.2f} TB/s):"
    )
    by_tokens: dict[int, dict[str, float]] = {}
    for key, value in result.items():
        name, _, tokens = key.partition("/")
        if tokens.isdigit():  # one_launch/1, dual/32, mlp/32...
            by_tokens.setdefault(int(tokens), {})[name] = value
    head = ["tokens", "one kernel", "dual GEMM", "down GEMM", "cuBLAS down"]
    head += ["`geglu_mlp`", "floor", "fraction of floor"]
    rows = []
    for tokens, row in sorted(by_tokens.items()):
        one = row.get("one_launch", {}).get("None")
        dual = row.get("dual", {}).get("None")
        down = row.get("down", {})
        mlp = row.get("mlp")
        ours = one if one is not None else mlp
        us = [one, dual, down.get("None"), down.get("cublas"), mlp]
        cells = [tokens] + [ms(v / 1e3) if v is not None else "-" for v in us]
        cells += [ms(floor), frac(floor / (ours / 1e3)) if ours else "-"]
        rows.append(cells)
    return lines + table(head, rows) + [""]


def summary_families_section(paths: list[Path]) -> list[str]:
    """README: each family's layer against eager, a column per GPU (its newest run)."""
    results = [load(p) for p in paths]
    lines = paragraph(
        "Feed-forwards, bf16, GPU time by CUDA-graph replay: eager, then fused-geglu, ms; "
        + "; ".join(stamp(r["env"]) for r in results)
        + ":"
    )
    families = [r["families"] for r in results]
    rows = []
    for name in dict.fromkeys(name for f in families for name in f):
        size = next(f[name] for f in families if name in f)
        cells = [
            f"{ms(r['eager_ms'])}, {ms(r['ours_ms'])} ({r['speedup']:.2f}x)"
            if (r := f.get(name))
            else "-"
            for f in families
        ]
        rows.append([name, f"{size['tokens']} x {size['hidden']}", *cells])
    head = ["feed-forward", "tokens x hidden"]
    head += [device_of(p) for p in paths]
    return lines + table(head, rows) + [""]


def render_summary() -> str:
    """README.md's text between the markers: the families, a column per GPU; FP8 per
    GPU; end to end, a row per GPU (each where measured)."""
    lines = paragraph(
        "Every table, with sources and methods: [docs/results.md](docs/results.md)."
    )
    families = [path for gpu in gpus() if (path := newest_families(gpu))]
    if families:
        lines += summary_families_section(families)
    for gpu in gpus():
        if path := newest("fp8", gpu):
            lines += fp8_section(path, load(path), brief=True)
    paths = [path for gpu in gpus() if (path := newest("e2e", gpu))]
    if paths:
        lines += summary_e2e_section(paths)
    return "\n".join(lines) + "\n"


def summary_e2e_section(paths: list[Path]) -> list[str]:
    """README.md's end-to-end table: a row per GPU (its newest e2e.py run), eager and
    kernelized per task, and whether greedy generation gave eager's tokens in all."""
    results = [load(p) for p in paths]
    layers = dict.fromkeys(r["model"]["num_hidden_layers"] for r in results)
    equal = [r.get("tokens_equal_eager") for res in results for r in res["rows"]]
    lines = paragraph(
        f"Gemma-2B-shaped model, {' and '.join(map(str, layers))} layers, bf16 "
        f"(`benchmarks/e2e.py`): eager, then fused-geglu, ms (`generate()`: per new "
        f"token), medians of interleaved rounds, and the median of the rounds' speed-ups "
        f"(steady against a host that drifts over a run); generated tokens "
        f"{'equal' if all(e is not False for e in equal) else 'NOT all equal to'} "
        f"eager's:"
    )
    head = ["GPU, date, versions, rounds", *E2E_TASKS.values()]
    rows = []
    for res in results:
        env = res["env"]
        cells = {
            r["task"]: f"{r['eager_ms']:.2f}, {r['ours_ms']:.2f} "
            f"({r['speedup_median_of_rounds']:.2f}x)"
            for r in res["rows"]
        }
        label = (
            f"{env['device']}, {env['date']}, Triton {env['triton']}, transformers "
            f"{env['transformers']}, {res['args']['rounds']} rounds"
        )
        rows.append([label, *(cells.get(task, "-") for task in E2E_TASKS)])
    return lines + table(head, rows) + [""]


# docs/results.md's sections of one GPU after its comparison, each from its newest file.
SECTIONS = {"tune-decode": decode_section, "e2e": e2e_section, "fp8": fp8_section}
SECTIONS |= {"families": families_section, "distributed": distributed_section}


def render() -> str:
    """docs/results.md's text between the markers: every table, per GPU."""
    lines = []
    for gpu in gpus():
        lines += [f"### {gpu}", ""]
        compare = newest("compare", gpu)
        lines += compare_section(compare, load(compare))
        rerun = newest("compare-training", gpu)
        if rerun and measured_at(rerun) >= measured_at(compare):
            lines += training_rerun_section(rerun, load(rerun))
        for path in newest_per_triton(gpu, *PARTIAL_COMPARES):
            lines += compare_section(path, load(path))
        lines += triton_change_section(gpu)
        for kind, section in SECTIONS.items():
            path = newest_families(gpu) if kind == "families" else newest(kind, gpu)
            if path and path.name.endswith(f"-{kind}.json"):  # not a comparison's
                lines += section(path, load(path))
        if paths := newest_per_triton(gpu, "sweep-8192"):
            lines += sweep_8192_section(paths)
        if path := newest("sweep-decode", gpu):
            lines += sweep_decode_section(path)
        if paths := newest_per_triton(gpu, "first-call"):
            lines += first_call_section(paths)
        if path := newest("report", gpu):
            lines += report_section(path, load(path), link_root="../")
    return "\n".join(lines) + "\n"


# Each file with its block's renderer.
TARGETS = {README: render_summary, RESULTS_DOC: render}


def draw_report_charts() -> None:
    """Each GPU's newest report's PNG charts beside its JSON (matplotlib: not byte-stable,
    so --check compares only the text)."""
    paths = [path for gpu in gpus() if (path := newest("report", gpu))]
    if not paths:
        return
    import report  # beside this script; imports torch, so only here

    for path in paths:
        report.charts(json.loads(path.read_text()), RESULTS, prefix=f"{path.stem}-")


def replace_section(text: str, section: str, name: str = "README.md") -> str:
    """``text`` with its one block between the markers replaced by ``section``."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"{name} must have exactly one {START} ... {END} block")
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{section}{END}{tail}"


def stale() -> list[Path]:
    """The files whose generated block differs from the JSON."""
    return [
        path
        for path, render_block in TARGETS.items()
        if replace_section(
            text := path.read_text(), render_block(), path.relative_to(ROOT).as_posix()
        )
        != text
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a results block is out of date"
    )
    args = parser.parse_args()
    if args.check:
        if paths := stale():
            names = ", ".join(p.relative_to(ROOT).as_posix() for p in paths)
            print(f"{names}: results are out of date: run `make results`")
            return 1
        return 0
    for path, render_block in TARGETS.items():
        name = path.relative_to(ROOT).as_posix()
        path.write_text(replace_section(path.read_text(), render_block(), name))
    draw_report_charts()
    print("README.md and docs/results.md results regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
