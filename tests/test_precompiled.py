"""Precompiled kernels (docs/precompiled.md): the lookup loads an artifact only for the
launch it was compiled for (this Triton, this GPU, this kernel source, this
specialisation and these options) and answers None (JIT) for anything else; the
interpreter never consults it. Runs on the CPU: one artifact is compiled for sm_90 by
scripts/precompile.py into a temporary folder, then looked up."""

import json

import pytest
from conftest import HAS_GPU, ROOT, run_python

_LOOKUP = """
import importlib.util, json, lzma, os, shutil, sys
import torch
from triton.backends.compiler import GPUTarget

out = sys.argv[1]
spec = importlib.util.spec_from_file_location("precompile", sys.argv[2] + "/scripts/precompile.py")
pc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pc)
# one launch: the H200 table's decode MLP, bf16, one token of a 2048 x 16384 MLP
assert pc.main(["--out", out, "--smoke", "--tokens", "1", "--arch", "90", "--table",
                "NVIDIA H200", "--dtype", "bf16", "--model", "2048x16384", "--jobs", "1"]) == 0
fg = sys.modules["fused_geglu"]
launch, pre, tuning = fg.launch, fg.precompiled, fg.tuning
T90 = GPUTarget("cuda", 90, 32)

# What the Launcher hands the lookup on its first call (the real Launcher, the launch
# itself stubbed: there is no GPU), for the same host call precompile recorded.
seen = []
real_find = pre.find
launch.Launcher._launch_through_triton = lambda self, grid, args: None
launch.current_device_and_stream = lambda: (0, 0)
launch._stream_getters = lambda: (lambda: 0, lambda device: 0)
launch.COMPILE_OPTIONS = {"enable_fp_fusion": True, "enable_reflect_ftz": False}
cpu = torch.device("cpu")
launch._SM_COUNT[cpu] = 132
tuning.set_table(cpu, tuning.SHIPPED["NVIDIA H200"])
H, I = 2048, 16384


def launch_of(M, dtype=torch.bfloat16):
    seen.clear()
    w = [torch.empty(I, H, dtype=dtype), torch.empty(I, H, dtype=dtype),
         torch.empty(H, I, dtype=dtype)]
    x, o = torch.empty(M, H, dtype=dtype), torch.empty(M, H, dtype=dtype)
    pre.find = lambda kernel, args, kwargs: seen.append((kernel, args, kwargs))
    try:
        fg.one_launch.one_launch_mlp(x, *w, o, fg.gemm.GELU_TANH)
    finally:
        pre.find = real_find
    assert len(seen) == 1, seen
    return seen[0]


kernel, args, kwargs = launch_of(1)
res = {}
binary = pre.find(kernel, args, kwargs, target=T90, root=out)
res["hit"] = binary is not None
if binary is not None:
    folder = os.path.join(out, pre.triton.__version__, "cuda90",
                          kernel.__name__)
    with open(os.path.join(folder, binary.key + ".xz"), "rb") as f:
        res["hit_is_the_file"] = binary.cubin == lzma.decompress(f.read())
    res["hit_num_warps"] = binary.num_warps == kwargs["num_warps"]
    res["hit_not_loaded"] = binary.function is None  # loads on the GPU, at first launch
res["other_arch"] = pre.find(kernel, args, kwargs, target=GPUTarget("cuda", 89, 32), root=out)
res["other_warp_size"] = pre.find(kernel, args, kwargs, target=GPUTarget("cuda", 90, 64), root=out)
res["hip"] = pre.find(kernel, args, kwargs, target=GPUTarget("hip", "gfx942", 64), root=out)
res["two_tokens"] = pre.find(kernel, *launch_of(2)[1:], target=T90, root=out)
res["sixteen_tokens"] = pre.find(kernel, *launch_of(16)[1:], target=T90, root=out)
res["fp16"] = pre.find(kernel, *launch_of(1, torch.float16)[1:], target=T90, root=out)
res["num_warps"] = pre.find(kernel, args, {**kwargs, "num_warps": kwargs["num_warps"] // 2},
                            target=T90, root=out)
res["num_stages"] = pre.find(kernel, args, {**kwargs, "num_stages": 1}, target=T90, root=out)
res["constexpr"] = pre.find(kernel, args, {**kwargs, "EVEN_K": not kwargs["EVEN_K"]},
                            target=T90, root=out)
res["fp_fusion"] = pre.find(kernel, args, {**kwargs, "enable_fp_fusion": False},
                            target=T90, root=out)
misaligned = list(args)
misaligned[1] = torch.empty(I * H + 8, dtype=torch.bfloat16)[8:]  # 16 bytes off: still D
misaligned[2] = torch.empty(I * H + 1, dtype=torch.bfloat16)[1:]  # 2 bytes off
res["unaligned_weight"] = pre.find(kernel, tuple(misaligned), kwargs, target=T90, root=out)
# the kernel's source changed: its cache_key (source and dependencies) differs
saved_hash = kernel.hash
kernel.hash = "0" * 64
res["changed_source"] = pre.find(kernel, args, kwargs, target=T90, root=out)
kernel.hash = saved_hash
# another ptxas bundled with this Triton version, or a user's ptxas
pre._TOOLCHAIN[1] = pre._TOOLCHAIN[1] + [["ptxas", 1]]
res["other_build"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre._TOOLCHAIN.clear()
users_ptxas = os.environ.get("TRITON_PTXAS_PATH")  # the GPU machine's override, kept
os.environ["TRITON_PTXAS_PATH"] = "/usr/bin/true"
res["user_ptxas"] = pre.find(kernel, args, kwargs, target=T90, root=out)
if users_ptxas is None:
    del os.environ["TRITON_PTXAS_PATH"]
else:
    os.environ["TRITON_PTXAS_PATH"] = users_ptxas
# a compiler hook the user set
pre.triton.knobs.runtime.jit_cache_hook = lambda *a, **k: None
res["hooked"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.triton.knobs.runtime.jit_cache_hook = None
# Triton's cache-invalidating environment (e.g. TRITON_DEFAULT_FP_FUSION)
real_env = pre.artifact_key
pre.artifact_key = lambda s, o, t, e: real_env(s, o, t, {"TRITON_DEFAULT_FP_FUSION": "0"})
res["env_var"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.artifact_key = real_env
# a Triton series whose JITFunction.run was not checked (a future one), and another
# version's artifacts only
real_series = pre.series
pre.series = lambda version=None: "3.10"
res["unchecked_series"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.series = real_series
pre.ENABLED = False
res["disabled"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.ENABLED = True
# an artifact is read once per process: each later find of it (another launcher of the
# same specialisation) gets its own kernel object (a module per device) from memory
if binary is not None:
    with open(os.path.join(folder, binary.key + ".xz"), "wb") as f:
        f.write(b"not read again")
again = pre.find(kernel, args, kwargs, target=T90, root=out)
res["hit_again"] = again is not None and again is not binary and again.cubin == binary.cubin
os.rename(os.path.join(out, pre.triton.__version__), os.path.join(out, "0.0.0"))
pre._LISTINGS.clear()
res["other_version"] = pre.find(kernel, args, kwargs, target=T90, root=out)
res = {k: (v if isinstance(v, bool) else v is None and "JIT" or "LOADED") for k, v in res.items()}
print(json.dumps(res))
"""


