"""Launch machinery: device facts, bounded plan caches, and launching a Triton kernel with
little host time.

``kernel[grid](*args)`` (``JITFunction.run``) binds and specialises every argument and
hashes the result on each call, which costs more host time than the launch itself. Triton
compiles one kernel per (constexprs, options, each pointer's dtype and 16-byte alignment,
each int's class: == 1, % 16 == 0, 32- or 64-bit). A ``Launcher`` serves arguments of one
such specialisation (its owner keys launchers by dtypes, shapes and strides, in a bounded
``BoundedCache``): its first call loads the kernel compiled at build time for exactly
that launch where the build ships one (precompiled.py), else goes through
``kernel[grid]``; later ones hand the compiled kernel's launcher what ``JITFunction.run``
would. Misaligned pointers, launch hooks
(proton), the interpreter, and a Triton whose launcher refuses those arguments take
``kernel[grid]`` every time.
"""

import contextlib
import json
import os
import threading
import warnings

import torch
import triton
from triton import knobs
from triton.runtime.jit import JITFunction

from . import precompiled

# triton.jit picks the interpreter when a kernel is defined; read the knob once, here.
INTERPRETED = triton.knobs.runtime.interpret
if not INTERPRETED and (torch.version.cuda or torch.version.hip):
    # Triton's argument specialiser imports gluon's Hopper module on its first call:
    # imported with the package instead, not inside a user's first call (decision 0016).
    with contextlib.suppress(ImportError):
        import triton.experimental.gluon.nvidia.hopper


def interpreter_index_fails(triton_version: str, numpy_version: str) -> bool:
    """Whether Triton's interpreter fails where a program id serves as a Python index (the
    GEMMs' tile loops): before Triton 3.7 it converts a 1-element array with ``int()``,
    which NumPy 2.4 refuses (triton-lang/triton#9171)."""

    def major_minor(version: str) -> tuple[int, int]:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)

    return major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4)


def _cpu_unavailable() -> str | None:
    """Why the CPU cannot run the kernels in this process, or None where it can. With
    TRITON_INTERPRET=1 set after triton was imported, Triton's own library (tl.sigmoid
    ...) was jitted for the GPU and the interpreter cannot call it."""
    if not INTERPRETED:
        return "set TRITON_INTERPRET=1 before importing triton"
    if isinstance(triton.language.standard.sigmoid, JITFunction):
        return (
            "TRITON_INTERPRET=1 was set after triton was imported: set it before the "
            "first `import triton` (or in the shell)"
        )
    import numpy  # the interpreter's own dependency

    if interpreter_index_fails(triton.__version__, numpy.__version__):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run under NumPy "
            f"{numpy.__version__}, triton-lang/triton#9171: install numpy<2.4 or "
            "Triton 3.7 or later"
        )
    return None


CPU_UNAVAILABLE = _cpu_unavailable()


def _toolkit_version(root: str) -> str | None:
    """major.minor of the CUDA toolkit at ``root``: its version.json, else its cuda.h."""
    try:
        with open(os.path.join(root, "version.json")) as f:
            return ".".join(json.load(f)["cuda"]["version"].split(".")[:2])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        with open(os.path.join(root, "include", "cuda.h")) as f:
            for line in f:
                if line.startswith("#define CUDA_VERSION "):
                    number = int(line.split()[2])  # 1000 * major + 10 * minor
                    return f"{number // 1000}.{number % 1000 // 10}"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _toolkit_libdevice() -> str | None:
    """The libdevice of the CUDA toolkit torch was built with (same major.minor), if one is
    installed: eager's ``erff`` comes from it, and the one Triton bundles can differ (Triton
    3.6's against CUDA 13.0's: one ulp at about 7 million of the 2^32 floats)."""
    version = torch.version.cuda
    if INTERPRETED or not version or torch.version.hip:
        return None
    roots = (
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        f"/usr/local/cuda-{version}",
        f"/usr/local/cuda-{version.split('.')[0]}",
        "/usr/local/cuda",
    )
    for root in filter(None, roots):
        path = os.path.join(root, "nvvm", "libdevice", "libdevice.10.bc")
        if _toolkit_version(root) == version and os.path.isfile(path):
            return path
    return None


# Compile options of every kernel, so that the GeLU math rounds as PyTorch's GPU kernels:
# a * b + c contracted into FMAs (nvcc's and hipcc's default; Triton's default changes
# across versions, and 3.9 warns where it is left unset), and on CUDA libdevice without
# flush-to-zero, and torch's toolkit libdevice where found, unless the user points Triton
# at one (TRITON_LIBDEVICE_PATH). The AMD backend has no libdevice fields, and Intel's
# XPU backend is left to its defaults (Triton refuses unknown options).
_USER_LIBDEVICE = getattr(getattr(knobs, "nvidia", None), "libdevice_path", None)
TOOLKIT_LIBDEVICE = None if _USER_LIBDEVICE else _toolkit_libdevice()
if INTERPRETED or not (torch.version.cuda or torch.version.hip):
    COMPILE_OPTIONS = {}
