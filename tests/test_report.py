"""The benchmark library (benchmarks/bench_lib.py) and the scripts built on it: the
`kernels benchmark .` workloads, the profiling report (scripts/report.py), its check, the
comparison and end-to-end benchmarks (their GPU-free parts), and the README results, which
scripts/render_results.py must reproduce from the JSON."""

import json
import subprocess
import sys
import types

import pytest
import torch
from conftest import HAS_GPU, ROOT, run_python

sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "benchmarks")]
import bench_lib as lib
import check_report
import compare
import e2e
import render_results as render
import report
import tune

BENCHMARKS = sorted((ROOT / "benchmarks").glob("benchmark*.py"))
STAGES = ["linear_compile", "mlp_ours_dual_gemm"]
TOKENS = [1, 16]
GPU_SCRIPTS = {  # script: arguments that would make it run
    "compare.py": ["--only", "host"],
    "tune.py": ["--out", "tune.json"],
    "launch_overhead.py": [],
    "check_report.py": ["report.json"],
    "distributed.py": [],
    "e2e.py": ["--layers", "1", "--prefill-tokens", "8", "--new-tokens", "2"],
    "layer_host_time.py": ["--baseline", "."],
    "mlp_sustained.py": [],
}


def test_benchmark_scripts_exist():
    expected = {f"benchmark_{name}.py" for name in ("activation", "linear", "mlp")}
    assert expected <= {p.name for p in BENCHMARKS}


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_small_workload(script, fused_geglu, device):
    """What the kernels runner does for each workload, for the small one: a fresh
    instance, setup_, benchmark_, then verify_'s reference against self.out."""
    # The kernels CLI needs sigstore, which the GPU image lacks: skipped there.
    cli = pytest.importorskip(
        "kernels.cli.benchmark", reason="kernels' CLI needs sigstore"
    )
    discover_benchmark_classes = cli.discover_benchmark_classes

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
    assert "| linear_compile | 16 |" in run.stdout  # the markdown table, printed
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
    result = json.loads((report_dir / "report.json").read_text())
    assert {"env", "config", "ceilings", "notes", "stages", "charts"} <= set(result)
    assert result["config"]["tokens"] == TOKENS
    assert list(result["stages"]) == STAGES
    time_key = result["config"]["time_key"]
    assert time_key == ("gpu_ms" if HAS_GPU else "cpu_ms")
    for stage in result["stages"].values():
        assert stage["cold_start_ms"] == stage["rows"]["1"]["first_call_ms"] > 0
        assert list(stage["rows"]) == ["1", "16"]
        for row in stage["rows"].values():
            assert row[time_key] > 0 and row["kernels_per_call"] >= 1
            assert sum(row["kernels"].values()) == row["kernels_per_call"]
            assert row["bytes"] > 0 and row["flops"] > 0
            if HAS_GPU:
                assert row["host_us"] > 0 and 0 < row["frac_roofline"]
    compiled = result["stages"]["linear_compile"]
    # Static shapes at 1 token, then one recompile with a dynamic token count.
    assert compiled["frames_compiled"] >= 1 and compiled["compile_s"] > 0
    assert compiled["recompiles"] == compiled["frames_compiled"] - 1
    dual = result["stages"]["mlp_ours_dual_gemm"]["rows"]["16"]
    ns = result["env"]["kernel"]
    if not HAS_GPU:  # the outermost ops: fp32 takes the projections and our activation
        assert dual["kernels"] == {"aten::linear": 3, f"{ns}::geglu": 1}
    t, h, i = 16, 64, 160  # x, 3 weights, output, and the product's round trip
    assert dual["bytes"] == 4 * (2 * t * h + 3 * i * h + 2 * t * i)
    assert dual["flops"] == 6 * t * h * i


def test_report_times_before_profiling(tmp_path, monkeypatch):
    """Every row is timed before the profiler runs: a process that has profiled runs later
    kernels slower (docs/decisions/0013-benchmark-method.md)."""
    calls = []
    for name, tag in (("device_ms", "time"), ("launched", "profile")):
        original = getattr(lib, name)

        def record(*args, _original=original, _tag=tag, **kwargs):
            calls.append(_tag)
            return _original(*args, **kwargs)

        monkeypatch.setattr(lib, name, record)
    args = ["--hidden", "32", "--intermediate", "64", "--dtype", "float32"]
    args += ["--tokens", "1", "3", "--stages", "linear_eager", "mlp_eager"]
    assert report.main([*args, "--out", str(tmp_path)]) == 0
    assert calls == ["time"] * 4 + ["profile"] * 4


