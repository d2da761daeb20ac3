"""A kernel Triton compiled (its cubin and metadata) loaded and launched through the CUDA
driver API, without Triton's driver: how a precompiled kernel (precompiled.py) runs.

Triton's driver, on its first use in a process, compiles C sources with the host's C
compiler (its ``cuda_utils`` module, and up to Triton 3.6 a launcher per kernel
signature) into Triton's cache: seconds where that cache is empty, as in a fresh
container. A precompiled kernel needs none of it:

- the module is loaded with ``cuModuleLoadData``, with the dynamic shared memory opt-in
  that Triton's ``load_binary`` sets;
- a kernel whose parameters are pointers and scalars is launched by torch's static CUDA
  launcher (``torch._C._StaticCudaLauncher``, the C++ launcher torch.compile uses for
  its cubins: one call per launch, no Python per argument);
- a kernel taking TMA descriptors (a 128-byte ``CUtensorMap`` by value, which that
  launcher cannot pass) is launched with ``cuLaunchKernel`` through ctypes, each
  descriptor encoded with ``cuTensorMapEncodeTiled`` exactly as Triton's launcher does
  (``fill_tma_descriptor``: box and dims innermost first, 128-byte L2 promotion, no
  interleave, the compiled swizzle), followed by its shape (i32) and strides (i64).

Parameters follow the compiled signature: a ``constexpr`` is not passed; the kernel's
trailing global and profile scratch pointers are null (kernels needing scratch are
refused). A kernel this module cannot launch as Triton would (clusters, PDL, cooperative
grids, fp16 scalars, tuples, im2col or fp4 descriptors) is refused: the caller compiles.
"""

import ctypes
import operator
import threading

_SCALARS = {  # signature type -> (torch's static launcher code, ctypes type)
    "i1": ("b", ctypes.c_int8),
    "i8": ("b", ctypes.c_int8),
    "i16": ("h", ctypes.c_int16),
    "i32": ("i", ctypes.c_int32),
    "i64": ("l", ctypes.c_int64),
    "u1": ("B", ctypes.c_uint8),
    "u8": ("B", ctypes.c_uint8),
    "u16": ("H", ctypes.c_uint16),
    "u32": ("I", ctypes.c_uint32),
    "u64": ("K", ctypes.c_uint64),
    "fp32": ("f", ctypes.c_float),
    "f32": ("f", ctypes.c_float),
    "fp64": ("d", ctypes.c_double),
}
# Triton's element-type numbering in descriptor metadata -> CUtensorMapDataType
_TMA_DTYPE = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
_TMA_TF32 = 11
_SHARED_STATIC_MAX = 49152  # bytes a kernel gets without the opt-in

_CUDA: list = []  # the loaded libcuda, once
# (artifact key, device) -> CUfunction: a module is loaded once per process and device
_FUNCTIONS: dict[tuple[str, int], int] = {}
_LOCK = threading.Lock()


def cuda():
    """libcuda through ctypes, with the prototypes used here."""
    if not _CUDA:
        P, c = ctypes.POINTER, ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        prototypes = {
            "cuCtxGetCurrent": [P(c.c_void_p)],
            "cuDeviceGet": [P(c.c_int), c.c_int],
            "cuDevicePrimaryCtxRetain": [P(c.c_void_p), c.c_int],
            "cuCtxSetCurrent": [c.c_void_p],
            "cuModuleLoadData": [P(c.c_void_p), c.c_char_p],
            "cuModuleGetFunction": [P(c.c_void_p), c.c_void_p, c.c_char_p],
            "cuDeviceGetAttribute": [P(c.c_int), c.c_int, c.c_int],
            "cuFuncGetAttribute": [P(c.c_int), c.c_int, c.c_void_p],
            "cuFuncSetAttribute": [c.c_void_p, c.c_int, c.c_int],
            "cuFuncSetCacheConfig": [c.c_void_p, c.c_int],
            # (map, dtype, rank, address, dims, strides, box, element strides,
            #  interleave, swizzle, L2 promotion, out-of-bounds fill)
            "cuTensorMapEncodeTiled": [c.c_void_p, c.c_int, c.c_uint32, c.c_void_p]
            + [P(c.c_uint64)] * 2
            + [P(c.c_uint32)] * 2
            + [c.c_int] * 4,
            # (function, grid x y z, block x y z, shared bytes, stream, params, extra)
            "cuLaunchKernel": [c.c_void_p, *[c.c_uint] * 7, c.c_void_p]
            + [P(c.c_void_p)] * 2,
            "cuGetErrorString": [c.c_int, P(c.c_char_p)],
        }
        for name, argtypes in prototypes.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        _CUDA.append(lib)
    return _CUDA[0]


