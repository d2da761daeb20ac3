"""Public functions, their input checks, and their ``torch.library`` registration.

Every kernel is a ``torch.library.custom_op`` with a fake (meta) implementation and,
where differentiable, an autograd formula, so the functions run under
``torch.compile(fullgraph=True)`` without graph breaks. The op namespace comes from the
build's ``_ops.py`` and is unique per build, as kernel-builder's is.
"""

import functools
import math
import sys

import torch

from ._ops import add_op_namespace_prefix
from .activation import INTERPRETED, as_rows, geglu_bwd, geglu_fwd
from .gemm import ACTIVATIONS, gemm

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# cuda includes ROCm; cpu: the interpreter only; meta: shapes only (the fake kernels)
DEVICES = ("cuda", "xpu", "cpu", "meta")
APPROXIMATIONS = ("tanh", "none")


def _describe(tensors: dict[str, torch.Tensor]) -> str:
    return "; ".join(
        f"{n}: shape {tuple(t.shape)}, {t.dtype}, {t.device}"
        for n, t in tensors.items()
    )


def _given(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The optional tensors (biases) that were passed."""
    return {n: t for n, t in tensors.items() if t is not None}


# Tensor types checked and dispatched by the fast paths below; subclasses (DTensor,
# FakeTensor, user subclasses) take the full checks and the dispatcher.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def check_tensors(op: str, dtensors: bool = False, **tensors: torch.Tensor) -> None:
    """Dense tensors of one dtype on one device, a supported dtype, a device Triton can
    run on; DTensors only where ``dtensors`` (the op has a sharding rule). Messages name
    every tensor's shape, dtype and device (built only on error)."""
    first = next(iter(tensors.values()))
    if type(first) in _PLAIN_TENSORS:  # the common case, in a few attribute reads
        dtype, device = first.dtype, first.device
        if (
            dtype in SUPPORTED_DTYPES
            and kernels_run_on(device)
            and all(
                type(t) in _PLAIN_TENSORS
                and t.dtype == dtype
                and t.device == device
                and t.layout == torch.strided
                for t in tensors.values()
            )
        ):
            return
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}"
            )
        if not dtensors and is_dtensor(t):
            raise TypeError(
                f"{op}: {name} is a DTensor (placements {t.placements} on {t.device_mesh}); "
                f"{op} takes local tensors: pass .to_local() shards and do the collectives "
                f"your parallel plan needs (this package's layers do both)"
            )
        if t.layout != torch.strided:
            raise TypeError(
                f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}"
            )
    (first_name, first), *rest = tensors.items()
    for name, t in rest:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{op}: expected {name} and {first_name} to have the same dtype, "
                f"but got {first_name}.dtype = {first.dtype} and {name}.dtype = {t.dtype} "
                f"({_describe(tensors)})"
            )
        if t.device != first.device:
            raise ValueError(
                f"{op}: expected all tensors on one device, but {first_name} is on {first.device} "
                f"and {name} on {t.device} ({_describe(tensors)})"
            )
    if first.dtype not in SUPPORTED_DTYPES:
        why = (
            "; float64 is refused rather than silently computed in float32"
            if first.dtype == torch.float64
            else ""
        )
        raise TypeError(
            f"{op}: dtype {first.dtype} is not supported (supported: bfloat16, float16, "
            f"float32){why} ({_describe(tensors)})"
        )
    if first.device.type not in DEVICES:
        raise RuntimeError(
            f"{op}: Triton kernels cannot run on {first.device.type} tensors (supported: "
            f"cuda, xpu, cpu with TRITON_INTERPRET=1, and meta) ({_describe(tensors)})"
        )
    if first.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{op}: CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before "
            f"importing triton) or a GPU ({_describe(tensors)})"
        )


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor (about 1 s at
    the package's import): none exists before that module is imported."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device`` (the CPU only under the interpreter)."""
    return device.type in DEVICES and (device.type != "cpu" or INTERPRETED)


def _check_approximate(op: str, approximate: str) -> None:
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(
            f"{op}: approximate must be 'tanh' or 'none', got {approximate!r}"
        )


# --- Dispatch ---------------------------------------------------------------------------
# Each op exists twice over the same implementation: a custom op (with fake and autograd)
# that torch.compile traces without graph breaks, and an autograd.Function for eager calls.
# The custom op's Python dispatch costs ~150 us per call (measured on the development
# machine; ~200 us more host time per layer on the H200's host), more than the kernels
# take at decode sizes, so eager calls skip it.


def _eager_function(impl, setup_context, autograd, backward_impl):
    """An autograd.Function running ``impl`` and, in backward, ``autograd`` with
    ``backward_impl`` in place of the backward custom op. Its forward takes ``ctx``
    itself: a separate setup_context makes every apply() bind the arguments through
    inspect.signature (~100 us of host time per call on the H200's host)."""

    def forward(ctx, *args):
        output = impl(*args)
        setup_context(ctx, args, output)
        return output

    def backward(ctx, *grads):
        return autograd(ctx, *grads, backward=backward_impl)

    members = {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
        "impl": staticmethod(impl),
    }
    return type(f"{impl.__name__}_eager", (torch.autograd.Function,), members)


def _dispatched(t: torch.Tensor) -> bool:
    """Whether the call must go through the dispatcher: under torch.compile, on a meta
    tensor or a tensor subclass (a FakeTensor: only the custom op's fake applies; a
    DTensor: its sharding rule runs the op on the local shards)."""
    return (
        torch.compiler.is_compiling()
        or type(t) not in _PLAIN_TENSORS
        or t.device.type == "meta"
    )


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a call on ``tensors`` (None for an absent bias)."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors
    )