def test_report_renders(report_dir):
    """A report JSON, as if committed to benchmarks/results/, renders as a table."""
    result = json.loads((report_dir / "report.json").read_text())
    lines = render.report_section(render.RESULTS / "date-device-report.json", result)
    text = "\n".join(lines)
    assert all(f"| {s} | 16 |" in text for s in STAGES)


def test_check_report_rows(report_dir, fused_geglu):
    """benchmarks/check_report.py re-times every row of a report (here with CPU wall
    times in place of the GPU timers) and compares each with the report's time."""
    result = json.loads((report_dir / "report.json").read_text())
    timed = []

    def wall(fn, reported_ms):
        assert reported_ms > 0
        timed.append(fn)
        return [lib.timed(fn)[1] for _ in range(5)]

    timers = {
        row["timer"]: wall
        for s in result["stages"].values()
        for row in s["rows"].values()
    }
    rows = check_report.check(result, fused_geglu, timers)
    assert len(rows) == len(timed) == len(STAGES) * len(TOKENS)
    assert [(r["stage"], r["tokens"]) for r in rows] == [
        (s, t) for s in STAGES for t in TOKENS
    ]
    for r in rows:
        time_key = result["config"]["time_key"]
        assert (
            r["report_ms"]
            == result["stages"][r["stage"]]["rows"][str(r["tokens"])][time_key]
        )
        assert r["independent_q20_ms"] <= r["independent_ms"] <= r["independent_q80_ms"]
        assert r["ratio"] == pytest.approx(r["report_ms"] / r["independent_ms"])


def test_check_report_agreement():
    """Agreement is a ratio within max(5%, the independent timing's q20-q80 spread)."""
    agreement = check_report.agreement
    steady = [1.0] * 8 + [1.01, 0.99]
    assert agreement(1.04, steady)["agrees"] and not agreement(1.06, steady)["agrees"]
    noisy = [0.8, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.1, 1.2, 1.3]
    row = agreement(1.12, noisy)  # q20 0.98, q80 1.12: a 14% tolerance
    assert row["tolerance"] == pytest.approx(0.14) and row["agrees"]
    assert not agreement(1.5, noisy)["agrees"]


def test_families_benchmark(fused_geglu, device):
    """compare.py's families section on small sizes (a smoke run: one call each instead
    of the GPU timers): every family's layer runs and matches its eager module."""
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


