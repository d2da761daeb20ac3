"""Launch machinery: device facts, bounded plan caches, and launching a Triton kernel with
little host time.

``kernel[grid](*args)`` (``JITFunction.run``) binds and specialises every argument and
hashes the result on each call, which costs more host time than the launch itself. Triton
compiles one kernel per (constexprs, options, each pointer's dtype and 16-byte alignment,
each int's class: == 1, % 16 == 0, 32- or 64-bit). A ``Launcher`` serves arguments of one
such specialisation (its owner keys launchers by dtypes, shapes and strides, in a bounded
``LRU``): its first call goes through ``kernel[grid]``, later ones launch the compiled
kernel through its own runner (``CompiledKernel[grid](*args)``, the pattern of Triton's
fused-softmax tutorial). Misaligned pointers, launch hooks (proton), the interpreter, and a
Triton whose runner refuses the call take ``kernel[grid]`` every time.
"""

from collections import OrderedDict

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

# triton.jit picks the interpreter when a kernel is defined; read the knob once, here.
INTERPRETED = triton.knobs.runtime.interpret


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (triton.cdiv is a constexpr function in recent Triton,
    whose Python call costs microseconds per launch)."""
    return -(-a // b)


# Per-device facts, read once (a dict, not functools.cache: torch.compile traces the route
# policy that reads them, and Dynamo warns on lru_cache-wrapped calls).
_SM_COUNT: dict[torch.device, int] = {}
_HAS_TMA: dict[torch.device, bool] = {}


def num_programs(device: torch.device) -> int:
    """Persistent-grid width: one program per SM (a few under the interpreter)."""
    n = _SM_COUNT.get(device)
    if n is None:
        n = (
            4
            if INTERPRETED
            else torch.cuda.get_device_properties(device).multi_processor_count
        )
        _SM_COUNT[device] = n
    return n


def has_tma(device: torch.device) -> bool:
    """Whether the TMA GEMM kernel runs here: data-center Hopper and Blackwell GPUs (compute
    capability 9.x, 10.x: the 227 KB of shared memory its tiles assume), and the
    interpreter (so that CPU tests cover that path too)."""
    tma = _HAS_TMA.get(device)
    if tma is None:
        if INTERPRETED:
            tma = device.type == "cpu"
        else:
            tma = (
                device.type == "cuda"
                and torch.version.hip is None
                and torch.cuda.get_device_capability(device)[0] in (9, 10)
            )
        _HAS_TMA[device] = tma
    return tma


class LRU(OrderedDict):
    """A bounded mapping that forgets its least recently used entry: host-side plans keyed
    by exact shapes stay few however many token counts a process sees."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get(self, key, default=None):
        value = super().get(key, default)
        if value is not default:
            self.move_to_end(key)
        return value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if len(self) > self.size:
            self.popitem(last=False)


# Whether the direct launch works with this Triton (False from its first refused call on).
direct_launch_works = hasattr(triton.compiler.CompiledKernel, "__getitem__")
# Pipeline depth that fitted in shared memory, after a launch had to retry with fewer
# stages (a GPU with less shared memory than the tables assume).
_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch_hooks_set() -> bool:
    """Whether a profiler (e.g. proton) hooks Triton's launches: JITFunction.run calls them."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def _aligned(arg) -> bool:
    """Whether a pointer argument is 16-byte aligned (what Triton specialises pointers on)."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr() % 16 == 0
    base = getattr(arg, "base", None)  # a TensorDescriptor
    return base is None or base.data_ptr() % 16 == 0


class Launcher:
    """Launches one kernel with fixed constexprs (flags, tiles, ``num_warps``,
    ``num_stages``) for arguments of one specialisation: the caller keys its launchers by
    the arguments' dtypes, shapes and strides, so every call of one launcher compiles to
    the same kernel. The first call, and any with a misaligned pointer or under a launch
    hook, goes through ``kernel[grid](...)``; later calls launch the compiled kernel."""

    __slots__ = ("compiled", "constexprs", "kernel", "values")

    def __init__(self, kernel, constexprs: dict):
        self.kernel = kernel
        self.constexprs = constexprs
        # The runner takes every parameter, constexprs too, in parameter order.
        params = getattr(kernel, "params", ())
        self.values = tuple(constexprs[p.name] for p in params if p.is_constexpr)
        self.compiled = None

    def __call__(self, grid: int, *args) -> None:
        """``args``: the kernel's runtime parameters in order, None where unused (Triton
        compiles those out)."""
        global direct_launch_works
        compiled = self.compiled
        if (
            compiled is not None
            and all(map(_aligned, args))
            and not _launch_hooks_set()
        ):
            try:
                compiled[(grid, 1, 1)](*args, *self.values)
                return
            except (TypeError, AttributeError):
                # This Triton's runner takes other arguments (the call launched nothing):
                # Triton's own launch from now on.
                direct_launch_works = False
                self.compiled = None
        compiled = self._launch_through_triton(grid, args)
        if (
            direct_launch_works
            and isinstance(self.kernel, JITFunction)
            and all(map(_aligned, args))
        ):
            self.compiled = compiled

    def _launch_through_triton(self, grid: int, args: tuple):
        constexprs = self.constexprs
        key = (id(self.kernel), self.values)
        stages = _STAGES_THAT_FIT.get(key, constexprs["num_stages"])
        while True:
            try:
                return self.kernel[(grid,)](
                    *args, **{**constexprs, "num_stages": stages}
                )
            except triton.runtime.errors.OutOfResources:
                if stages == 1:
                    raise
                stages -= 1
                _STAGES_THAT_FIT[key] = stages
