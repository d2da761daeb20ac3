"""Sweep the launch table's candidates on this GPU (Gemma-2B's MLP shapes, bf16) and write
the times as JSON; with ``--write``, also the table itself, which the package reads for
this GPU (torch-ext/fused_geglu/tuning_<GPU>.json; ``make build`` ships it). Each entry of
the table is the fastest candidate of its sweep; entries not swept keep the table in use.
cuBLAS and eager are timed in the same run. Candidates run through tuning.use (a table
in force), never by patching the package.

Usage: python benchmarks/tune.py [--only gemm decode ...] [--write] [--out tune.json]"""

import argparse
import dataclasses
import json
from pathlib import Path

import bench_lib as lib
import torch
import torch.nn.functional as F

H, I = 2048, 16384  # Gemma-2B
DT = torch.bfloat16


def timed(ours, key: str, fn, candidates: dict, graph: bool = False) -> dict:
    """{candidate name: ms} of ``fn`` under each candidate's table fields; a candidate
    that does not fit (shared memory) is recorded with its error."""
    result = {}
    for name, fields in candidates.items():
        with ours.tuning.use("cuda", **fields):
            try:
                result[name] = lib.bench_ms(fn, graph)
            except Exception as error:  # noqa: BLE001 (a candidate that cannot launch)
                result[name] = repr(error)[:100]
        print(key, name, result[name], flush=True)
    return result


def fastest(times: dict) -> str:
    """The name of the fastest candidate that ran."""
    return min((ms, name) for name, ms in times.items() if isinstance(ms, float))[1]


def sweep(ours, key: str, fn, candidates: dict, graph: bool = False) -> tuple:
    """({candidate: ms}, the fastest candidate's fields)."""
    times = timed(ours, key, fn, candidates, graph)
    return times, candidates[fastest(times)]


def gemm_candidates(table, shape_class: str, tiles: list) -> dict:
    """Candidates replacing one shape class's tiles, the table's own first (every row
    count on our GEMM: no ``linear_cublas_rows``)."""
    current = tuple(table.gemm[shape_class])
    return {
        str(t): {"gemm": {**table.gemm, shape_class: t}, "linear_cublas_rows": (0, 0)}
        for t in [current] + [tuple(t) for t in tiles if tuple(t) != current]
    }


def cublas_rows(result: dict) -> tuple[int, int]:
    """``linear_cublas_rows``: the decode classes' rows (1-16, 17-64) where cuBLAS beat the
    fastest tile of the class's single GEMM, as one range ((0, 0): none)."""
    spans = {16: (1, 16), 64: (17, 64)}
    won = [
        spans[tokens]
        for tokens in spans
        if (times := result[f"decode{tokens}_single"])["cublas"]
        < min(v for k, v in times.items() if k != "cublas" and isinstance(v, float))
    ]
    return (won[0][0], won[-1][1]) if won else (0, 0)