def test_training_benchmark(fused_geglu, device, monkeypatch):
    """compare.py's training section on small sizes (a smoke run: one step each instead of
    the GPU timer and memory measure; torch.compile left out, inductor's CPU compile is
    slow): every family's layer trains, dropout off, with eager's gradients, and so does
    the Gemma MLP with frozen weights (the input's gradient only)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    trained = []

    def once(steps):
        grads = {peer: step() for peer, step in steps.items()}
        for got in grads.values():
            torch.testing.assert_close(got, grads["eager"], rtol=1e-4, atol=1e-4)
        trained.append((set(steps), len(grads["eager"])))
        return {peer: (1.0, [1.0]) for peer in steps}

    measured, gpu_timed, host_timed = [], [], []
    result = compare.training(
        fused_geglu, device, torch.float32, scale=32, timer=once,
        memory=lambda step: measured.append(step) or 0.0,
        gpu_timer=lambda step: gpu_timed.append(step) or 0.5,
        host_timer=lambda steps: host_timed.append(steps) or dict.fromkeys(steps, 9.0),
    )  # fmt: skip
    frozen = "Gemma-2B MLP, frozen weights"
    modules = compare.family_modules(fused_geglu, 32)
    larger = {
        f"{name}, {factor}x the tokens": name
        for name, factor in compare.LARGER_TRAINING.items()
    }
    assert list(result) == [*modules, *larger, frozen]
    params = {name: len(list(m[0].parameters())) for name, m in modules.items()}
    params |= {row: params[name] for row, name in larger.items()}
    liger = {"liger"} if lib.liger() else set()
    for (names, n_grads), (name, row) in zip(trained, result.items(), strict=True):
        assert set(row) == {"tokens", "hidden"} | names, name
        if name == frozen or name in larger:
            assert names == {"eager", "ours"}
        else:
            gemma = liger if name == "Gemma-2B MLP" else set()
            assert names == {"eager", "compile", "ours"} | gemma, name
        assert n_grads == 1 + (0 if name == frozen else params[name]), name
        for peer in names:
            assert row[peer] == {
                "ms": 1.0, "rounds_ms": [1.0], "gpu_ms": 0.5,
                "gpu_rounds_ms": [0.5] * 3, "peak_extra_MiB": 0.0, "host_us": 9.0,
            }  # fmt: skip
    steps = sum(len(names) for names, _ in trained)
    assert len(measured) == steps and len(gpu_timed) == 3 * steps  # 3 rounds
    # every step under SHORT_STEP_MS (0.5 ms here): host-timed, each section once
    assert [set(s) for s in host_timed] == [names for names, _ in trained]


def test_render_linear_fwd_bwd():
    """compare.py's Linear forward+backward rows render as a table; results written when
    it timed one shape (``fwd_bwd_<MxNxK>_bias_ms``) as a sentence."""
    with_linear = [
        render.load(p) for p in sorted(render.RESULTS.glob("*-compare.json"))
    ]
    result = [r for r in with_linear if "linear" in r][-1]  # the newest that timed it
    forward, path = result["linear"]["forward"], render.RESULTS / "x-compare.json"
    ms = {"eager": 2.0, "compile": 3.0, "ours": 1.0}
    old = {"forward": forward, "fwd_bwd_8x16x32_bias_ms": ms}
    text = " ".join(render.compare_section(path, result | {"linear": old}))
    assert "at 8 x 16 x 32: fused-geglu 1.000 ms, eager 2.000 ms." in text
    row = {"M": 8, "N": 16, "K": 32, "ours_vs_eager": 2.0}
    row |= {peer: {"ms": t, "rounds_ms": [t]} for peer, t in ms.items()}
    new = {"forward": forward, "fwd_bwd": [row]}
    text = "\n".join(render.compare_section(path, result | {"linear": new}))
    assert "| 8, 16, 32 | 1.000 | 2.000 | 3.000 | 2.00 |" in text
    assert "fused-geglu 1.000 ms, eager" not in text


def test_interleaved_ms(monkeypatch):
    """Peers are timed in interleaved rounds, every other one in reverse order (the first
    peer timed alone read up to 0.23 ms slow) and each one's median is reported."""
    order, fake_ms = [], {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0])}

    def bench(fn):
        order.append(fn())
        return next(fake_ms[order[-1]])

    monkeypatch.setattr(lib, "bench_ms", bench)
    timed = lib.interleaved_ms({"a": lambda: "a", "b": lambda: "b"})
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert timed == {"a": (2.0, [3.0, 1.0, 2.0]), "b": (5.0, [5.0, 4.0, 6.0])}


def test_host_us_interleaves_short_loops():
    """Host time: one warm-up call each, then per round an n-call loop of each function
    in turn, every other round reversed; the median per call."""
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "ab"}
    us = lib.host_us(fns, n=2, rounds=3)
    ab, ba = ["a", "a", "b", "b"], ["b", "b", "a", "a"]  # every other round reversed
    assert order == ["a", "b"] + ab + ba + ab
    assert set(us) == {"a", "b"} and all(t > 0 for t in us.values())


def fake_event(name, device_type, annotation=False, parent=None):
    return types.SimpleNamespace(
        name=name,
        device_type=device_type,
        is_user_annotation=annotation,
        cpu_parent=parent,
    )


