"""GPU comparison of our kernels with eager PyTorch, torch.compile and Liger, all measured in
one run; writes benchmarks/results/<date>-<gpu>-compare.json (or --out). Needs a CUDA GPU.

Times are medians of triton.testing.do_bench; shapes of 64 tokens or fewer are timed by
CUDA-graph replay (do_bench_cudagraph) so launch gaps don't pose as kernel time, and their
host (CPU) time per call is reported separately. The `training` section times a training
step of each family's feed-forward (and of the Gemma MLP with frozen weights) with its
peak memory; the `host` section the host cost of every public op and layer at tiny
shapes. Kernel lists are taken after all timing (a profiled process runs later kernels
slower).
"""

import argparse
import functools
import json
import statistics
from pathlib import Path

import bench_lib as lib
import torch
import torch.nn.functional as F
from torch import nn

BF16 = torch.bfloat16


def grads(fn, inputs, dy):
    """A forward+backward step of ``fn`` as a function of nothing."""
    return lambda: torch.autograd.grad(fn(*inputs), inputs, dy)


def activation(ours, ceil, later):
    m, n = 8192, 16384
    g = torch.randn(m, n, dtype=BF16, device="cuda", requires_grad=True)
    u = torch.randn(m, n, dtype=BF16, device="cuda", requires_grad=True)
    dy = torch.randn(m, n, dtype=BF16, device="cuda")
    peers = lib.activation_peers(ours)
    rows = {}
    fwd_bytes = 3 * m * n * 2
    for name, fn in peers.items():
        with torch.no_grad():
            fwd = lib.bench_ms(lambda fn=fn: fn(g, u))
        tbps = fwd_bytes / fwd / 1e9
        rows[name] = {"fwd_ms": fwd, "fwd_TBps": tbps}
        rows[name]["fwd_frac_of_copy"] = tbps / ceil["copy_TBps"]
    steps = {name: grads(fn, (g, u), dy) for name, fn in peers.items()}
    for name, (ms, rounds) in lib.interleaved_ms(steps).items():
        rows[name] |= {"fwd_bwd_ms": ms, "fwd_bwd_rounds_ms": rounds}
    out = torch.empty(m, n, dtype=BF16, device="cuda")
    x = torch.randn(m, 2 * n, dtype=BF16, device="cuda")
    rows["ours_gelu_tanh_and_mul"] = {
        "fwd_ms": lib.bench_ms(lambda: ours.gelu_tanh_and_mul(out, x))
    }
    return {"shape": [m, n], "dtype": "bfloat16", "approximate": "tanh", "rows": rows}


