"""End to end: a Gemma-2B-shaped transformers GemmaForCausalLM (random weights from a config:
18 layers, hidden 2048, intermediate 16384, vocab 256000, 8 heads of 256, 1 key/value head;
bfloat16), eager against a copy kernelized with our GeGLUMLP (Mode.INFERENCE). After a
warm-up on the same shapes, both are timed side by side in interleaved rounds (wall time,
the GPU drained before and after each call; medians):
- prefill: one forward of --prefill-tokens tokens (only the last token's logits), ms;
- greedy generate() of --new-tokens tokens from a --prompt-tokens prompt with the default
  cache, and with cache_implementation="static": ms per new token (the prompt's prefill
  included).
Each row has the speed-up of the medians and the median of each round's speed-up (the
host's drift between rounds cancels in the latter).
The warm-up's greedy tokens of the kernelized model are compared with eager's, and so are
the logits of one forward over the prompt (the one-launch MLP) and over the prefill (the
dual GEMM). --free-mlp, --two-kernels and --launches-skipped add models to the rounds;
--tasks picks the rows. Writes the environment and every row as JSON to
benchmarks/results/<date>-<gpu>-e2e.json or --out.

Usage: python benchmarks/e2e.py [--layers 18] [--prefill-tokens 8192] [--new-tokens 64]
Needs a CUDA GPU: without one it says so and exits with status 2.
"""

import argparse
import copy
import json
import logging
import statistics
import sys
from pathlib import Path

import bench_lib as lib  # first: it picks the interpreter without a GPU
import torch

GEMMA_2B = {
    "vocab_size": 256000,
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
}