def test_kernel_counts_drop_annotations():
    """GPU kernels only: no CPU events and no GPU-side ranges of record_function
    annotations (counted as kernels once; git show 5e74ca8:benchmarks/NOTES.md, session 4)."""
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    outer = fake_event("fused::geglu_mlp", cpu)
    events = [
        outer,
        fake_event("aten::mm", cpu, parent=outer),
        fake_event("fused-geglu linear", cpu, annotation=True),
        fake_event("fused-geglu linear", cuda, annotation=True),
        fake_event("_gemm_kernel", cuda),
        fake_event("_gemm_kernel", cuda),
        fake_event("_geglu_fwd_kernel", cuda),
    ]
    counts = lib.kernel_counts(events, gpu=True)
    assert counts == {"_gemm_kernel": 2, "_geglu_fwd_kernel": 1}
    # Without a GPU: the outermost ops.
    assert lib.kernel_counts(events, gpu=False) == {"fused::geglu_mlp": 1}


def test_environment_record(fused_geglu):
    env = lib.environment(fused_geglu)
    assert json.loads(json.dumps(env)) == env
    assert (
        env["torch"] == torch.__version__ and env["kernel"] == fused_geglu._ops.ops.name
    )
    keys = {
        "date",
        "device",
        "triton",
        "transformers",
        "kernels",
        "liger_kernel",
        "git",
    }
    assert keys <= set(env)
    assert env["git"] is None or len(env["git"].removesuffix("-dirty")) >= 7
    path = lib.results_path(env | {"device": "NVIDIA H200"}, "e2e")
    assert (
        path == ROOT / "benchmarks" / "results" / f"{env['date']}-NVIDIA_H200-e2e.json"
    )


def test_peer_names():
    """One naming scheme: <op>_<peer>, the peers eager, compile, liger and ours."""
    peers = {name.split("_", 1)[1] for name in lib.STAGES}
    assert peers == {"eager", "compile", "liger", "ours", "ours_layer"} | {
        "ours_dual_gemm",
        "ours_fused_activation",
    }
    with pytest.raises(ValueError, match="unknown stages"):
        lib.stages(["mlp_ours_fused_act"], None, 8, 16, torch.float32)


def test_report_writes_before_charts(report_dir, tmp_path, monkeypatch, capsys):
    """Without matplotlib the report still writes its JSON and markdown, with a note."""
    result = json.loads((report_dir / "report.json").read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    report.write(result, tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["charts"] == []
    assert "| linear_compile | 16 |" in (tmp_path / "report.md").read_text()
    assert "No charts" in capsys.readouterr().out


def test_gpu_scripts_exit_clearly_without_cuda():
    """With CUDA hidden, each GPU-only script says in one line that it needs a CUDA GPU
    and exits with status 2 (one interpreter runs them all: torch imports once)."""
    run = run_python(
        f"""
        import contextlib, io, json, runpy, sys
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        exits = {{}}
        for script, args in {GPU_SCRIPTS!r}.items():
            sys.argv = [f"{ROOT}/benchmarks/{{script}}", *args]
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    runpy.run_path(sys.argv[0], run_name="__main__")
            except SystemExit as error:
                exits[script] = [error.code, stderr.getvalue().strip().splitlines()]
        print(json.dumps(exits))
        """,
        CUDA_VISIBLE_DEVICES="",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    exits = json.loads(run.stdout.strip().splitlines()[-1])
    for script in GPU_SCRIPTS:
        message = f"benchmarks/{script} needs a CUDA GPU (none is visible here)."
        assert exits[script] == [2, [message]], script


def test_e2e_arguments():
    args = e2e.parse_args([])
    assert (args.layers, args.prefill_tokens, args.new_tokens) == (18, 8192, 64)
    args = e2e.parse_args(
        ["--layers", "2", "--prefill-tokens", "64", "--new-tokens", "4"]
    )
    assert (args.layers, args.prefill_tokens, args.new_tokens) == (2, 64, 4)
    with pytest.raises(SystemExit) as error:
        e2e.parse_args(["--layers", "0"])
    assert error.value.code == 2
    a, b = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 2, 5, 4]])
    assert e2e.first_difference(a, b) == 2 and e2e.first_difference(a, a) is None