def test_lookup_only_for_the_launch_compiled(tmp_path):
    done = run_python(
        f"import sys; sys.argv = ['', {str(tmp_path)!r}, {str(ROOT)!r}]\n" + _LOOKUP,
        TRITON_INTERPRET=None,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    hits = ("hit", "hit_is_the_file", "hit_num_warps", "hit_not_loaded", "hit_again")
    assert {k: res.pop(k) for k in hits} == dict.fromkeys(hits, True)
    assert res == dict.fromkeys(res, "JIT") and len(res) == 19, res


def test_the_build_ships_the_artifacts():
    """build.toml's pyext takes the artifacts' files (scripts/build.py copies them into
    build/torch-cuda only)."""
    import tomllib

    pyext = tomllib.loads((ROOT / "build.toml").read_text())["torch-noarch"]["pyext"]
    assert {"py", "json", "xz"} <= set(pyext)
    assert "precompiled" in (ROOT / "scripts" / "build.py").read_text()


def test_the_interpreter_never_looks_up(fused_geglu, monkeypatch):
    """Under TRITON_INTERPRET the Launcher runs the kernel's Python: no artifact."""
    import torch

    if not fused_geglu.launch.INTERPRETED:
        return  # a GPU run: the lookup is the point there

    def refuse(*args, **kwargs):
        raise AssertionError("the interpreter consulted precompiled kernels")

    monkeypatch.setattr(fused_geglu.precompiled, "find", refuse)
    gate, up = torch.randn(4, 64), torch.randn(4, 64)
    out = torch.empty_like(gate)
    fused_geglu.elementwise.geglu_forward(gate, up, out, "tanh")
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(out, expected)
    launcher = fused_geglu.launch.Launcher(
        fused_geglu.activation.geglu_fwd_kernel,
        {"APPROX_TANH": True, "BLOCK_M": 1, "BLOCK_N": 64, "INT64": False,
         "num_warps": 4, "num_stages": 1},
    )  # fmt: skip
    assert not launcher._launch_precompiled(
        1, (gate, up, out, 1, 256, 0, 1, 0, 1, 0, 1)
    )


_ABI = """
import ctypes, importlib.util, json, re, sys
import torch
import triton
from triton.backends.compiler import GPUTarget

spec = importlib.util.spec_from_file_location("precompile", sys.argv[1] + "/scripts/precompile.py")
pc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pc)
fg = pc.load_package(pc.ROOT / "build" / "torch-cuda")
pre, cubin = fg.precompiled, fg.cubin
T90 = GPUTarget("cuda", 90, 32)
launches = {}
pc.record_launches(
    fg, pc.GPUS[90][:1], [torch.bfloat16], [(256, 1024)], [1, 100],
    lambda kernel, args, kwargs: launches.setdefault(kernel.__name__, (kernel, args, kwargs)),
)
SIZES = {"8": 1, "16": 2, "32": 4, "64": 8}
CODES = {"b": 1, "h": 2, "i": 4, "l": 8, "B": 1, "H": 2, "I": 4, "K": 8, "f": 4, "d": 8, "O": 8}


def ptx_params(ptx, name):
    # the .entry's parameters: (bytes, alignment) each
    head = ptx[ptx.index(f".entry {name}("):]
    head = head[: head.index(")")]
    out = []
    for m in re.finditer(r"\\.param\\s+(?:\\.align\\s+(\\d+)\\s+)?\\.[a-z]+(\\d+)\\b[^,\\n]*?(?:\\[(\\d+)\\])?\\s*(?:,|$)", head, re.M):
        out.append((SIZES[m.group(2)] * int(m.group(3) or 1), int(m.group(1) or 0)))
    return out


class FakeCuda:
    def __init__(self):
        self.encoded = []

    def cuTensorMapEncodeTiled(self, out, dtype, rank, address, dims, strides, box, ones, *modes):
        self.encoded.append([dtype, rank, address, list(dims[:rank]), list(strides[:rank - 1]),
                             list(box[:rank]), list(ones[:rank]), list(modes)])
        return 0


res = {}
for name, (kernel, args, kwargs) in sorted(launches.items()):
    src, options, _ = pre.specialize(kernel, T90, args, kwargs)
    binary = triton.compile(src, target=T90, options=options.__dict__)
    meta = json.loads(open(next(p for n, p in binary.metadata_group.items() if n.endswith(".json"))).read())
    assert cubin.refusal(src.signature, meta) is None, (name, cubin.refusal(src.signature, meta))
    kc = cubin.CubinKernel("k", src.signature, meta, binary.asm["cubin"])
    values = fg.launch.Launcher(kernel, kwargs).values
    expected = ptx_params(binary.asm["ptx"], meta["name"])
    row = {"ptx": expected}
    if kc.tma:
        fake = FakeCuda()
        cubin._CUDA[:] = [fake]
        passed = kc.tma_values((*args, *values))
        row["passed"] = [(ctypes.sizeof(v), 64 if isinstance(v, cubin._TensorMap) else 0) for v in passed]
        descs = [a for a in args if type(a).__name__ == "TensorDescriptor"]
        row["encoded"] = fake.encoded
        row["descriptors"] = [[list(d.shape), list(d.strides), list(d.block_shape), d.base.data_ptr(), d.base.element_size()] for d in descs]
        row["meta"] = meta["tensordesc_meta"]
    else:
        seen = []
        kc.launch = lambda *call: seen.append(call)
        kc.run(3, 1, 1, 7, 11, None, None, None, None, *args, *values)
        function, gx, gy, gz, warps, shared, codes, passed, stream = seen[0]
        row["passed"] = [(CODES[c], 0) for c in codes]
        row["call"] = [function, gx, warps == meta["num_warps"], shared == meta["shared"], stream]
        kept = [a for a, ty in zip(args, src.signature.values()) if ty != "constexpr"]
        row["same_args"] = all(p is a for p, a in zip(passed, kept)) and passed[len(kept):] == (None,) * (len(codes) - len(kept))
    res[name] = row
print(json.dumps(res))
"""


def test_launch_matches_the_compiled_parameters():
    """cubin.py passes each kernel the parameters its PTX declares, in order and size
    (pointers, scalars, 128-byte tensor maps aligned to 64, the scratch pointers), and
    encodes each TMA descriptor as Triton's launcher does: dims, byte strides and box
    innermost first, Triton's element type mapped to CUDA's, the compiled swizzle, 128-byte
    L2 promotion. Compiles one launch of each kernel the route makes for sm_90 on the CPU."""
    done = run_python(
        f"import sys; sys.argv = ['', {str(ROOT)!r}]\n" + _ABI, TRITON_INTERPRET=None
    )
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"one_launch_mlp_kernel", "gemm_kernel", "gemm_tma_kernel"} <= set(res), res
    for name, row in res.items():
        sizes = [size for size, _ in row["ptx"]]
        assert [size for size, _ in row["passed"]] == sizes, (name, row)
        for (size, align), (_, ptx_align) in zip(row["passed"], row["ptx"]):
            assert size != 128 or (align == ptx_align == 64), (name, row)
        if "call" in row:
            assert row["call"] == [11, 3, True, True, 7] and row["same_args"], (
                name,
                row,
            )
    tma = res["gemm_tma_kernel"]
    assert len(tma["encoded"]) == len(tma["descriptors"]) == len(tma["meta"]) >= 3
    host_dtype = {8: 10, 9: 8, 10: 9}
    for encoded, (shape, strides, block, address, elem), meta in zip(
        tma["encoded"], tma["descriptors"], tma["meta"]
    ):
        dtype, rank, base, dims, byte_strides, box, ones, modes = encoded
        assert dtype == host_dtype.get(meta["elem_type"], meta["elem_type"])
        assert (rank, base, dims) == (len(shape), address, shape[::-1])
        assert (
            byte_strides == [elem * s for s in strides[:-1]][::-1] and strides[-1] == 1
        )
        # the compiled box: the descriptor's block, its inner dim cut to the swizzle width
        assert box == meta["block_size"][::-1] and len(block) == rank
        assert ones == [1] * rank and modes == [0, meta["swizzle"], 2, 0]


