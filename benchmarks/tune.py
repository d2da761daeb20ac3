"""Sweep the launch-configuration tables' candidates on this GPU (bf16) and write the times
as JSON: the evidence behind the choices in activation._elementwise_config and
gemm._gemm_config. Usage: python benchmarks/tune.py --out tune.json"""

import argparse
import json
from pathlib import Path

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from kernels import get_local_kernel

    ours = get_local_kernel(ROOT)
    dt = torch.bfloat16
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }

    # Elementwise GeGLU, 8192 x 16384: (BLOCK_M, BLOCK_N, num_warps)
    g, u, dy = (torch.randn(8192, 16384, dtype=dt, device="cuda") for _ in range(3))
    act = {}
    default = ours.activation._elementwise_config
    for cfg in [
        (4, 1024, 4),
        (8, 1024, 4),
        (8, 1024, 8),
        (16, 1024, 8),
        (2, 2048, 4),
        (4, 2048, 8),
        (1, 4096, 8),
    ]:
        ours.activation._elementwise_config = lambda n, e, cfg=cfg: cfg
        fwd = do_bench(
            lambda: ours.activation.geglu_fwd(g, u, torch.empty_like(g), "tanh"),
            return_mode="median",
        )
        bwd = do_bench(
            lambda: ours.activation.geglu_bwd(dy, g, u, "tanh"), return_mode="median"
        )
        act[str(cfg)] = {"fwd_ms": fwd, "bwd_ms": bwd}
        print("act", cfg, fwd, bwd, flush=True)
    ours.activation._elementwise_config = default
    result["elementwise"] = act

    # GEMMs: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
    default_gemm = ours.gemm._gemm_config
    keys = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"]
    big = [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4),
           (256, 128, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3)]  # fmt: skip
    dual = [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4),
            (128, 128, 32, 8, 8, 5), (256, 64, 64, 8, 8, 3)]  # fmt: skip
    small = [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 32, 256, 1, 4, 3), (16, 16, 256, 1, 4, 4),
             (16, 64, 256, 1, 8, 3), (16, 128, 128, 1, 8, 4)]  # fmt: skip
    gemm = {}
    h, i = 2048, 16384
    for tokens, cands in ((8192, big), (1, small), (16, small), (64, small)):
        x = torch.randn(tokens, h, dtype=dt, device="cuda")
        wg, wu = (torch.randn(i, h, dtype=dt, device="cuda") / h**0.5 for _ in range(2))
        wd = torch.randn(h, i, dtype=dt, device="cuda") / i**0.5
        hh = torch.randn(tokens, i, dtype=dt, device="cuda")
        bench = do_bench if tokens > 64 else do_bench_cudagraph
        for name, fn, cs in (
            ("up", lambda: ours.linear(x, wg), cands),
            ("down", lambda: ours.linear(hh, wd), cands),
            (
                "dual",
                lambda: ours.geglu_linear(x, wg, wu),
                dual if tokens > 64 else cands,
            ),
        ):
            for cfg in cs:
                ours.gemm._gemm_config = lambda *a, cfg=cfg: dict(zip(keys, cfg))
                try:
                    ms = bench(fn, return_mode="median")
                except (
                    triton.runtime.errors.OutOfResources
                ) as e:  # too big for shared memory
                    ms = repr(e)[:120]
                gemm[f"{name}/{tokens}/{cfg}"] = ms
                print("gemm", name, tokens, cfg, ms, flush=True)
        ours.gemm._gemm_config = default_gemm
        # backward GEMM shapes at 8192 tokens with the table's own choice
    x = torch.randn(8192, h, dtype=dt, device="cuda", requires_grad=True)
    w = (torch.randn(i, h, dtype=dt, device="cuda") / h**0.5).requires_grad_()
    b = torch.randn(i, dtype=dt, device="cuda", requires_grad=True)
    dyl = torch.randn(8192, i, dtype=dt, device="cuda")
    result["linear_fwd_bwd_bias_ms"] = do_bench(
        lambda: torch.autograd.grad(ours.linear(x, w, b), (x, w, b), dyl),
        return_mode="median",
    )
    result["eager_linear_fwd_bwd_bias_ms"] = do_bench(
        lambda: torch.autograd.grad(
            torch.nn.functional.linear(x, w, b), (x, w, b), dyl
        ),
        return_mode="median",
    )
    print(result["linear_fwd_bwd_bias_ms"], result["eager_linear_fwd_bwd_bias_ms"])
    result["gemm"] = gemm
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
