"""GPU comparison of our kernels with eager PyTorch, torch.compile and Liger, all measured in
one run; writes benchmarks/results/<date>-<gpu>.json (or --out). Needs a CUDA GPU.

Times are medians of triton.testing.do_bench; shapes of 64 tokens or fewer are timed by
CUDA-graph replay (do_bench_cudagraph) so launch gaps don't pose as kernel time, and their
host (CPU) time per call is reported separately.
"""

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

ROOT = Path(__file__).resolve().parent.parent


def load_ours():
    from kernels import get_local_kernel

    return get_local_kernel(ROOT)


def liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.transformers.geglu import LigerGEGLUMLP
    except ImportError:
        return None, None
    return LigerGELUMulFunction, LigerGEGLUMLP


def bench(fn, graph=False):
    if graph:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def interleaved_ms(fns: dict, rounds: int = 3) -> dict:
    """{name: (median ms, each round's ms)}: every function benched once per round, in
    turn. Timed once each, one after the other, the first timed MLP training step read
    0.06-0.23 ms above the same computation timed later (three runs; benchmarks/NOTES.md)."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(bench(fn))
    return {name: (statistics.median(t), t) for name, t in times.items()}


def host_us(fns: dict, n=20, repeats=15) -> dict:
    """Host time per call of each function: the median over ``repeats`` rounds, each of
    which times a loop of ``n`` calls of every function in turn (interleaved: the host's
    drift, large on the H200 host, reaches all of them alike), the GPU drained before each
    loop. Short loops: a loop that fills the GPU's launch queue waits for the GPU and
    times it instead of the host."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