_FRESH_GPU_PROCESS = """
import importlib.util, json, os, sys
import torch
import triton

out, root = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("precompile", root + "/scripts/precompile.py")
pc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pc)
sys.modules["precompile"] = pc  # its forked workers' jobs name it
toolkit = pc.load_package(pc.ROOT / "build" / "torch-cuda").launch.TOOLKIT_LIBDEVICE
for name in [m for m in sys.modules if m.split(".")[0] == "fused_geglu"]:
    del sys.modules[name]  # main loads the package afresh
major, minor = torch.cuda.get_device_capability()
# this GPU's launches of a 256 x 1024 GeGLU MLP at 1 and 100 tokens, compiled on the CPU
assert pc.main(["--out", out, "--arch", str(10 * major + minor), "--dtype", "bf16",
                "--model", "256x1024", "--tokens", "1", "100", "--jobs", "4",
                *(["--libdevice", toolkit] if toolkit else [])]) == 0
fg = sys.modules["fused_geglu"]
pre = fg.precompiled
pre.ROOT = out
lookups = []
real_find = pre.find


def find(kernel, *args, **kwargs):
    found = real_find(kernel, *args, **kwargs)
    lookups.append([kernel.__name__, found is not None])
    return found


pre.find = find


def cache_files():
    return sum(len(f) for _, _, f in os.walk(os.environ["TRITON_CACHE_DIR"]))


compiled_here = cache_files()  # what compiling the artifacts left there
from transformers import GemmaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP

torch.manual_seed(0)
config = GemmaConfig(hidden_size=256, intermediate_size=1024, hidden_act="gelu_pytorch_tanh")
mlp = GemmaMLP(config).to("cuda", torch.bfloat16).eval()
layer = fg.layers.GeGLUMLP.forward.__get__(mlp)
xs = {m: torch.randn(m, 256, device="cuda", dtype=torch.bfloat16) for m in (1, 100)}


def outputs():
    with torch.no_grad():
        # the second 1-token call: the direct launch with the weights' addresses
        return [layer(xs[1]), layer(xs[1]), layer(xs[100])]


loaded = outputs()
torch.cuda.synchronize()
res = {
    "lookups": list(lookups),  # before the JIT pass below
    "triton_driver_started": triton.runtime.driver._active is not None,
    "triton_cache_files_added": cache_files() - compiled_here,
    # cuBLAS set up for the module's dtype at its first call (launch.prepare_cublas)
    "cublas_prepared": [[str(d), str(t)] for d, t in fg.launch._CUBLAS_READY],
}
# Another Triton version's artifacts only: every lookup of new launchers misses and
# Triton's JIT compiles them (the fallback)
os.rename(os.path.join(out, triton.__version__), os.path.join(out, "0.0.0"))
pre._LISTINGS.clear()
fg.launch.clear_plans()
lookups.clear()
jit = outputs()
res["fallback_lookups"] = list(lookups)
res["bitwise_100"] = torch.equal(loaded[2], jit[2])
res["max_diff_1"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(loaded[:2], jit[:2]))
res["scale_1"] = float(jit[0].float().abs().max())
print(json.dumps(res))
"""