def gemms(ours, table) -> tuple[dict, dict]:
    """The 16-bit GEMM classes: TMA tiles at 8192 tokens (single with N = 16384, narrow
    single with N = 2048, dual), decode tiles at 16 and 64 tokens (CUDA-graph replay);
    cuBLAS (twice, for the dual GEMM's two products) in the same run, and where it beat
    our decode tiles (``linear_cublas_rows``)."""
    wg, wu = (torch.randn(I, H, dtype=DT, device="cuda") / H**0.5 for _ in range(2))
    wd = torch.randn(H, I, dtype=DT, device="cuda") / I**0.5
    tma = [(128, 256, 64, 8, 8, 3), (128, 256, 64, 16, 8, 3), (128, 256, 64, 4, 8, 3),
           (256, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4),
           (64, 256, 64, 8, 8, 4)]  # fmt: skip
    dual = [(128, 128, 64, 16, 8, 3), (128, 128, 64, 8, 8, 3), (128, 128, 64, 32, 8, 3),
            (128, 128, 64, 16, 8, 4), (128, 64, 64, 16, 8, 4), (256, 64, 64, 16, 8, 3),
            (64, 128, 64, 16, 4, 4)]  # fmt: skip
    decode = {16: [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 8, 4),
                   (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 4)],
              64: [(64, 64, 128, 1, 4, 4), (64, 64, 128, 1, 4, 3), (64, 64, 64, 1, 4, 6),
                   (64, 128, 128, 1, 8, 3), (64, 64, 128, 1, 8, 4), (64, 32, 256, 1, 4, 3)]}  # fmt: skip
    x = torch.randn(8192, H, dtype=DT, device="cuda")
    h = torch.randn(8192, I, dtype=DT, device="cuda")
    cases = {  # shape class: (ours, tiles, cuBLAS's time)
        "tma_single": (lambda: ours.linear(x, wg), tma, lambda: lib.bench_ms(lambda: F.linear(x, wg))),
        "tma_single_narrow": (lambda: ours.linear(h, wd), tma, lambda: lib.bench_ms(lambda: F.linear(h, wd))),
        "tma_gated": (lambda: ours.geglu_linear(x, wg, wu), dual, lambda: 2 * lib.bench_ms(lambda: F.linear(x, wg))),
    }  # fmt: skip
    for tokens, tiles in decode.items():
        xs = torch.randn(tokens, H, dtype=DT, device="cuda")
        hs = torch.randn(tokens, I, dtype=DT, device="cuda")
        cases[f"decode{tokens}_single"] = (
            lambda hs=hs: ours.linear(hs, wd), tiles,
            lambda hs=hs: lib.bench_ms(lambda: F.linear(hs, wd), True),
        )  # fmt: skip
        cases[f"decode{tokens}_gated"] = (
            lambda xs=xs: ours.geglu_linear(xs, wg, wu), tiles,
            lambda xs=xs: 2 * lib.bench_ms(lambda: F.linear(xs, wg), True),
        )  # fmt: skip
    result, chosen = {}, dict(table.gemm)
    for shape_class, (fn, tiles, cublas_ms) in cases.items():
        candidates = gemm_candidates(table, shape_class, tiles)
        graph = shape_class.startswith("decode")
        times, fields = sweep(ours, shape_class, fn, candidates, graph)
        result[shape_class] = {**times, "cublas": cublas_ms()}
        chosen[shape_class] = fields["gemm"][shape_class]
    return result, {"gemm": chosen, "linear_cublas_rows": cublas_rows(result)}


def one_launch_candidates(table) -> dict:
    """Candidates replacing the one-launch MLP's tiles (BLOCK_I, BLOCK_K, BLOCK_N, warps,
    stages), the table's own first."""
    keys = ("BLOCK_I", "BLOCK_K", "BLOCK_N", "num_warps", "num_stages")
    tiles = [(128, 128, 256, 8, 3), (128, 128, 256, 8, 4), (128, 128, 128, 8, 3),
             (128, 128, 128, 8, 4), (64, 128, 256, 8, 3), (64, 128, 128, 4, 4),
             (128, 256, 256, 8, 2), (128, 128, 256, 4, 3)]  # fmt: skip
    current = tuple(table.one_launch[k] for k in keys)
    return {
        str(t): {"one_launch": {**table.one_launch, **dict(zip(keys, t))}}
        for t in [current] + [t for t in tiles if t != current]
    }


def decode_mlp(ours, table) -> tuple[dict, dict]:
    """The one-launch MLP's tiles at 1 and 16 tokens (CUDA-graph replay), against the
    weight-streaming floor (the three weights at the measured copy rate), eager and the
    two kernels: the candidate with the least time summed over both (``chosen``), and
    ``one_launch_graph_max_tokens`` the most tokens up to which it beat the two kernels at
    each count measured (0: at none)."""
    gm = ours.gemm
    wg, wu = (torch.randn(I, H, dtype=DT, device="cuda") / H**0.5 for _ in range(2))
    wd = torch.randn(H, I, dtype=DT, device="cuda") / I**0.5
    candidates = one_launch_candidates(table)
    result = {"floor_ms": 3 * H * I * 2 / (lib.ceilings()["copy_TBps"] * 1e9)}
    for tokens in (1, 16):
        x = torch.randn(tokens, H, dtype=DT, device="cuda")
        out = torch.empty(tokens, H, dtype=DT, device="cuda")
        result[str(tokens)] = row = timed(
            ours,
            f"one-launch MLP, {tokens} tokens",
            lambda: ours.one_launch.one_launch_mlp(x, wg, wu, wd, out, gm.GELU_TANH),
            candidates,
            graph=True,
        )
        row["eager"] = lib.bench_ms(
            lambda: F.linear(
                F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu), wd
            ),
            True,
        )
        with ours.tuning.use("cuda", one_launch_graph_max_tokens=0):
            row["two_kernels"] = lib.bench_ms(
                lambda: ours.geglu_mlp(x, wg, wu, wd), True
            )
    total = {
        name: result["1"][name] + result["16"][name]
        for name in candidates
        if isinstance(result["1"][name], float)
        and isinstance(result["16"][name], float)
    }
    result["chosen"] = best = fastest(total)
    result["one_launch_graph_max_tokens"] = most = graph_max_tokens(result, best)
    return result, {**candidates[best], "one_launch_graph_max_tokens": most}