elif torch.version.hip:
    COMPILE_OPTIONS = {"enable_fp_fusion": True}
else:
    COMPILE_OPTIONS = {
        "enable_fp_fusion": True,
        "enable_reflect_ftz": False,
        **(
            {"extern_libs": {"libdevice": TOOLKIT_LIBDEVICE}}
            if TOOLKIT_LIBDEVICE
            else {}
        ),
    }


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


_CUBLAS_READY: set[tuple[torch.device, torch.dtype]] = set()


def prepare_cublas(device: torch.device, dtype: torch.dtype) -> None:
    """Runs one tiny ``dtype`` GEMM on ``device`` once per process. A process's first
    cuBLAS GEMM of a dtype sets cuBLAS up for that dtype (beyond creating its handle:
    decision 0016), which eager's first call pays: paid here, at the first call of a
    module whose route can reach cuBLAS (its down projection at some token counts), not
    by whichever later call first takes it. Not while a CUDA graph is captured, nor for
    FP8 weights (their GEMMs are scaled ones)."""
    if (
        device.type != "cuda"
        or INTERPRETED
        or dtype not in (torch.float16, torch.bfloat16, torch.float32)
        or (device, dtype) in _CUBLAS_READY
        or torch.cuda.is_current_stream_capturing()
    ):
        return
    _CUBLAS_READY.add((device, dtype))
    with torch.cuda.device(device), torch.no_grad():
        a = torch.zeros(16, 16, dtype=dtype, device=device)
        torch.mm(a, a)


