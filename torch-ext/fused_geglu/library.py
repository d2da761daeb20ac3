"""The kernels as ``torch.library`` custom ops, each with a fake (meta) implementation, and
the eager bypass.

Each op is registered once; ``KernelOp.__call__`` is how every caller reaches it. Under
``torch.compile``, or for a tensor the dispatcher must see (a FakeTensor, a DTensor, a
meta tensor), it calls the op, which Dynamo treats as opaque and DTensor runs on its
shards. Eager calls on plain tensors run the implementation directly: the custom op's
Python dispatch costs more host time than the launches at decode sizes. Profiles still
name the op (a ``record_function`` range while a profiler runs).

The ops are not differentiable: autograd.py wraps them, one ``autograd.Function`` per
public op. The op namespace comes from the build's ``_ops.py`` and is unique per build, as
kernel-builder's is.
"""

import functools
import math

import torch

from . import one_launch
from ._ops import add_op_namespace_prefix
from .checks import PLAIN_TENSORS
from .elementwise import as_rows, geglu_backward, geglu_forward
from .gemm import GELU_TANH, NO_ACT, gelu_code, gemm, gemm_act, gemm_dact, gemm_gated


def rows_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the GEMMs read it: itself when 2-D or contiguous (no view made), else 2-D
    rows (a view, or a copy where strides cannot express one)."""
    if t.dim() == 2 or (t.is_contiguous() and t.shape[-1] > 0):
        return t
    return as_rows(t)


def empty(like: torch.Tensor, *shape, dtype: torch.dtype | None = None) -> torch.Tensor:
    # new_empty: fewer arguments to parse than torch.empty(shape, dtype=, device=)
    if dtype is None:
        return like.new_empty(shape)
    return like.new_empty(shape, dtype=dtype)


# Whether a profiler records: eager calls then run inside a record_function named for the op.
profiler_enabled = torch.autograd._profiler_enabled


def dispatched(t: torch.Tensor) -> bool:
    """Whether a call on ``t`` must go through the dispatcher (see the module docstring)."""
    return (
        torch.compiler.is_compiling()
        or type(t) not in PLAIN_TENSORS
        or t.device.type == "meta"
    )


def _on_tensors_device(impl):
    """``impl`` with the current CUDA device set to its first argument's: Triton launches on
    the current device, which need not hold the tensors when a model is spread over GPUs
    (transformers' ``device_map="auto"``)."""

    def run(*args):
        t = args[0]
        if t.is_cuda and t.get_device() != torch.cuda.current_device():
            with torch.cuda.device(t.device):
                return impl(*args)
        return impl(*args)

    return run


class KernelOp:
    """A custom op and its implementation. The implementation may return None for an
    output it did not compute (eager callers skip those allocations); the registered op
    returns an empty tensor there, as its schema needs."""

    def __init__(self, name: str, schema: str, impl, fake, mutates_args=()):
        impl = _on_tensors_device(impl)

        def registered(*args):
            out = impl(*args)
            if isinstance(out, tuple):
                return tuple(empty(args[0], 0) if o is None else o for o in out)
            return out

        self.impl = impl
        self.op = torch.library.custom_op(
            add_op_namespace_prefix(name), registered, mutates_args=mutates_args,
            schema=schema,
        )  # fmt: skip
        self.op.register_fake(fake)
        self.name = self.op._qualname

    def __call__(self, *args):
        if dispatched(args[0]):
            return self.op(*args)
        return self.eager(*args)

    def eager(self, *args):
        """The implementation, for plain tensors outside torch.compile."""
        if profiler_enabled():
            with torch.profiler.record_function(self.name):
                return self.impl(*args)
        return self.impl(*args)


# --- GeGLU activation -------------------------------------------------------------------


def _geglu(gate, up, approximate):
    out = empty(gate, *gate.shape)
    geglu_forward(gate, up, out, approximate)
    return out


geglu = KernelOp(
    "geglu",
    "(Tensor gate, Tensor up, str approximate) -> Tensor",
    _geglu,
    lambda gate, up, approximate: empty(gate, *gate.shape),
)

geglu_grad = KernelOp(
    "geglu_backward",
    "(Tensor dout, Tensor gate, Tensor up, str approximate) -> (Tensor, Tensor)",
    geglu_backward,
    lambda dout, gate, up, approximate: (
        empty(gate, *gate.shape),
        empty(gate, *gate.shape),
    ),
)


def _geglu_backward_in_place(dout, gate, up, approximate):
    geglu_backward(dout, gate, up, approximate, gate, up)


# Overwrites gate and up with their gradients: for a backward that owns them (autograd.py).
geglu_grad_in_place = KernelOp(
    "geglu_backward_in_place",
    "(Tensor dout, Tensor(a!) gate, Tensor(b!) up, str approximate) -> ()",
    _geglu_backward_in_place,
    lambda dout, gate, up, approximate: None,
    mutates_args=("gate", "up"),
)


def gate_and_up(y: torch.Tensor, gate_half: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves of ``y`` (``[..., 2d]``) as (gate, up) views; ``gate_half``: which half is
    the gate (0: the first)."""
    d = y.shape[-1] // 2
    first, second = y[..., :d], y[..., d:]
    return (first, second) if gate_half == 0 else (second, first)


def _geglu_halves(y, gate_half, approximate):
    return _geglu(*gate_and_up(y, gate_half), approximate)


geglu_halves = KernelOp(
    "geglu_halves",
    "(Tensor y, int gate_half, str approximate) -> Tensor",
    _geglu_halves,
    lambda y, gate_half, approximate: empty(y, *y.shape[:-1], y.shape[-1] // 2),
)


def _geglu_halves_backward(dout, y, gate_half, approximate):
    """y's gradient as one tensor, its halves written by the backward kernel (no concat)."""
    dy = empty(y, *y.shape)
    geglu_backward(
        dout, *gate_and_up(y, gate_half), approximate, *gate_and_up(dy, gate_half)
    )
    return dy


geglu_halves_grad = KernelOp(
    "geglu_halves_backward",
    "(Tensor dout, Tensor y, int gate_half, str approximate) -> Tensor",
    _geglu_halves_backward,
    lambda dout, y, gate_half, approximate: empty(y, *y.shape),
)


def _gelu_and_mul(out, x, approximate):
    geglu_forward(*gate_and_up(x, 0), out, approximate)


gelu_and_mul = KernelOp(
    "gelu_and_mul",
    "(Tensor(a!) out, Tensor x, str approximate) -> ()",
    _gelu_and_mul,
    lambda out, x, approximate: None,
    mutates_args=("out",),
)


@functools.cache
def register_dtensor_rules() -> None:
    """DTensor sharding rules of the elementwise ops, registered at their first DTensor
    call: all inputs replicated, or all sharded along one same dim, and the outputs
    alike (GeLU is not linear: no Partial)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def elementwise(like: torch.Tensor, n_in: int, n_out: int) -> list:
        placements = [Replicate()] + [Shard(d) for d in range(like.ndim)]
        return [([p] * n_out, [p] * n_in + [None]) for p in placements]

    register_sharding(geglu.op._opoverload)(
        lambda gate, up, approximate: elementwise(gate, 2, 1)
    )
    register_sharding(geglu_grad.op._opoverload)(
        lambda dout, gate, up, approximate: elementwise(gate, 3, 2)
    )


# --- Linear with bias/activation epilogue -----------------------------------------------


def _linear(x, weight, bias, activation, store_preact):
    """(act(x @ weight^T + bias), the pre-activation when ``store_preact`` else None)."""
    x2 = rows_operand(x)
    n = weight.shape[0]
    y = empty(x, *x.shape[:-1], n)
    preact = None
    if activation == NO_ACT:
        gemm(x2, weight, y, bias=bias)
    else:
        preact = empty(x, math.prod(x.shape[:-1]), n) if store_preact else None
        gemm_act(x2, weight, y, activation, bias=bias, preact=preact)
    return y, preact


def _linear_fake(x, weight, bias, activation, store_preact):
    m = 1
    for s in x.shape[:-1]:  # symbolic under torch.compile (Size.numel() specialises)
        m = m * s
    preact = empty(x, m, weight.shape[0]) if store_preact else empty(x, 0)
    return empty(x, *x.shape[:-1], weight.shape[0]), preact


linear = KernelOp(
    "linear",
    "(Tensor x, Tensor weight, Tensor? bias, int activation, bool store_preact)"
    " -> (Tensor, Tensor)",
    _linear,
    _linear_fake,
)


def _bias_grad_alone(dz: torch.Tensor) -> torch.Tensor:
    """Column sums of dZ [M, N] in fp32, for a bias whose weight needs no gradient."""
    return dz.float().sum(0)


def _linear_backward(dy, x, weight, preact, activation, need_dx, need_dw, need_db):
    """(dx, dw, db), None where not needed, of act(x @ W^T + b) with an activation
    (without one, training takes cuBLAS: policy.linear). dZ = round(dY * act'(Z)) is formed
    in each GEMM's prologue; the bias gradient rides in the weight-gradient GEMM, or is a
    column sum when no weight gradient is needed."""
    dy2, x2 = as_rows(dy), as_rows(x)
    dx = dw = db = None
    if need_dx:  # dX = dZ @ W
        dx = empty(x, *x.shape)
        gemm_dact(dy2, preact, weight.t(), as_rows(dx), activation)
    db32 = empty(dy, weight.shape[0], dtype=torch.float32) if need_db else None
    if need_dw:  # dW = dZ^T @ X; db = row sums of dZ^T, in the same GEMM
        dw = empty(weight, *weight.shape)
        gemm_dact(dy2.t(), preact.t(), x2.t(), dw, activation, bias_grad=db32)
    elif need_db:
        approximate = "tanh" if activation == GELU_TANH else "none"
        dz = torch.ops.aten.gelu_backward(dy2, preact, approximate=approximate)
        db32 = _bias_grad_alone(dz)
    if need_db:
        db = db32.to(dy.dtype)
    return dx, dw, db


linear_grad = KernelOp(
    "linear_backward",
    "(Tensor dy, Tensor x, Tensor weight, Tensor preact, int activation, bool need_dx,"
    " bool need_dw, bool need_db) -> (Tensor, Tensor, Tensor)",
    _linear_backward,
    lambda dy, x, weight, preact, activation, need_dx, need_dw, need_db: (
        empty(x, *x.shape) if need_dx else empty(x, 0),
        empty(weight, *weight.shape) if need_dw else empty(weight, 0),
        empty(dy, weight.shape[0] if need_db else 0),
    ),
)


# --- GeGLU dual GEMM --------------------------------------------------------------------


def _geglu_linear(x, w_gate, w_up, b_gate, b_up, approximate, store_preact):
    """(h, gate, up): the pre-activations when ``store_preact``, else None."""
    x2 = rows_operand(x)
    n = w_gate.shape[0]
    h = empty(x, *x.shape[:-1], n)
    gate = up = None
    if store_preact:
        m = math.prod(x.shape[:-1])
        gate, up = empty(x, m, n), empty(x, m, n)
    gemm_gated(
        x2, w_gate, w_up, h, gelu_code(approximate), bias_gate=b_gate, bias_up=b_up,
        gate=gate, up=up,
    )  # fmt: skip
    return h, gate, up


def _geglu_linear_fake(x, w_gate, w_up, b_gate, b_up, approximate, store_preact):
    h, pre = _linear_fake(x, w_gate, None, NO_ACT, store_preact)
    return h, pre, empty(pre, *pre.shape)


geglu_linear = KernelOp(
    "geglu_linear",
    "(Tensor x, Tensor w_gate, Tensor w_up, Tensor? b_gate, Tensor? b_up,"
    " str approximate, bool store_preact) -> (Tensor, Tensor, Tensor)",
    _geglu_linear,
    _geglu_linear_fake,
)


# --- The whole MLP in one launch (inference, few tokens) --------------------------------


def _one_launch_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate):
    out = empty(x, *x.shape[:-1], w_down.shape[0])
    one_launch.one_launch_mlp(
        rows_operand(x), w_gate, w_up, w_down, out, gelu_code(approximate),
        bias_gate=b_gate, bias_up=b_up, bias_down=b_down,
    )  # fmt: skip
    return out


one_launch_mlp = KernelOp(
    "one_launch_mlp",
    "(Tensor x, Tensor w_gate, Tensor w_up, Tensor w_down, Tensor? b_gate, Tensor? b_up,"
    " Tensor? b_down, str approximate) -> Tensor",
    _one_launch_mlp,
    lambda x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate: empty(
        x, *x.shape[:-1], w_down.shape[0]
    ),
)
