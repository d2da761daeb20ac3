"""Precompiled kernels (docs/precompiled.md): the lookup loads an artifact only for the
launch it was compiled for (this Triton, this GPU, this kernel source, this
specialisation and these options) and answers None (JIT) for anything else; the
interpreter never consults it. Runs on the CPU: one artifact is compiled for sm_90 by
scripts/precompile.py into a temporary folder, then looked up."""

import json

from conftest import ROOT, run_python

_LOOKUP = """
import importlib.util, json, os, shutil, sys
import torch
from triton.backends.compiler import GPUTarget

out = sys.argv[1]
spec = importlib.util.spec_from_file_location("precompile", sys.argv[2] + "/scripts/precompile.py")
pc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pc)
# one launch: the H200 table's decode MLP, bf16, one token of a 2048 x 16384 MLP
assert pc.main(["--out", out, "--smoke", "--tokens", "1", "--table", "NVIDIA H200",
                "--dtype", "bf16", "--model", "2048x16384", "--jobs", "1"]) == 0
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
    with open(os.path.join(folder, binary.hash + ".cubin"), "rb") as f:
        res["hit_is_the_file"] = binary.asm["cubin"] == f.read()
    res["hit_num_warps"] = binary.metadata.num_warps == kwargs["num_warps"]
    res["hit_not_loaded"] = binary.module is None  # loads on the GPU, at first launch
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
# another build of this Triton version (its compiler binaries), or a user's ptxas
pre._TOOLCHAIN[1] = pre._TOOLCHAIN[1] + [["libtriton.so", 1]]
res["other_build"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre._TOOLCHAIN.clear()
os.environ["TRITON_PTXAS_PATH"] = "/usr/bin/true"
res["user_ptxas"] = pre.find(kernel, args, kwargs, target=T90, root=out)
del os.environ["TRITON_PTXAS_PATH"]
# a compiler hook the user set
pre.triton.knobs.runtime.jit_cache_hook = lambda *a, **k: None
res["hooked"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.triton.knobs.runtime.jit_cache_hook = None
# Triton's cache-invalidating environment (e.g. TRITON_DEFAULT_FP_FUSION)
real_env = pre.artifact_key
pre.artifact_key = lambda s, o, t, e: real_env(s, o, t, {"TRITON_DEFAULT_FP_FUSION": "0"})
res["env_var"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.artifact_key = real_env
# a Triton series whose JITFunction.run was not checked (3.6), and another version's
# artifacts only
real_series = pre.series
pre.series = lambda version=None: "3.6"
res["unchecked_series"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.series = real_series
pre.ENABLED = False
res["disabled"] = pre.find(kernel, args, kwargs, target=T90, root=out)
pre.ENABLED = True
res["hit_again"] = pre.find(kernel, args, kwargs, target=T90, root=out) is not None
os.rename(os.path.join(out, pre.triton.__version__), os.path.join(out, "3.8.0"))
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
    assert {"py", "json", "cubin"} <= set(pyext)
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
