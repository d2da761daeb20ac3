"""Host time per GeGLUMLP layer call at 1 token: this tree's build against a baseline
tree's (``--baseline DIR``: a checkout of another commit, built with ``make build``), eager
GemmaMLP beside, in interleaved rounds of 20-call loops (bench_lib.host_us) on separate
copies of one module. Writes benchmarks/results/<date>-<gpu>-layer-host-time.json (or --out).
Needs a CUDA GPU.

    git worktree add /tmp/base 220737b && make -C /tmp/base build
    python benchmarks/layer_host_time.py --baseline /tmp/base
"""

import argparse
import copy
import json
from pathlib import Path

import bench_lib as lib
import torch
from kernels import get_local_kernel
from transformers import GemmaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP

SHAPES = ((1, 256, 1024), (1, 2048, 16384))  # tokens, hidden, intermediate (Gemma-2B)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lib.require_cuda("benchmarks/layer_host_time.py")
    ours, base = lib.load_ours(), get_local_kernel(args.baseline)
    env = lib.environment(ours)
    result = {
        "env": env,
        "baseline": str(args.baseline),
        "rounds": args.rounds,
        "n": 20,
    }
    for tokens, hidden, inter in SHAPES:
        config = GemmaConfig(
            hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh"
        )
        eager = GemmaMLP(config).to("cuda", torch.bfloat16).eval()
        mine, theirs = copy.deepcopy(eager), copy.deepcopy(eager)
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)

        def no_grad(fn):
            def call():
                with torch.no_grad():
                    fn()

            return call

        calls = {
            "eager": no_grad(lambda: eager(x)),
            "baseline": no_grad(lambda: base.layers.GeGLUMLP.forward(theirs, x)),
            "ours": no_grad(lambda: ours.layers.GeGLUMLP.forward(mine, x)),
        }
        row = lib.host_us(calls, n=20, rounds=args.rounds)
        row["ours_over_baseline"] = row["ours"] / row["baseline"]
        result[f"{tokens}x{hidden}x{inter}"] = row
        print(tokens, hidden, inter, row, flush=True)
    out = args.out or lib.results_path(env, "layer-host-time")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
