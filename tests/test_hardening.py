"""Hardening (issue 7): bad input fails at the Python boundary with a message that names
the shapes, dtypes and devices, never inside Triton; NaN, Inf and extreme values come out
where float64 puts them (rounded to the dtype where ours and eager round), never judged
against CPU float32 eager, whose erf-GeLU of +Inf is NaN on some x86 CPUs (see
``test_gelu_of_inf_is_platform_dependent_in_cpu_float32``); zero-size, one-element,
strided and zero-stride tensors (inputs and incoming gradients) work; the package source
makes no risky calls.

Stated semantics where float64 would say otherwise (in ``_special_refs``): the tanh gelu'
of |gate| > sqrt(float32 max) is NaN (float32's x * x overflows, in eager too); gelu and
gelu' computed in float32 may underflow or move an fp16 rounding tie (either is
accepted); the exact GeLU's 1 + erf cancels for gates below about -6, as eager's does.
"""

import copy
import math
import re
import textwrap
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_GPU, ROOT, run_python
from reference import (
    assert_same_bits,
    assert_within_erff_ulp,
    bit_for_bit,
    cast,
    check_against_float64,
    dtype_slack,
    eager_geglu,
    eager_geglu_linear,
    eager_geglu_mlp,
    eager_linear,
    fwd_bwd,
)
from torch import nn

INF, NAN = float("inf"), float("nan")
APPROX = ["tanh", "none"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GEMM_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])


# --- 1. Bad input: a clear error at the Python boundary ---------------------------------


def _rand(device, *shape, dtype=torch.float32):
    return torch.randn(shape, device=device).to(dtype)