def linear(ours, ceil, later):
    shapes = [  # forward, and forward+backward
        (8192, 16384, 2048),
        (8192, 2048, 16384),
        (4096, 4096, 4096),
        (8192, 4096, 4096),
    ]
    out = []
    for m, n, k in shapes + [(64, 16384, 2048), (16, 16384, 2048), (1, 16384, 2048)]:
        lin = nn.Linear(k, n, device="cuda", dtype=BF16).requires_grad_(False)
        lin.weight.normal_(0, k**-0.5)
        x = torch.randn(m, k, dtype=BF16, device="cuda")
        small = m <= lib.GRAPH_TOKENS
        row = {"M": m, "N": n, "K": k}
        flops, bytes_ = 2 * m * n * k, 2 * (m * k + n * k + m * n + n)
        peers = lib.linear_peers(ours, lin)
        peers["eager_mm_then_add"] = lambda x: (x @ lin.weight.t()) + lin.bias
        calls = {name: (lambda fn=fn: fn(x)) for name, fn in peers.items()}
        if small:  # CUDA-graph replay, one peer after another
            timed = {
                name: (lib.bench_ms(c, graph=True), None) for name, c in calls.items()
            }
        else:  # a few percent of noise between runs: interleaved rounds, medians
            timed = lib.interleaved_ms(calls)
        for name, (ms, rounds) in timed.items():
            row[name] = {
                "ms": ms,
                "TFLOPs": flops / ms / 1e9,
                "TBps": bytes_ / ms / 1e9,
            }
            if rounds is not None:
                row[name]["rounds_ms"] = rounds
        row["ours_vs_eager"] = row["eager"]["ms"] / row["ours"]["ms"]
        if small:
            row["ours"]["frac_of_copy"] = row["ours"]["TBps"] / ceil["copy_TBps"]
        else:
            row["ours"]["frac_of_peak"] = row["ours"]["TFLOPs"] / ceil["matmul_TFLOPs"]
        later.append((row["ours"], lambda fn=peers["ours"], x=x: fn(x)))
        out.append(row)
    fwd_bwd = []  # with bias, x, weight and bias trainable, interleaved
    torch.compiler.reset()  # room for nn.Linear's recompiles (see main)
    for m, n, k in shapes:
        lin = nn.Linear(k, n, device="cuda", dtype=BF16)
        x = torch.randn(m, k, dtype=BF16, device="cuda", requires_grad=True)
        dy = torch.randn(m, n, dtype=BF16, device="cuda")
        steps = {
            name: lambda fn=fn: torch.autograd.grad(fn(x), (x, *lin.parameters()), dy)
            for name, fn in lib.linear_peers(ours, lin).items()
        }
        row = {"M": m, "N": n, "K": k}
        # 7 rounds: ours is cuBLAS's F.linear here (policy.linear), a tie within 2-3%
        # per round
        for name, (ms, rounds) in lib.interleaved_ms(steps, rounds=7).items():
            row[name] = {"ms": ms, "rounds_ms": rounds}
        row["ours_vs_eager"] = row["eager"]["ms"] / row["ours"]["ms"]
        fwd_bwd.append(row)
    return {"forward": out, "fwd_bwd": fwd_bwd}


