"""Kernels compiled at build time (``make precompile``), loaded by a ``Launcher``'s first
call instead of Triton's compiler (docs/precompiled.md).

An artifact is Triton's own output for one launch (its metadata JSON and cubin), stored
under ``precompiled/<triton version>/<backend><arch>/<kernel name>/<key>.{json,cubin}``
beside this module. ``<key>`` is a SHA-256 over everything Triton's compiler reads,
computed the same way at build time and at run time:

- the Triton version and a fingerprint of its compiler binaries (libtriton's and the
  bundled ptxas' sizes) and of user overrides of ptxas (TRITON_PTXAS_PATH ...);
- the target (backend, arch, warp size: ``driver.active.get_current_target()``);
- ``ASTSource.hash()`` of the launch, made by Triton's own binder and ``_pack_args`` from
  the launch's arguments: the kernel's ``cache_key`` (its source and every function and
  global it uses), the signature (dtypes), the constexprs, the specialisation attributes
  (16-byte divisibility, ints equal to 1);
- ``options.hash()``: every compile option (num_warps, num_stages, fp fusion, ftz, the
  libdevice *content*, debug, ptxas options, TRITON_OVERRIDE_ARCH ...);
- Triton's cache-invalidating environment variables.

Anything else (another Triton or build of it, another GPU, a changed kernel, a launch not
shipped, a compiler hook or override set, a Triton whose ``JITFunction.run`` was not
checked against ``_RUN_KNOBS``) finds no file and the launcher compiles as before. Nothing
here changes a Triton setting of the process (its cache directory, its knobs).
"""

import hashlib
import json
import os
import threading

import triton

FORMAT = 1
DIRNAME = "precompiled"
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), DIRNAME)
# FUSED_GEGLU_PRECOMPILED=0: never load an artifact (always Triton's JIT).
ENABLED = os.environ.get("FUSED_GEGLU_PRECOMPILED", "1") != "0"

# The keyword arguments JITFunction.run adds (from Triton's knobs) before it binds a
# launch, per Triton series: checked against each series' runtime/jit.py. A series not
# listed never loads an artifact (its run() may add others, giving other options).
_RUN_KNOBS = {
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
    """This Triton install's compiler, cheaply: its version, the sizes of libtriton and of
    the bundled ptxas binaries (another build of one version differs), and any override
    of the tools it runs. Hashing libtriton as Triton's cache key does costs ~0.3 s."""
    if not _TOOLCHAIN:
        base = os.path.dirname(os.path.abspath(triton.__file__))
        sizes = []
        for folder in (
            os.path.join(base, "_C"),
            os.path.join(base, "backends", "nvidia", "bin"),
        ):
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                names = []
            for name in names:
                if name.startswith(("libtriton", "ptxas")):
                    sizes.append([name, os.path.getsize(os.path.join(folder, name))])
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


def _compiler_watched() -> bool:
    """Whether the user hooks, overrides or dumps Triton's compilations: then every
    kernel goes through the compiler, as they expect."""
    knobs = triton.knobs
    try:
        return bool(
            knobs.compilation.always_compile
            or knobs.compilation.override
            or knobs.compilation.dump_ir
            or getattr(knobs.compilation, "listener", None)
            or knobs.runtime.jit_cache_hook
            or knobs.runtime.jit_post_compile_hook
            or knobs.runtime.add_stages_inspection_hook
        )
    except AttributeError:
        return True


_LISTINGS: dict[str, frozenset] = {}  # folder -> its file names (read once)
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


def find(kernel, args: tuple, kwargs: dict, target=None, root: str = ROOT):
    """The compiled kernel (a triton CompiledKernel, its handles not loaded yet) that
    ``kernel[grid](*args, **kwargs)`` would compile on ``target`` (default: the current
    device's), where ``root`` holds its artifact; None otherwise (the caller compiles).
    Never raises."""
    if not ENABLED:
        return None
    try:
        if target is None:
            target = triton.runtime.driver.active.get_current_target()
        if target.backend != "cuda" or series() not in _RUN_KNOBS:
            return None
        folder = os.path.join(target_dir(root, target), kernel.__name__)
        names = _listing(folder)
        if not names or _compiler_watched():
            return None
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler import CompiledKernel

        src, options, _ = specialize(kernel, target, args, kwargs)
        key = artifact_key(src, options, target, get_cache_invalidating_env_vars())
        if f"{key}.json" not in names or f"{key}.cubin" not in names:
            return None
        meta, cubin = (
            os.path.join(folder, f"{key}.{ext}") for ext in ("json", "cubin")
        )
        with open(meta) as f:
            stored = json.load(f)
        if (
            stored.get("fused_geglu_key") != key
            or stored.get("triton_version") != triton.__version__
            or stored.get("target", {}).get("arch") != target.arch
            or stored.get("name") != src.name
        ):
            return None
        return CompiledKernel(
            src, {f"{src.name}.json": meta, f"{src.name}.cubin": cubin}, key
        )
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
    cubin = binary.asm["cubin"]
    with open(os.path.join(folder, f"{key}.cubin"), "wb") as f:
        f.write(cubin)
    text = json.dumps(meta, sort_keys=True)
    with open(os.path.join(folder, f"{key}.json"), "w") as f:
        f.write(text)
    return {
        "key": key,
        "file": os.path.join(folder, key),
        "bytes": len(cubin) + len(text),
    }