class BoundedCache(dict):
    """A dict that forgets its oldest entry beyond ``size`` entries: host-side plans keyed by
    exact shapes stay few however many token counts a process sees. A hit is a plain
    ``dict.get`` (no bookkeeping on the hot path). Every one is emptied by
    ``clear_plans`` (a launch table changed)."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size
        made_from_tables(self)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        if len(self) > self.size:
            del self[next(iter(self))]


_PLAN_CACHES: list[dict] = []


def made_from_tables(cache: dict) -> dict:
    """``cache``, registered to be cleared by clear_plans: what it holds was decided from
    the launch tables."""
    _PLAN_CACHES.append(cache)
    return cache


def clear_plans() -> None:
    """Forgets every plan made from the launch tables (tuning.use changed one)."""
    for cache in _PLAN_CACHES:
        cache.clear()


# Whether the direct launch works with this Triton: False from its first refused call on,
# with the error kept for diagnosis.
direct_launch_works = True
direct_launch_error: Exception | None = None
# Pipeline depth that fitted in shared memory, after a launch had to retry with fewer
# stages (a GPU with less shared memory than the tables assume).
_STAGES_THAT_FIT: dict[tuple, int] = {}
_RUNTIME_KNOBS = knobs.runtime


def _launch_hooks_set() -> bool:
    """Whether a profiler (e.g. proton) hooks Triton's launches: JITFunction.run calls them.
    A hook is a function, or a chain of them (an empty chain calls nothing)."""
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class Launcher:
    """Launches one kernel with fixed constexprs (flags, tiles, ``num_warps``,
    ``num_stages``) for arguments of one specialisation: the caller keys its launchers by
    the arguments' dtypes, shapes and strides, so every call of one launcher compiles to
    the same kernel. The first call, and any with a misaligned pointer, under a launch
    hook or on a device other than the one the compiled kernel was loaded on, goes
    through ``kernel[grid](...)``; later calls hand the compiled kernel's launcher the
    arguments ``JITFunction.run`` would (every parameter, constexprs too)."""

    __slots__ = (
        "binary",
        "binary_device",
        "constexprs",
        "device",
        "kernel",
        "looked_up",
        "pointers",
        "stream",
        "values",
    )

    def __init__(self, kernel, constexprs: dict):
        self.kernel = kernel
        self.constexprs = {**COMPILE_OPTIONS, **constexprs}
        params = getattr(kernel, "params", ())
        self.values = tuple(constexprs[p.name] for p in params if p.is_constexpr)
        # the CompiledKernel itself, not its function handle: from Triton 3.8 on, its
        # __del__ unloads the module the handle lives in
        self.binary = None
        # the device the compiled kernel was loaded on (a CUDA function is per device)
        self.binary_device = None
        self.pointers = ()  # positions of the tensor arguments
        # The current-device and -stream getters JITFunction.run launches with.
        self.device = self.stream = None
        # whether the first call looked for a precompiled kernel (precompiled.py)
        self.looked_up = False

    def __call__(self, grid: int, *args) -> None:
        """``args``: the kernel's runtime parameters in order, None where unused (Triton
        compiles those out): None at the same positions in every call, as the compiled
        kernel's are."""
        if self.binary is not None and not _launch_hooks_set():
            device = self.device()
            for i in self.pointers:
                if args[i].data_ptr() & 15:
                    break
            else:
                if device == self.binary_device and self._run(
                    grid, self.stream(device), args
                ):
                    return
        elif not self.looked_up:
            self.looked_up = True
            if self._launch_precompiled(grid, args):
                return
        binary = self._launch_through_triton(grid, args)
        if (
            direct_launch_works
            and isinstance(self.kernel, JITFunction)
            and not _launch_hooks_set()
        ):
            pointers = tuple(
                i for i, a in enumerate(args) if isinstance(a, torch.Tensor)
            )
            if all(args[i].data_ptr() & 15 == 0 for i in pointers):
                self.device, self.stream = _stream_getters()
                self.pointers, self.binary = pointers, binary
                self.binary_device = self.device()

    def _launch_precompiled(self, grid: int, args: tuple) -> bool:
        """The first launch through the kernel compiled at build time for exactly this
        launch (precompiled.find: same Triton, GPU, kernel source, specialisation and
        options), then kept as the direct launch's; False where there is none, or it did
        not load (e.g. too much shared memory here): the caller compiles."""
        if (
            INTERPRETED
            or torch.version.hip
            or not direct_launch_works
            or not isinstance(self.kernel, JITFunction)
            or _launch_hooks_set()
        ):
            return False
        pointers = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if any(args[i].data_ptr() & 15 for i in pointers):
            return False
        stages = _STAGES_THAT_FIT.get(
            (id(self.kernel), self.values), self.constexprs["num_stages"]
        )
        binary = precompiled.find(
            self.kernel, args, {**self.constexprs, "num_stages": stages}
        )
        if binary is None:
            return False
        get_device, get_stream = _stream_getters()
        device = get_device()
        if not binary.load(device):  # e.g. more shared memory than this GPU has
            return False
        self.device, self.stream = get_device, get_stream
        self.pointers, self.binary, self.binary_device = pointers, binary, device
        if self._run(grid, get_stream(device), args):
            return True
        self.binary = self.binary_device = None
        return False

    def launch_aligned(self, grid: int, device: int, stream: int, args: tuple) -> bool:
        """The direct launch on ``stream`` of ``device`` (the current device and its current
        stream: current_device_and_stream()) for a caller that knows its pointers 16-byte
        aligned, as the first launch's were: in ``args`` a tensor, or the int address of
        one that the caller keeps alive (Triton's launcher takes it as is and skips its
        per-tensor pointer query). False where it launched nothing (not compiled yet, or
        for another device, a launch hook set, this Triton refuses the call): the caller
        then calls the launcher with tensors."""
        return (
            device == self.binary_device
            and self.binary is not None
            and not _launch_hooks_set()
            and self._run(grid, stream, args)
        )

    def _run(self, grid: int, stream: int, args: tuple) -> bool:
        global direct_launch_works, direct_launch_error
        binary = self.binary
        try:
            binary.run(
                grid, 1, 1, stream, binary.function, binary.packed_metadata, None, None,
                None, *args, *self.values,
            )  # fmt: skip
            return True
        except (TypeError, AttributeError, SystemError) as error:
            # This Triton's launcher takes other arguments (the call launched nothing):
            # Triton's own launch from now on.
            direct_launch_works, direct_launch_error = False, error
            self.binary = None
            return False

    def _launch_through_triton(self, grid: int, args: tuple):
        if not INTERPRETED:
            return self._compile_and_launch(grid, args)
        with _INTERPRETER:  # see SHARED_SCRATCH
            try:
                return self._compile_and_launch(grid, args)
            except BaseException:
                for store in SHARED_SCRATCH:
                    store.clear()
                raise

    def _compile_and_launch(self, grid: int, args: tuple):
        key = (id(self.kernel), self.values)
        stages = _STAGES_THAT_FIT.get(key, self.constexprs["num_stages"])
        while True:
            try:
                return self.kernel[(grid,)](
                    *args, **{**self.constexprs, "num_stages": stages}
                )
            except triton.runtime.errors.OutOfResources:
                if stages == 1:
                    raise
                stages -= 1
                _STAGES_THAT_FIT[key] = stages
            except Exception as error:
                if "extern_libs" not in self.constexprs:
                    raise
                return self._launch_without_toolkit_libdevice(grid, args, stages, error)

    def _launch_without_toolkit_libdevice(self, grid, args, stages, error):
        """The launch again with Triton's own libdevice: where it succeeds, the toolkit's
        was what failed (bitcode this Triton's LLVM cannot link), and no later kernel
        takes it; where it fails too, ``error`` was not about libdevice."""
        without = {k: v for k, v in self.constexprs.items() if k != "extern_libs"}
        try:
            binary = self.kernel[(grid,)](*args, **{**without, "num_stages": stages})
        except Exception:  # noqa: BLE001 (a failing retry: error was not about libdevice)
            binary = None
        if binary is None:
            raise error  # its own cause kept: a CompilationError's holds the message
        _drop_toolkit_libdevice(error)
        self.constexprs = without
        return binary