def graph_max_tokens(result: dict, best: str) -> int:
    """``one_launch_graph_max_tokens``: the most tokens up to which candidate ``best`` beat
    the two kernels at each token count the decode sweep measured (0: not at the first)."""
    most = 0
    for tokens in sorted(int(t) for t in result if t.isdigit()):
        if result[str(tokens)][best] >= result[str(tokens)]["two_kernels"]:
            break
        most = tokens
    return most


def elementwise(ours, table) -> tuple[dict, dict]:
    """Contiguous operands (one long row: flat tiles, per direction) and strided ones (the
    halves of one [M, 2N] tensor, row tiles of ``row_tile_elements``), 8192 x 16384, and
    ModernBERT's halves (8192 x 1152), against a copy."""
    g, u, dy = (torch.randn(8192, I, dtype=DT, device="cuda") for _ in range(3))
    out = torch.empty_like(g)
    result = {"copy_ms": lib.bench_ms(lambda: out.copy_(g))}
    flats = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]
    act, chosen = ours.elementwise, {}
    for key, fn in (
        ("flat_forward", lambda: act.geglu_forward(g, u, out, "tanh")),
        ("flat_backward", lambda: act.geglu_backward(dy, g, u, "tanh")),
    ):
        candidates = {str(t): {key: t} for t in [getattr(table, key)] + flats}
        result[key], fields = sweep(ours, key, fn, candidates)
        chosen |= fields
    rows, candidates = (
        {},
        {str(e): {"row_tile_elements": e} for e in (4096, 8192, 16384)},
    )
    for M, N in ((8192, I), (8192, 1152)):
        both = torch.randn(M, 2 * N, dtype=DT, device="cuda")
        o = torch.empty(M, N, dtype=DT, device="cuda")
        rows[f"{M}x{N}"] = timed(
            ours, f"rows {M}x{N}",
            lambda both=both, o=o, N=N: act.geglu_forward(both[:, :N], both[:, N:], o, "tanh"),
            candidates,
        )  # fmt: skip
    result["row_tile_elements"] = rows
    total = {e: sum(r[e] for r in rows.values()) for e in candidates}
    return result, chosen | candidates[fastest(total)]


def where(path: Path) -> str:
    """``path`` as a table's source names it: from the checkout's root where it lies inside."""
    path = path.resolve()
    return str(path.relative_to(lib.ROOT) if path.is_relative_to(lib.ROOT) else path)


SECTIONS = {"gemm": gemms, "decode": decode_mlp, "elementwise": elementwise}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument(
        "--write", action="store_true", help="write this GPU's table into the package"
    )
    args = parser.parse_args()
    lib.require_cuda("benchmarks/tune.py")
    ours = lib.load_ours()
    env = lib.environment(ours)
    out = args.out or lib.results_path(env, "tune")
    device = torch.device("cuda", torch.cuda.current_device())
    table = ours.tuning.table(device)
    result = {"env": env, "ceilings": lib.ceilings(), "table_in_use": table.gpu}
    fields = {}
    for name in args.only:
        result[name], chosen = SECTIONS[name](ours, table)
        fields |= chosen
        out.write_text(json.dumps(result, indent=1) + "\n")
    props = torch.cuda.get_device_properties(device)
    new = dataclasses.replace(
        table,
        gpu=env["device"],
        capability=(props.major, props.minor),
        sms=props.multi_processor_count,
        source=(f"{where(out)}: {', '.join(args.only)}",),
        **fields,
    )
    result["table"] = json.loads(new.to_json())
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"Wrote {out}")
    if args.write:
        name = "tuning_" + env["device"].replace(" ", "_") + ".json"
        path = lib.ROOT / "torch-ext" / "fused_geglu" / name
        path.write_text(new.to_json())
        print(f"Wrote {path}: run `make build` to ship it")


if __name__ == "__main__":
    main()