TASKS = ("prefill", "generate", "generate_static_cache")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=18, help="decoder layers")
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--prompt-tokens", type=int, default=16, help="for generate()")
    parser.add_argument("--new-tokens", type=int, default=64, help="for generate()")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    parser.add_argument(
        "--free-mlp",
        action="store_true",
        help="also time a copy whose MLPs cost nothing but an allocation and a memset: "
        "the most any MLP kernel could gain in this loop",
    )
    parser.add_argument(
        "--two-kernels",
        action="store_true",
        help="also time the kernelized model with the one-launch decode MLP turned off "
        "(the dual GEMM and cuBLAS, as under torch.compile)",
    )
    parser.add_argument(
        "--launches-skipped",
        action="store_true",
        help="also time the kernelized model with Triton's launcher skipped (its outputs "
        "unwritten): the host time of our Python path alone",
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        choices=TASKS,
        default=list(TASKS),
        help="the rows to time (default: all)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    sizes = ("layers", "prefill_tokens", "prompt_tokens", "new_tokens", "rounds")
    for name in sizes:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def build_models(layers: int, max_tokens: int):
    """(eager, kernelized): the same random weights; only the kernelized copy's GemmaMLP
    layers run our GeGLUMLP forward."""
    from kernels import (
        LocalLayerRepository,
        Mode,
        kernelize,
        replace_kernel_forward_from_hub,
        use_kernel_mapping,
    )
    from transformers import GemmaConfig, GemmaForCausalLM
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = GemmaConfig(
        **GEMMA_2B, num_hidden_layers=layers, max_position_embeddings=max_tokens
    )
    with torch.device("cuda"):
        eager = GemmaForCausalLM(config).to(torch.bfloat16).eval()
    replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
    repo = LocalLayerRepository(lib.ROOT, layer_name="GeGLUMLP")
    # Unmapped layers (rotary embedding, GeluTanh) keep their forward; kernelize warns.
    logging.getLogger("kernels").setLevel(logging.ERROR)
    with use_kernel_mapping({"GeGLUMLP": {"cuda": repo}}, inherit_mapping=False):
        ours = kernelize(copy.deepcopy(eager), mode=Mode.INFERENCE, device="cuda")
    mlps = [m for m in ours.modules() if isinstance(m, GemmaMLP)]
    swapped = sum(m.forward.__func__.__qualname__ == "GeGLUMLP.forward" for m in mlps)
    if not 0 < swapped == len(mlps):
        raise RuntimeError(
            f"kernelize swapped {swapped} of {len(mlps)} GemmaMLP layers"
        )
    return eager, ours


class two_kernel_route:
    """A kernelized model whose calls run with the route's one-launch threshold at 0."""

    def __init__(self, model):
        self.model = model
        layer_forward = next(
            m.forward for m in model.modules() if hasattr(m, "gate_proj")
        )
        package = layer_forward.__func__.__module__.rpartition(".")[0]
        self.policy = vars(sys.modules[f"{package}.policy"])
        self.launch = sys.modules[f"{package}.launch"]

    def __call__(self, *args, **kwargs):
        return self._off(self.model, *args, **kwargs)

    def generate(self, *args, **kwargs):
        return self._off(self.model.generate, *args, **kwargs)

    def _off(self, fn, *args, **kwargs):
        limit = self.policy["ONE_LAUNCH_MAX_TOKENS"]
        self.policy["ONE_LAUNCH_MAX_TOKENS"] = 0
        try:
            return fn(*args, **kwargs)
        finally:
            self.policy["ONE_LAUNCH_MAX_TOKENS"] = limit


class launches_skipped(two_kernel_route):
    """A kernelized model whose calls run with every direct launch skipped (the Launcher
    reports it launched): our host path without Triton's launcher call."""

    def __init__(self, model):
        super().__init__(model)
        self.launcher = self.launch.Launcher

    def _off(self, fn, *args, **kwargs):
        run, self.launcher._run = self.launcher._run, lambda *_: True
        try:
            return fn(*args, **kwargs)
        finally:
            self.launcher._run = run


def tasks(model, args, prefill_ids, prompt_ids) -> dict:
    """{task: call} for one model; generate's calls return the generated tokens."""

    def generate(**kwargs):
        return model.generate(
            prompt_ids,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,  # random weights may emit EOS early
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )

    calls = {
        "prefill": lambda: model(prefill_ids, logits_to_keep=1),
        "generate": generate,
        "generate_static_cache": lambda: generate(cache_implementation="static"),
    }
    return {task: calls[task] for task in args.tasks}


def logits_agreement(eager, ours, ids, keep: int = 256) -> dict:
    """The logits of one forward over ``ids`` (its last ``keep`` positions), ours against
    eager's: the largest difference over eager's largest magnitude, and the fraction of
    positions whose argmax agrees (greedy tokens alone can agree over a wrong MLP: random
    weights)."""
    a, b = (m(ids, logits_to_keep=keep).logits.float() for m in (eager, ours))
    return {
        "tokens": ids.shape[-1],
        "positions": a.shape[1],
        "max_abs_diff_over_max_abs": ((a - b).abs().max() / a.abs().max()).item(),
        "argmax_equal_fraction": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The first position where two token sequences differ, or None."""
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else int(diff[0, -1])


def run(args) -> dict:
    torch.manual_seed(0)
    ours_kernel = lib.load_ours()
    env = lib.environment(ours_kernel)
    max_tokens = max(args.prefill_tokens, args.prompt_tokens + args.new_tokens)
    eager, ours = build_models(args.layers, max_tokens)
    models = [("eager", eager), ("ours", ours)]
    if args.two_kernels:
        models.append(("ours_two_kernels", two_kernel_route(ours)))
    if args.launches_skipped:
        models.append(("ours_launches_skipped", launches_skipped(ours)))
    if args.free_mlp:
        free = copy.deepcopy(eager)
        for m in free.model.layers:
            m.mlp.forward = torch.zeros_like
        models.append(("free_mlp", free))
    vocab = GEMMA_2B["vocab_size"]
    prefill_ids = torch.randint(0, vocab, (1, args.prefill_tokens), device="cuda")
    prompt_ids = torch.randint(0, vocab, (1, args.prompt_tokens), device="cuda")
    calls = {}
    for name, model in models:
        for task, call in tasks(model, args, prefill_ids, prompt_ids).items():
            calls[f"{task}/{name}"] = call
    # The static cache compiles the step; both models share its code objects, and each
    # decoder layer's index is a guard: room for every recompile, else Dynamo falls back to
    # eager after 8 and the static-cache rows time that.
    torch._dynamo.config.recompile_limit = 8 * args.layers
    torch._dynamo.config.accumulated_recompile_limit = 64 * args.layers
    with torch.inference_mode():
        agreement = [  # the one-launch MLP (a prompt's few tokens), the dual GEMM (prefill)
            logits_agreement(eager, ours, ids) for ids in (prompt_ids, prefill_ids)
        ]
        print(json.dumps(agreement), flush=True)
        warm = {key: call() for key, call in calls.items()}  # compiles; greedy tokens
        times = lib.interleaved(calls, lambda call: lib.timed(call)[1], args.rounds)
    rows = []
    for task in args.tasks:
        per = 1 if task == "prefill" else args.new_tokens
        row = {"task": task, "unit": "ms" if per == 1 else "ms per new token"}
        for name, _ in models:
            rounds = [t / per for t in times[f"{task}/{name}"]]
            row |= {f"{name}_ms": statistics.median(rounds), f"{name}_rounds": rounds}
        for name, _ in models[1:]:
            key = "speedup" if name == "ours" else f"{name}_speedup"
            row[key] = row["eager_ms"] / row[f"{name}_ms"]
            # Each round's eager/other ratio: the host's drift between rounds cancels.
            pairs = zip(row["eager_rounds"], row[f"{name}_rounds"])
            row[f"{key}_median_of_rounds"] = statistics.median(e / o for e, o in pairs)
        if task != "prefill":
            eager_tokens, our_tokens = warm[f"{task}/eager"], warm[f"{task}/ours"]
            row["tokens_equal_eager"] = bool(torch.equal(eager_tokens, our_tokens))
            row["first_difference"] = first_difference(eager_tokens, our_tokens)
        rows.append(row)
        print(json.dumps(row), flush=True)
    config = GEMMA_2B | {"num_hidden_layers": args.layers, "dtype": "bfloat16"}
    run_args = {k: v for k, v in vars(args).items() if k != "out"}
    return {
        "env": env, "model": config, "args": run_args, "logits_agreement": agreement,
        "rows": rows,
    }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    lib.require_cuda("benchmarks/e2e.py")
    result = run(args)
    out = args.out or lib.results_path(result["env"], "e2e")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"Wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