def check(result: int, what: str) -> None:
    if result:
        text = ctypes.c_char_p()
        cuda().cuGetErrorString(result, ctypes.byref(text))
        name = text.value.decode() if text.value else "unknown error"
        raise RuntimeError(f"fused_geglu: {what} failed: CUDA error {result} ({name})")


def _static_launcher():
    try:
        from torch._C import _StaticCudaLauncher
    except ImportError:
        return None
    return getattr(_StaticCudaLauncher, "_launch_kernel", None)


def refusal(signature: dict, meta: dict) -> str | None:
    """Why this module cannot launch the kernel as Triton's launcher would, or None."""
    if meta.get("num_ctas", 1) != 1 or any(
        d != 1 for d in meta.get("cluster_dims", ())
    ):
        return "thread block clusters"
    if meta.get("launch_pdl") or meta.get("launch_cooperative_grid"):
        return "a PDL or cooperative launch"
    if meta.get("global_scratch_size", 0) or meta.get("profile_scratch_size", 0):
        return "scratch memory"
    if meta.get("instrumentation_mode"):
        return "instrumentation"
    types = list(signature.values())
    if not all(isinstance(ty, str) for ty in types):
        return "a tuple parameter"
    descriptors = meta.get("tensordesc_meta") or ()
    if sum(ty.startswith("tensordesc") for ty in types) != len(descriptors):
        return "descriptors without their metadata"
    for ty in types:
        if not (
            ty in ("constexpr", *_SCALARS)
            or ty[0] == "*"
            or ty.startswith("tensordesc")
        ):
            return f"a {ty} parameter"
    if any(d.get("fp4_padded") or d.get("is_im2col") for d in descriptors):
        return "an fp4 or im2col descriptor"
    return None


class CubinKernel:
    """One compiled kernel: ``load(device)`` once per device, then ``run`` with the
    arguments of ``CompiledKernel.run`` (the launcher's ``_run`` calls either)."""

    def __init__(self, key: str, signature: dict, meta: dict, cubin: bytes):
        """``key``: the artifact's (precompiled.artifact_key); ``signature``: the
        compiled ASTSource's (parameter name -> type, in order); ``meta``: Triton's
        metadata JSON of the compilation; ``cubin``: its binary."""
        self.key = key
        self.name = meta["name"]
        self.cubin = cubin
        self.num_warps = meta["num_warps"]
        self.shared = meta["shared"]
        self.function = None  # CUfunction on the device loaded (CompiledKernel's field)
        self.packed_metadata = None
        # each passed parameter: (position in the launch's arguments, type)
        passed = [
            (i, ty) for i, ty in enumerate(signature.values()) if ty != "constexpr"
        ]
        scratch = [
            k for k in ("global_scratch_size", "profile_scratch_size") if k in meta
        ]
        descriptors = iter(meta.get("tensordesc_meta") or ())
        self.params = [
            (i, ty, next(descriptors) if ty.startswith("tensordesc") else None)
            for i, ty in passed
        ]
        self.null_pointers = len(scratch)
        self.tma = any(d is not None for _, _, d in self.params)
        if not self.tma:
            positions = [i for i, _ in passed]
            self.select = (
                operator.itemgetter(*positions)
                if len(positions) > 1
                else lambda args: tuple(args[i] for i in positions)
            )
            self.codes = "".join(
                "O" if ty[0] == "*" else _SCALARS[ty][0] for _, ty in passed
            ) + "O" * len(scratch)
            self.nulls = (None,) * len(scratch)
            self.launch = _static_launcher()

    def load(self, device: int) -> bool:
        """Loads the module on ``device`` (the current one); False where it cannot run
        there (more shared memory or threads than the GPU offers, a driver refusal, a
        torch without the static launcher for a kernel that needs it)."""
        if not self.tma and self.launch is None:
            return False
        function = _FUNCTIONS.get((self.key, device))
        if function is None:
            try:
                function = self._load(device)
            except (OSError, RuntimeError):
                return False
            if function is None:
                return False
            with _LOCK:
                function = _FUNCTIONS.setdefault((self.key, device), function)
        self.function = function
        return True

    def _load(self, device: int) -> int | None:
        lib, c = cuda(), ctypes
        _make_context_current(device)
        module, function = c.c_void_p(), c.c_void_p()
        check(lib.cuModuleLoadData(c.byref(module), self.cubin), "cuModuleLoadData")
        check(
            lib.cuModuleGetFunction(c.byref(function), module, self.name.encode()),
            "cuModuleGetFunction",
        )
        optin, threads, static = c.c_int(), c.c_int(), c.c_int()
        # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
        check(
            lib.cuDeviceGetAttribute(c.byref(optin), 97, device), "cuDeviceGetAttribute"
        )
        # CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
        check(
            lib.cuFuncGetAttribute(c.byref(threads), 0, function), "cuFuncGetAttribute"
        )
        if self.shared > optin.value or self.num_warps * 32 > threads.value:
            return None
        if self.shared > _SHARED_STATIC_MAX and optin.value > _SHARED_STATIC_MAX:
            # CU_FUNC_CACHE_PREFER_SHARED = 1; CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            check(lib.cuFuncSetCacheConfig(function, 1), "cuFuncSetCacheConfig")
            check(
                lib.cuFuncGetAttribute(c.byref(static), 1, function),
                "cuFuncGetAttribute",
            )
            check(
                lib.cuFuncSetAttribute(function, 8, optin.value - static.value),
                "cuFuncSetAttribute",
            )
        return function.value

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata,
            launch_metadata, enter_hook, exit_hook, *args):  # fmt: skip
        """``CompiledKernel.run``'s call: ``args`` every parameter, constexprs too."""
        if not self.tma:
            self.launch(
                function, grid_x, grid_y, grid_z, self.num_warps, self.shared,
                self.codes, (*self.select(args), *self.nulls), stream,
            )  # fmt: skip
            return
        values = self.tma_values(args)
        params = (ctypes.c_void_p * len(values))(*map(ctypes.addressof, values))
        check(
            cuda().cuLaunchKernel(
                function, grid_x, grid_y, grid_z, 32 * self.num_warps, 1, 1,
                self.shared, stream, params, None,
            ),
            f"launching {self.name}",
        )  # fmt: skip

    def tma_values(self, args: tuple) -> list:
        """The kernel's parameters as ctypes values, in the compiled order (the TMA
        launch's ``kernelParams`` point at them)."""
        values = []
        for i, ty, descriptor in self.params:
            arg = args[i]
            if descriptor is not None:
                values.append(_tensor_map(arg, descriptor))
                values.extend(ctypes.c_int32(s) for s in arg.shape)
                values.extend(ctypes.c_int64(s) for s in arg.strides)
            elif ty[0] == "*":
                address = arg if isinstance(arg, int) else arg.data_ptr()
                values.append(ctypes.c_uint64(address))
            else:
                values.append(_SCALARS[ty][1](arg))
        values.extend(ctypes.c_uint64(0) for _ in range(self.null_pointers))
        return values


