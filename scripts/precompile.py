"""Compiles, on the CPU, the kernels the route launches into the package's precompiled/
folder (docs/precompiled.md): `make precompile` (after `make build`), then `make build`
again ships them in build/torch-cuda/.

The launches are not written out by hand: the package (build/torch-cuda, imported as on a
GPU machine, without TRITON_INTERPRET) runs its own host code on CPU tensors for each
launch table (H100, H200), dtype, model shape and token count, with ``Launcher.__call__``
replaced by a recorder. Each recorded launch is specialised as JITFunction.run would
(precompiled.specialize) for each target and compiled once per distinct key, in forked
workers. Covered: the inference forward (one-launch decode MLP for up to 16 tokens, the
gated GEMM and the down GEMM beyond, through TMA where the route takes it) and the
elementwise GeGLU (forward and backward; contiguous, and the halves of a [M, 2I]
projection). Not covered: training's GEMMs (dact, bias gradients, accumulate), FP8.

Usage: python scripts/precompile.py [--arch 90 --arch 80 ...] [--out DIR] [--smoke]
"""

import argparse
import importlib.util
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "torch-ext" / "fused_geglu" / "precompiled"
# (hidden, intermediate): Gemma-2B's and Gemma-7B's MLPs
MODELS = ((2048, 16384), (3072, 24576))
TOKENS = (
    *range(1, 17),
    17,
    32,
    64,
    65,
    100,
    128,
    256,
    512,
    1000,
    1024,
    2048,
    4096,
    8192,
)


def load_package(tree: Path):
    spec = importlib.util.spec_from_file_location(
        "fused_geglu", tree / "__init__.py", submodule_search_locations=[str(tree)]
    )
    fg = importlib.util.module_from_spec(spec)
    sys.modules["fused_geglu"] = fg
    spec.loader.exec_module(fg)
    return fg


def record_launches(fg, tables, dtypes, models, tokens, on_launch, smoke=False) -> int:
    """Runs the host code, handing ``on_launch(kernel, args, kwargs)`` every Launcher call
    it makes (as kernel[grid](*args, **kwargs) would receive it) instead of launching;
    returns their number. The package's state is restored after."""
    import torch

    launch = fg.launch
    count = 0

    def record(self, grid, *args):
        nonlocal count
        # a misaligned pointer never takes a precompiled kernel (Launcher)
        if all(a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor)):
            count += 1
            on_launch(self.kernel, args, dict(self.constexprs))

    cpu = torch.device("cpu")
    saved = (launch.Launcher.__call__, launch.Launcher.launch_aligned,
             launch.current_device_and_stream, launch.COMPILE_OPTIONS)  # fmt: skip
    launch.Launcher.__call__ = record
    launch.Launcher.launch_aligned = lambda self, *a: False
    launch.current_device_and_stream = lambda: (0, 0)
    # the CUDA compile options, as launch.py sets them on a CUDA torch (Triton's own
    # libdevice: TOOLKIT_LIBDEVICE found none; see docs/precompiled.md)
    launch.COMPILE_OPTIONS = {"enable_fp_fusion": True, "enable_reflect_ftz": False}
    launch._SM_COUNT[cpu] = 132
    launch._HAS_TMA[cpu] = True
    tuning, gemm, act = fg.tuning, fg.gemm, fg.gemm.GELU_TANH
    try:
        for table in tables:
            tuning.set_table(cpu, tuning.SHIPPED[table])
            launch.clear_plans()
            for dtype in dtypes:
                for H, I in models:
                    w_gate, w_up = (torch.empty(I, H, dtype=dtype) for _ in range(2))
                    w_down = torch.empty(H, I, dtype=dtype)
                    for M in tokens:
                        x = torch.empty(M, H, dtype=dtype)
                        out = torch.empty(M, H, dtype=dtype)
                        if M <= tuning.ONE_LAUNCH_MAX_TOKENS:
                            fg.one_launch.one_launch_mlp(
                                x, w_gate, w_up, w_down, out, act
                            )
                        if smoke:
                            continue
                        h = torch.empty(M, I, dtype=dtype)
                        gemm.gemm_gated(x, w_gate, w_up, h, act)
                        gemm.gemm(h, w_down, out)
                        proj = torch.empty(M, 2 * I, dtype=dtype)
                        gate, up = proj[:, :I], proj[:, I:]
                        for approximate in ("tanh", "none"):
                            fg.elementwise.geglu_forward(gate, up, h, approximate)
                            fg.elementwise.geglu_forward(h, h, h, approximate)
                            fg.elementwise.geglu_backward(h, h, h, approximate)
    finally:
        (launch.Launcher.__call__, launch.Launcher.launch_aligned,
         launch.current_device_and_stream, launch.COMPILE_OPTIONS) = saved  # fmt: skip
        launch._SM_COUNT.pop(cpu, None)
        launch._HAS_TMA.pop(cpu, None)
        tuning.set_table(cpu, None)
        launch.clear_plans()
    return count


