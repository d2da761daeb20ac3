"""Autograd: one ``torch.autograd.Function`` per differentiable op, over the kernel ops of
library.py, and the PyTorch formulas that define each op.

- Backward computes only the gradients ``ctx.needs_input_grad`` asks for: a frozen weight
  costs no weight-gradient GEMM.
- Double backward (``create_graph=True``): backward then differentiates the op's PyTorch
  formula from the saved inputs, so second derivatives are eager's, not zero.
- ``torch.func`` transforms (grad, vmap, jacrev, ...) and forward-mode AD run the PyTorch
  formula itself (``apply`` below): it is the op's definition, and PyTorch's own rules
  cover it. Kernels do not run there.
- The Functions take ``ctx`` in ``forward`` (no ``setup_context``): ``apply`` then skips
  binding the arguments through ``inspect.signature`` on every call.
"""

import torch
import torch.nn.functional as F

from . import library
from .checks import transforms_active
from .gemm import GELU_TANH, NO_ACT


def _approximate(activation: int) -> str:
    return "tanh" if activation == GELU_TANH else "none"


def geglu_formula(gate, up, approximate):
    return F.gelu(gate, approximate=approximate) * up


def geglu_halves_formula(y, gate_half, approximate):
    return geglu_formula(*library.gate_and_up(y, gate_half), approximate)


def linear_formula(x, weight, bias, activation):
    y = F.linear(x, weight, bias)
    return (
        y if activation == NO_ACT else F.gelu(y, approximate=_approximate(activation))
    )


def geglu_linear_formula(x, w_gate, w_up, b_gate, b_up, approximate):
    gate = F.linear(x, w_gate, b_gate)
    return F.gelu(gate, approximate=approximate) * F.linear(x, w_up, b_up)


def geglu_mlp_formula(x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate):
    h = geglu_linear_formula(x, w_gate, w_up, b_gate, b_up, approximate)
    return F.linear(h, w_down, b_down)


def _differentiable_grads(formula, inputs: tuple, needs: tuple, grad_out):
    """The gradients of ``formula(*inputs)`` as a graph of PyTorch ops (double backward):
    the saved inputs are the originals, so the result differentiates again."""
    wrt = [t for t, need in zip(inputs, needs) if need]
    with torch.enable_grad():
        out = formula(*inputs)
    grads = iter(torch.autograd.grad(out, wrt, grad_out, create_graph=True))
    return tuple(next(grads) if need else None for need in needs)


# Whether the running backward keeps the graph (retain_graph=True); private in torch,
# hence asked for with a default: without it, saved tensors are assumed to be kept.
_keeps_graph = getattr(
    torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True
)


class GeGLU(torch.autograd.Function):
    """``owned``: gate and up are the caller's temporaries, which no one else reads (a
    layer's own projections). Backward then writes dgate and dup over them, where they
    die with this backward (an eager one that does not retain the graph), and bumps their
    version counters: any other saved use of them raises PyTorch's in-place error
    instead of reading gradients. The activation's backward then allocates nothing."""

    @staticmethod
    def forward(ctx, gate, up, approximate, owned):
        # gelu(gate) is recomputed in backward: only the inputs are kept alive.
        ctx.save_for_backward(gate, up)
        ctx.approximate = approximate
        ctx.owned = owned
        return library.geglu(gate, up, approximate)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():
            inputs = (gate, up, ctx.approximate)
            return _differentiable_grads(geglu_formula, inputs, needs, dout)
        if ctx.owned and not library.dispatched(dout) and not _keeps_graph():
            library.geglu_grad_in_place.eager(dout, gate, up, ctx.approximate)
            torch.autograd.graph.increment_version((gate, up))
            dgate, dup = gate, up
        else:
            dgate, dup = library.geglu_grad(dout, gate, up, ctx.approximate)
        return dgate if needs[0] else None, dup if needs[1] else None, None, None


class GeGLUHalves(torch.autograd.Function):
    """GeGLU of the two halves of one tensor ``y`` (a projection's output), with y's
    gradient returned as one tensor: through views (``chunk``), autograd would concatenate
    the halves' gradients, a copy of y's size. ``owned``: as GeGLU's; y itself then
    carries its gradient."""

    @staticmethod
    def forward(ctx, y, gate_half, approximate, owned):
        ctx.save_for_backward(y)
        ctx.gate_half, ctx.approximate, ctx.owned = gate_half, approximate, owned
        return library.geglu_halves(y, gate_half, approximate)

    @staticmethod
    def backward(ctx, dout):
        # y is the Function's one tensor input: autograd records it only when y needs grad.
        (y,) = ctx.saved_tensors
        gate_half, approximate = ctx.gate_half, ctx.approximate
        if torch.is_grad_enabled():
            inputs, needs = (y, gate_half, approximate), (True, False, False)
            (dy, _, _) = _differentiable_grads(
                geglu_halves_formula, inputs, needs, dout
            )
        elif ctx.owned and not library.dispatched(dout) and not _keeps_graph():
            gate, up = library.gate_and_up(y, gate_half)
            library.geglu_grad_in_place.eager(dout, gate, up, approximate)
            torch.autograd.graph.increment_version((y,))
            dy = y
        else:
            dy = library.geglu_halves_grad(dout, y, gate_half, approximate)
        return dy, None, None, None


class Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation):
        y, preact = library.linear(x, weight, bias, activation, activation != NO_ACT)
        ctx.save_for_backward(x, weight, bias, preact)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, preact = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():
            inputs = (x, weight, bias, ctx.activation)
            return _differentiable_grads(linear_formula, inputs, needs, dy)
        need_db = bias is not None and needs[2]
        dx, dw, db = library.linear_grad(
            dy, x, weight, preact, ctx.activation, needs[0], needs[1], need_db
        )
        return (
            dx if needs[0] else None,
            dw if needs[1] else None,
            db if need_db else None,
            None,
        )


class GeGLULinear(torch.autograd.Function):
    """The dual GEMM forward, storing gate and up for backward alone; backward writes dgate
    and dup over them (where nothing else can read them again: an eager backward that does
    not retain the graph) and runs cuBLAS for the GEMMs, dX's second accumulating into
    the first (beta = 1)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, b_gate, b_up, approximate):
        h, gate, up = library.geglu_linear(
            x, w_gate, w_up, b_gate, b_up, approximate, True
        )
        ctx.save_for_backward(x, w_gate, w_up, b_gate, b_up, gate, up)
        ctx.approximate = approximate
        return h

    @staticmethod
    def backward(ctx, dh):
        x, w_gate, w_up, b_gate, b_up, gate, up = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if torch.is_grad_enabled():
            inputs = (x, w_gate, w_up, b_gate, b_up, ctx.approximate)
            return _differentiable_grads(geglu_linear_formula, inputs, needs, dh)
        dh = dh.reshape(gate.shape)  # gate and up are [rows, intermediate]
        if not library.dispatched(dh) and not _keeps_graph():
            library.geglu_grad_in_place.eager(dh, gate, up, ctx.approximate)
            dgate, dup = gate, up
        else:
            dgate, dup = library.geglu_grad(dh, gate, up, ctx.approximate)
        dx = dwg = dwu = None
        if needs[0]:  # dX = dGate @ Wg + dUp @ Wu
            dx = torch.mm(dgate, w_gate).addmm_(dup, w_up).view(x.shape)
        if needs[1] or needs[2]:
            x2 = x.reshape(gate.shape[0], x.shape[-1])
            dwg = torch.mm(dgate.t(), x2) if needs[1] else None
            dwu = torch.mm(dup.t(), x2) if needs[2] else None
        dbg = dgate.sum(0) if needs[3] else None
        dbu = dup.sum(0) if needs[4] else None
        return dx, dwg, dwu, dbg, dbu, None


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a call on ``tensors`` (None for an absent bias)."""
    return torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors
    )


def _call(function, formula, op, args: tuple, tensors: tuple, store_preact=None,
          function_args: tuple = ()):  # fmt: skip
    """One public function's call: the autograd Function where autograd records it, else
    the kernel op (dispatched, or its body in eager); the PyTorch formula under torch.func
    transforms and forward-mode AD. ``store_preact``: the op's last argument (False: the
    forward's intermediates are not kept) for ops that return them after the output.
    ``function_args``: the Function's arguments after the op's."""
    grad = needs_grad(*tensors)
    if not library.dispatched(args[0]):
        if transforms_active():
            return formula(*args)
        if grad:
            return function.apply(*args, *function_args)
        run = op.eager
    elif grad:
        return function.apply(*args, *function_args)
    else:
        run = op.op
    if store_preact is None:
        return run(*args)
    return run(*args, store_preact)[0]


def geglu(gate, up, approximate: str, owned: bool = False) -> torch.Tensor:
    """``owned``: see GeGLU."""
    args = (gate, up, approximate)
    return _call(
        GeGLU, geglu_formula, library.geglu, args, (gate, up), function_args=(owned,)
    )


def geglu_halves(y, gate_half: int, approximate: str, owned: bool = False):
    """``owned``: see GeGLU."""
    args = (y, gate_half, approximate)
    return _call(
        GeGLUHalves, geglu_halves_formula, library.geglu_halves, args, (y,),
        function_args=(owned,),
    )  # fmt: skip


def linear(x, weight, bias, activation: int) -> torch.Tensor:
    args = (x, weight, bias, activation)
    return _call(Linear, linear_formula, library.linear, args, (x, weight, bias), False)


def geglu_linear(x, w_gate, w_up, b_gate, b_up, approximate: str) -> torch.Tensor:
    args = (x, w_gate, w_up, b_gate, b_up, approximate)
    tensors = (x, w_gate, w_up, b_gate, b_up)
    return _call(
        GeGLULinear, geglu_linear_formula, library.geglu_linear, args, tensors, False
    )


def one_launch_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate):
    """The whole MLP in one launch, where autograd records nothing (the route's call: no
    backward is defined for it); the PyTorch formula under torch.func transforms."""
    args = (x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate)
    if library.dispatched(x):
        return library.one_launch_mlp.op(*args)
    if transforms_active():
        return geglu_mlp_formula(*args)
    return library.one_launch_mlp.eager(*args)
