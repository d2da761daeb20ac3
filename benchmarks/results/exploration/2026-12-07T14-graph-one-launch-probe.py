"""Probe (not committed): in CUDA graphs at 1-16 tokens, the one launch (fresh zeroed
scratch per capture: memset nodes) against the two kernels geglu_mlp takes there, and the
layer; Gemma-2B MLP bf16. Interleaved rounds; max abs diff one vs two."""
import json, os, statistics, sys
sys.path.insert(0, "benchmarks")
import bench_lib as lib
import torch
ours = lib.load_ours()
ol = sys.modules[ours.__name__ + ".one_launch"]
gm = sys.modules[ours.__name__ + ".gemm"]
H, I = 2048, 16384
model = lib.eager_geglu_mlp(H, I).to("cuda", torch.bfloat16)
wg, wu, wd = model.gate_proj.weight, model.up_proj.weight, model.down_proj.weight
act = gm.activation_code("tanh") if hasattr(gm, "activation_code") else gm.GELU_TANH
res = {"env": lib.environment(ours), "ceilings": lib.ceilings(), "rows": {}}
res["floor_us"] = 3 * H * I * 2 / (res["ceilings"]["copy_TBps"] * 1e6)
print(res, flush=True)
with torch.no_grad():
    for t in [int(v) for v in os.environ.get('PROBE_TOKENS', '1 16').split()]:
        x = torch.randn(t, H, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(t, H, dtype=torch.bfloat16, device="cuda")
        def one(x=x, out=out):
            ol.one_launch_mlp(x, wg, wu, wd, out, act)
            return out
        def two(x=x):
            return ours.geglu_mlp(x, wg, wu, wd)  # in a capture: the two kernels
        def layer(x=x):
            return ours.layers.GeGLUMLP.forward(model, x)
        ref = model(x).float()
        err = {"one": (one().float() - ref).abs().max().item()}
        fns = {"one": one, "two": two, "layer": layer}
        times = lib.interleaved(fns, lambda f: lib.bench_ms(f, True) * 1e3, 3)
        row = {k: {"us": statistics.median(v), "rounds_us": v} for k, v in times.items()}
        row["max_abs_vs_eager"] = err
        res["rows"][str(t)] = row
        print(t, json.dumps(row), flush=True)
        open(os.path.join(os.environ.get("OUT", "."), "probe-graph-one-launch.json"), "w").write(json.dumps(res, indent=1))