_JOBS: list = []  # (src, options, target), read by the forked workers


def _compile(i: int):
    from fused_geglu import precompiled

    src, options, target, out = _JOBS[i]
    start = time.perf_counter()
    try:
        done = precompiled.compile_artifact(src, options, target, out)
        done["error"] = None
    except Exception as e:  # noqa: BLE001 (reported per launch)
        done = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
    done |= {"kernel": src.fn.__name__, "arch": target.arch,
             "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tree", type=Path, default=ROOT / "build" / "torch-cuda")
    parser.add_argument("--arch", type=int, action="append", help="default: 90")
    parser.add_argument("--table", action="append", help="default: the shipped tables")
    parser.add_argument("--dtype", action="append", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--model", action="append", help="HxI, e.g. 2048x16384")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--smoke", action="store_true",
                        help="the decode MLP only (tests)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("precompile: unset TRITON_INTERPRET (the kernels compile for the GPU)")

    import torch
    from triton.backends.compiler import GPUTarget

    fg = load_package(args.tree)
    precompiled = fg.precompiled
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtypes = [names[d] for d in args.dtype or ("bf16", "fp16")]
    tables = args.table or sorted(fg.tuning.SHIPPED)
    models = [tuple(int(v) for v in m.split("x")) for m in args.model or ()] or MODELS
    targets = [GPUTarget("cuda", arch, 32) for arch in args.arch or (90,)]

    start = time.perf_counter()
    from triton._C.libtriton import get_cache_invalidating_env_vars

    env_vars = get_cache_invalidating_env_vars()
    if env_vars:
        print(f"precompile: note, compiling under {env_vars} (part of the key)")
    seen = set()

    def on_launch(kernel, call_args, kwargs):
        for target in targets:
            src, options, _ = precompiled.specialize(kernel, target, call_args, kwargs)
            key = precompiled.artifact_key(src, options, target, env_vars)
            if key not in seen:
                seen.add(key)
                _JOBS.append((src, options, target, str(args.out)))

    launches = record_launches(
        fg, tables, dtypes, models, args.tokens, on_launch, args.smoke
    )
    print(
        f"precompile: {launches} launches recorded, {len(_JOBS)} distinct compilations"
    )
    if args.jobs <= 1 or len(_JOBS) <= 1:
        results = [_compile(i) for i in range(len(_JOBS))]
    else:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            results = pool.map(_compile, range(len(_JOBS)), chunksize=1)
    failed = [r for r in results if r["error"]]
    total = sum(r.get("bytes", 0) for r in results)
    report = {
        "triton": precompiled.triton.__version__,
        "targets": [t.arch for t in targets],
        "tables": tables,
        "dtypes": [str(d) for d in dtypes],
        "models": models,
        "compiled": len(results) - len(failed),
        "failed": failed,
        "bytes": total,
        "seconds": round(time.perf_counter() - start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"report-{precompiled.triton.__version__}.json").write_text(
        json.dumps(report, indent=1) + "\n"
    )
    print(json.dumps({k: v for k, v in report.items() if k != "failed"}))
    for r in failed:
        print(f"FAILED {r['kernel']} sm_{r['arch']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