def _call(op, eager, grad: bool, *args):
    """``op(*args)``: the custom op when dispatched; else the eager Function, or with nothing
    to differentiate (``grad`` False: inference) the implementation alone."""
    if _dispatched(args[0]):
        return op(*args)
    run = eager.apply if grad else eager.impl
    if torch.autograd._profiler_enabled():  # profiles still name the op
        with torch.profiler.record_function(op._qualname):
            return run(*args)
    return run(*args)


# --- GeGLU activation -------------------------------------------------------------------


def _geglu_impl(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    geglu_fwd(gate, up, out, approximate)
    return out


_geglu = torch.library.custom_op(
    add_op_namespace_prefix("geglu"), _geglu_impl, mutates_args=()
)


@_geglu.register_fake
def _(gate, up, approximate):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def _geglu_backward_impl(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return geglu_bwd(dout, gate, up, approximate)


_geglu_backward = torch.library.custom_op(
    add_op_namespace_prefix("geglu_backward"), _geglu_backward_impl, mutates_args=()
)


@_geglu_backward.register_fake
def _(dout, gate, up, approximate):
    return (
        torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
        torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
    )


def _geglu_setup_context(ctx, inputs, output):
    gate, up, approximate = inputs
    # gelu(gate) is recomputed in backward: only the inputs are kept alive.
    ctx.save_for_backward(gate, up)
    ctx.approximate = approximate


def _geglu_autograd(ctx, dout, backward=_geglu_backward):
    gate, up = ctx.saved_tensors
    dgate, dup = backward(dout, gate, up, ctx.approximate)
    return dgate, dup, None


_geglu.register_autograd(_geglu_autograd, setup_context=_geglu_setup_context)


@functools.cache
def _register_dtensor_rules() -> None:
    """DTensor sharding rules of the elementwise ops, registered at their first DTensor
    call: all inputs replicated, or all sharded along one same dim, and the outputs
    alike (GeLU is not linear: no Partial)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def elementwise(like: torch.Tensor, n_in: int, n_out: int) -> list:
        placements = [Replicate()] + [Shard(d) for d in range(like.ndim)]
        return [([p] * n_out, [p] * n_in + [None]) for p in placements]

    register_sharding(_geglu._opoverload)(
        lambda gate, up, approximate: elementwise(gate, 2, 1)
    )
    register_sharding(_geglu_backward._opoverload)(
        lambda dout, gate, up, approximate: elementwise(gate, 3, 2)
    )


_geglu_eager = _eager_function(
    _geglu_impl, _geglu_setup_context, _geglu_autograd, _geglu_backward_impl
)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh"
) -> torch.Tensor:
    """``gelu(gate, approximate) * up``, differentiable; ``approximate`` is "tanh" or "none".

    ``gate`` and ``up``: ``[..., N]`` of one shape, dtype and device; any strides.
    """
    _check_approximate("geglu", approximate)
    check_tensors("geglu", dtensors=True, gate=gate, up=up)
    if gate.dim() == 0 or up.dim() == 0:
        raise ValueError(
            f"geglu: gate and up must have at least one dimension, got shapes "
            f"{tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.shape != up.shape:
        raise ValueError(
            f"geglu: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if is_dtensor(gate) or is_dtensor(up):
        _register_dtensor_rules()
    return _call(_geglu, _geglu_eager, needs_grad(gate, up), gate, up, approximate)


def _gelu_and_mul_impl(out: torch.Tensor, x: torch.Tensor, approximate: str) -> None:
    d = x.shape[-1] // 2
    geglu_fwd(x[..., :d], x[..., d:], out, approximate)


_gelu_and_mul = torch.library.custom_op(
    add_op_namespace_prefix("gelu_and_mul"), _gelu_and_mul_impl, mutates_args=("out",)
)


@_gelu_and_mul.register_fake
def _(out, x, approximate):
    return None


def _gelu_and_mul_checked(
    op: str, out: torch.Tensor, x: torch.Tensor, approximate: str
) -> torch.Tensor:
    check_tensors(op, out=out, x=x)
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(
            f"{op}: x must be [..., 2d] with an even last dim, got shape {tuple(x.shape)}"
        )
    expected = (*x.shape[:-1], x.shape[-1] // 2)
    if tuple(out.shape) != expected:
        raise ValueError(
            f"{op}: out must have shape {expected} for x of shape {tuple(x.shape)}, got {tuple(out.shape)}"
        )
    if out.numel() > 0 and any(
        s == 0 and n > 1 for s, n in zip(out.stride(), out.shape)
    ):
        raise ValueError(
            f"{op}: out has a zero stride (strides {out.stride()}, e.g. from expand()), so "
            f"several results would be written to one memory location; clone() it first"
        )
    if _dispatched(x) or torch.autograd._profiler_enabled():
        _gelu_and_mul(out, x, approximate)
    else:
        _gelu_and_mul_impl(out, x, approximate)
    return out


def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """kernels-community ``activation`` semantics: ``out = gelu(x[..., :d]) * x[..., d:]``
    with exact (erf) GeLU, written into ``out`` (``[..., d]``), which is returned."""
    return _gelu_and_mul_checked("gelu_and_mul", out, x, "none")


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """As ``gelu_and_mul`` with the tanh approximation of GeLU."""
    return _gelu_and_mul_checked("gelu_tanh_and_mul", out, x, "tanh")


# --- Linear with bias/activation epilogue -----------------------------------------------


def _empty(
    like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _op_outputs(like: torch.Tensor, *outputs: torch.Tensor | None) -> tuple:
    """A custom op's outputs: each one not computed (None) as a fresh empty tensor, which
    the op's schema needs. Eager calls keep the Nones and skip those allocations."""
    return tuple(_empty(like, 0) if o is None else o for o in outputs)


def _linear_forward(x, weight, bias, activation, store_preact):
    """(y, the pre-activation when ``store_preact`` else None)."""
    x2 = as_rows(x)
    y = _empty(x, x2.shape[0], weight.shape[0])
    preact = _empty(x, *y.shape) if store_preact else None
    gemm(x2, weight, y, bias1=bias, activation=activation, preact1=preact)
    return y.view(*x.shape[:-1], weight.shape[0]), preact


def _linear_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    store_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _op_outputs(x, *_linear_forward(x, weight, bias, activation, store_preact))


_linear = torch.library.custom_op(
    add_op_namespace_prefix("linear"), _linear_impl, mutates_args=()
)


@_linear.register_fake
def _(x, weight, bias, activation, store_preact):
    m = math.prod(
        x.shape[:-1]
    )  # symbolic under torch.compile (Size.numel() specialises)
    preact = _empty(x, m, weight.shape[0]) if store_preact else _empty(x, 0)
    return _empty(x, *x.shape[:-1], weight.shape[0]), preact


def _linear_backward_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    preact: torch.Tensor,
    activation: str | None,
    has_bias: bool,
    need_dx: bool,
    need_dw: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dy2, x2 = as_rows(dy), as_rows(x)
    # With an activation, dZ = round(dY * act'(Z)) is formed in each GEMM's prologue.
    act, z = (activation, preact) if activation is not None else (None, None)
    dx = _empty(x, *x.shape) if need_dx else _empty(x, 0)
    dw = _empty(weight, *weight.shape) if need_dw else _empty(weight, 0)
    db32 = (
        _empty(dy, weight.shape[0], dtype=torch.float32) if has_bias else _empty(dy, 0)
    )
    if need_dx:  # dX = dZ @ W
        gemm(dy2, weight.t(), as_rows(dx), grad_act=act, grad_act_of=z)
    if need_dw or has_bias:  # dW = dZ^T @ X; db = row sums of dZ^T, in the same GEMM
        dw_out = dw if need_dw else _empty(weight, *weight.shape)
        gemm(
            dy2.t(), x2.t(), dw_out, grad_act=act, grad_act_of=None if z is None else z.t(),
            sum_a=db32 if has_bias else None,
        )  # fmt: skip
    return dx, dw, db32.to(dy.dtype)


_linear_backward = torch.library.custom_op(
    add_op_namespace_prefix("linear_backward"), _linear_backward_impl, mutates_args=()
)


@_linear_backward.register_fake
def _(dy, x, weight, preact, activation, has_bias, need_dx, need_dw):
    return (
        _empty(x, *x.shape) if need_dx else _empty(x, 0),
        _empty(weight, *weight.shape) if need_dw else _empty(weight, 0),
        _empty(dy, weight.shape[0] if has_bias else 0),
    )


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias, activation, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.activation = activation
    ctx.has_bias = bias is not None


def _linear_autograd(ctx, dy, _dpreact, backward=_linear_backward):
    x, weight, preact = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx, dw, db = backward(
        dy,
        x,
        weight,
        preact,
        ctx.activation,
        ctx.has_bias and need_db,
        need_dx,
        need_dw,
    )
    return (
        dx if need_dx else None,
        dw if need_dw else None,
        db if need_db else None,
        None,
        None,
    )


_linear.register_autograd(_linear_autograd, setup_context=_linear_setup_context)
_linear_eager = _eager_function(
    _linear_forward, _linear_setup_context, _linear_autograd, _linear_backward_impl
)


def _check_linear_shapes(
    op: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    names: tuple[str, str, str] = ("x", "weight", "bias"),
) -> None:
    """x: [..., K], weight: [N, K], bias: [N]; ``names`` as the caller's arguments."""
    xn, wn, bn = names
    if x.dim() == 0:
        raise ValueError(f"{op}: {xn} must be [..., in_features], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(
            f"{op}: {wn} must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: {xn}'s last dim must equal {wn}'s in_features (dim 1), got {xn} "
            f"{tuple(x.shape)} and {wn} {tuple(weight.shape)}"
        )
    _check_bias(op, bias, weight, bn, wn)


def _check_bias(op, bias, weight, bn="bias", wn="weight") -> None:
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{op}: {bn} must have shape ({weight.shape[0]},), {wn}'s out_features, got "
            f"{tuple(bias.shape)}"
        )


def _check_activation(op: str, activation: str | None) -> None:
    if activation is not None and (
        not isinstance(activation, str) or activation not in ACTIVATIONS
    ):
        raise ValueError(
            f"{op}: activation must be None, 'gelu' or 'gelu_tanh', got {activation!r}"
        )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` in one kernel: bias and activation in the epilogue.

    x: [..., K]; weight: [N, K] (``nn.Linear`` layout, any strides); bias: [N];
    activation: None, "gelu" (exact) or "gelu_tanh". Differentiable in all three.
    """
    _check_activation("linear", activation)
    check_tensors("linear", x=x, weight=weight, **_given(bias=bias))
    _check_linear_shapes("linear", x, weight, bias)
    return _linear_checked(x, weight, bias, activation)


def _linear_checked(x, weight, bias, activation):
    """``linear`` once its arguments are known to be valid."""
    grad = needs_grad(x, weight, bias)
    store_preact = grad and activation is not None
    args = (x, weight, bias, activation, store_preact)
    return _call(_linear, _linear_eager, grad, *args)[0]


# --- GeGLU dual GEMM --------------------------------------------------------------------


def _geglu_linear_forward(x, w_gate, w_up, b_gate, b_up, approximate, store_preact):
    """(h, gate, up): the pre-activations when ``store_preact``, else None."""
    x2 = as_rows(x)
    m, n = x2.shape[0], w_gate.shape[0]
    h = _empty(x, m, n)
    gate, up = (_empty(x, m, n), _empty(x, m, n)) if store_preact else (None, None)
    activation = "gelu_tanh" if approximate == "tanh" else "gelu"
    gemm(
        x2, w_gate, h, b2=w_up, bias1=b_gate, bias2=b_up, activation=activation,
        preact1=gate, preact2=up,
    )  # fmt: skip
    return h.view(*x.shape[:-1], n), gate, up


def _geglu_linear_impl(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    b_gate: torch.Tensor | None,
    b_up: torch.Tensor | None,
    approximate: str,
    store_preact: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _op_outputs(
        x,
        *_geglu_linear_forward(
            x, w_gate, w_up, b_gate, b_up, approximate, store_preact
        ),
    )


_geglu_linear = torch.library.custom_op(
    add_op_namespace_prefix("geglu_linear"), _geglu_linear_impl, mutates_args=()
)


@_geglu_linear.register_fake
def _(x, w_gate, w_up, b_gate, b_up, approximate, store_preact):
    m, n = math.prod(x.shape[:-1]), w_gate.shape[0]
    pre = (
        (_empty(x, m, n), _empty(x, m, n))
        if store_preact
        else (_empty(x, 0), _empty(x, 0))
    )
    return _empty(x, *x.shape[:-1], n), *pre


def _geglu_linear_backward_impl(
    dh: torch.Tensor,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: str,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x2 = as_rows(x)
    dgate, dup = geglu_bwd(as_rows(dh), gate, up, approximate)
    dx = _empty(x, *x.shape)
    dx2 = as_rows(dx)
    gemm(dgate, w_gate.t(), dx2)  # dX = dGate @ Wg + dUp @ Wu
    gemm(dup, w_up.t(), dx2, add_c=True)
    grads = []
    for d, w in ((dgate, w_gate), (dup, w_up)):  # dW = d^T @ X, db = row sums of d^T
        dw = _empty(w, *w.shape)
        db32 = _empty(d, w.shape[0], dtype=torch.float32) if has_bias else _empty(d, 0)
        gemm(d.t(), x2.t(), dw, sum_a=db32 if has_bias else None)
        grads += [dw, db32.to(d.dtype)]
    return dx, grads[0], grads[2], grads[1], grads[3]


_geglu_linear_backward = torch.library.custom_op(
    add_op_namespace_prefix("geglu_linear_backward"),
    _geglu_linear_backward_impl,
    mutates_args=(),
)


@_geglu_linear_backward.register_fake
def _(dh, x, w_gate, w_up, gate, up, approximate, has_bias):
    nb = w_gate.shape[0] if has_bias else 0
    return (
        _empty(x, *x.shape),
        _empty(w_gate, *w_gate.shape),
        _empty(w_up, *w_up.shape),
        _empty(x, nb),
        _empty(x, nb),
    )


def _geglu_linear_setup_context(ctx, inputs, output):
    x, w_gate, w_up, b_gate, _, approximate, _ = inputs
    _, gate, up = output
    ctx.save_for_backward(x, w_gate, w_up, gate, up)
    ctx.approximate = approximate
    ctx.has_bias = b_gate is not None


def _geglu_linear_autograd(ctx, dh, _dgate, _dup, backward=_geglu_linear_backward):
    x, w_gate, w_up, gate, up = ctx.saved_tensors
    dx, dwg, dwu, dbg, dbu = backward(
        dh, x, w_gate, w_up, gate, up, ctx.approximate, ctx.has_bias
    )
    return (
        dx,
        dwg,
        dwu,
        dbg if ctx.has_bias else None,
        dbu if ctx.has_bias else None,
        None,
        None,
    )


_geglu_linear.register_autograd(
    _geglu_linear_autograd, setup_context=_geglu_linear_setup_context
)
_geglu_linear_eager = _eager_function(
    _geglu_linear_forward,
    _geglu_linear_setup_context,
    _geglu_linear_autograd,
    _geglu_linear_backward_impl,
)


def _check_geglu_linear(
    op: str,
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    b_gate: torch.Tensor | None,
    b_up: torch.Tensor | None,
    approximate: str,
    **more: torch.Tensor,
) -> None:
    """The dual GEMM's arguments; ``more``: further tensors of the same dtype and device."""
    _check_approximate(op, approximate)
    check_tensors(
        op, x=x, w_gate=w_gate, w_up=w_up, **_given(b_gate=b_gate, b_up=b_up), **more
    )
    if (b_gate is None) != (b_up is None):
        given, missing = ("b_up", "b_gate") if b_gate is None else ("b_gate", "b_up")
        raise ValueError(
            f"{op}: pass both biases or neither, got {given} but {missing} is None"
        )
    _check_linear_shapes(op, x, w_gate, b_gate, ("x", "w_gate", "b_gate"))
    _check_linear_shapes(op, x, w_up, b_up, ("x", "w_up", "b_up"))
    if w_gate.shape != w_up.shape:
        raise ValueError(
            f"{op}: w_gate and w_up must have the same shape [intermediate, hidden], got "
            f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}"
        )


def geglu_linear(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    approximate: str = "tanh",
) -> torch.Tensor:
    """``gelu(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)`` in one dual-GEMM kernel: each x
    tile is loaded once for both products and gate/up never reach HBM unless autograd
    needs them. Weights are [I, H] in any strides, so the halves of one fused [2I, H]
    weight (ModernBERT ``Wi``, diffusers ``GEGLU.proj``) are passed as row slices, no copy.
    """
    _check_geglu_linear("geglu_linear", x, w_gate, w_up, b_gate, b_up, approximate)
    return _geglu_linear_checked(x, w_gate, w_up, b_gate, b_up, approximate)


def _geglu_linear_checked(x, w_gate, w_up, b_gate, b_up, approximate):
    """``geglu_linear`` once its arguments are known to be valid."""
    store_preact = needs_grad(x, w_gate, w_up, b_gate, b_up)
    args = (x, w_gate, w_up, b_gate, b_up, approximate, store_preact)
    return _call(_geglu_linear, _geglu_linear_eager, store_preact, *args)[0]


def geglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None = None,
    b_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    approximate: str = "tanh",
) -> torch.Tensor:
    """``down(gelu(gate(x)) * up(x))`` in two kernels: the GeGLU dual GEMM, then the
    down projection with its bias in the epilogue."""
    _check_geglu_linear(
        "geglu_mlp", x, w_gate, w_up, b_gate, b_up, approximate,
        w_down=w_down, **_given(b_down=b_down),
    )  # fmt: skip
    inter = w_gate.shape[0]
    if w_down.dim() != 2 or w_down.shape[1] != inter:
        raise ValueError(
            f"geglu_mlp: w_down must be 2-D [hidden_out, intermediate] with intermediate = "
            f"w_gate.shape[0] = {inter}, got w_down of shape {tuple(w_down.shape)}"
        )
    _check_bias("geglu_mlp", b_down, w_down, "b_down", "w_down")
    # Everything is checked above: skip the two functions' own checks on this path.
    h = _geglu_linear_checked(x, w_gate, w_up, b_gate, b_up, approximate)
    return _linear_checked(h, w_down, b_down, None)