# The interpreter runs a kernel's programs in Python, one after another: two threads'
# launches would interleave (on the same scratch, and in Triton's patched language
# module), and an interrupted launch (KeyboardInterrupt) stops part-way, leaving scratch
# that launches otherwise leave zero (gemm.py's stores, SHARED_SCRATCH) half written. One
# launch at a time, and the scratch dropped (made afresh, zeroed) where one stops. On a
# GPU a launched kernel runs to its end, and launches on one stream run in order.
_INTERPRETER = threading.Lock()
SHARED_SCRATCH: list[dict] = []


def _drop_toolkit_libdevice(error: Exception) -> None:
    global COMPILE_OPTIONS, TOOLKIT_LIBDEVICE
    if TOOLKIT_LIBDEVICE is None:
        return
    warnings.warn(
        f"fused_geglu: Triton could not link {TOOLKIT_LIBDEVICE} ({error!r}); kernels "
        "compiled from now on use Triton's own libdevice, whose erff can differ from "
        "eager's by one ulp (docs/numerics.md)",
        RuntimeWarning,
        stacklevel=4,
    )
    COMPILE_OPTIONS = {k: v for k, v in COMPILE_OPTIONS.items() if k != "extern_libs"}
    TOOLKIT_LIBDEVICE = None


def _stream_getters() -> tuple:
    """The current-device and current-stream getters ``JITFunction.run`` launches with:
    with torch loaded, Triton's CUDA and HIP drivers take torch's (GPUDriver), read here
    without starting Triton's driver (whose first use compiles C: cubin.py)."""
    if INTERPRETED or not (torch.version.cuda or torch.version.hip):
        driver = triton.runtime.driver.active
        return driver.get_current_device, driver.get_current_stream
    try:
        from torch._C import _cuda_getCurrentRawStream as get_stream
    except ImportError:

        def get_stream(device):
            return torch.cuda.current_stream(device).cuda_stream

    return torch.cuda.current_device, get_stream


_CURRENT = []  # the (current device, current stream) getters, once read


def current_device_and_stream() -> tuple[int, int]:
    """Where a launch goes now: the current device and its current stream (-1 and 0 under
    the interpreter, -1 being a CPU tensor's ``get_device()``)."""
    if INTERPRETED:
        return -1, 0
    if not _CURRENT:
        _CURRENT.extend(_stream_getters())
    get_device, get_stream = _CURRENT
    device = get_device()
    return device, get_stream(device)


def stream_scratch(
    store: dict,
    device: torch.device,
    numel: int,
    counters: int,
    zeroed: bool,
    capturing: bool | None = None,
    stream: int | None = None,
) -> tuple:
    """(fp32 workspace of at least ``numel``, zeroed int32 counters), kept in ``store`` per
    (device, stream) and reused: launches on one stream run in order, and the kernels
    leave the counters zero (and a ``zeroed`` workspace zero) for the next. Inside a CUDA
    graph capture, fresh ones (memset nodes): the graph may replay on any stream, beside
    other work of the capture stream. ``capturing``: whether a capture is on, and
    ``stream``: the launch's (current_device_and_stream()), where the caller knows (None:
    asked here)."""
    workspace = torch.zeros if zeroed else torch.empty
    if capturing is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if capturing:
        return (
            workspace(numel, dtype=torch.float32, device=device),
            torch.zeros(counters, dtype=torch.int32, device=device),
        )
    key = (device, current_device_and_stream()[1] if stream is None else stream)
    scratch = store.get(key)
    if scratch is None or scratch[0].numel() < numel:
        counts = (
            torch.zeros(counters, dtype=torch.int32, device=device)
            if scratch is None
            else scratch[1]
        )
        scratch = workspace(numel, dtype=torch.float32, device=device), counts
        store[key] = scratch
    return scratch
