"""Where the host time of a kernelized model goes: cProfile of greedy ``generate()`` on the
e2e benchmark's model (fewer layers), eager and kernelized, and the host time per call of
one MLP at 1 token, eager against kernelized, by interleaved rounds (bench_lib.host_us).
With --training FAMILY (a name of compare.py's training rows), the host time of that
row's training step instead. Needs a CUDA GPU.
Usage: python benchmarks/host_profile.py [--layers 4] [--top 30] [--training FAMILY]"""

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

import bench_lib as lib  # first: it picks the interpreter without a GPU
import torch
from e2e import build_models


def profile(fn, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    lib.sync()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def mlp_us_in_generate(models: dict, ids, gen: dict, rounds: int = 5) -> dict:
    """Host µs per MLP call inside greedy ``generate()`` (each layer's MLP timed where it
    is called: the caches and branch predictors as the model loop leaves them), per model,
    in interleaved rounds; medians."""
    spent = {}

    def timed(name, forward):
        def call(x):
            start = time.perf_counter()
            out = forward(x)
            spent[name].append(time.perf_counter() - start)
            return out

        return call

    saved = {}  # kernelize installs a layer's forward on the instance
    for name, model in models.items():
        for layer in model.model.layers:
            saved[layer.mlp] = layer.mlp.__dict__.get("forward")
            layer.mlp.forward = timed(name, layer.mlp.forward)
    per_round = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            spent[name] = []
            model.generate(ids, **gen)
            per_round[name].append(statistics.median(spent[name]) * 1e6)
    for mlp, forward in saved.items():
        del mlp.forward
        if forward is not None:
            mlp.forward = forward
    return {name: statistics.median(us) for name, us in per_round.items()}


def kernel_modules(mlp, *names: str) -> tuple:
    """The modules ``names`` of the package whose layer ``mlp`` runs (the one kernelize
    loaded, not necessarily lib.load_ours()'s module objects)."""
    package = mlp.forward.__func__.__module__.rpartition(".")[0]
    return tuple(sys.modules[f"{package}.{name}"] for name in names)


def breakdown(mlp, x) -> dict:
    """Host µs of the pieces of one kernelized MLP call at 1 token (``mlp``: a kernelized
    GemmaMLP, its route prepared), beside eager's single ops for scale."""
    layers, module_route, one_launch = kernel_modules(
        mlp, "layers", "module_route", "one_launch"
    )
    route_of, family = module_route.module_route, layers.GEMMA_MLP
    route = route_of(mlp, family)
    launch = route.mlp_launch
    grid, launcher = launch.plans[1]
    out = torch.empty_like(x)
    sums, arrivals = one_launch.stream_scratch(
        one_launch._SCRATCH, x.device, out.numel(), 1, True, capturing=False
    )
    H, I, N = launch.sizes
    args = (x, *launch.operands, out, sums, arrivals, 1, H, I, N, H, 1, *launch.strides)
    binary = launcher.binary
    direct_args = (x, *launch.addresses, *args[len(launch.operands) + 1 :])
    stream = torch.cuda.current_stream().cuda_stream
    run_args = (grid, 1, 1, stream, binary.function, binary.packed_metadata, None, None)
    run_args += (None, *args, *launcher.values)
    pieces = {
        "layer call": lambda: mlp(x),
        "layer forward (no Module.__call__)": lambda: mlp.forward(x),
        "module_route": lambda: route_of(mlp, family),
        "mlp_output": lambda: layers.mlp_output(route, x),
        "prepared launch": lambda: launch(x),
        "Launcher call (tensors)": lambda: launcher(grid, *args),
        "Launcher.launch_aligned (addresses)": lambda: launcher.launch_aligned(
            grid, torch.cuda.current_device(), stream, direct_args
        ),
        "Triton launcher (binary.run)": lambda: binary.run(*run_args),
        "torch.empty_like": lambda: torch.empty_like(x),
        "eager F.linear (down_proj shape)": lambda: torch.nn.functional.linear(
            out, mlp.down_proj.weight[:, :H]
        ),
        "eager F.gelu": lambda: torch.nn.functional.gelu(x, approximate="tanh"),
    }
    return {name: round(us, 2) for name, us in lib.host_us(pieces).items()}


def pieces_in_generate(model, ids, gen: dict) -> dict:
    """Host µs per call of the pieces of the kernelized MLP call inside greedy
    ``generate()`` (medians; each piece timed by a wrapper, which adds its own cost)."""
    mlp = model.model.layers[0].mlp
    layers, one_launch, launch = kernel_modules(mlp, "layers", "one_launch", "launch")
    spent: dict[str, list] = {}

    def timed(name, fn):
        spent[name] = []

        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name].append(time.perf_counter() - start)
            return out

        return call

    patched = [
        (layers, "module_route"),
        (layers, "mlp_output"),
        (one_launch.OneLaunchMLP, "__call__"),
        (one_launch, "stream_scratch"),
        (one_launch, "current_device_and_stream"),
        (launch.Launcher, "launch_aligned"),
        (torch, "empty_like"),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name in patched]
    for owner, name, fn in saved:
        setattr(owner, name, timed(name, fn))
    try:
        model.generate(ids, **gen)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return {
        name: round(statistics.median(t) * 1e6, 2) for name, t in spent.items() if t
    }


