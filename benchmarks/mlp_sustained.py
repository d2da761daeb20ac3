"""The 8192-token Gemma-2B MLP (bf16) against what the GPU sustains: cuBLAS's three GEMMs
back to back without the activation, eager's MLP, our layer and ``geglu_mlp``, our dual
and down GEMMs alone, and the 8192^3 matmul alone and three in a row; medians of
``do_bench`` over interleaved rounds. Writes benchmarks/results/<date>-<gpu>-sustained.json
(or --out). Needs a CUDA GPU."""

import argparse
import json
import statistics
from pathlib import Path

import bench_lib as lib
import torch
import torch.nn.functional as F
from transformers import GemmaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP

H, I, T = 2048, 16384, 8192  # Gemma-2B, 8192 tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lib.require_cuda("benchmarks/mlp_sustained.py")
    ours = lib.load_ours()
    config = GemmaConfig(
        hidden_size=H, intermediate_size=I, hidden_act="gelu_pytorch_tanh"
    )
    mlp = GemmaMLP(config).to("cuda", torch.bfloat16).eval()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    a, b = (
        torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    fns = {
        "matmul_8192^3": lambda: a @ b,
        "matmul_8192^3_x3": lambda: (a @ b, a @ b, a @ b),
        "cublas_gate_up_down": lambda: (
            F.linear(x, wg),
            F.linear(x, wu),
            F.linear(h, wd),
        ),
        "cublas_gate": lambda: F.linear(x, wg),
        "cublas_down": lambda: F.linear(h, wd),
        "eager_mlp": lambda: mlp(x),
        "ours_layer": lambda: ours.layers.GeGLUMLP.forward(mlp, x),
        "ours_geglu_mlp": lambda: ours.geglu_mlp(x, wg, wu, wd),
        "ours_dual": lambda: ours.geglu_linear(x, wg, wu),
        "ours_down": lambda: ours.linear(h, wd),
    }
    with torch.no_grad():
        times = lib.interleaved(fns, lib.bench_ms, args.rounds)
    env = lib.environment(ours)
    ms = {name: statistics.median(t) for name, t in times.items()}
    flops = 3 * 2 * T * H * I
    result = {"env": env, "ms": ms, "rounds_ms": times}
    result["matmul_TFLOPs"] = 2 * 8192**3 / ms["matmul_8192^3"] / 1e9
    result["matmul_x3_TFLOPs"] = 3 * 2 * 8192**3 / ms["matmul_8192^3_x3"] / 1e9
    result["floor_ms_at_matmul_rate"] = flops / (result["matmul_TFLOPs"] * 1e9)
    result["cublas_three_gemms_TFLOPs"] = flops / ms["cublas_gate_up_down"] / 1e9
    print(json.dumps({k: v for k, v in result.items() if k != "rounds_ms"}, indent=1))
    out = args.out or lib.results_path(env, "sustained")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"Wrote {out}")


if __name__ == "__main__":
    main()