def kernels_per_call(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        fn()
        torch.cuda.synchronize()
    names = [
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return len(names), sorted(set(names))


def ceilings():
    x = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm = bench(lambda: a @ b)
    return {
        "copy_TBps": 2 * x.numel() * 2 / ms / 1e9,
        "bf16_matmul_TFLOPs": 2 * 8192**3 / mm / 1e9,
    }


def activation(ours, copy_tbps):
    m, n = 8192, 16384
    g = torch.randn(m, n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    u = torch.randn(m, n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")

    def eager(g, u):
        return F.gelu(g, approximate="tanh") * u

    peers = {
        "ours": lambda g, u: ours.geglu(g, u, "tanh"),
        "eager": eager,
        "compile": torch.compile(eager),
    }
    liger_fn, _ = liger()
    if liger_fn is not None:
        peers["liger"] = liger_fn.apply
    rows = {}
    fwd_bytes = 3 * m * n * 2
    for name, fn in peers.items():
        with torch.no_grad():
            fwd = bench(lambda fn=fn: fn(g, u))
        rows[name] = {
            "fwd_ms": fwd,
            "fwd_TBps": fwd_bytes / fwd / 1e9,
            "fwd_frac_of_copy": fwd_bytes / fwd / 1e9 / copy_tbps,
        }
    steps = {
        name: (lambda fn=fn: torch.autograd.grad(fn(g, u), (g, u), dy))
        for name, fn in peers.items()
    }
    for name, (ms, rounds) in interleaved_ms(steps).items():
        rows[name] |= {"fwd_bwd_ms": ms, "fwd_bwd_rounds_ms": rounds}
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, 2 * n, dtype=torch.bfloat16, device="cuda")
    rows["ours_gelu_tanh_and_mul"] = {
        "fwd_ms": bench(lambda: ours.gelu_tanh_and_mul(out, x))
    }
    return {"shape": [m, n], "dtype": "bfloat16", "approximate": "tanh", "rows": rows}


def linear(ours, peak_tflops, copy_tbps):
    compiled = torch.compile(F.linear)
    shapes = [
        (8192, 16384, 2048),
        (8192, 2048, 16384),
        (4096, 4096, 4096),
        (8192, 4096, 4096),
    ]
    shapes += [(64, 16384, 2048), (16, 16384, 2048), (1, 16384, 2048)]
    out = []
    for m, n, k in shapes:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
        b = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        small = m <= 64
        row = {"M": m, "N": n, "K": k}
        flops, bytes_ = 2 * m * n * k, 2 * (m * k + n * k + m * n + n)
        peers = {
            "ours": lambda: ours.linear(x, w, b),
            "cublas": lambda: F.linear(x, w, b),
            "compile": lambda: compiled(x, w, b),
            "mm_then_add": lambda: (x @ w.t()) + b,
        }
        for name, fn in peers.items():
            ms = bench(fn, graph=small)
            row[name] = {
                "ms": ms,
                "TFLOPs": flops / ms / 1e9,
                "TBps": bytes_ / ms / 1e9,
            }
        row["ours_vs_cublas"] = row["cublas"]["ms"] / row["ours"]["ms"]
        row["ours_kernels"] = kernels_per_call(peers["ours"])
        if small:
            row["ours"]["frac_of_copy"] = row["ours"]["TBps"] / copy_tbps
        else:
            row["ours"]["frac_of_peak"] = row["ours"]["TFLOPs"] / peak_tflops
        out.append(row)
    # forward + backward with bias, against eager
    m, n, k = 8192, 16384, 2048
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = (
        torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
    ).requires_grad_()
    b = torch.randn(n, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
    fb = {
        name: bench(lambda fn=fn: torch.autograd.grad(fn(x, w, b), (x, w, b), dy))
        for name, fn in {"ours": ours.linear, "eager": F.linear}.items()
    }
    return {"forward": out, "fwd_bwd_8192x16384x2048_bias_ms": fb}


def mlp(ours):
    hidden, inter = 2048, 16384
    dt = torch.bfloat16
    gate = torch.nn.Linear(hidden, inter, bias=False, device="cuda", dtype=dt)
    up = torch.nn.Linear(hidden, inter, bias=False, device="cuda", dtype=dt)
    down = torch.nn.Linear(inter, hidden, bias=False, device="cuda", dtype=dt)

    def eager(x):
        return down(F.gelu(gate(x), approximate="tanh") * up(x))

    def ours_fused_act(x):
        return down(ours.geglu(gate(x), up(x), "tanh"))

    def ours_dual(x):
        return ours.geglu_mlp(
            x, gate.weight, up.weight, down.weight, approximate="tanh"
        )

    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    gemma_mlp = GemmaMLP(
        GemmaConfig(
            hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh"
        )
    ).to("cuda", dt)
    gemma_mlp.gate_proj, gemma_mlp.up_proj, gemma_mlp.down_proj = gate, up, down

    def ours_layer(x):  # what kernelize installs: our GeGLUMLP.forward on GemmaMLP
        return ours.layers.GeGLUMLP.forward(gemma_mlp, x)

    peers = {
        "ours_layer": ours_layer,
        "ours_dual_gemm": ours_dual,
        "ours_fused_activation": ours_fused_act,
        "eager": eager,
    }
    peers["compile"] = torch.compile(eager, dynamic=False)
    _, liger_mlp_cls = liger()
    if liger_mlp_cls is not None:
        from types import SimpleNamespace

        cfg = SimpleNamespace(
            hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh"
        )
        lm = liger_mlp_cls(cfg).to("cuda", dt)
        lm.gate_proj, lm.up_proj, lm.down_proj = gate, up, down
        peers["liger"] = lm
    result = {
        "hidden": hidden,
        "intermediate": inter,
        "dtype": "bfloat16",
        "forward": {},
        "fwd_bwd": {},
    }
    for tokens in (1, 16, 64, 8192):
        x = torch.randn(tokens, hidden, dtype=dt, device="cuda")
        small = tokens <= 64
        row = {}
        calls = {name: (lambda fn=fn: fn(x)) for name, fn in peers.items()}
        with torch.no_grad():
            for name, call in calls.items():
                row[name] = {"ms": bench(call, graph=small)}
            if small:
                for name, us in host_us(calls).items():
                    row[name]["host_us"] = us
            row["ours_dual_gemm"]["kernels"] = kernels_per_call(lambda: ours_dual(x))
            row["ours_layer"]["kernels"] = kernels_per_call(lambda: ours_layer(x))
        result["forward"][str(tokens)] = row
    x = torch.randn(8192, hidden, dtype=dt, device="cuda", requires_grad=True)
    dy = torch.randn(8192, hidden, dtype=dt, device="cuda")
    params = [x, gate.weight, up.weight, down.weight]
    steps = {
        name: (lambda fn=fn: torch.autograd.grad(fn(x), params, dy))
        for name, fn in peers.items()
    }
    timed = interleaved_ms(steps)
    for name, fn in peers.items():
        ms, rounds = timed[name]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(fn(x), params, dy)
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**20
        result["fwd_bwd"][name] = {
            "ms": ms,
            "rounds_ms": rounds,
            "peak_extra_MiB": extra,
        }
    return result


def families(
    ours, device="cuda", dtype=torch.bfloat16, scale=1, timer=None, host_timer=None
):
    """Each family's feed-forward at one real model size, inference: the eager module
    against our layer's forward on that module (what kernelize installs). GPU time by
    CUDA-graph replay (a lone small layer called in a loop measures its host time, which
    a model's forward hides behind the GPU's queue), host time per call beside it.
    ``scale`` divides every size; ``timer`` and ``host_timer`` replace the GPU timers
    (a CPU smoke run)."""
    from diffusers.models.activations import GEGLU
    from transformers import GemmaConfig, ModernBertConfig, T5Config
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    def s(n):
        return max(n // scale, 1)

    cases = {  # name: (module, our layer, tokens, hidden)
        "Gemma-2B MLP": (
            GemmaMLP(GemmaConfig(hidden_size=s(2048), intermediate_size=s(16384), hidden_act="gelu_pytorch_tanh")),
            ours.layers.GeGLUMLP, 8192, s(2048),
        ),
        "T5 v1.1 base (Flan-T5 base) DenseGatedActDense": (
            T5DenseGatedActDense(T5Config(d_model=s(768), d_ff=s(2048), feed_forward_proj="gated-gelu")),
            ours.layers.T5GeGLUDense, 8192, s(768),
        ),
        "ModernBERT base MLP": (
            ModernBertMLP(ModernBertConfig(hidden_size=s(768), intermediate_size=s(1152))),
            ours.layers.ModernBertGeGLUMLP, 8192, s(768),
        ),
        "Stable Diffusion 1.5 GEGLU (dim 640, 32x32 latents x 2)": (
            GEGLU(s(640), s(2560)), ours.layers.GEGLU, 2048, s(640),
        ),
    }  # fmt: skip
    timer = timer or (lambda fn: bench(fn, graph=True))
    host_timer = host_timer or host_us
    result = {}
    for name, (module, layer, tokens, hidden) in cases.items():
        module = module.to(device, dtype).eval()
        x = torch.randn(s(tokens), hidden, dtype=dtype, device=device)
        with torch.no_grad():
            eager_out, ours_out = module(x), layer.forward(module, x)
            eager, ours_fn = (
                (lambda m=module: m(x)),
                (lambda m=module, layer=layer: layer.forward(m, x)),
            )
            eager_ms, ours_ms = timer(eager), timer(ours_fn)
            hosts = host_timer({"eager": eager, "ours": ours_fn})
        result[name] = {
            "tokens": s(tokens),
            "hidden": hidden,
            "eager_ms": eager_ms,
            "ours_ms": ours_ms,
            "speedup": eager_ms / ours_ms,
            "eager_host_us": hosts["eager"],
            "ours_host_us": hosts["ours"],
            "max_abs_diff": (ours_out.float() - eager_out.float()).abs().max().item(),
        }
        print(name, result[name], flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--only", nargs="*", default=["activation", "linear", "mlp", "families"]
    )
    args = parser.parse_args()
    ours = load_ours()
    import transformers

    env = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        env["liger_kernel"] = version("liger-kernel")
    except ImportError:
        env["liger_kernel"] = None
    result = {"env": env, "ceilings": ceilings()}
    print(json.dumps(result, indent=1), flush=True)
    sections = {
        "activation": lambda: activation(ours, result["ceilings"]["copy_TBps"]),
        "linear": lambda: linear(
            ours,
            result["ceilings"]["bf16_matmul_TFLOPs"],
            result["ceilings"]["copy_TBps"],
        ),
        "mlp": lambda: mlp(ours),
        "families": lambda: families(ours),
    }
    for name in args.only:
        result[name] = sections[name]()
        print(name, json.dumps(result[name], indent=1), flush=True)
        out = (
            args.out
            or ROOT
            / "benchmarks"
            / "results"
            / f"{env['date']}-{env['gpu'].replace(' ', '_')}.json"
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
