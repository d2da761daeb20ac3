"""First calls in a fresh process with an empty Triton cache: what a short-lived container
pays before a Gemma-2B MLP (2048 x 16384, bf16) runs at speed, for eager, torch.compile,
Liger, our layer with its precompiled kernels (docs/precompiled.md) and our layer with
them turned off (FUSED_GEGLU_PRECOMPILED=0: Triton's JIT).

Each mode runs in its own process with empty Triton and Inductor caches: the first call at
each of --tokens, then --new-sizes token counts not seen before (3..706), each call timed
with a CUDA sync around it. The module is on the GPU and the packages imported before
the clock starts. Our two modes' outputs are compared (bitwise beyond the one-launch
decode MLP, whose fp32 sums are added in a varying order). Writes
benchmarks/results/<date>-<gpu>-triton<version>-first-call.json (or --out). Needs a GPU.

    python benchmarks/first_call.py
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("eager", "compile", "liger", "ours", "ours_jit")
TOKENS = (1, 7, 64, 512, 8192)
HIDDEN, INTERMEDIATE = 2048, 16384


def new_sizes(count: int, seen) -> list[int]:
    sizes = [
        t for t in random.Random(0).sample(range(3, 707), count + 8) if t not in seen
    ]
    return sizes[:count]


def child(mode: str, tokens: list[int], count: int, outputs: Path) -> dict:
    """Runs in the fresh process: the timings of one mode."""
    import bench_lib as lib
    import torch
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    torch.manual_seed(0)
    config = GemmaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        hidden_act="gelu_pytorch_tanh",
    )
    mlp = GemmaMLP(config).to("cuda", torch.bfloat16).eval()
    hits = []
    if mode == "compile":
        fn = torch.compile(mlp)
    elif mode == "liger":
        fn = lib.liger_mlp(mlp)
    elif mode in ("ours", "ours_jit"):
        ours = lib.load_ours()
        find = ours.precompiled.find

        def counted(kernel, *args, **kwargs):
            found = find(kernel, *args, **kwargs)
            hits.append([kernel.__name__, found is not None])
            return found

        ours.precompiled.find = counted
        fn = ours.layers.GeGLUMLP.forward.__get__(mlp)
    else:
        fn = mlp
    sizes = new_sizes(count, tokens)
    inputs = {
        t: torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for t in (*tokens, *sizes)
    }
    torch.cuda.synchronize()

    def first(t: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = fn(inputs[t])
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        results[t] = out.float().cpu()
        return ms

    results = {}
    first_ms = {t: first(t) for t in tokens}
    new_ms = [first(t) for t in sizes]
    torch.save(results, outputs)
    import triton

    driver = triton.runtime.driver
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    return {
        "first_call_ms": first_ms,
        "new_sizes": sizes,
        "new_sizes_ms": new_ms,
        "new_sizes_total_ms": sum(new_ms),
        "triton_cache_entries": sum(1 for p in cache.rglob("*") if p.is_file()),
        "triton_driver_started": getattr(driver, "_active", None) is not None,
        "precompiled_lookups": hits,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--new-sizes", type=int, default=20)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, outputs, report = args.child.split(",")
        row = child(mode, args.tokens, args.new_sizes, Path(outputs))
        Path(report).write_text(json.dumps(row))
        return

    import bench_lib as lib
    import torch

    lib.require_cuda("benchmarks/first_call.py")
    result = {"env": lib.environment(lib.load_ours()), "tokens": args.tokens}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            caches = {
                name: tempfile.mkdtemp(dir=tmp)
                for name in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
            }
            env = {**os.environ, **caches}
            env.pop("TRITON_INTERPRET", None)
            if mode == "ours_jit":
                env["FUSED_GEGLU_PRECOMPILED"] = "0"
            outputs[mode] = Path(tmp) / f"{mode}.pt"
            report = Path(tmp) / f"{mode}.json"
            command = [sys.executable, __file__, "--child", f"{mode},{outputs[mode]},{report}",
                       "--tokens", *map(str, args.tokens), "--new-sizes", str(args.new_sizes)]  # fmt: skip
            start = time.perf_counter()
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, check=False
            )
            if done.returncode:
                result[mode] = {"error": done.stderr[-3000:]}
                print(mode, "failed:", done.stderr[-3000:], file=sys.stderr)
                continue
            result[mode] = json.loads(report.read_text())
            result[mode]["process_s"] = time.perf_counter() - start
            print(mode, json.dumps({k: v for k, v in result[mode].items()
                                    if k not in ("precompiled_lookups", "new_sizes")}))  # fmt: skip
        if all(outputs.get(m) and outputs[m].exists() for m in ("ours", "ours_jit")):
            a, b = (torch.load(outputs[m]) for m in ("ours", "ours_jit"))
            result["ours_vs_jit"] = {
                str(t): {
                    "bitwise": bool(torch.equal(a[t], b[t])),
                    "max_abs_diff": float((a[t] - b[t]).abs().max()),
                }
                for t in a
            }
    path = args.out or lib.results_path(
        {**result["env"], "device": f"{result['env']['device']}-triton"
         f"{result['env']['triton']}"}, "first-call",
    )  # fmt: skip
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
