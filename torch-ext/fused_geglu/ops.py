"""Public functions, their input checks, and their ``torch.library`` registration.

Every kernel is a ``torch.library.custom_op`` with a fake (meta) implementation and,
where differentiable, an autograd formula, so the functions run under
``torch.compile(fullgraph=True)`` without graph breaks. The op namespace comes from the
build's ``_ops.py`` and is unique per build, as kernel-builder's is.
"""

import torch

from ._ops import add_op_namespace_prefix
from .activation import INTERPRETED, geglu_bwd, geglu_fwd

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
APPROXIMATIONS = ("tanh", "none")


def _describe(name: str, t: torch.Tensor) -> str:
    return f"{name}: shape {tuple(t.shape)}, {t.dtype}, {t.device}"


def check_tensors(op: str, **tensors: torch.Tensor) -> None:
    """One dtype and one device for all, a supported dtype, a device Triton can run on."""
    items = list(tensors.items())
    described = "; ".join(_describe(n, t) for n, t in items)
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}"
            )
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{op}: expected {name} and {first_name} to have the same dtype, "
                f"but got {first_name}.dtype = {first.dtype} and {name}.dtype = {t.dtype} ({described})"
            )
        if t.device != first.device:
            raise ValueError(
                f"{op}: expected all tensors on one device, but {first_name} is on {first.device} "
                f"and {name} on {t.device} ({described})"
            )
    if first.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: dtype {first.dtype} is not supported (supported: bfloat16, float16, float32); "
            f"float64 is refused rather than silently computed in float32 ({described})"
        )
    if first.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{op}: CPU tensors need the Triton interpreter (set TRITON_INTERPRET=1 before "
            f"importing triton) or a GPU ({described})"
        )


def _check_approximate(op: str, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(
            f"{op}: approximate must be 'tanh' or 'none', got {approximate!r}"
        )


# --- GeGLU activation -------------------------------------------------------------------


@torch.library.custom_op(add_op_namespace_prefix("geglu"), mutates_args=())
def _geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    geglu_fwd(gate, up, out, approximate)
    return out


@_geglu.register_fake
def _(gate, up, approximate):
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op(add_op_namespace_prefix("geglu_backward"), mutates_args=())
def _geglu_backward(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return geglu_bwd(dout, gate, up, approximate)


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


def _geglu_autograd(ctx, dout):
    gate, up = ctx.saved_tensors
    dgate, dup = _geglu_backward(dout, gate, up, ctx.approximate)
    return dgate, dup, None


_geglu.register_autograd(_geglu_autograd, setup_context=_geglu_setup_context)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh"
) -> torch.Tensor:
    """``gelu(gate, approximate) * up``, differentiable; ``approximate`` is "tanh" or "none".

    ``gate`` and ``up``: ``[..., N]`` of one shape, dtype and device; any strides.
    """
    _check_approximate("geglu", approximate)
    check_tensors("geglu", gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(
            f"geglu: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dim() == 0:
        raise ValueError(
            "geglu: gate and up must have at least one dimension, got 0-d tensors"
        )
    return _geglu(gate, up, approximate)


@torch.library.custom_op(add_op_namespace_prefix("gelu_and_mul"), mutates_args=("out",))
def _gelu_and_mul(out: torch.Tensor, x: torch.Tensor, approximate: str) -> None:
    d = x.shape[-1] // 2
    geglu_fwd(x[..., :d], x[..., d:], out, approximate)


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
    _gelu_and_mul(out, x, approximate)
    return out


def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """kernels-community ``activation`` semantics: ``out = gelu(x[..., :d]) * x[..., d:]``
    with exact (erf) GeLU, written into ``out`` (``[..., d]``), which is returned."""
    return _gelu_and_mul_checked("gelu_and_mul", out, x, "none")


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """As ``gelu_and_mul`` with the tanh approximation of GeLU."""
    return _gelu_and_mul_checked("gelu_tanh_and_mul", out, x, "tanh")
