"""Decode probe (not committed): split-K counts and tiles for the bf16 decode GEMMs of
Gemma-2B's MLP, CUDA-graph replay, cuBLAS and the floor in the same run."""
import json, sys, itertools
from pathlib import Path
sys.path.insert(0, "benchmarks")
import bench_lib as lib
import torch
import torch.nn.functional as F

H, I, DT = 2048, 16384, torch.bfloat16
ours = lib.load_ours()
tun, gm = ours.tuning, ours.gemm
table = tun.table(torch.device("cuda"))
auto_split = gm.split_k
ceil = lib.ceilings()
res = {"env": lib.environment(ours), "ceilings": ceil,
       "floor_us": 3 * H * I * 2 / (ceil["copy_TBps"] * 1e6),
       "table": {k: list(v) for k, v in table.gemm.items() if k.startswith("decode")}}
torch.manual_seed(0)
wg, wu = (torch.randn(I, H, dtype=DT, device="cuda") / H**0.5 for _ in range(2))
wd = torch.randn(H, I, dtype=DT, device="cuda") / I**0.5

def run(name, fn, cls, tile, split, M=1, N=1):
    tiles = -(-M // tile[0]) * -(-N // tile[1])
    if split and split > 1 and tiles > 132:  # one split-K counter per SM
        return "skipped: tiles > counters"
    gm.split_k = auto_split if split is None else (lambda t, k, p, s=split: s)
    with tun.use("cuda", gemm={**table.gemm, cls: tuple(tile)}, linear_cublas_rows=(0, 0)):
        try:
            us = lib.bench_ms(fn, True) * 1e3
        except Exception as e:
            us = repr(e)[:80]
    gm.split_k = auto_split
    print(name, cls, tile, split, us, flush=True)
    return us

import triton, triton.language as tl

@triton.jit
def read_kernel(x_ptr, out_ptr, per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * per_prog
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, per_prog, BLOCK):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))

flat = torch.randn(3 * H * I, dtype=DT, device="cuda")  # the three weights' bytes
sink = torch.empty(6144, dtype=torch.float32, device="cuda")
rf = res["read_floor_us"] = {}
for progs, block, warps in [(768, 2048, 4), (1536, 1024, 4), (1536, 2048, 4), (3072, 1024, 4), (6144, 1024, 4), (1536, 4096, 8)]:
    per = flat.numel() // progs
    us = lib.bench_ms(lambda: read_kernel[(progs,)](flat, sink, per, BLOCK=block, num_warps=warps), True) * 1e3
    rf[f"{progs}x{block}x{warps}"] = us
    print("read", progs, block, warps, us, "TB/s", flat.numel() * 2 / us / 1e6, flush=True)
del flat
Path(sys.argv[1]).write_text(json.dumps(res, indent=1))

for M in (64, 16):
    xs = torch.randn(M, H, dtype=DT, device="cuda")
    hs = torch.randn(M, I, dtype=DT, device="cuda")
    row = res[str(M)] = {}
    c = "16" if M <= 16 else "64"
    row["cublas_down"] = lib.bench_ms(lambda: F.linear(hs, wd), True) * 1e3
    row["cublas_gate_up"] = lib.bench_ms(lambda: (F.linear(xs, wg), F.linear(xs, wu)), True) * 1e3
    cur_s, cur_g = tuple(table.gemm[f"decode{c}_single"]), tuple(table.gemm[f"decode{c}_gated"])
    if M <= 16:
        singles = [cur_s]
        gateds = [cur_g, (16, 64, 128, 1, 4, 4)]
    else:
        singles = [cur_s, (64, 128, 128, 1, 8, 3), (64, 256, 64, 1, 8, 3)]
        gateds = [cur_g, (64, 128, 128, 1, 8, 3)]
    down = row["down"] = {}
    for tile, split in itertools.product(dict.fromkeys(singles), (None, 8, 16)):
        down[f"{tile} split {split}"] = run("down", lambda: ours.linear(hs, wd), f"decode{c}_single", tile, split, M, H)
    dual = row["dual"] = {}
    for tile, split in itertools.product(dict.fromkeys(gateds), (None, 2)):
        dual[f"{tile} split {split}"] = run("dual", lambda: ours.geglu_linear(xs, wg, wu), f"decode{c}_gated", tile, split, M, I)
    row["geglu_mlp"] = run("mlp", lambda: ours.geglu_mlp(xs, wg, wu, wd), f"decode{c}_gated", cur_g, None)
    def eager():
        return F.linear(F.gelu(F.linear(xs, wg), approximate="tanh") * F.linear(xs, wu), wd)
    row["eager"] = lib.bench_ms(eager, True) * 1e3
    def dual_cublas():
        return F.linear(ours.geglu_linear(xs, wg, wu), wd)
    row["dual_then_cublas_down"] = run("mlp2", dual_cublas, f"decode{c}_gated", cur_g, None)
    Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
ol = ours.one_launch
res["one_launch_rows"] = olr = {}
for M, final in ((16, 1024), (32, 512), (64, 256)):
    ol.ONE_LAUNCH_MAX_TOKENS = M
    xs = torch.randn(M, H, dtype=DT, device="cuda")
    o = torch.empty(M, H, dtype=DT, device="cuda")
    for bn in (128, 64):
        with tun.use("cuda", one_launch={**table.one_launch, "BLOCK_FINAL": final, "BLOCK_N": bn}):
            ol._PLANS.clear()
            try:
                us = lib.bench_ms(lambda: ol.one_launch_mlp(xs, wg, wu, wd, o, gm.GELU_TANH), True) * 1e3
            except Exception as e:
                us = repr(e)[:80]
        olr[f"{M} BLOCK_N {bn}"] = us
        print("one_launch rows", M, "BLOCK_N", bn, us, flush=True)
ol.ONE_LAUNCH_MAX_TOKENS = 16
ol._PLANS.clear()
out = Path(sys.argv[1]); out.write_text(json.dumps(res, indent=1))
for M in ("64", "16"):
    r = res[M]
    fl = lambda d: min((v, k) for k, v in d.items() if isinstance(v, float))
    print(M, "floor", res["floor_us"], "mlp", r["geglu_mlp"], "dual+cublas", r["dual_then_cublas_down"], "eager", r["eager"],
          "cublas down", r["cublas_down"], "best down", fl(r["down"]), "cur down", r["down"][next(iter(r["down"]))],
          "best dual", fl(r["dual"]), "cur dual", r["dual"][next(iter(r["dual"]))])
