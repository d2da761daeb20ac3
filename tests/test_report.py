"""The benchmark scripts (`kernels benchmark .`), the profiling report (scripts/report.py)
and the README results, which scripts/render_results.py must reproduce from the JSON."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import HAS_GPU, ROOT

BENCHMARKS = sorted((ROOT / "benchmarks").glob("benchmark*.py"))
STAGES = ["linear_compiled", "mlp_ours_dual_gemm"]
TOKENS = [1, 16]


def load_script(name: str, folder: str = "scripts"):
    """scripts/<name>.py (or <folder>/<name>.py) as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_scripts_exist():
    expected = {f"benchmark_{name}.py" for name in ("activation", "linear", "mlp")}
    assert expected <= {p.name for p in BENCHMARKS}


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_small_workload(script, fused_geglu, device):
    """What the kernels runner does for each workload, for the small one: a fresh
    instance, setup_, benchmark_, then verify_'s reference against self.out."""
    # Imported here: the kernels CLI needs sigstore, which the GPU image lacks.
    from kernels.cli.benchmark import discover_benchmark_classes

    classes = discover_benchmark_classes(script, ROOT)
    assert classes
    for cls in classes:
        for workload in ("small", "medium", "large"):
            for step in ("setup", "benchmark", "verify"):
                assert callable(getattr(cls, f"{step}_{workload}")), (cls, step)
        bench = cls()
        bench.kernel, bench.device = fused_geglu, device
        torch.manual_seed(bench.seed)
        bench.setup_small()
        bench.benchmark_small()
        ref = bench.verify_small()
        assert bench.out.shape == ref.shape and bench.out.dtype == ref.dtype
        assert torch.allclose(bench.out, ref, atol=1e-2), cls.__name__  # the runner's
        if ref.dtype == torch.float32:
            torch.testing.assert_close(bench.out, ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    args = ["--hidden", "64", "--intermediate", "160", "--dtype", "float32"]
    args += ["--tokens", *map(str, TOKENS), "--stages", *STAGES, "--out", str(out)]
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "report.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| linear_compiled | 16 |" in run.stdout  # the markdown table, printed
    return out


def test_report_files(report_dir):
    names = {p.name for p in report_dir.iterdir()}
    expected = {"report.json", "report.md", "time_per_stage.png"}
    expected |= {f"trace_{s}.json" for s in STAGES}
    expected |= {"roofline_fraction.png"} if HAS_GPU else set()
    assert expected <= names
    for stage in STAGES:
        trace = json.loads((report_dir / f"trace_{stage}.json").read_text())
        assert trace["traceEvents"]
    assert (report_dir / "time_per_stage.png").read_bytes()[:4] == b"\x89PNG"


def test_report_json(report_dir):
    report = json.loads((report_dir / "report.json").read_text())
    assert {"env", "config", "ceilings", "notes", "stages", "charts"} <= set(report)
    assert report["config"]["tokens"] == TOKENS
    assert list(report["stages"]) == STAGES
    time_key = report["config"]["time_key"]
    assert time_key == ("gpu_ms" if HAS_GPU else "cpu_ms")
    for stage in report["stages"].values():
        assert stage["cold_start_ms"] == stage["rows"]["1"]["first_call_ms"] > 0
        assert list(stage["rows"]) == ["1", "16"]
        for row in stage["rows"].values():
            assert row[time_key] > 0 and row["kernels_per_call"] >= 1
            assert sum(row["kernels"].values()) == row["kernels_per_call"]
            assert row["bytes"] > 0 and row["flops"] > 0
            if HAS_GPU:
                assert row["host_us"] > 0 and 0 < row["frac_roofline"]
    compiled = report["stages"]["linear_compiled"]
    # Static shapes at 1 token, then one recompile with a dynamic token count.
    assert compiled["frames_compiled"] >= 1 and compiled["compile_s"] > 0
    assert compiled["recompiles"] == compiled["frames_compiled"] - 1
    dual = report["stages"]["mlp_ours_dual_gemm"]["rows"]["16"]
    ns = report["env"]["kernel"]
    if not HAS_GPU:  # the outermost ops: our two custom ops
        assert dual["kernels"] == {f"{ns}::geglu_linear": 1, f"{ns}::linear": 1}
    t, h, i = 16, 64, 160  # x, 3 weights, output, and the product's round trip
    assert dual["bytes"] == 4 * (2 * t * h + 3 * i * h + 2 * t * i)
    assert dual["flops"] == 6 * t * h * i


def test_report_times_before_profiling(tmp_path, monkeypatch):
    """Every row is timed before the profiler runs: a process that has profiled runs later
    kernels slower (benchmarks/NOTES.md, session 5)."""
    report = load_script("report")
    calls = []
    for name, tag in (("device_ms", "time"), ("launched", "profile")):
        original = getattr(report, name)

        def record(*args, _original=original, _tag=tag, **kwargs):
            calls.append(_tag)
            return _original(*args, **kwargs)

        monkeypatch.setattr(report, name, record)
    args = ["--hidden", "32", "--intermediate", "64", "--dtype", "float32"]
    args += ["--tokens", "1", "3", "--stages", "linear_eager", "mlp_eager"]
    assert report.main([*args, "--out", str(tmp_path)]) == 0
    assert calls == ["time"] * 4 + ["profile"] * 4


def test_report_renders(report_dir):
    """A report JSON, as if committed to benchmarks/results/, renders as a table."""
    render = load_script("render_results")
    report = json.loads((report_dir / "report.json").read_text())
    lines = render.report_section(render.RESULTS / "date-device-report.json", report)
    text = "\n".join(lines)
    assert all(f"| {s} | 16 |" in text for s in STAGES)


def test_check_report_rows(report_dir, fused_geglu):
    """benchmarks/check_report.py re-times every row of a report (here with CPU wall
    times in place of the GPU timers) and compares each with the report's time."""
    check_report = load_script("check_report", "benchmarks")
    report = json.loads((report_dir / "report.json").read_text())
    timed, wall_ms = [], load_script("report").wall_ms

    def wall(fn, reported_ms):
        assert reported_ms > 0
        timed.append(fn)
        return [wall_ms(fn) for _ in range(5)]

    timers = {
        row["timer"]: wall
        for s in report["stages"].values()
        for row in s["rows"].values()
    }
    rows = check_report.check(report, fused_geglu, timers)
    assert len(rows) == len(timed) == len(STAGES) * len(TOKENS)
    assert [(r["stage"], r["tokens"]) for r in rows] == [
        (s, t) for s in STAGES for t in TOKENS
    ]
    for r in rows:
        time_key = report["config"]["time_key"]
        assert (
            r["report_ms"]
            == report["stages"][r["stage"]]["rows"][str(r["tokens"])][time_key]
        )
        assert r["independent_q20_ms"] <= r["independent_ms"] <= r["independent_q80_ms"]
        assert r["ratio"] == pytest.approx(r["report_ms"] / r["independent_ms"])


def test_check_report_agreement():
    """Agreement is a ratio within max(5%, the independent timing's q20-q80 spread)."""
    agreement = load_script("check_report", "benchmarks").agreement
    steady = [1.0] * 8 + [1.01, 0.99]
    assert agreement(1.04, steady)["agrees"] and not agreement(1.06, steady)["agrees"]
    noisy = [0.8, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3]
    row = agreement(1.12, noisy)  # q20 0.98, q80 1.12: a 14% tolerance
    assert row["tolerance"] == pytest.approx(0.14) and row["agrees"]
    assert not agreement(1.5, noisy)["agrees"]


def test_families_benchmark(fused_geglu, device):
    """compare.py's families section on small sizes (a smoke run: one call each instead
    of the GPU timers): every family's layer runs and matches its eager module."""
    compare = load_script("compare", "benchmarks")
    calls = []

    def once(fn):
        calls.append(fn())
        return 1.0

    result = compare.families(
        fused_geglu, device, torch.float16, scale=32, timer=once,
        host_timer=lambda fns: {name: once(fn) for name, fn in fns.items()},
    )  # fmt: skip
    assert len(result) == 4 and len(calls) == 16
    for name, row in result.items():
        assert row["speedup"] == 1.0 and row["max_abs_diff"] < 0.05, (name, row)


def test_compare_interleaves_training_timings(monkeypatch):
    """compare.py times the peers' training steps in interleaved rounds (the first peer
    timed alone read up to 0.23 ms slow) and reports each one's median."""
    compare = load_script("compare", "benchmarks")
    order, fake_ms = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def bench(fn):
        order.append(fn())
        return next(fake_ms[order[-1]])

    monkeypatch.setattr(compare, "bench", bench)
    timed = compare.interleaved_ms({"a": lambda: "a", "b": lambda: "b"})
    assert order == ["a", "b"] * 3
    assert timed == {"a": (2.0, [3.0, 1.0, 2.0]), "b": (5.0, [5.0, 4.0, 6.0])}


def test_results_match_json():
    """README's summary and docs/results.md's tables are exactly what render_results.py
    makes of the JSON, each in its one block."""
    render = load_script("render_results")
    assert set(render.TARGETS) == {ROOT / "README.md", ROOT / "docs" / "results.md"}
    assert render.stale() == [], "results differ from the JSON: run `make results`"


def test_results_check_command():
    """`render_results.py --check`, as CI or a user runs it."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render_results.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_summary_numbers_come_from_json():
    """The README's summary quotes the families and MLP rows of the committed JSON."""
    render = load_script("render_results")
    summary = render.render_summary()
    families = json.loads(render.newest("families").read_text())["families"]
    for name, row in families.items():
        assert f"| {name} |" in summary and render.ms(row["ours_ms"]) in summary
    assert "Gemma-2B MLP forward" in summary


def test_one_block_per_file():
    render = load_script("render_results")
    with pytest.raises(SystemExit, match="exactly one"):
        render.replace_section(f"{render.START}{render.END}" * 2, "x")
    assert render.replace_section(f"a{render.START}old{render.END}b", "new\n") == (
        f"a{render.START}\nnew\n{render.END}b"
    )


def test_render_rounding():
    render = load_script("render_results")
    assert [render.ms(v) for v in (3.12677, 0.2008, 0.0250164, 0.018946)] == [
        "3.127",
        "0.201",
        "0.0250",
        "0.0189",
    ]