def test_compare_host_calls(fused_geglu, device, monkeypatch):
    """compare.py's host section covers every public op and layer, and each call runs
    (torch.compile left out: inductor's CPU compile is slow)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    calls = compare.host_calls(fused_geglu, device, torch.float32, scale=16)
    ops = {
        "geglu forward",
        "geglu forward+backward",
        "gelu_and_mul",
        "gelu_tanh_and_mul",
    }
    ops |= {"linear forward", "linear forward+backward", "geglu_linear", "geglu_mlp"}
    layers = {"GeGLUMLP", "Linear", "T5GeGLUDense", "ModernBertGeGLUMLP", "GEGLU"}
    assert set(calls) == ops | {f"layers.{name}" for name in layers}
    for op, peers in calls.items():
        assert {"eager", "compile", "ours"} <= set(peers), op
        for call in peers.values():
            call()


def test_tune_cublas_rows():
    """tune.py's ``linear_cublas_rows``: the decode classes' rows where cuBLAS beat the
    fastest tile that ran, as one range."""

    def sweep(cublas_16, cublas_64):
        return {
            "decode16_single": {"(a)": 2.0, "(b)": 1.0, "(c)": "OutOfResources", "cublas": cublas_16},
            "decode64_single": {"(a)": 3.0, "cublas": cublas_64},
        }  # fmt: skip

    assert tune.cublas_rows(sweep(1.1, 2.9)) == (17, 64)
    assert tune.cublas_rows(sweep(0.9, 2.9)) == (1, 64)
    assert tune.cublas_rows(sweep(0.9, 3.1)) == (1, 16)
    assert tune.cublas_rows(sweep(1.1, 3.1)) == (0, 0)


def test_tune_graph_max_tokens():
    """CUDA graphs take the one launch up to the most tokens where the chosen tiles beat
    the two kernels at every count measured up to there."""

    def sweep(one_1, one_16):
        return {
            "floor_ms": 0.06,
            "1": {"(a)": one_1, "(b)": 0.05, "eager": 0.08, "two_kernels": 0.074},
            "16": {"(a)": one_16, "(b)": 0.05, "eager": 0.09, "two_kernels": 0.076},
        }

    assert tune.graph_max_tokens(sweep(0.073, 0.085), "(a)") == 1
    assert tune.graph_max_tokens(sweep(0.073, 0.075), "(a)") == 16
    assert tune.graph_max_tokens(sweep(0.075, 0.075), "(a)") == 0
    assert tune.graph_max_tokens(sweep(0.074, 0.070), "(a)") == 0
    assert tune.graph_max_tokens(sweep(0.075, 0.075), "(b)") == 16


def test_decode_section_reads_both_sweep_formats(tmp_path, monkeypatch):
    """The decode table from tune.py's ``decode`` sweep (the candidate it chose, the
    graphs' one-launch tokens named) and from an older ``decode_mlp`` sweep."""
    monkeypatch.setattr(render, "ROOT", tmp_path)
    env = {"device": "GPU X", "date": "2026-12-07"}
    row = {"(128, 128, 128, 8, 3)": 0.071, "(128, 128, 256, 8, 3)": 0.5,
           "two_kernels": 0.073, "eager": 0.079}  # fmt: skip
    sweep = {"floor_ms": 0.066, "1": row, "chosen": "(128, 128, 128, 8, 3)"}
    new = {"env": env, "decode": {**sweep, "one_launch_graph_max_tokens": 1}}
    text = "\n".join(render.decode_section(tmp_path / "new.json", new))
    assert "| 1 | 0.0710 | 0.0730 | 0.0790 |" in text
    assert "CUDA graphs two (one up to 1 token), and torch.compile two" in " ".join(
        text.split()
    )
    old = {"env": env, "decode_mlp": {"1": {**row, render.DECODE_CONFIG: 0.056}}}
    text = "\n".join(render.decode_section(tmp_path / "old.json", old))
    assert "| 1 | 0.0560 | 0.0730 | 0.0790 |" in text
    assert "CUDA graphs and torch.compile two" in " ".join(text.split())


def test_tune_source_names_the_sweep(tmp_path):
    """A written table's source names its sweep from the checkout's root where the sweep
    lies inside it, whole where it does not."""
    inside = lib.ROOT / "benchmarks" / "results" / "sweep.json"
    assert tune.where(inside) == "benchmarks/results/sweep.json"
    assert tune.where(tmp_path / "sweep.json") == str(tmp_path.resolve() / "sweep.json")