def peak_extra_mib(step) -> float:
    """The peak memory one call of ``step`` allocates beyond what was allocated before it,
    MiB (call it warm: after the timing)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# A step shorter than this on the GPU may be bound by the host when timed alone: its host
# time per step is measured too.
SHORT_STEP_MS = 1.0


def training_steps(
    peers, x, params, rounds=3, timer=None, memory=None, gpu_timer=None, host_timer=None
) -> dict:
    """``{peer: {"ms", "rounds_ms", "gpu_ms", "gpu_rounds_ms", "peak_extra_MiB"} (+
    "host_us")}`` of a training step (forward, and the gradients of ``params`` by
    autograd.grad: none accumulate) of each peer, a function of ``x``, in ``rounds``
    interleaved rounds: ``ms``, wall time between CUDA events (the host's time where the
    host is slower), and ``gpu_ms``, GPU time with the host ahead (lib.queued_gpu_ms: what
    the step costs where a model's queue hides the host), medians; each one's peak memory;
    for short steps the host time per step. ``timer``, ``memory``, ``gpu_timer`` and
    ``host_timer`` replace lib.interleaved_ms, peak_extra_mib, lib.queued_gpu_ms and
    lib.host_us (a CPU smoke run)."""
    timer = timer or functools.partial(lib.interleaved_ms, rounds=rounds)
    memory = memory or peak_extra_mib
    gpu_timer = gpu_timer or lib.queued_gpu_ms
    host_timer = host_timer or lib.host_us
    with torch.no_grad():  # of the output's shape: the first peer's
        dy = torch.randn_like(next(iter(peers.values()))(x))
    steps = {
        name: (lambda fn=fn: torch.autograd.grad(fn(x), params, dy))
        for name, fn in peers.items()
    }
    timed, rows = timer(steps), {}
    gpu = lib.interleaved(steps, gpu_timer, rounds)
    for name, step in steps.items():
        ms, rounds_ms = timed[name]
        rows[name] = {
            "ms": ms,
            "rounds_ms": rounds_ms,
            "gpu_ms": statistics.median(gpu[name]),
            "gpu_rounds_ms": gpu[name],
            "peak_extra_MiB": memory(step),
        }
    if min(row["gpu_ms"] for row in rows.values()) < SHORT_STEP_MS:
        for name, us in host_timer(steps).items():
            rows[name]["host_us"] = us
    return rows


def mlp(ours, ceil, later):
    hidden, inter = 2048, 16384
    model = lib.eager_geglu_mlp(hidden, inter).to("cuda", BF16)
    peers = lib.mlp_peers(ours, model, dynamic=False)
    result = {"hidden": hidden, "intermediate": inter, "dtype": "bfloat16"}
    result |= {"forward": {}, "fwd_bwd": {}}
    for tokens in (1, 16, 64, 8192):
        x = torch.randn(tokens, hidden, dtype=BF16, device="cuda")
        small = tokens <= lib.GRAPH_TOKENS
        calls = {name: (lambda fn=fn, x=x: fn(x)) for name, fn in peers.items()}
        with torch.no_grad():
            row = {
                name: {"ms": lib.bench_ms(c, graph=small)} for name, c in calls.items()
            }
            if small:
                for name, us in lib.host_us(calls).items():
                    row[name]["host_us"] = us
        for name in ("ours_dual_gemm", "ours_layer"):
            later.append((row[name], torch.no_grad()(calls[name])))
        result["forward"][str(tokens)] = row
    x = torch.randn(8192, hidden, dtype=BF16, device="cuda", requires_grad=True)
    params = [x, model.gate_proj.weight, model.up_proj.weight, model.down_proj.weight]
    result["fwd_bwd"] = training_steps(peers, x, params)
    return result


def family_modules(ours, scale: int = 1):
    """{name: (module, our layer, tokens, hidden)}: each family's feed-forward at one real
    model size, every size divided by ``scale``."""
    from diffusers.models.activations import GEGLU
    from transformers import GemmaConfig, ModernBertConfig, T5Config
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    def s(n):
        return max(n // scale, 1)

    return {
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


def families(ours, device="cuda", dtype=BF16, scale=1, timer=None, host_timer=None):
    """Each family's feed-forward at one real model size, inference: the eager module
    against our layer's forward on that module (what kernelize installs). GPU time by
    CUDA-graph replay (a lone small layer called in a loop measures its host time, which
    a model's forward hides behind the GPU's queue), host time per call beside it.
    ``scale`` divides every size; ``timer`` and ``host_timer`` replace the GPU timers
    (a CPU smoke run)."""
    timer = timer or (lambda fn: lib.bench_ms(fn, graph=True))
    host_timer = host_timer or lib.host_us
    result = {}
    for name, (module, layer, tokens, hidden) in family_modules(ours, scale).items():
        module = module.to(device, dtype).eval()
        x = torch.randn(max(tokens // scale, 1), hidden, dtype=dtype, device=device)
        with torch.no_grad():
            eager_out, ours_out = module(x), layer.forward(module, x)
            eager = lambda m=module: m(x)
            ours_fn = lambda m=module, layer=layer: layer.forward(m, x)
            eager_ms, ours_ms = timer(eager), timer(ours_fn)
            hosts = host_timer({"eager": eager, "ours": ours_fn})
        result[name] = {
            "tokens": x.shape[0],
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


def training_mode(module: nn.Module, device, dtype) -> nn.Module:
    """``module`` on ``device`` in ``dtype``, training, its dropouts (T5's, ModernBERT's)
    at p = 0 so that every peer computes the same."""
    module = module.to(device, dtype).train()
    for dropout in module.modules():
        if isinstance(dropout, nn.Dropout):
            dropout.p = 0.0
    return module


# Trained again at more tokens (eager against ours), past route.TRAINING_KERNEL_MIN_ELEMENTS
# activation outputs (2^25): ModernBERT base's 8192 x 1152 at 4x, SD's 2048 x 2560 at 8x.
LARGER_TRAINING = {
    "ModernBERT base MLP": 4,
    "Stable Diffusion 1.5 GEGLU (dim 640, 32x32 latents x 2)": 8,
}


def training(ours, device="cuda", dtype=BF16, scale=1, rounds=3, **timers):
    """Each family's feed-forward at one real model size, one training step (the input and
    every parameter trainable, dropout at p = 0 so that every peer computes the same):
    the eager module, torch.compile of it, Liger (Gemma's MLP) and our layer's forward on
    it; LARGER_TRAINING at more tokens, eager against ours; then the Gemma MLP with
    frozen projections (only the input trainable), eager against ours. ``scale``
    divides every size; ``rounds``: each step's interleaved rounds; ``timers``
    (training_steps' ``timer``, ``memory``, ``gpu_timer``, ``host_timer``) replace the
    GPU measures (a CPU smoke run)."""
    result = {}

    def measure(name, peers, module, tokens, hidden):
        x = torch.randn(max(tokens // scale, 1), hidden, dtype=dtype, device=device)
        x.requires_grad_(True)
        params = [x, *(p for p in module.parameters() if p.requires_grad)]
        result[name] = {"tokens": x.shape[0], "hidden": hidden}
        result[name] |= training_steps(peers, x, params, rounds, **timers)
        print(name, result[name], flush=True)

    modules = family_modules(ours, scale)
    for name, (module, layer, tokens, hidden) in modules.items():
        module = training_mode(module, device, dtype)
        peers = {"eager": module, "compile": torch.compile(module)}
        liger = lib.liger_mlp(module) if layer is ours.layers.GeGLUMLP else None
        if liger is not None:  # Liger has Gemma's MLP only
            peers["liger"] = liger
        peers["ours"] = lambda x, m=module, layer=layer: layer.forward(m, x)
        measure(name, peers, module, tokens, hidden)
    # Their rows above run eager's ops; these, our kernels.
    for name, factor in LARGER_TRAINING.items():
        module, layer, tokens, hidden = modules[name]
        peers = {
            "eager": module,
            "ours": lambda x, m=module, layer=layer: layer.forward(m, x),
        }
        measure(f"{name}, {factor}x the tokens", peers, module, factor * tokens, hidden)
    module, layer, tokens, hidden = modules["Gemma-2B MLP"]
    module.requires_grad_(False)
    peers = {"eager": module, "ours": lambda x: layer.forward(module, x)}
    measure("Gemma-2B MLP, frozen weights", peers, module, tokens, hidden)
    return result


# Tiny shapes for host time: the GPU work of a call is far shorter than its host time.
HOST_TOKENS, HOST_HIDDEN, HOST_INTER = 1, 256, 1024


def host_calls(ours, device="cuda", dtype=BF16, scale=1) -> dict[str, dict]:
    """``{op or layer: {peer: call}}`` for the host-time section: every public op (forward,
    and forward+backward where it has one) and every layer at 1 token, each against
    eager, torch.compile and Liger where Liger has it; ``scale`` divides the families'
    layer sizes."""
    t, h, i = HOST_TOKENS, HOST_HIDDEN, HOST_INTER

    def randn(*shape, grad=False):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=grad)

    def no_grad(fn, *args):
        return torch.no_grad()(lambda: fn(*args))

    g, u, dh = randn(t, i, grad=True), randn(t, i, grad=True), randn(t, i)
    x, xg = randn(t, h), randn(t, h, grad=True)
    gu, out = randn(t, 2 * i), randn(t, i)
    calls = {}
    act = lib.activation_peers(ours)
    calls["geglu forward"] = {p: no_grad(fn, g, u) for p, fn in act.items()}
    calls["geglu forward+backward"] = {
        p: grads(fn, (g, u), dh) for p, fn in act.items()
    }
    for op, approximate in (("gelu_and_mul", "none"), ("gelu_tanh_and_mul", "tanh")):
        peers = lib.activation_peers(ours, approximate)
        calls[op] = {p: no_grad(fn, gu[:, :i], gu[:, i:]) for p, fn in peers.items()}
        calls[op]["ours"] = no_grad(getattr(ours, op), out, gu)
    lin = nn.Linear(h, i, device=device, dtype=dtype)
    peers = lib.linear_peers(ours, lin)
    calls["linear forward"] = {p: no_grad(fn, x) for p, fn in peers.items()}
    calls["linear forward+backward"] = {
        p: lambda fn=fn: torch.autograd.grad(fn(xg), (xg, lin.weight, lin.bias), dh)
        for p, fn in peers.items()
    }
    mlp = lib.eager_geglu_mlp(h, i).to(device, dtype).requires_grad_(False)
    gate, up = mlp.gate_proj, mlp.up_proj

    def geglu_linear_eager(x):
        return F.gelu(gate(x), approximate="tanh") * up(x)

    calls["geglu_linear"] = {
        "eager": no_grad(geglu_linear_eager, x),
        "compile": no_grad(torch.compile(geglu_linear_eager), x),
        "ours": no_grad(ours.geglu_linear, x, gate.weight, up.weight),
    }
    peers = lib.mlp_peers(ours, mlp)
    others = {p: no_grad(fn, x) for p, fn in peers.items() if not p.startswith("ours")}
    calls["geglu_mlp"] = others | {"ours": no_grad(peers["ours_dual_gemm"], x)}
    calls["layers.GeGLUMLP"] = others | {"ours": no_grad(peers["ours_layer"], x)}
    layers = {"layers.Linear": (nn.Linear(h, i), ours.layers.Linear, h)}
    for module, layer, _, hidden in family_modules(ours, scale).values():
        if layer is not ours.layers.GeGLUMLP:  # above, with Liger
            layers[f"layers.{layer.__name__}"] = (module, layer, hidden)
    for name, (module, layer, hidden) in layers.items():
        module = module.to(device, dtype).eval()
        y = randn(t, hidden)
        calls[name] = {
            "eager": no_grad(module, y),
            "compile": no_grad(torch.compile(module), y),
            "ours": no_grad(layer.forward, module, y),
        }
    return calls


def host(ours):
    """Host µs per call of every public op and layer against its peers, in interleaved
    rounds of 20-call loops (per op), at tiny shapes."""
    shape = {"tokens": HOST_TOKENS, "hidden": HOST_HIDDEN, "intermediate": HOST_INTER}
    result = {"shape": shape, "dtype": "bfloat16"}
    for op, calls in host_calls(ours).items():
        result[op] = lib.host_us(calls)
        print(op, result[op], flush=True)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--training-rounds", type=int, default=3, help="interleaved rounds per step"
    )
    sections = {"activation": activation, "linear": linear, "mlp": mlp}
    # args: parsed below, before any section runs
    sections |= {
        "training": lambda ours, ceil, later: training(
            ours, rounds=args.training_rounds
        )
    }
    sections |= {"families": lambda ours, ceil, later: families(ours)}
    sections |= {"host": lambda ours, ceil, later: host(ours)}
    parser.add_argument("--only", nargs="*", default=list(sections), choices=sections)
    args = parser.parse_args(argv)
    lib.require_cuda("benchmarks/compare.py")
    ours = lib.load_ours()
    env = lib.environment(ours)
    out = args.out or lib.results_path(env, "compare")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"env": env, "ceilings": lib.ceilings()}
    print(json.dumps(result, indent=1), flush=True)
    later = []  # (row, call): kernel lists, taken after all timing
    for name in args.only:
        # Compiled peers share code (nn.Linear's and GemmaMLP's forward), whose compiled
        # graphs dynamo limits (recompile_limit, 8): past it a peer runs eager.
        torch.compiler.reset()
        result[name] = sections[name](ours, result["ceilings"], later)
        print(name, json.dumps(result[name], indent=1), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
    for row, call in later:
        row |= lib.kernel_list(call)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"Wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