# (id, call(fused_geglu, T) with T(*shape, dtype=...) a random tensor on the device,
#  exception type, regex the message must contain)
BAD_INPUT = [
    # geglu
    ("geglu-shapes", lambda f, T: f.geglu(T(4, 8), T(4, 7)), ValueError,
     r"geglu: gate and up must have the same shape, got \(4, 8\) and \(4, 7\)"),
    ("geglu-dtypes", lambda f, T: f.geglu(T(4, 8), T(4, 8, dtype=torch.float16)), TypeError,
     (r"expected up and gate to have the same dtype, but got gate.dtype = torch.float32 "
      r"and up.dtype = torch.float16 \(gate: shape \(4, 8\)")),
    ("geglu-devices", lambda f, T: f.geglu(T(4, 8), torch.empty(4, 8, device="meta")),
     ValueError, r"expected all tensors on one device, but gate is on \w+.* and up on meta"),
    ("geglu-float64", lambda f, T: f.geglu(T(4, 8, dtype=torch.float64), T(4, 8, dtype=torch.float64)),
     TypeError, r"dtype torch.float64 is not supported .*float64 is refused"),
    ("geglu-int", lambda f, T: f.geglu(T(4, 8, dtype=torch.int32), T(4, 8, dtype=torch.int32)),
     TypeError, r"geglu: dtype torch.int32 is not supported \(supported: bfloat16, float16, float32\)"),
    ("geglu-bool", lambda f, T: f.geglu(T(4, dtype=torch.bool), T(4, dtype=torch.bool)),
     TypeError, r"dtype torch.bool is not supported"),
    ("geglu-complex", lambda f, T: f.geglu(T(4, dtype=torch.complex64), T(4, dtype=torch.complex64)),
     TypeError, r"dtype torch.complex64 is not supported"),
    ("geglu-0d", lambda f, T: f.geglu(T(), T()), ValueError,
     r"geglu: gate and up must have at least one dimension, got shapes \(\) and \(\)"),
    ("geglu-list", lambda f, T: f.geglu([1.0, 2.0], T(2)), TypeError,
     r"geglu: gate must be a torch.Tensor, got list"),
    ("geglu-none", lambda f, T: f.geglu(T(2), None), TypeError,
     r"geglu: up must be a torch.Tensor, got NoneType"),
    ("geglu-sparse", lambda f, T: f.geglu(T(4, 8).to_sparse(), T(4, 8).to_sparse()), TypeError,
     r"geglu: gate must be a dense \(strided\) tensor, got layout torch.sparse_coo"),
    ("geglu-approximate", lambda f, T: f.geglu(T(4), T(4), "erf"), ValueError,
     r"geglu: approximate must be 'tanh' or 'none', got 'erf'"),
    ("geglu-approximate-none", lambda f, T: f.geglu(T(4), T(4), None), ValueError,
     r"approximate must be 'tanh' or 'none', got None"),
    # gelu_and_mul, gelu_tanh_and_mul
    ("gelu_and_mul-odd", lambda f, T: f.gelu_and_mul(T(4, 3), T(4, 7)), ValueError,
     r"gelu_and_mul: x must be \[\.\.\., 2d\] with an even last dim, got shape \(4, 7\)"),
    ("gelu_and_mul-out-shape", lambda f, T: f.gelu_and_mul(T(4, 8), T(4, 8)), ValueError,
     r"out must have shape \(4, 4\) for x of shape \(4, 8\), got \(4, 8\)"),
    ("gelu_and_mul-0d", lambda f, T: f.gelu_and_mul(T(), T()), ValueError, r"even last dim, got shape \(\)"),
    ("gelu_tanh_and_mul-dtypes", lambda f, T: f.gelu_tanh_and_mul(T(4, 4, dtype=torch.float16), T(4, 8)),
     TypeError, r"gelu_tanh_and_mul: expected x and out to have the same dtype"),
    ("gelu_tanh_and_mul-devices", lambda f, T: f.gelu_tanh_and_mul(torch.empty(4, 4, device="meta"), T(4, 8)),
     ValueError, r"out is on meta and x on"),
    ("gelu_tanh_and_mul-int", lambda f, T: f.gelu_tanh_and_mul(T(4, 4, dtype=torch.int8), T(4, 8, dtype=torch.int8)),
     TypeError, r"torch.int8 is not supported"),
    ("gelu_and_mul-out-none", lambda f, T: f.gelu_and_mul(None, T(4, 8)), TypeError,
     r"out must be a torch.Tensor, got NoneType"),
    ("gelu_and_mul-out-expanded", lambda f, T: f.gelu_and_mul(T(1, 4).expand(3, 4), T(3, 8)),
     ValueError, r"out has a zero stride \(strides \(0, 1\)"),
    # linear
    ("linear-in-features", lambda f, T: f.linear(T(4, 8), T(3, 7)), ValueError,
     r"linear: x's last dim must equal weight's in_features \(dim 1\), got x \(4, 8\) and weight \(3, 7\)"),
    ("linear-weight-1d", lambda f, T: f.linear(T(4, 8), T(8)), ValueError,
     r"weight must be 2-D \[out_features, in_features\], got shape \(8,\)"),
    ("linear-bias-length", lambda f, T: f.linear(T(4, 8), T(3, 8), T(4)), ValueError,
     r"linear: bias must have shape \(3,\), weight's out_features, got \(4,\)"),
    ("linear-bias-2d", lambda f, T: f.linear(T(4, 8), T(3, 8), T(1, 3)), ValueError,
     r"bias must have shape \(3,\).*got \(1, 3\)"),
    ("linear-0d", lambda f, T: f.linear(T(), T(3, 8)), ValueError, r"linear: x must be \[\.\.\., in_features\], got a 0-d"),
    ("linear-dtypes", lambda f, T: f.linear(T(4, 8), T(3, 8), T(3, dtype=torch.bfloat16)), TypeError,
     r"expected bias and x to have the same dtype, but got x.dtype = torch.float32 and bias.dtype = torch.bfloat16"),
    ("linear-devices", lambda f, T: f.linear(T(4, 8), torch.empty(3, 8, device="meta")), ValueError,
     r"x is on \w+.* and weight on meta"),
    ("linear-float64", lambda f, T: f.linear(T(4, 8, dtype=torch.float64), T(3, 8, dtype=torch.float64)),
     TypeError, r"float64 is refused"),
    ("linear-module", lambda f, T: f.linear(T(4, 8), nn.Linear(8, 3)), TypeError,
     r"linear: weight must be a torch.Tensor, got Linear"),
    ("linear-bias-float", lambda f, T: f.linear(T(4, 8), T(3, 8), 0.5), TypeError,
     r"bias must be a torch.Tensor, got float"),
    ("linear-activation", lambda f, T: f.linear(T(4, 8), T(3, 8), None, "relu"), ValueError,
     r"linear: activation must be None, 'gelu' or 'gelu_tanh', got 'relu'"),
    ("linear-activation-tanh", lambda f, T: f.linear(T(4, 8), T(3, 8), None, "tanh"), ValueError,
     r"got 'tanh'"),
    ("linear-activation-list", lambda f, T: f.linear(T(4, 8), T(3, 8), None, ["gelu"]), ValueError,
     r"got \['gelu'\]"),
    # geglu_linear
    ("geglu_linear-weights", lambda f, T: f.geglu_linear(T(4, 8), T(6, 8), T(5, 8)), ValueError,
     r"geglu_linear: w_gate and w_up must have the same shape \[intermediate, hidden\], got \(6, 8\) and \(5, 8\)"),
    ("geglu_linear-in-features", lambda f, T: f.geglu_linear(T(4, 8), T(6, 8), T(6, 7)), ValueError,
     r"x's last dim must equal w_up's in_features \(dim 1\), got x \(4, 8\) and w_up \(6, 7\)"),
    ("geglu_linear-b_gate", lambda f, T: f.geglu_linear(T(4, 8), T(6, 8), T(6, 8), T(5), T(6)), ValueError,
     r"b_gate must have shape \(6,\), w_gate's out_features, got \(5,\)"),
    ("geglu_linear-one-bias", lambda f, T: f.geglu_linear(T(4, 8), T(6, 8), T(6, 8), T(6)), ValueError,
     r"pass both biases or neither, got b_gate but b_up is None"),
    ("geglu_linear-dtypes", lambda f, T: f.geglu_linear(T(4, 8), T(6, 8), T(6, 8, dtype=torch.float16)),
     TypeError, r"expected w_up and x to have the same dtype"),
    ("geglu_linear-devices", lambda f, T: f.geglu_linear(T(4, 8), T(6, 8), T(6, 8), T(6), torch.empty(6, device="meta")),
     ValueError, r"and b_up on meta"),
    ("geglu_linear-0d", lambda f, T: f.geglu_linear(T(), T(6, 8), T(6, 8)), ValueError,
     r"geglu_linear: x must be \[\.\.\., in_features\], got a 0-d tensor"),
    ("geglu_linear-approximate", lambda f, T: f.geglu_linear(T(4, 8), T(6, 8), T(6, 8), approximate="exact"),
     ValueError, r"geglu_linear: approximate must be 'tanh' or 'none', got 'exact'"),
    # geglu_mlp: w_down is checked against the intermediate size before any kernel runs
    ("geglu_mlp-w_down", lambda f, T: f.geglu_mlp(T(4, 8), T(6, 8), T(6, 8), T(8, 5)), ValueError,
     (r"geglu_mlp: w_down must be 2-D \[hidden_out, intermediate\] with intermediate = "
      r"w_gate.shape\[0\] = 6, got w_down of shape \(8, 5\)")),
    ("geglu_mlp-w_down-1d", lambda f, T: f.geglu_mlp(T(4, 8), T(6, 8), T(6, 8), T(6)), ValueError,
     r"w_down must be 2-D .* got w_down of shape \(6,\)"),
    ("geglu_mlp-b_down", lambda f, T: f.geglu_mlp(T(4, 8), T(6, 8), T(6, 8), T(8, 6), T(6), T(6), T(6)),
     ValueError, r"geglu_mlp: b_down must have shape \(8,\), w_down's out_features, got \(6,\)"),
    ("geglu_mlp-weights", lambda f, T: f.geglu_mlp(T(4, 8), T(6, 8), T(7, 8), T(8, 6)), ValueError,
     r"geglu_mlp: w_gate and w_up must have the same shape"),
    ("geglu_mlp-in-features", lambda f, T: f.geglu_mlp(T(4, 9), T(6, 8), T(6, 8), T(8, 6)), ValueError,
     r"geglu_mlp: x's last dim must equal w_gate's in_features"),
    ("geglu_mlp-dtypes", lambda f, T: f.geglu_mlp(T(4, 8), T(6, 8), T(6, 8), T(8, 6, dtype=torch.float16)),
     TypeError, r"geglu_mlp: expected w_down and x to have the same dtype"),
    ("geglu_mlp-devices", lambda f, T: f.geglu_mlp(T(4, 8), T(6, 8), T(6, 8), torch.empty(8, 6, device="meta")),
     ValueError, r"and w_down on meta"),
    ("geglu_mlp-int", lambda f, T: f.geglu_mlp(*(T(*s, dtype=torch.int64) for s in ((4, 8), (6, 8), (6, 8), (8, 6)))),
     TypeError, r"geglu_mlp: dtype torch.int64 is not supported"),
    ("geglu_mlp-approximate", lambda f, T: f.geglu_mlp(T(4, 8), T(6, 8), T(6, 8), T(8, 6), approximate="sigmoid"),
     ValueError, r"geglu_mlp: approximate must be 'tanh' or 'none', got 'sigmoid'"),
]  # fmt: skip