def test_tune_candidates_apply_to_every_table(fused_geglu):
    """Each candidate tune.py sweeps is a table in force (tuning.use) holding its tiles,
    for every shipped table: a candidate naming no table field fails here, not on a GPU."""
    tuning = fused_geglu.tuning
    for table in tuning.SHIPPED.values():
        candidates = [
            *tune.gemm_candidates(table, "decode64_single", [(64, 128, 128, 1, 8, 3)]).values(),
            *tune.one_launch_candidates(table).values(),
        ]  # fmt: skip
        assert len(candidates) > 2
        for fields in candidates:
            with tuning.use("cpu", table, **fields) as in_force:
                for name, value in fields.items():
                    assert getattr(in_force, name) == value, (table.gpu, name)
                assert tuning.table(torch.device("cpu")) is in_force


def test_triton_change_pairs_runs_of_one_tree(tmp_path, monkeypatch):
    """The table by Triton version sets each newer version's row against the Triton 3.6.0
    run of it nearest in time among those of the same package tree."""
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    monkeypatch.setattr(render, "ROOT", tmp_path.parent)

    def run(stamp, triton, tree, ms):
        env = {"device": "GPU X", "triton": triton, "git": tree}
        mlp = {"forward": {"1": {"ours_layer": {"ms": ms}}}}
        name = f"{stamp}-GPU_X-triton{triton}-compare-mlp.json"
        (tmp_path / name).write_text(json.dumps({"env": env, "mlp": mlp}))

    run("2026-01-01T00", "3.6.0", "a", 1.0)
    run("2026-01-01T05", "3.9.0", "a", 1.1)
    run("2026-01-01T06", "3.6.0", "b", 0.5)  # nearer, another tree
    lines = render.triton_change_section("GPU X")
    assert "| MLP layer, 1 token, forward | 1.000 | 1.100 | 1.100 |" in lines
    run("2026-01-01T04", "3.6.0", "a", 1.1)
    lines = render.triton_change_section("GPU X")
    assert "| MLP layer, 1 token, forward | 1.100 | 1.100 | 1.000 |" in lines


def test_render_rounding():
    assert [render.ms(v) for v in (3.12677, 0.2008, 0.0250164, 0.018946)] == [
        "3.127",
        "0.201",
        "0.0250",
        "0.0189",
    ]


def test_results_match_json():
    """README's summary and docs/results.md's tables are exactly what render_results.py
    makes of the JSON, each in its one block."""
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
    """The README's summary quotes the families, FP8 and end-to-end rows of the committed
    JSON."""
    summary = render.render_summary()
    paths = [render.newest_families(gpu) for gpu in render.gpus()]
    assert len(paths) > 1 and all(paths)
    for name in json.loads(paths[0].read_text())["families"]:
        row = [json.loads(p.read_text())["families"][name] for p in paths]
        cells = [f"{render.ms(r['eager_ms'])}, {render.ms(r['ours_ms'])}" for r in row]
        assert all(f"| {cell} (" in summary for cell in cells)
        assert summary.count(f"| {name} |") == 1
    fp8_rows = [
        row
        for row in json.loads(render.newest("fp8").read_text())["forward"]
        if row["tokens"] in render.README_FP8_TOKENS
    ]
    assert fp8_rows
    for row in fp8_rows:
        paths = [n for n in render.FP8_PATHS if n in row["ms"]]
        cells = (str(row["tokens"]), *(render.ms(row["ms"][n]) for n in paths))
        assert f"| {' | '.join(cells)} |" in summary
    for row in json.loads(render.newest("e2e").read_text())["rows"]:
        speedup = row["speedup_median_of_rounds"]
        cell = f"{row['eager_ms']:.2f}, {row['ours_ms']:.2f} ({speedup:.2f}x)"
        assert f"| {cell} |" in summary


def test_one_block_per_file():
    with pytest.raises(SystemExit, match="exactly one"):
        render.replace_section(f"{render.START}{render.END}" * 2, "x")
    assert render.replace_section(f"a{render.START}old{render.END}b", "new\n") == (
        f"a{render.START}\nnew\n{render.END}b"
    )
