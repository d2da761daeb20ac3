"""First calls in a fresh process with an empty Triton cache: what a short-lived container
pays before a Gemma-2B MLP (2048 x 16384, bf16) runs at speed, for eager, torch.compile,
Liger, our layer with its precompiled kernels (docs/precompiled.md) and our layer with
them turned off (FUSED_GEGLU_PRECOMPILED=0: Triton's JIT).

Each mode runs in its own process with empty Triton and Inductor caches: the first call at
each of --tokens, then --new-sizes token counts not seen before (3..706), each call timed
with a CUDA sync around it. The module is on the GPU and the packages imported before
the clock starts. Our two modes' outputs are compared (bitwise beyond the one-launch
decode MLP, whose fp32 sums are added in a varying order). Then, each in its own fresh
process too, the first greedy ``generate()`` of a Gemma-2B-shaped GemmaForCausalLM (e2e.py's
model: random weights, 18 layers; --prompt-tokens, --new-tokens) for eager, Liger's MLP
and ours kernelized (precompiled and JIT), then the median of three more. Writes
benchmarks/results/<date>-<gpu>-triton<version>-first-call.json (or --out). Needs a GPU.

    python benchmarks/first_call.py
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("eager", "compile", "liger", "ours", "ours_jit")
GENERATE_MODES = ("eager", "liger", "ours", "ours_jit")
TOKENS = (1, 7, 64, 512, 8192)
HIDDEN, INTERMEDIATE = 2048, 16384


def new_sizes(count: int, seen) -> list[int]:
    sizes = [
        t for t in random.Random(0).sample(range(3, 707), count + 8) if t not in seen
    ]
    return sizes[:count]


def recorded_lookups(package) -> list:
    """The package's precompiled lookups from now on, each as [kernel name, hit]."""
    lookups, find = [], package.precompiled.find

    def recorded(kernel, *args, **kwargs):
        found = find(kernel, *args, **kwargs)
        lookups.append([kernel.__name__, found is not None])
        return found

    package.precompiled.find = recorded
    return lookups


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
    lookups = []
    if mode == "compile":
        fn = torch.compile(mlp)
    elif mode == "liger":
        fn = lib.liger_mlp(mlp)
    elif mode in ("ours", "ours_jit"):
        ours = lib.load_ours()
        lookups = recorded_lookups(ours)
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
        "precompiled_lookups": lookups,
    }


def generate_child(mode: str, prompt_tokens: int, new_tokens: int) -> dict:
    """Runs in the fresh process: the first generate() of one mode, and the median of
    three after it."""
    import bench_lib as lib
    import e2e
    import torch

    torch.manual_seed(0)
    eager, ours = e2e.build_models(e2e.parse_args([]).layers, 4096)
    model = ours if mode in ("ours", "ours_jit") else eager
    if mode == "liger":
        for layer in model.model.layers:
            layer.mlp = lib.liger_mlp(layer.mlp)
    lookups = []
    if model is ours:
        forward = model.model.layers[0].mlp.forward.__func__
        lookups = recorded_lookups(sys.modules[forward.__module__.rpartition(".")[0]])
    ids = torch.randint(1, 1000, (1, prompt_tokens), device="cuda")
    torch.cuda.synchronize()

    def generate() -> tuple[float, list]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3, out[0].tolist()

    first_ms, tokens = generate()
    warm_ms = statistics.median(generate()[0] for _ in range(3))
    import triton

    return {"first_generate_ms": first_ms, "warm_generate_ms": warm_ms,
            "tokens": tokens, "precompiled_lookups": lookups,
            "triton_driver_started": getattr(triton.runtime.driver, "_active", None)
            is not None}  # fmt: skip


def fresh(tmp: str, mode: str, child_args: list[str], label: str = "") -> dict:
    """This script's child for ``mode`` in a fresh process with empty Triton and Inductor
    caches: its report, or {"error": ...}."""
    env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(dir=tmp),
           "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(dir=tmp)}  # fmt: skip
    env.pop("TRITON_INTERPRET", None)
    if mode == "ours_jit":
        env["FUSED_GEGLU_PRECOMPILED"] = "0"
    report = Path(tempfile.mkdtemp(dir=tmp)) / "report.json"
    start = time.perf_counter()
    command = [sys.executable, __file__, "--report", str(report), *child_args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        print(label or mode, "failed:", done.stderr[-3000:], file=sys.stderr)
        return {"error": done.stderr[-3000:]}
    row = json.loads(report.read_text())
    row["process_s"] = time.perf_counter() - start
    shown = {k: v for k, v in row.items()
             if k not in ("precompiled_lookups", "new_sizes", "tokens")}  # fmt: skip
    print(label or mode, json.dumps(shown))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--new-sizes", type=int, default=20)
    parser.add_argument("--generate-modes", nargs="*", default=GENERATE_MODES,
                        choices=GENERATE_MODES)  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    parser.add_argument("--mlp-child", help=argparse.SUPPRESS)
    parser.add_argument("--generate-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mlp_child:
        mode, outputs = args.mlp_child.split(",")
        row = child(mode, args.tokens, args.new_sizes, Path(outputs))
        Path(args.report).write_text(json.dumps(row))
        return
    if args.generate_child:
        row = generate_child(args.generate_child, args.prompt_tokens, args.new_tokens)
        Path(args.report).write_text(json.dumps(row))
        return

    import bench_lib as lib
    import torch

    lib.require_cuda("benchmarks/first_call.py")
    result = {"env": lib.environment(lib.load_ours()), "tokens": args.tokens}
    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            outputs[mode] = Path(tmp) / f"{mode}.pt"
            result[mode] = fresh(tmp, mode, [
                "--mlp-child", f"{mode},{outputs[mode]}",
                "--tokens", *map(str, args.tokens), "--new-sizes", str(args.new_sizes),
            ])  # fmt: skip
        if all(outputs.get(m) and outputs[m].exists() for m in ("ours", "ours_jit")):
            a, b = (torch.load(outputs[m]) for m in ("ours", "ours_jit"))
            result["ours_vs_jit"] = {
                str(t): {
                    "bitwise": bool(torch.equal(a[t], b[t])),
                    "max_abs_diff": float((a[t] - b[t]).abs().max()),
                }
                for t in a
            }
        if args.generate_modes:
            generate = {"prompt_tokens": args.prompt_tokens,
                        "new_tokens": args.new_tokens}  # fmt: skip
            for mode in args.generate_modes:
                generate[mode] = fresh(tmp, mode, [
                    "--generate-child", mode, "--prompt-tokens",
                    str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                ], label=f"generate {mode}")  # fmt: skip
            eager_tokens = generate.get("eager", {}).get("tokens")
            for mode in args.generate_modes:
                if eager_tokens and "tokens" in generate[mode]:
                    generate[mode]["tokens_equal_eager"] = (
                        generate[mode]["tokens"] == eager_tokens
                    )
            result["generate"] = generate
    path = args.out or lib.results_path(
        {**result["env"], "device": f"{result['env']['device']}-triton"
         f"{result['env']['triton']}"}, "first-call",
    )  # fmt: skip
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