@pytest.mark.parametrize(
    "call, exc, match", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT]
)
def test_bad_input(fused_geglu, device, call, exc, match):
    def T(*shape, dtype=torch.float32):
        return _rand(device, *shape, dtype=dtype)

    with pytest.raises(exc, match=match):
        call(fused_geglu, T)


def test_meta_tensors_give_shapes(fused_geglu):
    """Meta tensors (no data) run the fake implementations: shapes, no kernel launch."""
    x = torch.empty(2, 5, 8, device="meta", requires_grad=True)
    w = torch.empty(6, 8, device="meta", requires_grad=True)
    assert fused_geglu.geglu(w, w).shape == (6, 8)
    out = torch.empty(6, 4, device="meta")
    assert fused_geglu.gelu_and_mul(out, w.detach()) is out
    assert fused_geglu.linear(x, w, None, "gelu").shape == (2, 5, 6)
    y = fused_geglu.geglu_mlp(x, w, w, w.t())
    assert y.shape == (2, 5, 8) and y.device.type == "meta"
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_cpu_without_interpreter_raises():
    """CPU tensors without TRITON_INTERPRET: a RuntimeError that says what to do (the
    interpreter is chosen at import, hence a fresh process)."""
    code = textwrap.dedent(f"""
        import torch
        from pathlib import Path
        from kernels import get_local_kernel

        f = get_local_kernel(Path({str(ROOT)!r}))
        x, w = torch.randn(4, 8), torch.randn(6, 8)
        calls = {{
            "geglu": lambda: f.geglu(x, x),
            "gelu_and_mul": lambda: f.gelu_and_mul(torch.empty(4, 4), x),
            "linear": lambda: f.linear(x, w),
            "geglu_mlp": lambda: f.geglu_mlp(x, w, w, w.t()),
        }}
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as e:
                print(name, "->", e)
            else:
                print(name, "-> no error")
    """)
    run = run_python(code, TRITON_INTERPRET=None)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 4, run.stdout
    for line in lines:
        assert re.search(
            r"^\w+ -> \w+: CPU tensors need the Triton interpreter \(set TRITON_INTERPRET=1 "
            r"before importing triton\) or a GPU \(\w+: shape \(4, \d\), torch.float32, cpu",
            line,
        ), line


class _MLP(nn.Module):
    """gate_proj/up_proj/down_proj/act_fn, any of which can be left out, with GemmaMLP's
    forward (the same bytecode: the layer reproduces it)."""

    kernel_layer_name = "GeGLUMLP"  # what replace_kernel_forward_from_hub sets

    def __init__(self, act_fn=None, skip=(), hidden=8, inter=12, up_inter=None):
        super().__init__()
        sizes = {
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, up_inter or inter),
            "down_proj": (inter, hidden),
        }
        for name, (i, o) in sizes.items():
            if name not in skip:
                setattr(self, name, nn.Linear(i, o))
        if "act_fn" not in skip:
            self.act_fn = act_fn or nn.GELU(approximate="tanh")

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


# A module our layer cannot reproduce runs its own forward (warning why): its own result,
# or its own error.
@pytest.mark.parametrize(
    "module, outcome, reason",
    [
        (_MLP(skip=("up_proj",)), (AttributeError, "has no attribute 'up_proj'"), "no submodule up_proj"),
        (_MLP(skip=("act_fn",)), (AttributeError, "has no attribute 'act_fn'"), "no submodule act_fn"),
        (_MLP(act_fn=nn.SiLU()), None, r"SiLU\(\)' is not a GeLU|SiLU\(\) is not a GeLU"),
        (_MLP(act_fn=nn.ReLU()), None, r"ReLU\(\) is not a GeLU"),
    ],
    ids=["no-up_proj", "no-act_fn", "silu", "relu"],
)  # fmt: skip
def test_geglu_mlp_layer_runs_own_forward(fused_geglu, device, module, outcome, reason):
    forward = fused_geglu.layers.GeGLUMLP.forward.__get__(module.to(device))
    x = torch.randn(3, 8, device=device)
    if outcome is None:
        with pytest.warns(RuntimeWarning, match=reason):
            got = forward(x)
        torch.testing.assert_close(got, module(x), rtol=0, atol=0)
    else:
        with (
            pytest.raises(outcome[0], match=outcome[1]),
            pytest.warns(RuntimeWarning, match=reason),
        ):
            forward(x)


def test_geglu_mlp_layer_mismatched_projections(fused_geglu, device):
    """gate and up of different sizes: eager's own error, from its own formula."""
    module = _MLP(up_inter=10).to(device)
    forward = fused_geglu.layers.GeGLUMLP.forward.__get__(module)
    with pytest.raises(RuntimeError, match="must match the size"):
        forward(torch.randn(3, 8, device=device))