def training_profile(family: str, top: int) -> str:
    """One family's training step (compare.py's, bf16) of eager and of our layer: host µs
    per step (interleaved 20-step loops) and a cProfile of 20 of our steps."""
    from compare import family_modules, training_mode

    ours = lib.load_ours()
    module, layer, tokens, hidden = family_modules(ours)[family]
    module = training_mode(module, "cuda", torch.bfloat16)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    x.requires_grad_(True)
    params = [x, *module.parameters()]
    dy = torch.randn_like(module(x))
    steps = {
        "eager": lambda: torch.autograd.grad(module(x), params, dy),
        "ours": lambda: torch.autograd.grad(layer.forward(module, x), params, dy),
    }
    us = {name: round(v, 1) for name, v in lib.host_us(steps).items()}
    report = f"{family}, training step host us: {us}\n"
    return report + profile(lambda: [steps["ours"]() for _ in range(20)], top)


def main(argv=None) -> int:
    lib.require_cuda("host_profile.py")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--training", metavar="FAMILY", help="profile a compare.py training row instead"
    )
    args = parser.parse_args(argv)
    if args.training:
        print(training_profile(args.training, args.top))
        return 0
    eager, ours = build_models(args.layers, 256)
    ids = torch.randint(0, 1000, (1, 16), device="cuda")
    gen = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens}
    gen |= {"do_sample": False, "pad_token_id": 0}
    x = torch.randn(1, 1, eager.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    mlp_eager, mlp_ours = eager.model.layers[0].mlp, ours.model.layers[0].mlp
    with torch.no_grad():
        for model in (eager, ours):
            model.generate(ids, **gen)  # warm-up: compiles, plans
        us = lib.host_us(
            {"eager_mlp": lambda: mlp_eager(x), "ours_mlp": lambda: mlp_ours(x)}
        )
        print({name: round(v, 1) for name, v in us.items()})
        print("pieces of one kernelized MLP call, host us:")
        for name, us in breakdown(mlp_ours, x).items():
            print(f"  {name}: {us}")
        in_loop = mlp_us_in_generate({"eager": eager, "ours": ours}, ids, gen)
        print("MLP host us per call inside generate():", in_loop)
        print("pieces inside generate():", pieces_in_generate(ours, ids, gen))
        for name, model in (("eager", eager), ("ours", ours)):
            print(f"--- {name}: generate({args.new_tokens} tokens), by own time")
            print(profile(lambda m=model: m.generate(ids, **gen), args.top))
        # Launches that went through JITFunction.run (not the direct launch) in one more
        # generate: only the first of each new shape should.
        ours_kernel, slow = lib.load_ours(), []
        for kernel in (
            ours_kernel.gemm_kernels.gemm_kernel,
            ours_kernel.gemm_kernels.gemm_tma_kernel,
            ours_kernel.gemm_kernels.one_launch_mlp_kernel,
        ):
            kernel.run = lambda *a, _run=kernel.run, **k: (
                slow.append(1) or _run(*a, **k)
            )
        ours.generate(ids, **gen)
        direct = ours_kernel.launch.direct_launch_works
        print(
            f"launches through JITFunction.run in one generate: {len(slow)}; direct launch works: {direct}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