@pytest.mark.skipif(not HAS_GPU, reason="launches precompiled kernels on a GPU")
def test_fresh_process_runs_precompiled_kernels_without_triton(tmp_path):
    """In a fresh process, a layer whose launches were all precompiled (on the CPU)
    compiles nothing (Triton's cache unchanged) and never starts Triton's driver (whose
    first use compiles C). With another Triton version's artifacts only, every lookup
    misses and Triton's JIT runs instead, giving the same result: bit for bit at 100 tokens,
    and within the reordered fp32 additions of the one-launch decode MLP at 1 token. Its
    first call set cuBLAS up for the module's dtype (launch.prepare_cublas)."""
    done = run_python(
        f"import sys; sys.argv = ['', {str(tmp_path / 'pre')!r}, {str(ROOT)!r}]\n"
        + _FRESH_GPU_PROCESS,
        TRITON_CACHE_DIR=str(tmp_path / "triton-cache"),
        FUSED_GEGLU_PRECOMPILED=None,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    names = {name for name, _ in res["lookups"]}
    assert {"one_launch_mlp_kernel", "gemm_tma_kernel"} <= names, res
    assert all(hit for _, hit in res["lookups"]), res
    assert not res["triton_driver_started"], res
    assert res["triton_cache_files_added"] == 0, res
    assert res["cublas_prepared"] == [["cuda:0", "torch.bfloat16"]], res
    fallback_hits = [hit for _, hit in res["fallback_lookups"]]
    assert fallback_hits and not any(fallback_hits), res
    assert res["bitwise_100"], res
    assert res["max_diff_1"] <= 2**-7 * res["scale_1"], res
