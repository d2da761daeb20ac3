"""Kernels compiled at build time (``make precompile``), loaded by a ``Launcher``'s first
call instead of Triton's compiler (docs/precompiled.md).

An artifact is Triton's own output for one launch (its metadata JSON and its cubin,
xz-compressed to a fifth of its size), stored beside this module under
``precompiled/<triton version>/<backend><arch>/<kernel name>/<key>.{json,xz}``. ``<key>`` is a SHA-256 over everything Triton's compiler reads,
computed the same way at build time and at run time:

- the Triton version, the sizes of its bundled ptxas binaries and any user override of
  ptxas or libdevice (TRITON_PTXAS_PATH ...);
- the target (backend, arch, warp size: what ``driver.active.get_current_target()``
  reports, read from torch);
- ``ASTSource.hash()`` of the launch, made by Triton's own binder and ``_pack_args`` from
  the launch's arguments: the kernel's ``cache_key`` (its source and every function and
  global it uses), the signature (dtypes), the constexprs, the specialisation attributes
  (16-byte divisibility, ints equal to 1);
- ``options.hash()``: every compile option (num_warps, num_stages, fp fusion, ftz, the
  libdevice *content*, debug, ptxas options, TRITON_OVERRIDE_ARCH ...);
- Triton's cache-invalidating environment variables.

Anything else (another Triton version or ptxas, another GPU, a changed kernel, a launch not
shipped, a compiler hook or override set, a Triton whose ``JITFunction.run`` was not
checked against ``_RUN_KNOBS``) finds no file and the launcher compiles as before. A hit
is loaded and launched by cubin.py, without Triton's driver: a fresh process with an
empty Triton cache compiles nothing. Nothing here changes a Triton setting of the
process (its cache directory, its knobs).
"""

import hashlib
import json
import lzma
import os
import threading

import torch
import triton

from . import cubin

FORMAT = 1
DIRNAME = "precompiled"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), DIRNAME)
# FUSED_GEGLU_PRECOMPILED=0: never load an artifact (always Triton's JIT).
ENABLED = os.environ.get("FUSED_GEGLU_PRECOMPILED", "1") != "0"

# The keyword arguments JITFunction.run adds (from Triton's knobs) before it binds a
# launch, per Triton series: checked against each series' runtime/jit.py. A series not
# listed never loads an artifact (its run() may add others, giving other options).
_RUN_KNOBS = {
    "3.6": ("debug", "instrumentation_mode"),
    "3.7": ("debug", "instrumentation_mode"),
    "3.8": ("debug", "instrumentation_mode"),
    "3.9": ("debug", "instrumentation_mode", "fpsan_homomorphic_casts"),
}
# Environment variables that replace a tool the compiler runs.
_TOOL_OVERRIDES = (
    "TRITON_PTXAS_PATH",
    "TRITON_PTXAS_BLACKWELL_PATH",
    "TRITON_LIBDEVICE_PATH",
)


def series(version: str = triton.__version__) -> str:
    return ".".join(version.split(".")[:2])


