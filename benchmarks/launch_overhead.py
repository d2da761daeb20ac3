"""Host time of one GEMM launch, by part: our wrappers (``geglu_linear``, ``gemm_gated``),
Triton's ``JITFunction.run`` (``kernel[grid](...)``) and its pieces (the argument binder,
the cache key), and the compiled kernel's launcher called directly (``ck.run``), for the
portable kernel at 1 token and the TMA kernel at 2048 tokens (GPU only; prints µs per
call: bench_lib.host_us, interleaved rounds of 20-call loops; the runs of 2026-11-29
used one 200-call loop each: docs/decisions/0011-direct-launch-host-path.md).

Usage: python benchmarks/launch_overhead.py (after `make build`)
"""

import bench_lib as lib  # first: it picks the interpreter without a GPU
import torch
from triton._C.libtriton import native_specialize_impl
from triton.runtime.driver import driver
from triton.runtime.jit import compute_cache_key


def main():
    lib.require_cuda("benchmarks/launch_overhead.py")
    ours = lib.load_ours()
    g, kernels = ours.gemm, ours.gemm_kernels
    recorded = {}  # kernel name -> (args, kwargs, compiled kernel) of its last launch
    for name in ("gemm_kernel", "gemm_tma_kernel"):
        kernel = getattr(kernels, name)

        def record(*a, _run=kernel.run, _name=name, **kw):
            compiled = _run(*a, **kw)
            recorded[_name] = (a, kw, compiled)
            return compiled

        kernel.run = record
    for tokens, hidden, inter in ((1, 2048, 16384), (2048, 640, 2560)):
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        wg = torch.randn(inter, hidden, device="cuda", dtype=torch.bfloat16)
        wu = torch.randn(inter, hidden, device="cuda", dtype=torch.bfloat16)
        recorded.clear()
        g._PLANS.clear()  # each launch through JITFunction.run is recorded
        with torch.no_grad():
            for _ in range(3):
                ours.geglu_linear(x, wg, wu)
            kname = (
                "gemm_tma_kernel" if "gemm_tma_kernel" in recorded else "gemm_kernel"
            )
            a, kw, ck = recorded[kname]
            k = getattr(kernels, kname)
            del k.run  # back to JITFunction.run
            grid = kw.pop("grid")
            kw.pop("warmup")
            dev = driver.active.get_current_device()
            _, key_cache, _, backend, binder = k.device_caches[dev]
            bound, spec, opts = binder(*a, **kw)
            args_all = list(bound.values())
            stream = driver.active.get_current_stream(dev)
            nonconst = [v for p, v in zip(k.params, args_all) if not p.is_constexpr]
            res = {
                "geglu_linear (all)": lambda: ours.geglu_linear(x, wg, wu),
                "kernel[grid](...)": lambda: k[grid](*a, **kw),
                "binder": lambda: binder(*a, **kw),
                "compute_cache_key": lambda: compute_cache_key(key_cache, spec, opts),
                "get_current_stream": lambda: driver.active.get_current_stream(dev),
                "torch current_stream": lambda: torch.cuda.current_stream().cuda_stream,
                "specialize non-constexpr": lambda: [
                    native_specialize_impl(backend, v, False, True, True)
                    for v in nonconst
                ],
                "ck.run direct": lambda: ck.run(
                    grid[0],
                    1,
                    1,
                    stream,
                    ck.function,
                    ck.packed_metadata,
                    None,
                    None,
                    None,
                    *args_all,
                ),
                "gemm_gated() wrapper": lambda: g.gemm_gated(  # with its output
                    x,
                    wg,
                    wu,
                    torch.empty(tokens, inter, device="cuda", dtype=wg.dtype),
                    g.GELU_TANH,
                ),
            }
            print(f"tokens {tokens} {kname} ({len(a)} positional, {len(kw)} kw):")
            for name, us in lib.host_us(res).items():
                print(f"  {name:28s} {us:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