def test_linear_layer_as_nn_linear(fused_geglu, device):
    """float64 runs F.linear (a warning says so); a wrong size raises F.linear's error; a
    module that is no nn.Linear runs its own forward."""
    forward = fused_geglu.layers.Linear.forward
    linear = nn.Linear(8, 3).double().to(device)
    x = torch.randn(2, 8, device=device, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="torch.float64"):
        torch.testing.assert_close(
            forward.__get__(linear)(x), linear(x), rtol=0, atol=0
        )
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        forward.__get__(nn.Linear(8, 3).to(device))(torch.randn(2, 7, device=device))
    # Not an nn.Linear: its own forward (here: none) and its own error.
    with pytest.raises(NotImplementedError), pytest.warns(RuntimeWarning, match="not"):
        forward.__get__(nn.Module())(torch.randn(2, 8, device=device))


@pytest.mark.parametrize(
    "skip, act_fn, error",
    [(("up_proj",), None, "has no attribute 'up_proj'"), ((), nn.SiLU(), None)],
    ids=["no-up_proj", "silu"],
)
def test_kernelized_layer_runs_own_forward(fused_geglu, device, skip, act_fn, error):
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    model = _MLP(act_fn=act_fn, skip=skip).to(device)
    eager = copy.deepcopy(model)
    repo = LocalLayerRepository(ROOT, layer_name="GeGLUMLP")
    with use_kernel_mapping({"GeGLUMLP": {device: repo}}, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device=device)
    assert model.forward.__func__.__qualname__ == "GeGLUMLP.forward"
    x = torch.randn(3, 8, device=device)
    if error is None:
        with pytest.warns(RuntimeWarning, match="runs its own forward"):
            got = model(x)
        torch.testing.assert_close(got, eager(x), rtol=0, atol=0)
    else:
        with (
            pytest.raises(AttributeError, match=error),
            pytest.warns(RuntimeWarning, match="runs its own forward"),
        ):
            model(x)


# --- 2. NaN, Inf and extreme values ------------------------------------------------------

_COMMON = [0.0, -0.0, 1.0, -1.0, 2.0, -3.0, -5.0, INF, -INF, NAN]
# Largest finite values, values whose cube overflows float32, subnormals. Gates of about
# -13 to -6 are left to the tail tests below.
SPECIAL = {
    torch.float32: _COMMON + [1e4, -1e4, 3.38e38, -3.38e38, 1e20, -1e20, 1e-40],
    torch.float16: _COMMON + [6e4, -6e4, 65504.0, -65504.0, 6e-8],
    torch.bfloat16: _COMMON + [1e4, -1e4, 3.38e38, -3.38e38, 1e20, -1e20],
}
K0, K1 = math.sqrt(2 / math.pi), 0.044715


def gelu64(x, approximate):
    """float64 GeLU that stays accurate for x << 0 (no 1 + tanh / 1 + erf cancelling)."""
    if approximate == "tanh":
        return x * torch.sigmoid(2 * K0 * (x + K1 * x**3))
    return 0.5 * x * torch.erfc(-x / math.sqrt(2))


def gelu_grad64(x, approximate):
    if approximate == "tanh":
        u = K0 * (x + K1 * x**3)
        s = torch.sigmoid(2 * u)
        return s + 2 * x * s * torch.sigmoid(-2 * u) * K0 * (1 + 3 * K1 * x * x)
    return 0.5 * torch.erfc(-x / math.sqrt(2)) + x * torch.exp(-x * x / 2) / math.sqrt(
        2 * math.pi
    )


def assert_specials_as(ours, expected, ref=None, eager=None, what=""):
    """NaN and Inf exactly where ``expected`` has them, the same sign where both are
    non-zero (eager's float32 exact GeLU gives -0 or +0 by code path, so zeros may
    differ); ``expected`` may be a tuple of alternatives, each element matching one; and
    finite values at least about as close to the float64 ``ref`` as ``eager``'s (where
    eager is finite; else within 4 units of rounding). ``ref`` may be a tuple of
    alternatives too: float64, and float64 through float32's rounding, each element
    matching one (CPU eager's error at a float32 tie depends on the CPU: GeLU of the
    smallest fp16 subnormal is exactly half of it in float32, 0 once rounded, and eager
    gave the true value on one x86 machine, the tie on another)."""
    ours = ours.detach().cpu()
    alternatives = expected if isinstance(expected, tuple) else (expected,)
    ok = torch.zeros_like(ours, dtype=torch.bool)
    for x in (x.detach().cpu() for x in alternatives):
        same = (ours.isnan() == x.isnan()) & (ours.isinf() == x.isinf())
        nonzero = ~ours.isnan() & (ours != 0) & (x != 0)
        ok |= same & (~nonzero | (ours.signbit() == x.signbit()))
    bad = (~ok).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: NaN/Inf or sign differ at {bad[:5].tolist()}: ours "
        f"{ours[bad[:5]].tolist()}, float64 {alternatives[0].cpu()[bad[:5]].tolist()}"
    )
    if ref is None:
        return
    dtype, finite = ours.dtype, ours.isfinite()
    eps = torch.finfo(dtype).eps * dtype_slack(dtype)
    o, e = ours.double()[finite], eager.cpu().double()[finite]
    close = torch.zeros_like(o, dtype=torch.bool)
    for r in ref if isinstance(ref, tuple) else (ref,):
        r = r.cpu()[finite]
        eager_err = torch.nan_to_num(2 * (e - r).abs(), nan=0.0, posinf=0.0)
        tol = torch.maximum(eager_err, 4 * eps * r.abs()) + torch.finfo(dtype).tiny
        close |= (o - r).abs() <= tol
    bad = (~close).nonzero()
    first = (ref if isinstance(ref, tuple) else (ref,))[0].cpu()[finite]
    assert bad.numel() == 0, f"{what}: {o[bad[:5]]} vs float64 {first[bad[:5]]}"


