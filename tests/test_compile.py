"""Every kernel compiles for a Hopper GPU (CUDA sm_90) on this machine, GPU or not: Triton's
whole pipeline down to a cubin, for the flag and tile combinations the host code launches.
The interpreter runs a kernel's Python, not Triton's code generator, so a kernel that only
the compiler refuses (a helper whose returns differ in type between constexpr branches)
would otherwise first fail on a GPU."""

import json

from conftest import ROOT, run_python

# Runs without TRITON_INTERPRET: the package imported as on a GPU machine (its GPU math and
# configurations), each case compiled for GPUTarget("cuda", 90, 32). A case is a kernel and
# its arguments: CPU tensors and ints stand for the launch's (what Triton specialises on:
# dtypes, 16-byte alignment, values 1), descriptors from TensorDescriptor.from_tensor.
_COMPILE_ALL = """
import dataclasses, importlib.util, json, multiprocessing, os, sys, time
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource, compile
from triton.tools.tensor_descriptor import TensorDescriptor
from triton._C.libtriton import native_specialize_impl

tree = sys.argv[1] + "/build/torch-cuda"
spec = importlib.util.spec_from_file_location(
    "fused_geglu", tree + "/__init__.py", submodule_search_locations=[tree]
)
fg = importlib.util.module_from_spec(spec)
sys.modules["fused_geglu"] = fg
spec.loader.exec_module(fg)
act, gk, gemm, tuning = fg.activation, fg.gemm_kernels, fg.gemm, fg.tuning
f8k, f8g = fg.fp8.kernels, fg.fp8.gemm
# The launch tables of a GPU with 132 SMs (the H100's and H200's), the H200's unless a
# case names the H100's.
dev = torch.device("cuda", 0)
fg.launch._SM_COUNT[dev] = 132
H200, H100 = tuning.SHIPPED["NVIDIA H200"], tuning.SHIPPED["NVIDIA H100 80GB HBM3"]
tuning.set_table(dev, H200)
TARGET = GPUTarget("cuda", 90, 32)
BACKEND = CUDABackend(TARGET)
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
fp8 = torch.float8_e4m3fn


def compiled(kernel, args: dict, constexprs: dict, options: dict) -> None:
    signature, values, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name], values[(i,)] = "constexpr", constexprs[p.name]
            continue
        value = args[p.name]
        if value is None:
            signature[p.name], values[(i,)] = "constexpr", None
            continue
        # (type, specialisation) as in a launch: an int equal to 1 becomes the constexpr 1,
        # 16-byte-aligned pointers and multiples of 16 get their divisibility attribute
        # (without it loads do not vectorise, and registers and spills differ)
        kind, key = native_specialize_impl(BACKEND, value, False, True, True)
        signature[p.name] = kind
        if kind == "constexpr":
            values[(i,)] = value
        elif isinstance(key, str):
            attrs[(i,)] = BACKEND.parse_attr(key)
    src = ASTSource(fn=kernel, signature=signature, constexprs=values, attrs=attrs)
    binary = compile(src, target=TARGET, options=options)
    assert binary.asm["cubin"], "no cubin"


def t(*shape, dtype=bf16):
    return torch.zeros(shape, dtype=dtype)


def elementwise(kernel, dtype, tanh, tile, int64):
    block_m, block_n, warps = tile
    names = [p.name for p in kernel.params if not p.is_constexpr]
    args = {n: (t(64, dtype=dtype) if n.endswith("_ptr") else 1 << 20) for n in names}
    args |= {"M": 4096, "N": 256}
    consts = {"APPROX_TANH": tanh, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "INT64": int64}
    return kernel, args, consts, {"num_warps": warps}


def common_gemm_args(names, M, N, K, dtype, a_dtype, c_dtype, epi, split):
    # The arguments both portable kernels take (pointers, strides, the split's scratch).
    args = {n: None for n in names}
    args |= {"a_ptr": t(64, dtype=a_dtype), "b_ptr": t(64, dtype=dtype),
             "c_ptr": t(64, dtype=c_dtype), "M": M, "N": N, "K": K}
    args |= {n: 4096 for n in names if n.startswith("stride_")}
    args |= {"stride_ak": 1, "stride_bk": 1, "stride_cn": 1, "stride_buk": 1,
             "stride_zk": 1, "stride_bias": 1, "stride_bias_up": 1}
    args = {n: v for n, v in args.items() if n in names}
    if epi.gated:
        args["b_up_ptr"] = t(64, dtype=dtype)
    if epi.has_bias:
        args["bias_ptr"] = t(64, dtype=dtype)
        args["bias_up_ptr"] = t(64, dtype=dtype) if epi.gated else None
    if split > 1:
        args["ws_ptr"], args["counters_ptr"] = t(64, dtype=fp32), t(64, dtype=torch.int32)
    return args


def portable_gemm(M, N, K, dtype, epi, split=1):
    cfg = tuning.gemm_config(M, N, dtype, dev, epi.gated, False, False)
    names = [p.name for p in gk.gemm_kernel.params if not p.is_constexpr]
    args = common_gemm_args(names, M, N, K, dtype, dtype, dtype, epi, split)
    if epi.store_preact:
        args["preact_ptr"] = t(64, dtype=dtype)
        args["preact_up_ptr"] = t(64, dtype=dtype) if epi.gated else None
    if epi.dact:
        args["z_ptr"] = t(64, dtype=dtype)
    if epi.bias_grad:
        args["bias_grad_ptr"] = t(64, dtype=fp32)
    consts = {**epi.constexprs(), **cfg.constexprs(), "SPLIT_K": split,
              "EVEN_K": K % cfg.block_k == 0,
              "INPUT_PRECISION": gemm.input_precision(dtype)}
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages")}
    return gk.gemm_kernel, args, consts, options


def fp8_scales(epi):
    # The scale pointers an FP8 GEMM reads and writes (fp32).
    return {"a_scale_ptr": t(64, dtype=fp32), "b_scale_ptr": t(64, dtype=fp32),
            "b_up_scale_ptr": t(64, dtype=fp32) if epi.gated else None,
            "c_scale_ptr": t(64, dtype=fp32) if epi.quant_out else None,
            "stride_bsn": 16, "stride_bsk": 1, "stride_cs": 64 if epi.quant_out else None}


def portable_fp8_gemm(M, N, K, epi, split=1, quant_a=False, b_tma=False, up_first=None):
    # quant_a: A in bf16, quantized in the K loop; b_tma: B's descriptors; up_first (with
    # both, gated): one descriptor over both weights (STACKED)
    swap = tuning.fp8_swap_ab(M, N, epi.gated, quant_a, dev, b_tma)
    cfg = tuning.fp8_config(M, epi.gated, False, swap, b_tma)
    names = [p.name for p in f8k.gemm_fp8_kernel.params if not p.is_constexpr]
    c_dtype = fp8 if epi.quant_out else bf16
    args = common_gemm_args(names, M, N, K, fp8, bf16 if quant_a else fp8, c_dtype, epi,
                            split)  # fmt: skip
    args |= fp8_scales(epi)
    if quant_a:
        args["a_scale_ptr"] = None
    if epi.clear:
        args["clear_ptr"] = t(epi.clear, dtype=torch.int32)
    stacked = up_first is not None
    if stacked:
        args["b_ptr"] = TensorDescriptor.from_tensor(
            t(2, N, K, dtype=fp8), [2, cfg.block_n, cfg.block_k])
        args["b_up_ptr"] = None
    elif b_tma:
        box = [cfg.block_n, cfg.block_k]
        for name in ("b_ptr", "b_up_ptr") if epi.gated else ("b_ptr",):
            args[name] = TensorDescriptor.from_tensor(t(N, K, dtype=fp8), box)
    consts = {**epi.constexprs(), **cfg.constexprs(), "SPLIT_K": split,
              "QUANT_A": quant_a, "CLEAR": epi.clear,
              "SWAP_AB": swap, "B_TMA": b_tma, "STACKED": stacked,
              "UP_FIRST": bool(up_first),
              "EVEN_K": K % cfg.block_k == 0,
              "INPUT_PRECISION": gemm.input_precision(fp8)}
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages")}
    if stacked:
        options["num_stages"] = f8g.stacked_stages(cfg)
    return f8k.gemm_fp8_kernel, args, consts, options


def tma_descs(M, N, K, dtype, c_dtype, cfg, gated, boxes, a_t=False, b_t=False):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    a_block = [bk, bm] if a_t else [bm, bk]
    if gated:
        b_desc = TensorDescriptor.from_tensor(t(2, N, K, dtype=dtype), [boxes, bn, bk])
    else:
        b_desc = TensorDescriptor.from_tensor(t(N, K, dtype=dtype),
                                              [bk, bn] if b_t else [bn, bk])
    return {
        "a_desc": TensorDescriptor.from_tensor(t(M, K, dtype=dtype), a_block),
        "b_desc": b_desc,
        "c_desc": TensorDescriptor.from_tensor(t(M, N, dtype=c_dtype), [bm, bn]),
    }


def tma_gemm(M, N, K, dtype, epi, a_t=False, b_t=False):
    extra = epi.dact != gemm.NO_ACT or epi.accumulate or (epi.store_preact and not epi.gated)
    cfg = tuning.gemm_config(M, N, dtype, dev, epi.gated, True, extra)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    args = tma_descs(M, N, K, dtype, dtype, cfg, epi.gated, 2, a_t, b_t)
    args |= {
        "z_desc": TensorDescriptor.from_tensor(t(M, K, dtype=dtype), [bk, bm] if a_t else [bm, bk])
        if epi.dact else None,
        "bias_ptr": t(64, dtype=dtype) if epi.has_bias else None,
        "bias_up_ptr": t(64, dtype=dtype) if epi.has_bias and epi.gated else None,
        "preact_ptr": t(64, dtype=dtype) if epi.store_preact else None,
        "preact_up_ptr": None,
        "bias_grad_ptr": t(64, dtype=fp32) if epi.bias_grad else None,
        "M": M, "N": N, "K": K, "stride_bias": 1, "stride_bias_up": 1,
    }
    if epi.store_preact and epi.gated:  # the stored gate and up leave through TMA
        args["preact_ptr"], args["preact_up_ptr"] = (
            TensorDescriptor.from_tensor(t(M, N, dtype=dtype), [bm, bn]) for _ in range(2)
        )
    consts = {**epi.constexprs(), **cfg.constexprs(), "A_T": a_t, "B_T": b_t,
              "UP_FIRST": False, "INPUT_PRECISION": gemm.input_precision(dtype)}
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages")}
    return gk.gemm_tma_kernel, args, consts, options


def tma_fp8_gemm(M, N, K, epi):
    cfg = tuning.fp8_config(M, epi.gated, True, False, False)
    c_dtype = fp8 if epi.quant_out else bf16
    # one dot per weight: two boxes of one descriptor (gemm.stacked_weights)
    args = tma_descs(M, N, K, fp8, c_dtype, cfg, epi.gated, 1)
    args |= {
        "bias_ptr": t(64, dtype=bf16) if epi.has_bias else None,
        "bias_up_ptr": t(64, dtype=bf16) if epi.has_bias and epi.gated else None,
        "M": M, "N": N, "K": K, "stride_bias": 1, "stride_bias_up": 1,
        **fp8_scales(epi),
    }
    consts = {**epi.constexprs(), **cfg.constexprs(), "A_T": False, "B_T": False,
              "UP_FIRST": False, "INPUT_PRECISION": gemm.input_precision(fp8)}
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages")}
    return f8k.gemm_fp8_tma_kernel, args, consts, options


def decode_mlp(H, I, N, dtype, bias, fp8_weights=False, table=H200):
    with tuning.use(dev, table):
        cfg = tuning.one_launch_config(I, dtype, dev, fp8_weights)
    kernel = f8k.one_launch_mlp_fp8_kernel if fp8_weights else gk.one_launch_mlp_kernel
    names = [p.name for p in kernel.params if not p.is_constexpr]
    args = {n: t(64, dtype=dtype) for n in names if n.endswith("_ptr")}
    args |= {"sums_ptr": t(64, dtype=fp32), "arrivals_ptr": t(1, dtype=torch.int32)}
    if fp8_weights:
        scales = ("gate_scale_ptr", "up_scale_ptr", "down_scale_ptr")
        args |= {n: t(64, dtype=fp32) for n in scales}
        args |= {n: t(64, dtype=fp8) for n in ("w_gate_ptr", "w_up_ptr", "w_down_ptr")}
    if not bias:
        args |= {"bias_gate_ptr": None, "bias_up_ptr": None, "bias_down_ptr": None}
    args |= {n: H for n in names if n.startswith("stride_")}
    args |= {"stride_xk": 1, "stride_gk": 1, "stride_uk": 1, "stride_dk": 1,
             "stride_on": 1, "stride_bias_gate": 1, "stride_bias_up": 1,
             "stride_bias_down": 1, "M": 3, "H": H, "I": I, "N": N}
    if fp8_weights:
        args |= {"stride_gsk": 1, "stride_dsk": 1}
    consts = {"HAS_BIAS": bias, "HAS_DOWN_BIAS": bias, "ACTIVATION": gemm.GELU_TANH,
              "EVEN_K": H % cfg["BLOCK_K"] == 0, "BLOCK_M": tuning.ONE_LAUNCH_MAX_TOKENS,
              "INPUT_PRECISION": gemm.input_precision(dtype), **cfg}
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages")}
    return kernel, args, consts, options


E, F8 = gemm.Epilogue, f8g.FP8Epilogue
flat_fwd = (1, *tuning.flat_tile(dev, backward=False))
flat_bwd = (1, *tuning.flat_tile(dev, backward=True))
CASES = {
    "geglu forward, tanh, bf16, flat": elementwise(act.geglu_fwd_kernel, bf16, True, flat_fwd, False),
    "geglu forward, exact, fp32, rows, int64": elementwise(
        act.geglu_fwd_kernel, fp32, False, tuning.row_tile_config(13824, 4, dev), True),
    "geglu backward, tanh, bf16, flat": elementwise(act.geglu_bwd_kernel, bf16, True, flat_bwd, False),
    "geglu backward, exact, fp16, rows": elementwise(
        act.geglu_bwd_kernel, fp16, False, tuning.row_tile_config(512, 2, dev), False),
    "gemm decode, gated tanh, split 4": portable_gemm(
        1, 16384, 2048, bf16, E(activation=gemm.GELU_TANH, gated=True), split=4),
    "gemm 32 rows, exact + bias + preact, uneven K": portable_gemm(
        32, 4096, 1000, fp16, E(activation=gemm.GELU, store_preact=True, has_bias=True)),
    "gemm portable, dact + accumulate, fp32": portable_gemm(
        4096, 1024, 1024, fp32, E(dact=gemm.GELU, accumulate=True)),
    "gemm portable, weight gradient + bias gradient": portable_gemm(
        4096, 1024, 1024, bf16, E(bias_grad=True)),
    "tma dual gemm, tanh + bias + preacts": tma_gemm(
        8192, 16384, 2048, bf16, E(activation=gemm.GELU_TANH, gated=True,
                                    store_preact=True, has_bias=True)),
    "tma gemm, dact exact, A transposed, bias gradient": tma_gemm(
        2048, 16384, 8192, bf16, E(dact=gemm.GELU, bias_grad=True), a_t=True),
    "tma gemm, accumulate, B transposed": tma_gemm(
        8192, 2048, 16384, fp16, E(accumulate=True), b_t=True),
    "decode MLP, bf16, even K": decode_mlp(2048, 16384, 2048, bf16, False),
    "decode MLP, bf16, the H100's tiles": decode_mlp(2048, 16384, 2048, bf16, False, table=H100),
    "decode MLP, fp16, uneven K, biases": decode_mlp(1000, 3000, 1000, fp16, True),
    "fp8 quantize": (f8k.quantize_fp8_kernel, {"x_ptr": t(64), "up_ptr": None,
        "q_ptr": t(64, dtype=fp8), "s_ptr": t(64, dtype=fp32), "M": 4096, "K": 2048,
        "stride_xm": 2048, "stride_xk": 1, "stride_sk": 4096},
        {"BLOCK_M": 32, "BLOCK_K": 128, "ACTIVATION": 0}, {"num_warps": 4}),
    "fp8 quantize of geglu, padded scales": (f8k.quantize_fp8_kernel, {"x_ptr": t(64),
        "up_ptr": t(64), "q_ptr": t(64, dtype=fp8), "s_ptr": t(64, dtype=fp32),
        "M": 8190, "K": 16384, "stride_xm": 16384, "stride_xk": 1, "stride_sk": 8192},
        {"BLOCK_M": 32, "BLOCK_K": 128, "ACTIVATION": gemm.GELU_TANH}, {"num_warps": 4}),
    "fp8 decode MLP, biases": decode_mlp(2048, 16384, 2048, bf16, True, fp8_weights=True),
    "fp8 gemm 64 rows, gated, h quantized": portable_fp8_gemm(
        64, 16384, 2048, F8(activation=gemm.GELU_TANH, gated=True,
                                quant_out=True, act_bf16=True)),
    "fp8 gemm 64 rows, gated, h quantized, weights through TMA (swapped)": portable_fp8_gemm(
        64, 16384, 2048, F8(activation=gemm.GELU_TANH, gated=True,
                                quant_out=True, act_bf16=True), b_tma=True),
    "fp8 gemm decode, down, swapped, split 8": portable_fp8_gemm(
        16, 2048, 16384, F8(), split=8),
    "fp8 gemm 64 rows, down, weights through TMA, split 8": portable_fp8_gemm(
        64, 2048, 16384, F8(), split=8, b_tma=True),
    "fp8 gemm 256 rows, down, swapped, 128-token tiles, split 2": portable_fp8_gemm(
        256, 2048, 16384, F8(), split=2),
    "fp8 gemm decode, gated, x quantized in the loop, swapped, clears counters": portable_fp8_gemm(
        1, 16384, 2048, F8(activation=gemm.GELU_TANH, gated=True,
                               quant_out=True, act_bf16=True, clear=256), quant_a=True),
    "fp8 gemm decode, gated, x quantized in the loop, weights stacked": portable_fp8_gemm(
        16, 16384, 2048, F8(activation=gemm.GELU_TANH, gated=True,
                                quant_out=True, act_bf16=True, clear=256), quant_a=True,
        b_tma=True, up_first=False),
    "fp8 gemm 32 rows, gated, x quantized in the loop, weights stacked, up first": portable_fp8_gemm(
        32, 16384, 2048, F8(activation=gemm.GELU_TANH, gated=True,
                                quant_out=True, act_bf16=True, clear=256), quant_a=True,
        b_tma=True, up_first=True),
    "fp8 gemm 32 rows, gated, x quantized in the loop, weights through TMA": portable_fp8_gemm(
        32, 16384, 2048, F8(activation=gemm.GELU_TANH, gated=True,
                                quant_out=True, act_bf16=True, clear=256), quant_a=True,
        b_tma=True),
    "fp8 tma dual gemm, h quantized, bias": tma_fp8_gemm(
        8192, 16384, 2048, F8(activation=gemm.GELU, gated=True, has_bias=True,
                                  quant_out=True, act_bf16=True)),
    "fp8 tma gemm, down": tma_fp8_gemm(8192, 2048, 16384, F8()),
}
def compile_case(name):
    # None, or the case's error (the cases compile in forked workers, one per core)
    kernel, args, consts, options = CASES[name]
    start = time.perf_counter()
    try:
        compiled(kernel, args, consts, options)
        error = None
    except Exception as e:  # noqa: BLE001 (reported per case)
        cause = e.__cause__ or e
        error = f"{type(e).__name__}: {str(e)[-800:]} ({cause!r})"[-1500:]
    print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return error


with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
    results = dict(zip(CASES, pool.map(compile_case, list(CASES), chunksize=1)))
print(json.dumps(results))
"""


def test_every_kernel_compiles_for_hopper():
    done = run_python(
        f"import sys; sys.argv = ['', {str(ROOT)!r}]\n" + _COMPILE_ALL,
        TRITON_INTERPRET=None,
        TRITON_DEFAULT_FP_FUSION="1",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 28
    failed = {name: error for name, error in results.items() if error is not None}
    assert not failed, json.dumps(failed, indent=1)
