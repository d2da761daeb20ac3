"""Sweep the launch-configuration tables' candidates on this GPU (bf16) and write the times
as JSON: the evidence behind the choices in elementwise.py (FLAT_TILES,
row_tile_config, also at the families' widths) and gemm.gemm_config. cuBLAS is timed in
the same run.
Usage: python benchmarks/tune.py --out tune.json"""

import argparse
import json
from pathlib import Path

import bench_lib as lib
import torch
import torch.nn.functional as F
import triton


def elementwise(act):
    """Contiguous operands (one long row: FLAT_TILES, per kernel) and strided ones (the
    halves of one [M, 2N] tensor, row tiles: row_tile_config), 8192 x 16384. Launch plans
    are cached: each candidate starts from an empty plan cache."""
    dt = torch.bfloat16
    g, u, dy = (torch.randn(8192, 16384, dtype=dt, device="cuda") for _ in range(3))
    x = torch.randn(8192, 2 * 16384, dtype=dt, device="cuda")
    out = torch.empty_like(g)
    result = {"copy_ms": lib.bench_ms(lambda: out.copy_(g))}
    default = dict(act.FLAT_TILES)
    for cfg in [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]:
        act.FLAT_TILES.update(dict.fromkeys(default, cfg))
        act._PLANS.clear()
        result[f"flat{cfg}"] = {
            "fwd_ms": lib.bench_ms(lambda: act.geglu_forward(g, u, out, "tanh")),
            "bwd_ms": lib.bench_ms(lambda: act.geglu_backward(dy, g, u, "tanh")),
        }
        print("flat", cfg, result[f"flat{cfg}"], flush=True)
    act.FLAT_TILES.update(default)
    default = act.row_tile_config
    for cfg in [(4, 1024, 4), (2, 2048, 4), (4, 2048, 8), (1, 4096, 8)]:
        act.row_tile_config = lambda n, e, cfg=cfg: cfg
        act._PLANS.clear()
        ms = lib.bench_ms(
            lambda: act.geglu_forward(x[:, :16384], x[:, 16384:], out, "tanh")
        )
        result[f"rows{cfg}"] = {"fwd_ms": ms}
        print("rows", cfg, ms, flush=True)
    act.row_tile_config = default
    act._PLANS.clear()
    return result


def family_rows(act):
    """Row tiles for the families' halves whose width is no power of two (ModernBERT
    base: 2 x 1152 at 8192 tokens; SD 1.5 GEGLU: 2 x 2560 at 2048 tokens): forward, and
    backward into strided outputs as in training, per candidate (the shipped one
    first)."""
    dt, default, result = torch.bfloat16, act.row_tile_config, {}
    for M, N in ((8192, 1152), (2048, 2560)):
        both = torch.randn(M, 2 * N, dtype=dt, device="cuda")
        gate, up = both[:, :N], both[:, N:]
        dy, out = (torch.empty(M, N, dtype=dt, device="cuda") for _ in range(2))
        dy.normal_()
        grads = torch.empty_like(both)  # strided like the in-place backward's outputs
        dgate, dup = grads[:, :N], grads[:, N:]
        shipped = default(N, 2)
        for cfg in [shipped] + [(8192 // b, b, 8) for b in (2048, 1024, 512, 256)]:
            act.row_tile_config = lambda n, e, cfg=cfg: cfg
            act._PLANS.clear()
            key = f"rows{M}x{N}{cfg}" + (" shipped" if cfg is shipped else "")
            result[key] = {
                "fwd_ms": lib.bench_ms(
                    lambda: act.geglu_forward(gate, up, out, "tanh")
                ),
                "bwd_ms": lib.bench_ms(
                    lambda: act.geglu_backward(dy, gate, up, "tanh", dgate, dup)
                ),
            }
            print(key, result[key], flush=True)
    act.row_tile_config = default
    act._PLANS.clear()
    return result


def gemms(ours):
    """Candidates per shape class: TMA tiles at 8192 tokens (single and dual), portable
    tiles at decode sizes (CUDA-graph timing)."""
    dt = torch.bfloat16
    gm = ours.gemm
    default = gm.gemm_config
    single = [(128, 256, 64, 8, 8, 3), (256, 128, 64, 8, 8, 3), (128, 256, 64, 16, 8, 3),
              (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 4)]  # fmt: skip
    dual = [(128, 128, 64, 16, 8, 3), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4),
            (256, 64, 64, 8, 8, 3), (64, 128, 64, 8, 4, 4)]  # fmt: skip
    small = [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 16, 256, 1, 4, 4),
             (16, 128, 128, 1, 8, 4), (32, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 4)]  # fmt: skip
    result = {}

    def sweep(key, fn, cands, graph=False):
        result[key] = {}
        for cfg in cands:
            gm.gemm_config = lambda *a, cfg=cfg: gm.GemmConfig(*cfg)
            gm._PLANS.clear()
            try:
                result[key][str(cfg)] = lib.bench_ms(fn, graph)
            except triton.runtime.errors.OutOfResources as e:  # shared memory
                result[key][str(cfg)] = repr(e)[:100]
            print(key, cfg, result[key][str(cfg)], flush=True)
        gm.gemm_config = default
        gm._PLANS.clear()

    for m, n, k in ((8192, 16384, 2048), (8192, 2048, 16384), (4096, 4096, 4096), (8192, 4096, 4096)):  # fmt: skip
        x = torch.randn(m, k, dtype=dt, device="cuda")
        w = torch.randn(n, k, dtype=dt, device="cuda") / k**0.5
        b = torch.randn(n, dtype=dt, device="cuda")
        key = f"linear/{m}x{n}x{k}"
        sweep(key, lambda: ours.linear(x, w, b), single)
        result[key]["cublas"] = lib.bench_ms(lambda: F.linear(x, w, b))
    h, i = 2048, 16384
    wg, wu = (torch.randn(i, h, dtype=dt, device="cuda") / h**0.5 for _ in range(2))
    wd = torch.randn(h, i, dtype=dt, device="cuda") / i**0.5
    for tokens in (8192, 1, 16, 64):
        x = torch.randn(tokens, h, dtype=dt, device="cuda")
        hh = torch.randn(tokens, i, dtype=dt, device="cuda")
        graph = tokens <= 64
        sweep(
            f"dual/{tokens}",
            lambda: ours.geglu_linear(x, wg, wu),
            small if graph else dual,
            graph,
        )
        result[f"dual/{tokens}"]["cublas_x2"] = 2 * lib.bench_ms(
            lambda: F.linear(x, wg), graph
        )
        if graph:
            sweep(f"up/{tokens}", lambda: ours.linear(x, wg), small, graph)
            sweep(f"down/{tokens}", lambda: ours.linear(hh, wd), small, graph)
    return result