def _in_dtype(refs, dtype):
    """float64 results rounded to ``dtype``: the stated semantics (IEEE arithmetic in
    float64, overflowing where the dtype does), whose NaN/Inf pattern ours must have."""
    return [r.to(dtype) for r in refs]


def _rounded(t, dtype):
    """``t`` rounded once to ``dtype``: torch's float64 -> float16 goes through float32,
    and that second rounding moves ties (gelu(6e-8), just above half the smallest fp16
    subnormal, became exactly half and rounded to 0); numpy's rounds once."""
    if dtype == torch.float16:
        return (
            torch.from_numpy(t.cpu().numpy().astype(np.float16)).to(t.device).double()
        )
    return t.to(dtype).double()


# Where float32's x * x overflows, the tanh gelu' is Inf * 0 = NaN in eager (every
# platform) and ours, both computing in float32, where float64 gives 1 (or 0): stated.
FP32_SQRT_MAX = math.sqrt(torch.finfo(torch.float32).max)


def _special_refs(gate, up, dy, approximate, dtype, through_fp32=False):
    """float64 out, d gate, d up of GeGLU, rounded to ``dtype`` where ours and eager
    round: the activation before ``* up`` and ``dy *``, ``dy * up`` before gelu'.
    ``through_fp32``: gelu and gelu' first rounded to float32, as computed there (this
    moves a tie in fp16, and underflows gelu' of the negative tail to 0)."""
    g64, u64, dy64 = (t.double() for t in (gate, up, dy))
    act64, grad64 = gelu64(g64, approximate), gelu_grad64(g64, approximate)
    if through_fp32:
        act64, grad64 = _rounded(act64, torch.float32), _rounded(grad64, torch.float32)
    if approximate == "tanh":
        grad64 = grad64.masked_fill(g64.abs() > FP32_SQRT_MAX, NAN)
    act = _rounded(act64, dtype)
    return [act * u64, _rounded(dy64 * u64, dtype) * grad64, dy64 * act]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_special_values_as_float64(fused_geglu, device, dtype, approximate):
    """Every (gate, up, dout) triple of special values, forward and both gradients: NaN
    and Inf where float64 puts them (rounded to the dtype), not where CPU float32 eager
    does (see test_gelu_of_inf_is_platform_dependent_in_cpu_float32); finite values as
    close to float64 as eager's. (On the H200 eager fp16 tanh differs at gate 6e-8: half
    the smallest subnormal in its fp32, a tie it rounds to 0, so 0 * Inf = NaN; float64
    and ours keep the true, slightly larger value, which rounds up: Inf.)"""
    values = torch.tensor(SPECIAL[dtype], dtype=torch.float64)
    gate, up, dy = (
        t.reshape(-1).to(device, dtype)
        for t in torch.meshgrid(values, values, values, indexing="ij")
    )
    ours = fwd_bwd(partial(fused_geglu.geglu, approximate=approximate), [gate, up], dy)
    eager = fwd_bwd(partial(eager_geglu, approximate=approximate), [gate, up], dy)
    refs = _special_refs(gate, up, dy, approximate, dtype)
    via32 = _special_refs(gate, up, dy, approximate, dtype, through_fp32=True)
    for what, o, x, x32, r, r32, e in zip(
        ("out", "d gate", "d up"),
        ours,
        _in_dtype(refs, dtype),
        _in_dtype(via32, dtype),
        refs,
        via32,
        eager,
    ):
        assert_specials_as(o, (x, x32), (r, r32), e, f"{dtype} {approximate} {what}")
    # gelu_and_mul runs the same kernel on the [..., 2d] layout: the same results.
    fn = (
        fused_geglu.gelu_tanh_and_mul
        if approximate == "tanh"
        else fused_geglu.gelu_and_mul
    )
    out = fn(torch.empty_like(gate), torch.cat([gate, up]))
    torch.testing.assert_close(out, ours[0].detach(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_of_inf_is_platform_dependent_in_cpu_float32(
    fused_geglu, device, dtype, approximate
):
    """The platform-dependent case, named: on some x86 CPUs (AMD EPYC with AVX-512; also
    the Intel Xeon this suite was written on) torch's vectorized float32 erf-GeLU returns
    NaN for +Inf, where float64 and GPUs return +Inf; bf16 computes in float32 and
    inherits it. Eager float32 on the CPU is therefore no reference for special values.
    Ours must equal the float64 semantics on every platform: gelu(+Inf) = +Inf,
    gelu(-Inf) = -Inf * 0 = NaN (float64 and GPUs agree, both flavours), NaN propagates,
    and gelu'(+-Inf) = NaN (Inf * pdf(Inf) = Inf * 0)."""
    x = torch.tensor(
        [INF, -INF, NAN, 1.0] * 16, dtype=dtype, device=device
    )  # vectorized
    ones = torch.ones_like(x)
    out, d_gate, d_up = fwd_bwd(partial(fused_geglu.geglu, approximate=approximate), [x, ones], ones)  # fmt: skip
    x64 = x.double().cpu().requires_grad_()
    ref = F.gelu(x64, approximate=approximate)
    (ref_grad,) = torch.autograd.grad(ref, x64, torch.ones_like(ref))
    assert ref[0] == INF and ref[1].isnan() and ref[2].isnan()
    assert out[0] == INF and out[1].isnan() and out[2].isnan()
    assert_specials_as(out, ref.detach().to(dtype), what="gelu")
    assert_specials_as(d_up, ref.detach().to(dtype), what="d up")
    assert_specials_as(d_gate, ref_grad.to(dtype), what="d gate")
    # Documented, not asserted either way: CPU float32 eager's gelu(+Inf) is +Inf or NaN.
    cpu32 = F.gelu(x.cpu().float(), approximate=approximate)[0]
    assert cpu32 == INF or cpu32.isnan()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_overflow_as_float64(fused_geglu, device, dtype, approximate):
    """gelu(big) * 2 overflows in the input dtype, as float64's product rounded to it."""
    big = 6e4 if dtype == torch.float16 else 3e38
    gate = torch.tensor([big, -big, big], dtype=dtype, device=device)
    up = torch.tensor([2.0, 2.0, -2.0], dtype=dtype, device=device)
    out = fused_geglu.geglu(gate, up, approximate)
    assert out[0] == INF and out[2] == -INF and out[1] == 0
    ref = gelu64(gate.double(), approximate) * up.double()
    assert_specials_as(out, ref.to(dtype))


TAIL = [-12.0, -10.0, -8.0]


def _tail_as_eager_on_gpu(fused_geglu, device, approximate, gate, up, dy) -> bool:
    """On the GPU the kernels compute eager's expressions (test_bit_for_bit_eager_on_gpu):
    the tail is eager's, bit for bit. Returns whether that was the check made."""
    if device != "cuda" or torch.version.hip is not None:
        return False
    ours = fwd_bwd(partial(fused_geglu.geglu, approximate=approximate), [gate, up], dy)
    eager = fwd_bwd(partial(eager_geglu, approximate=approximate), [gate, up], dy)
    for name, a, b in zip(("out", "d gate", "d up"), ours, eager):
        if bit_for_bit(fused_geglu, approximate):
            assert_same_bits(a, b, f"{approximate} {name}")
        else:
            assert_within_erff_ulp(a, b, gate, up, dy, name)
    return True


@pytest.mark.parametrize("approximate", APPROX)
def test_negative_tail_times_inf_as_float64(fused_geglu, device, approximate):
    """Gates of about -13 to -6 in the interpreter: ours keeps the tiny true gelu/gelu'
    (see ``test_negative_tail_accuracy``), so a product with Inf is +-Inf, as in float64.
    Eager float32 rounds them to 0 (1 + tanh(u) and cdf + x pdf cancel) and gives NaN
    there; so does ours on the GPU, where it is eager's bit for bit."""
    gate = torch.tensor(TAIL, device=device)
    up = torch.full_like(gate, INF)
    dy = torch.full_like(gate, 2.0)
    big = torch.full_like(gate, 3e38)  # dy * up overflows to Inf before gelu'
    if _tail_as_eager_on_gpu(fused_geglu, device, approximate, gate, up, dy):
        _tail_as_eager_on_gpu(fused_geglu, device, approximate, gate, big, dy)
        return
    ours_fn = partial(fused_geglu.geglu, approximate=approximate)

    def expected(up, k):
        return tuple(
            _special_refs(gate, up, dy, approximate, gate.dtype, fp32)[k].float()
            for fp32 in (False, True)
        )

    out = fwd_bwd(ours_fn, [gate, up], dy)[0]
    if approximate == "tanh":  # the exact forward cancels (1 + erf), as eager's does
        assert_specials_as(out, expected(up, 0), what="out")
    d_gate = fwd_bwd(ours_fn, [gate, big], dy)[1]
    assert_specials_as(d_gate, expected(big, 1), what="d gate")
    assert d_gate.isinf().any()  # not all NaN: eager gives NaN for each


@pytest.mark.parametrize(
    "approximate, rtol_fwd, rtol_grad", [("tanh", 1e-5, 1e-5), ("none", None, 5e-2)]
)
def test_negative_tail_accuracy(fused_geglu, device, approximate, rtol_fwd, rtol_grad):
    """Why the interpreter's tail differs from eager: ours is close to float64 where
    eager's is 0. (The exact forward is not: 1 + erf cancels in our form as in eager's.)
    On the GPU the tail is eager's bit for bit."""
    x = torch.linspace(-9.5, -3.0, 27, device=device)
    ones = torch.ones_like(x)
    if _tail_as_eager_on_gpu(fused_geglu, device, approximate, x, ones, ones):
        return
    out, dgate, _ = fwd_bwd(
        partial(fused_geglu.geglu, approximate=approximate), [x, ones], ones
    )
    x64 = x.double().cpu()
    if rtol_fwd is not None:
        torch.testing.assert_close(
            out.detach().double().cpu(), gelu64(x64, approximate), rtol=rtol_fwd, atol=0
        )
    torch.testing.assert_close(
        dgate.double().cpu(), gelu_grad64(x64, approximate), rtol=rtol_grad, atol=0
    )


def _poison(t, *entries):
    """Copy of ``t`` with ``entries``: (index, value) pairs."""
    t = t.clone()
    for index, value in entries:
        t[index] = value
    return t


def _gemm_special_inputs(device, dtype, m=6, n=9, k=40):
    """x, w_gate, w_up, b_gate, b_up, dY with Inf/NaN entries; the finite ones ~N(0, 1) so
    that no finite sum overflows and no gate lands in the negative tail."""
    x = _poison(
        _rand(device, m, k, dtype=dtype), ((0, 3), INF), ((1, 5), -INF), ((2, 7), NAN)
    )
    wg = _poison(
        _rand(device, n, k, dtype=dtype) / k**0.5, ((4, 11), INF), ((5, 3), 0.0)
    )
    wu = _poison(_rand(device, n, k, dtype=dtype) / k**0.5, ((2, 9), -INF))
    bg = _poison(_rand(device, n, dtype=dtype), (7, -INF))
    bu = _poison(_rand(device, n, dtype=dtype), (8, INF))
    dy = _poison(_rand(device, m, n, dtype=dtype), ((3, 2), INF))
    return x, wg, wu, bg, bu, dy


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh"])
def test_linear_special_values_as_float64(fused_geglu, device, dtype, activation):
    """NaN and Inf where float64 has them (rounded to the dtype), not CPU float32 eager
    (whose erf-GeLU of +Inf is NaN on some CPUs)."""
    x, w, _, b, _, dy = _gemm_special_inputs(device, dtype)
    ours = fwd_bwd(partial(fused_geglu.linear, activation=activation), [x, w, b], dy)
    eager = partial(eager_linear, activation=activation)
    refs = _in_dtype(fwd_bwd(eager, cast([x, w, b], torch.float64), dy), dtype)
    for what, o, r in zip(("y", "dx", "dw", "db"), ours, refs):
        assert_specials_as(o, r, what=what)


@pytest.mark.parametrize("dtype", GEMM_DTYPES, ids=str)
@pytest.mark.parametrize("approximate", APPROX)
def test_geglu_linear_special_values_as_float64(
    fused_geglu, device, dtype, approximate
):
    """As the linear's: float64's NaN/Inf pattern, rounded to the dtype."""
    *inputs, dy = _gemm_special_inputs(device, dtype)
    ours = fwd_bwd(
        partial(fused_geglu.geglu_linear, approximate=approximate), inputs, dy
    )
    eager = partial(eager_geglu_linear, approximate=approximate)
    refs = _in_dtype(fwd_bwd(eager, cast(inputs, torch.float64), dy), dtype)
    for what, o, r in zip(("h", "dx", "dwg", "dwu", "dbg", "dbu"), ours, refs):
        assert_specials_as(o, r, what=what)


# --- 3. Sizes: empty, one element, strided and zero-stride ------------------------------


@pytest.mark.parametrize(
    "shape", [(0,), (0, 5), (5, 0), (3, 0, 4), (1,), (1, 1), (1, 7), (7, 1)], ids=str
)
@pytest.mark.parametrize("approximate", APPROX)
def test_activation_sizes(fused_geglu, device, shape, approximate):
    gate, up, dy = (torch.randn(shape, device=device) for _ in range(3))
    ours = check_against_float64(
        partial(fused_geglu.geglu, approximate=approximate),
        partial(eager_geglu, approximate=approximate),
        [gate, up],
        dy,
    )
    fn = (
        fused_geglu.gelu_and_mul
        if approximate == "none"
        else fused_geglu.gelu_tanh_and_mul
    )
    out = fn(torch.empty(shape, device=device), torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, ours[0].detach())


def _sizes(sizes):
    """(sizes, bias) params."""
    return [
        pytest.param(s, bias, id=f"{s}-bias={bias}")
        for s in sizes
        for bias in (False, True)
    ]


@pytest.mark.parametrize(
    "mnk, bias",
    _sizes(
        [(0, 5, 3), (4, 0, 3), (4, 5, 0), (1, 1, 1), (1, 5, 3), (4, 1, 3), (4, 5, 1)]
    ),
)
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_linear_sizes(fused_geglu, device, mnk, bias, activation):
    """Empty and one-element M, N, K; K = 0 gives act(bias) (or act(0)) and zero grads."""
    m, n, k = mnk
    shapes = [(m, k), (n, k)] + ([(n,)] if bias else [])
    args = [torch.randn(s, device=device) for s in shapes]
    dy = torch.randn(m, n, device=device)
    check_against_float64(
        partial(fused_geglu.linear, activation=activation),
        partial(eager_linear, activation=activation),
        args,
        dy,
    )


@pytest.mark.parametrize(
    "mih, bias", _sizes([(0, 6, 4), (3, 0, 4), (3, 6, 0), (1, 1, 1)])
)
def test_geglu_linear_sizes(fused_geglu, device, mih, bias):
    m, i, h = mih
    shapes = [(m, h), (i, h), (i, h)] + ([(i,), (i,)] if bias else [])
    args = [torch.randn(s, device=device) for s in shapes]
    dy = torch.randn(m, i, device=device)
    check_against_float64(
        partial(fused_geglu.geglu_linear, approximate="none"),
        partial(eager_geglu_linear, approximate="none"),
        args,
        dy,
    )


@pytest.mark.parametrize("mih, bias", _sizes([(0, 6, 4), (3, 0, 4), (3, 6, 0)]))
def test_geglu_mlp_sizes(fused_geglu, device, mih, bias):
    """I = 0 is K = 0 for the down projection; H = 0 for the gate/up projections."""
    m, i, h = mih
    shapes = [(m, h), (i, h), (i, h), (h, i)] + ([(i,), (i,), (h,)] if bias else [])
    args = [torch.randn(s, device=device) for s in shapes]
    dy = torch.randn(m, h, device=device)
    check_against_float64(fused_geglu.geglu_mlp, eager_geglu_mlp, args, dy)


def _layouts(device, shape):
    """Views of ``shape``: 1-D strided and zero-stride; 2-D transposed, strided and
    zero-stride (expand) rows, columns or both."""
    n = shape[-1]
    if len(shape) == 1:
        return [
            torch.randn(2 * n, device=device)[::2],
            torch.randn(1, device=device).expand(n),
        ]
    m = shape[0]
    return [
        torch.randn(n, m, device=device).t(),
        torch.randn(m, 2 * n + 3, device=device)[:, 3 : 3 + 2 * n : 2],
        torch.randn(1, n, device=device).expand(m, n),
        torch.randn(1, 1, device=device).expand(m, n),
    ]


def _incoming_grads(device, m, n):
    """dY as autograd may hand it over: expanded (as from ``sum()``), transposed, strided."""
    return [
        torch.ones(1, 1, device=device).expand(m, n),
        torch.randn(1, n, device=device).expand(m, n),
        torch.randn(n, m, device=device).t(),
        torch.randn(2 * m, n, device=device)[::2],
    ]


def _check_layouts(ours_fn, eager_fn, device, m, n_out, in_shapes):
    """Each 2-D input in each layout of ``_layouts`` (the others contiguous), then each
    incoming-gradient layout of ``_incoming_grads``."""
    base = [torch.randn(s, device=device) for s in in_shapes]
    for pos, shape in enumerate(in_shapes):
        for t in _layouts(device, shape) if len(shape) == 2 else []:
            check_against_float64(
                ours_fn, eager_fn, base[:pos] + [t] + base[pos + 1 :], None
            )
    for dy in _incoming_grads(device, m, n_out):
        check_against_float64(ours_fn, eager_fn, base, dy)


def test_geglu_layouts(fused_geglu, device):
    _check_layouts(
        lambda g, u: fused_geglu.geglu(g, u), lambda g, u: F.gelu(g, approximate="tanh") * u,
        device, 6, 33, [(6, 33), (6, 33)],
    )  # fmt: skip


def test_linear_layouts(fused_geglu, device):
    _check_layouts(
        lambda x, w, b: fused_geglu.linear(x, w, b, "gelu"),
        lambda x, w, b: eager_linear(x, w, b, "gelu"),
        device, 6, 9, [(6, 20), (9, 20), (9,)],
    )  # fmt: skip


def test_geglu_linear_layouts(fused_geglu, device):
    _check_layouts(
        lambda *a: fused_geglu.geglu_linear(*a),
        eager_geglu_linear,
        device, 6, 9, [(6, 20), (9, 20), (9, 20), (9,), (9,)],
    )  # fmt: skip


@pytest.mark.parametrize("layout", [0, 1], ids=["strided", "expanded"])
@pytest.mark.parametrize("fn", ["linear", "geglu_linear", "geglu_mlp"])
def test_noncontiguous_bias(fused_geglu, device, fn, layout):
    x = torch.randn(6, 20, device=device)
    w = [torch.randn(s, device=device) for s in ((9, 20), (9, 20), (20, 9))]
    b = [_layouts(device, (n,))[layout] for n in (9, 9, 20)]
    eager_fn, inputs = {
        "linear": (eager_linear, [x, w[0], b[0]]),
        "geglu_linear": (eager_geglu_linear, [x, w[0], w[1], b[0], b[1]]),
        "geglu_mlp": (eager_geglu_mlp, [x, *w, *b]),
    }[fn]
    check_against_float64(getattr(fused_geglu, fn), eager_fn, inputs, None)


def test_permuted_batch(fused_geglu, device):
    """3-D views whose leading dims have no single row stride (the kernels copy them), with
    an incoming gradient of that layout too."""

    def permuted(a, b, n):
        return torch.randn(b, a, n, device=device).transpose(0, 1)

    w = [torch.randn(9, 20, device=device) for _ in range(3)]
    cases = [
        (fused_geglu.geglu, lambda g, u: F.gelu(g, approximate="tanh") * u,
         [permuted(2, 3, 33), permuted(2, 3, 33)], 33),
        (fused_geglu.linear, F.linear, [permuted(2, 3, 20), w[0]], 9),
        (fused_geglu.geglu_linear, eager_geglu_linear, [permuted(2, 3, 20), *w[1:]], 9),
    ]  # fmt: skip
    for ours_fn, eager_fn, inputs, n in cases:
        check_against_float64(ours_fn, eager_fn, inputs, permuted(2, 3, n))


# --- 5. The package source makes no risky calls -------------------------------------------


def test_no_risky_calls_in_package():
    forbidden = re.compile(
        r"\beval\(|\bexec\(|pickle|urllib|\brequests\b|\bsocket\b|subprocess"
    )
    sources = sorted((ROOT / "torch-ext" / "fused_geglu").rglob("*.py"))
    assert sources
    hits = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sources
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if forbidden.search(line)
    ]
    assert not hits, hits


# --- 6. Huge tensors (GPU) -------------------------------------------------------------
# More than 2^31 elements: every offset past int32's range must be formed in int64.

HUGE_ROWS = 2**31 // 2048 + 64  # rows of 2048 columns: 2^31 + 131072 elements


@pytest.mark.gpu
def test_activation_past_2_31_elements(fused_geglu):
    """Forward and backward of a [2^31 / 2048 + 64, 2048] bf16 GeGLU (three 4.3 GB tensors);
    the last rows, past offset 2^31, against float64 as closely as eager."""
    from reference import assert_close_to_ref, geglu_ref

    g, u, dy = (torch.randn(HUGE_ROWS, 2048, dtype=torch.bfloat16, device="cuda") for _ in range(3))  # fmt: skip
    g.requires_grad_(), u.requires_grad_()
    out = fused_geglu.geglu(g, u, "tanh")
    dg, du = torch.autograd.grad(out, (g, u), dy)
    tail = slice(-64, None)
    gt, ut = (t[tail].detach().double().requires_grad_() for t in (g, u))
    ge, ue = (t[tail].detach().clone().requires_grad_() for t in (g, u))
    ref, eager = geglu_ref(gt, ut, "tanh"), F.gelu(ge, approximate="tanh") * ue
    assert_close_to_ref(out[tail], ref, eager)
    for ours, r, e in zip(
        (dg[tail], du[tail]),
        torch.autograd.grad(ref, (gt, ut), dy[tail].double()),
        torch.autograd.grad(eager, (ge, ue), dy[tail]),
    ):
        assert_close_to_ref(ours, r, e)


@pytest.mark.gpu
@pytest.mark.parametrize("operand", ["x", "weight"])
def test_linear_past_2_31_elements(fused_geglu, operand):
    """A 4.3 GB operand: x with 2^31 / 2048 + 64 rows (the TMA kernel, forward and
    backward), or a weight with that many out-features at 16 tokens (the portable kernel).
    Rows past offset 2^31 against float64 as closely as eager."""
    from reference import assert_close_to_ref

    big = torch.randn(HUGE_ROWS, 2048, dtype=torch.bfloat16, device="cuda")
    small = torch.randn(16, 2048, dtype=torch.bfloat16, device="cuda") / 2048**0.5
    if operand == "x":
        x, w = big, small
        y = fused_geglu.linear(x.requires_grad_(), w)
        dy = torch.randn_like(y)
        dx = torch.autograd.grad(y, x, dy)[0]
        rows = slice(-64, None)
        assert_close_to_ref(
            y[rows], F.linear(x[rows].double(), w.double()), F.linear(x[rows], w)
        )
        assert_close_to_ref(dx[rows], dy[rows].double() @ w.double(), dy[rows] @ w)
    else:
        x, w = small * 2048**0.5, big / 2048**0.5
        y = fused_geglu.linear(x, w)
        cols = slice(-64, None)
        assert_close_to_ref(
            y[:, cols], F.linear(x.double(), w[cols].double()), F.linear(x, w[cols])
        )