def _make_context_current(device: int) -> None:
    """The device's primary context (torch's) current on this thread, where none is."""
    lib, c = cuda(), ctypes
    context = c.c_void_p()
    check(lib.cuCtxGetCurrent(c.byref(context)), "cuCtxGetCurrent")
    if not context.value:
        handle = c.c_int()
        check(lib.cuDeviceGet(c.byref(handle), device), "cuDeviceGet")
        check(
            lib.cuDevicePrimaryCtxRetain(c.byref(context), handle),
            "cuDevicePrimaryCtxRetain",
        )
        check(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")


class _TensorMap(ctypes.Structure):
    _fields_ = [("words", ctypes.c_uint64 * 16)]  # CUtensorMap: 128 bytes


def _tensor_map(desc, meta: dict) -> _TensorMap:
    """``desc`` (a host TensorDescriptor) encoded as Triton's launcher encodes it."""
    rank = len(desc.shape)
    elem = meta["elem_size"]
    dtype = (
        _TMA_TF32 if getattr(desc, "round_f32_to_tf32", False) else meta["elem_type"]
    )
    dims = (ctypes.c_uint64 * rank)(*reversed(desc.shape))
    strides = (ctypes.c_uint64 * rank)(*[elem * s for s in reversed(desc.strides[:-1])])
    box = (ctypes.c_uint32 * rank)(*reversed(meta["block_size"]))
    ones = (ctypes.c_uint32 * rank)(*[1] * rank)
    # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA = 1 for "nan" padding, else NONE
    fill = 1 if getattr(desc, "padding", "zero") == "nan" else 0
    # 64-byte alignment, as CUtensorMap's declaration asks
    storage = ctypes.create_string_buffer(128 + 64)
    offset = -ctypes.addressof(storage) % 64
    tensor_map = _TensorMap.from_buffer(storage, offset)
    check(
        cuda().cuTensorMapEncodeTiled(
            ctypes.addressof(tensor_map), _TMA_DTYPE[dtype], rank,
            desc.base.data_ptr(), dims, strides, box, ones,
            0,  # CU_TENSOR_MAP_INTERLEAVE_NONE
            meta["swizzle"],
            2,  # CU_TENSOR_MAP_L2_PROMOTION_L2_128B
            fill,
        ),
        "cuTensorMapEncodeTiled",
    )  # fmt: skip
    return tensor_map  # from_buffer keeps ``storage`` alive