def decode_mlp(ours):
    """The whole-MLP kernel's tiles (gemm.mlp_config) on the Gemma-2B MLP at decode sizes,
    against the two-kernel route (dual GEMM, cuBLAS down projection) and eager, by
    CUDA-graph replay; the weight-streaming floor is the three weights at copy rate. With
    e4m3 weights (128 x 128 block scales), the shipped tiles in one launch against the
    three kernels (quantize, dual GEMM, down GEMM)."""
    dt = torch.bfloat16
    gm = ours.gemm
    h, i = 2048, 16384
    wg, wu = (torch.randn(i, h, dtype=dt, device="cuda") / h**0.5 for _ in range(2))
    wd = torch.randn(h, i, dtype=dt, device="cuda") / i**0.5
    default = gm.mlp_config
    # (BLOCK_I, BLOCK_K, BLOCK_N, num_warps, num_stages)
    cands = [(128, 128, 128, 8, 3), (128, 128, 256, 8, 3), (128, 128, 128, 4, 3),
             (128, 128, 64, 8, 3), (64, 128, 128, 4, 3), (256, 64, 128, 8, 3),
             (128, 64, 128, 8, 4)]  # fmt: skip
    result = {}
    e4m3, scales = torch.float8_e4m3fn, []
    for w in (wg, wu, wd):  # one scale per 128 x 128 block: 1/8, weights 8x larger
        scales.append(
            torch.full((w.shape[0] // 128, w.shape[1] // 128), 0.125, device="cuda")
        )
    qg, qu, qd = ((w.float() * 8).to(e4m3) for w in (wg, wu, wd))
    for tokens in (1, 2, 4, 8, 16):
        x = torch.randn(tokens, h, dtype=dt, device="cuda")
        out = torch.empty(tokens, h, dtype=dt, device="cuda")
        row = result[str(tokens)] = {}
        for cfg in cands:
            keys = ("BLOCK_I", "BLOCK_K", "BLOCK_N", "num_warps", "num_stages")
            gm.mlp_config = lambda *a, cfg=cfg: dict(zip(keys, cfg))
            gm._MLP_PLANS.clear()
            try:
                row[str(cfg)] = lib.bench_ms(
                    lambda: gm.geglu_mlp_small(x, wg, wu, wd, out, gm.GELU_TANH), True
                )
            except triton.runtime.errors.OutOfResources as e:
                row[str(cfg)] = repr(e)[:100]
            print("decode_mlp", tokens, cfg, row[str(cfg)], flush=True)
        gm.mlp_config = default
        gm._MLP_PLANS.clear()
        with torch.no_grad():
            row["two_kernels"] = lib.bench_ms(
                lambda: F.linear(ours.geglu_linear(x, wg, wu), wd), True
            )
            row["eager"] = lib.bench_ms(
                lambda: F.linear(
                    F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu), wd
                ),
                True,
            )
            row["fp8_one_kernel"] = lib.bench_ms(
                lambda: gm.geglu_mlp_small(
                    x, qg, qu, qd, out, gm.GELU_TANH, scales=tuple(scales)
                ),
                True,
            )
            # The op with its one-launch flag off: the three kernels (deterministic mode
            # would also fill every new tensor with NaN, a kernel each)
            row["fp8_three_kernels"] = lib.bench_ms(
                lambda: ours.library.geglu_mlp_fp8(
                    x, qg, scales[0], qu, scales[1], qd, scales[2], None, None, None,
                    "tanh", False,
                ),
                True,
            )  # fmt: skip
        print("decode_mlp", tokens, row, flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    sections = ("elementwise", "family_rows", "gemm", "decode_mlp")
    parser.add_argument("--only", nargs="*", default=sections, choices=sections)
    args = parser.parse_args()
    lib.require_cuda("benchmarks/tune.py")
    ours = lib.load_ours()
    result = {"env": lib.environment(ours)}
    if "elementwise" in args.only:
        result["elementwise"] = elementwise(ours.elementwise)
    if "family_rows" in args.only:
        result["family_rows"] = family_rows(ours.elementwise)
    if "gemm" in args.only:
        result["gemm"] = gemms(ours)
    if "decode_mlp" in args.only:
        result["decode_mlp"] = decode_mlp(ours)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