def run_kwargs(kernel, kwargs: dict, version: str = triton.__version__) -> dict | None:
    """``kwargs`` as JITFunction.run hands them to its binder, or None for a Triton series
    whose run() was not checked."""
    names = _RUN_KNOBS.get(series(version))
    if names is None:
        return None
    knobs = triton.knobs
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", kernel.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if "fpsan_homomorphic_casts" in names:
        kw["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kw


_BINDERS: dict = {}  # (kernel, target) -> (backend, binder)


def specialize(kernel, target, args: tuple, kwargs: dict):
    """(ASTSource, options, backend) that ``kernel[grid](*args, **kwargs)`` compiles on
    ``target``, from Triton's own binder and ``_pack_args``."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kw = run_kwargs(kernel, kwargs)
    if kw is None:
        raise LookupError(f"Triton {triton.__version__}: run() not checked")
    entry = _BINDERS.get((kernel, target))
    if entry is None:
        backend = make_backend(target)
        binder = create_function_from_signature(
            kernel.signature, kernel.params, backend
        )
        entry = _BINDERS[(kernel, target)] = (backend, binder)
    backend, binder = entry
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kw, bound, specialization, options
    )
    return ASTSource(kernel, signature, constexprs, attrs), options, backend


_TOOLCHAIN: list = []


def toolchain() -> list:
    """This Triton install's compiler, cheaply: its version, the sizes of its bundled
    ptxas binaries, and any override of the tools it runs. libtriton is left out: one
    release is built per Python version (another file, the same compiler), and hashing
    it as Triton's cache key does costs ~0.3 s."""
    if not _TOOLCHAIN:
        folder = os.path.join(
            os.path.dirname(os.path.abspath(triton.__file__)),
            "backends",
            "nvidia",
            "bin",
        )
        try:
            names = sorted(n for n in os.listdir(folder) if n.startswith("ptxas"))
        except OSError:
            names = []
        sizes = [[n, os.path.getsize(os.path.join(folder, n))] for n in names]
        _TOOLCHAIN.extend([triton.__version__, sizes])
    overrides = [[n, os.environ[n]] for n in _TOOL_OVERRIDES if os.environ.get(n)]
    return [*_TOOLCHAIN, overrides]


def artifact_key(src, options, target, env_vars: dict) -> str:
    """The artifact's name: SHA-256 over every input of the compilation (module doc)."""
    material = json.dumps(
        [
            FORMAT,
            toolchain(),
            [target.backend, target.arch, target.warp_size],
            src.hash(),
            options.hash(),
            sorted((str(k), str(v)) for k, v in env_vars.items()),
        ]
    )
    return hashlib.sha256(material.encode()).hexdigest()


def target_dir(root: str, target, version: str = triton.__version__) -> str:
    return os.path.join(root, version, f"{target.backend}{target.arch}")


def _hook_set(hook) -> bool:
    """A hook is a function, or a chain of them (Triton 3.9: an empty chain calls none)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _compiler_watched() -> bool:
    """Whether the user hooks, overrides or dumps Triton's compilations or kernel loads:
    then every kernel goes through Triton, as they expect."""
    knobs = triton.knobs
    try:
        runtime, compilation = knobs.runtime, knobs.compilation
        hooks = ("jit_cache_hook", "jit_post_compile_hook", "add_stages_inspection_hook",
                 "kernel_load_start_hook", "kernel_load_end_hook")  # fmt: skip
        return bool(
            compilation.always_compile
            or compilation.override
            or compilation.dump_ir
            or getattr(compilation, "listener", None)
            or any(_hook_set(getattr(runtime, name, None)) for name in hooks)
        )
    except AttributeError:
        return True


_LISTINGS: dict[str, frozenset] = {}  # folder -> its file names (read once)
# key -> its artifact's (metadata, cubin), checked: the launchers of one specialisation
# (one per shape class) read and decompress it once
_READ: dict[str, tuple] = {}
_LOCK = threading.Lock()


def _listing(folder: str) -> frozenset:
    names = _LISTINGS.get(folder)
    if names is None:
        try:
            names = frozenset(os.listdir(folder))
        except OSError:
            names = frozenset()
        with _LOCK:
            _LISTINGS[folder] = names
    return names


def current_target():
    """The current CUDA device's compile target, as Triton's driver reports it (without
    starting that driver: precompiled kernels run without it, cubin.py)."""
    from triton.backends.compiler import GPUTarget

    major, minor = torch.cuda.get_device_capability()
    return GPUTarget("cuda", major * 10 + minor, 32)


def find(kernel, args: tuple, kwargs: dict, target=None, root: str | None = None):
    """The kernel (a cubin.CubinKernel, not loaded yet) that ``kernel[grid](*args,
    **kwargs)`` would compile on ``target`` (default: the current CUDA device's), where
    ``root`` (default ROOT) holds its artifact and cubin.py can launch it; None otherwise
    (the caller compiles). Never raises."""
    if not ENABLED:
        return None
    try:
        root = root or ROOT
        if target is None:
            target = current_target()
        if target.backend != "cuda" or series() not in _RUN_KNOBS:
            return None
        folder = os.path.join(target_dir(root, target), kernel.__name__)
        names = _listing(folder)
        if not names or _compiler_watched():
            return None
        from triton._C.libtriton import get_cache_invalidating_env_vars

        src, options, _ = specialize(kernel, target, args, kwargs)
        key = artifact_key(src, options, target, get_cache_invalidating_env_vars())
        if f"{key}.json" not in names or f"{key}.xz" not in names:
            return None
        read = _READ.get(key)
        if read is not None:
            return cubin.CubinKernel(key, src.signature, *read)
        path = os.path.join(folder, key)
        with open(f"{path}.json") as f:
            meta = json.load(f)
        if (
            meta.get("fused_geglu_key") != key
            or meta.get("triton_version") != triton.__version__
            or meta.get("target", {}).get("arch") != target.arch
            or meta.get("name") != src.name
            or cubin.refusal(src.signature, meta) is not None
        ):
            return None
        with open(f"{path}.xz", "rb") as f:
            binary = lzma.decompress(f.read())
        with _LOCK:
            _READ[key] = meta, binary
        return cubin.CubinKernel(key, src.signature, meta, binary)
    except Exception:  # noqa: BLE001 (any mismatch of this Triton's API: JIT)
        return None


def compile_artifact(src, options, target, root: str) -> dict:
    """Compiles ``src`` with ``options`` (``specialize``'s) for ``target`` (no GPU
    needed) into ``root``: what ``find`` loads. Returns {key, file, bytes}."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.compiler import compile

    key = artifact_key(src, options, target, get_cache_invalidating_env_vars())
    folder = os.path.join(target_dir(root, target), src.fn.__name__)
    os.makedirs(folder, exist_ok=True)
    binary = compile(src, target=target, options=options.__dict__)
    meta_path = next(p for n, p in binary.metadata_group.items() if n.endswith(".json"))
    with open(meta_path) as f:
        meta = json.load(f)
    meta["fused_geglu_key"] = key
    packed = lzma.compress(binary.asm["cubin"], preset=9 | lzma.PRESET_EXTREME)
    with open(os.path.join(folder, f"{key}.xz"), "wb") as f:
        f.write(packed)
    text = json.dumps(meta, sort_keys=True)
    with open(os.path.join(folder, f"{key}.json"), "w") as f:
        f.write(text)
    return {
        "key": key,
        "file": os.path.join(folder, key),
        "bytes": len(packed) + len(text),
        "cubin_bytes": len(binary.asm["cubin"]),
    }
