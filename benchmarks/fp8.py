"""The FP8 GeGLU MLP against transformers' FP8 path and the bf16 MLPs, in one run (CUDA GPU).

A Gemma-2B MLP (hidden 2048, intermediate 16384, tanh GeLU) whose projections are
transformers' ``FP8Linear`` (e4m3 weights in 128 x 128 blocks, fp32 scales, dynamic
activations), as ``FineGrainedFP8Config`` loads them, from random weights:

- ``fp8_transformers``: the module's own forward, on the kernels-community
  ``finegrained-fp8`` Triton kernel (``--peer``: its ``torch-ext/finegrained_fp8`` folder,
  assembled here into a local kernel tree; DeepGEMM is not measured);
- ``fp8_ours``: our ``GeGLUMLP`` layer over the same module;
- ``bf16_eager`` / ``bf16_ours``: GemmaMLP in bf16 with the dequantized weights.

Forward time by CUDA-graph replay up to 64 tokens, else do_bench, interleaved rounds;
the ceilings (copy bandwidth, ``torch._scaled_mm`` e4m3 8192^3 with row-wise scales);
the kernels per forward; the largest error of each FP8 path against a float64
reference of the same quantized model (tests/reference.py); and a tiny Gemma saved and
reloaded with ``FineGrainedFP8Config``, kernelized, its next-token argmax against the
unkernelized model's. With ``--tune``, a sweep of the FP8 GEMM tiles at 8192 tokens.

    python benchmarks/fp8.py --peer .peers/finegrained-fp8/finegrained_fp8
"""

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import bench_lib
import torch
from reference import (
    fp8_dequantize_weight,
    fp8_geglu_mlp,
    fp8_quantize_weight,
)

HIDDEN, INTERMEDIATE = 2048, 16384


def peer_kernel(source: Path):
    """kernels-community finegrained-fp8 as a local kernel tree (its _ops.py and
    metadata.json written here), as transformers would load it from the Hub."""
    from kernels import get_local_kernel

    root = Path(tempfile.mkdtemp()) / "finegrained-fp8"
    tree = root / "build" / "torch-cuda"
    shutil.copytree(source, tree)
    namespace = "_finegrained_fp8_local"
    (tree / "_ops.py").write_text(
        "import torch\n"
        f"ops = torch.ops.{namespace}\n\n\n"
        "def add_op_namespace_prefix(op_name: str) -> str:\n"
        f'    return f"{namespace}::{{op_name}}"\n'
    )
    (tree / "metadata.json").write_text(
        json.dumps(
            {
                "name": "finegrained-fp8",
                "license": "apache-2.0",
                "id": namespace,
                "version": 1,
                "backend": {"type": "cuda"},
                "python-depends": [],
            }
        )
    )
    return get_local_kernel(root)


def use_peer(source: Path) -> None:
    from transformers.integrations import hub_kernels

    hub_kernels._KERNEL_MODULE_MAPPING["finegrained-fp8"] = peer_kernel(source)


def mlps():
    """(fp8 GemmaMLP, bf16 GemmaMLP of the dequantized weights, fp8 weights, scales)."""
    from transformers import GemmaConfig
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = GemmaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        hidden_act="gelu_pytorch_tanh",
    )
    bf16 = GemmaMLP(config).to("cuda", torch.bfloat16)
    fp8 = copy.deepcopy(bf16)
    weights, scales = [], []
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = getattr(bf16, name).weight
        q, s = fp8_quantize_weight(w.float())
        proj = FP8Linear(w.shape[1], w.shape[0], block_size=(128, 128))
        proj.weight = torch.nn.Parameter(q, requires_grad=False)
        proj.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
        setattr(fp8, name, proj.to("cuda"))
        getattr(bf16, name).weight.data = fp8_dequantize_weight(q, s).to(w.dtype)
        weights.append(q)
        scales.append(s)
    return fp8, bf16, weights, scales


