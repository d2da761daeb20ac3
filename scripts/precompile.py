"""Compiles, on the CPU, the kernels the route launches into the package's precompiled/
folder (docs/precompiled.md): `make precompile` (after `make build`), then `make build`
again ships them in build/torch-cuda/.

The launches are not written out by hand: the package (build/torch-cuda, imported as on a
GPU machine, without TRITON_INTERPRET) runs its own host code on CPU tensors as each
target's GPUs would (GPUS: launch table, SM count, TMA), for each dtype, model shape and
token count, with ``Launcher.__call__`` replaced by a recorder. Each recorded launch is
specialised as JITFunction.run would (precompiled.specialize) for its target and
compiled once per distinct key, in forked workers. Covered: the inference forward (one-launch decode MLP for up to 16 tokens, the
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
    33,
    48,
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


# The GPUs each target's artifacts serve, as the route sees them: (launch table, SM count,
# TMA kernels). sm_90: the H100's and H200's own tables; other GPUs take the default
# table (tuning._nearest), with TMA on Blackwell data-center GPUs only (launch.has_tma);
# the SM count changes the split-K choices of few-token GEMMs.
GPUS = {
    90: (("NVIDIA H100 80GB HBM3", 132, True), ("NVIDIA H200", 132, True)),
    100: ((None, 148, True),),  # B200
    80: ((None, 108, False),),  # A100
    89: ((None, 128, False), (None, 142, False)),  # RTX 4090, L40S
    120: ((None, 170, False),),  # RTX 5090
}


def record_launches(
    fg, gpus, dtypes, models, tokens, on_launch, smoke=False, libdevice=None
) -> int:
    """Runs the host code for each of ``gpus`` (GPUS' entries; None: the default table),
    handing ``on_launch(kernel, args, kwargs)`` every Launcher call it makes (as
    kernel[grid](*args, **kwargs) would receive it) instead of launching; returns their
    number. ``libdevice``: the CUDA toolkit's that launch.py would link (TOOLKIT_LIBDEVICE)
    where one matching torch's CUDA is installed; None: Triton's own. The package's state
    is restored after."""
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
    # the CUDA compile options, as launch.py sets them on a CUDA torch
    launch.COMPILE_OPTIONS = {"enable_fp_fusion": True, "enable_reflect_ftz": False}
    if libdevice:
        launch.COMPILE_OPTIONS["extern_libs"] = {"libdevice": libdevice}
    tuning, gemm, act = fg.tuning, fg.gemm, fg.gemm.GELU_TANH
    try:
        for table, sms, tma in gpus:
            launch._SM_COUNT[cpu], launch._HAS_TMA[cpu] = sms, tma
            tuning.set_table(cpu, tuning.SHIPPED[table] if table else tuning.DEFAULT)
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
                        # both orders in memory: the TMA kernel's UP_FIRST
                        for first, second in ((w_gate, w_up), (w_up, w_gate)):
                            gemm.gemm_gated(x, first, second, h, act)
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
    parser.add_argument("--arch", type=int, action="append", choices=sorted(GPUS),
                        help="default: every target in GPUS")  # fmt: skip
    parser.add_argument("--table", action="append",
                        help="sm_90 only: these launch tables (default: GPUS')")  # fmt: skip
    parser.add_argument("--dtype", action="append", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--model", action="append", help="HxI, e.g. 2048x16384")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--libdevice", action="append", default=[],
                        help="also for this CUDA toolkit's libdevice.10.bc (launch.py "
                        "links the toolkit's where it matches torch's CUDA)")  # fmt: skip
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
    models = [tuple(int(v) for v in m.split("x")) for m in args.model or ()] or MODELS
    gpus = dict(GPUS)
    if args.table:
        gpus[90] = tuple((table, 132, True) for table in args.table)
    archs = args.arch or sorted(GPUS)

    start = time.perf_counter()
    from triton._C.libtriton import get_cache_invalidating_env_vars

    env_vars = get_cache_invalidating_env_vars()
    if env_vars:
        print(f"precompile: note, compiling under {env_vars} (part of the key)")
    seen = set()
    launches = 0
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)

        def on_launch(kernel, call_args, kwargs, target=target):
            src, options, _ = precompiled.specialize(kernel, target, call_args, kwargs)
            key = precompiled.artifact_key(src, options, target, env_vars)
            if key not in seen:
                seen.add(key)
                _JOBS.append((src, options, target, str(args.out)))

        for libdevice in (None, *args.libdevice):
            launches += record_launches(
                fg, gpus[arch], dtypes, models, args.tokens, on_launch, args.smoke,
                libdevice,
            )  # fmt: skip
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
        "gpus": {arch: gpus[arch] for arch in archs},
        "dtypes": [str(d) for d in dtypes],
        "models": models,
        "libdevices": args.libdevice,
        "compiled": len(results) - len(failed),
        "failed": failed,
        "bytes": total,
        "cubin_bytes": sum(r.get("cubin_bytes", 0) for r in results),
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