def scaled_mm_tflops() -> float:
    """torch._scaled_mm, e4m3 8192^3 with row-wise scales, bf16 out: the FP8 matmul rate."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    ms = bench_lib.bench_ms(
        lambda: torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16)
    )
    return 2 * n**3 / ms / 1e9


def deterministic(fn):
    """``fn`` under torch.use_deterministic_algorithms(True): our layer's kernels without
    the one launch (its fp32 sums are atomic), as a CUDA graph runs them."""

    def call(x):
        torch.use_deterministic_algorithms(True)
        try:
            return fn(x)
        finally:
            torch.use_deterministic_algorithms(False)

    return call


def errors(fns: dict, fp8, weights, scales, tokens: int) -> dict:
    """Each FP8 path's largest error against the float64 model (same quantization)."""
    x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    ref = fp8_geglu_mlp(x, weights, scales, [None] * 3, "tanh", exact=True)
    out = {}
    with torch.no_grad():
        for name, fn in fns.items():
            out[name] = (fn(x).double() - ref).abs().max().item()
    return out


def tiny_gemma_agreement(ours) -> dict:
    """A tiny Gemma saved and reloaded with FineGrainedFP8Config, kernelized: its
    next-token argmax against the unkernelized FP8 model's at every position of one
    forward over a batch of prompts."""
    from kernels import Mode
    from transformers import (
        FineGrainedFP8Config,
        GemmaConfig,
        GemmaForCausalLM,
    )

    config = GemmaConfig(
        vocab_size=2048, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128,
        hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        GemmaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        # use_kernels=False: from transformers 5.25 on, from_pretrained kernelizes with the
        # Hub's kernels by default (rotary among them); the comparison is plain against ours.
        load = lambda: GemmaForCausalLM.from_pretrained(
            folder,
            quantization_config=FineGrainedFP8Config(),
            device_map="cuda",
            use_kernels=False,
        ).eval()
        plain, kernelized = load(), load()
    replaced = ours.kernelize_mlps(kernelized, mode=Mode.INFERENCE, device="cuda")
    ids = torch.randint(0, config.vocab_size, (8, 64), device="cuda")
    with torch.no_grad():
        a, b = plain(ids).logits.float(), kernelized(ids).logits.float()
        kernels = bench_lib.kernel_list(lambda: kernelized(ids))["kernels"]
    projection = type(kernelized.model.layers[0].mlp.gate_proj).__name__
    return {
        "layers_kernelized": len(replaced),
        "projection_class": projection,
        "positions": a.shape[0] * a.shape[1],
        "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
        "max_abs_logit_diff": (a - b).abs().max().item(),
        "max_abs_logit": a.abs().max().item(),
        "fp8_kernels_per_forward": {
            k: v for k, v in kernels.items() if "fp8" in k or "gemm" in k or "mlp" in k
        },
    }


def tune(ours, fp8_mlp) -> list:
    """FP8 GEMM tiles at 8192 tokens: (block_m, warps, stages) for the dual GEMM (BLOCK_N
    128, the scale block) and the down GEMM (block_n)."""
    gemm, one_launch, rows = ours.fp8.gemm, ours.one_launch, []
    real = gemm.fp8_config
    x = torch.randn(8192, HIDDEN, dtype=torch.bfloat16, device="cuda")
    layer = ours.layers.GeGLUMLP
    candidates = [
        (gated, bm, bn, warps, stages, group)
        for gated in (True, False)
        for bm, bn, warps in ((128, 128, 8), (64, 128, 4), (128, 64, 4), (128, 256, 8))
        for stages, group in ((3, 8), (4, 8), (4, 16))
        if not (gated and bn != 128)
    ]
    for gated, bm, bn, warps, stages, group in candidates:

        def config(M, g, tma, *rest, _c=(gated, bm, bn, warps, stages, group)):
            if g == _c[0] and tma and M > 64:
                return gemm.GemmConfig(_c[1], _c[2], 128, _c[5], _c[3], _c[4])
            return real(M, g, tma, *rest)

        gemm.fp8_config = config
        gemm._PLANS.clear()
        try:
            with torch.no_grad():
                ms = bench_lib.bench_ms(lambda: layer.forward(fp8_mlp, x))
            rows.append({"gated": gated, "block_m": bm, "block_n": bn, "warps": warps,
                         "stages": stages, "group_m": group, "mlp_ms": ms})  # fmt: skip
        except Exception as error:  # noqa: BLE001 (a config that does not fit: recorded)
            rows.append({"gated": gated, "block_m": bm, "block_n": bn, "warps": warps,
                         "stages": stages, "group_m": group, "error": str(error)[:200]})  # fmt: skip
        finally:
            gemm.fp8_config = real
            gemm._PLANS.clear()
        print(rows[-1], file=sys.stderr)
    real_mlp = one_launch.one_launch_config
    for tokens in (1, 16):
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        for warps in (4, 8):
            for stages in (2, 3, 4):
                one_launch.one_launch_config = (
                    lambda *a, _o={"num_warps": warps, "num_stages": stages}: {
                        **real_mlp(*a),
                        **_o,
                    }
                )
                one_launch._PLANS.clear()
                try:
                    with torch.no_grad():
                        ms = bench_lib.bench_ms(lambda: layer.forward(fp8_mlp, x), True)
                    rows.append({"decode_tokens": tokens, "warps": warps, "stages": stages,
                                 "mlp_ms": ms})  # fmt: skip
                finally:
                    one_launch.one_launch_config = real_mlp
                    one_launch._PLANS.clear()
                print(rows[-1], file=sys.stderr)
    return rows


def main() -> None:
    bench_lib.require_cuda("fp8.py")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=Path, help="finegrained-fp8's torch-ext folder")
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1, 16, 32, 64, 128, 256, 1024, 2048, 8192],
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    ours = bench_lib.load_ours()
    env = bench_lib.environment(ours)
    env["deepgemm"] = "not measured"
    result = {"env": env, "shape": {"hidden": HIDDEN, "intermediate": INTERMEDIATE}}
    fp8, bf16, weights, scales = mlps()
    layer = ours.layers.GeGLUMLP
    fns = {
        "fp8_ours": lambda x: layer.forward(fp8, x),
        "bf16_eager": bf16,
        "bf16_ours": lambda x: layer.forward(bf16, x),
    }
    if args.peer is not None:
        use_peer(args.peer)
        fns = {"fp8_transformers": fp8, **fns}
    if args.tune:
        result["tune"] = tune(ours, fp8)
    result["ceilings"] = {
        **bench_lib.ceilings(),
        "fp8_scaled_mm_TFLOPs": scaled_mm_tflops(),
        "fp8_weight_bytes": sum(w.numel() for w in weights),
    }
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        graph = tokens <= bench_lib.GRAPH_TOKENS
        calls = {name: (lambda fn=fn: fn(x)) for name, fn in fns.items()}
        with torch.no_grad():
            for call in calls.values():
                call()  # compile / autotune outside the timing
                if graph:  # and what the capture runs (cold: decisions/0003)
                    deterministic(lambda _, call=call: call())(None)
            times = bench_lib.interleaved(
                calls, lambda fn: bench_lib.bench_ms(fn, graph), args.rounds
            )
            kernels = {
                n: bench_lib.kernel_list(c) for n, c in calls.items() if "fp8" in n
            }
        row = {"tokens": tokens, "timer": "do_bench_cudagraph" if graph else "do_bench"}
        row["ms"] = {n: statistics.median(t) for n, t in times.items()}
        row["rounds_ms"] = times
        row["kernels"] = kernels
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("tokens", "ms")}), file=sys.stderr)
    result["forward"] = rows
    fp8_fns = {n: fn for n, fn in fns.items() if n.startswith("fp8")}
    # The kernels that CUDA graphs (decode) run in place of an eager call's one launch.
    kernels = {"fp8_ours_kernels": deterministic(fp8_fns["fp8_ours"])}
    result["errors_vs_float64"] = {}
    for t in (16, 256, 2048, 8192):  # from 2048 the all-cuBLAS route (where it applies)
        paths = fp8_fns | (kernels if t <= ours.tuning.ONE_LAUNCH_MAX_TOKENS else {})
        result["errors_vs_float64"][str(t)] = errors(paths, fp8, weights, scales, t)
    if args.peer is not None:
        result["tiny_gemma"] = tiny_gemma_agreement(ours)
    path = args.out or bench_lib.results_path(env, "fp8")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
