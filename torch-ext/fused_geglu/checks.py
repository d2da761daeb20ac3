"""Input checks of the public functions: dense tensors of one supported dtype on one device
Triton can run on, and consistent shapes. Messages name every tensor's shape, dtype and
device; they are built only on error."""

import sys

import torch
from torch.autograd import forward_ad

from .launch import CPU_UNAVAILABLE

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# cuda includes ROCm; cpu: the interpreter only; meta: shapes only (the fake kernels)
DEVICES = ("cuda", "xpu", "cpu", "meta")
APPROXIMATIONS = ("tanh", "none")
# linear()'s activation argument -> the GEMM's activation code (gemm.py)
LINEAR_ACTIVATIONS = {None: 0, "gelu": 1, "gelu_tanh": 2}


def describe(tensors: dict[str, torch.Tensor]) -> str:
    return "; ".join(
        f"{n}: shape {tuple(t.shape)}, {t.dtype}, {t.device}"
        for n, t in tensors.items()
    )


def given(**tensors: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The optional tensors (biases) that were passed."""
    return {n: t for n, t in tensors.items() if t is not None}


# Tensor types checked and dispatched by the fast paths below; subclasses (DTensor,
# FakeTensor, user subclasses) take the full checks and the dispatcher.
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def check_tensors(op: str, dtensors: bool = False, **tensors: torch.Tensor) -> None:
    """Dense tensors of one dtype on one device, a supported dtype, a device Triton can
    run on; DTensors only where ``dtensors`` (the op has a sharding rule). Messages name
    every tensor's shape, dtype and device (built only on error)."""
    first = next(iter(tensors.values()))
    if type(first) in PLAIN_TENSORS:  # the common case, in a few attribute reads
        dtype, device = first.dtype, first.device
        if dtype in SUPPORTED_DTYPES and device.type in _RUNNABLE_DEVICE_TYPES:
            for t in tensors.values():
                if (
                    type(t) not in PLAIN_TENSORS
                    or t.dtype is not dtype
                    or t.device != device
                    or t.layout is not torch.strided
                ):
                    break
            else:
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
                f"({describe(tensors)})"
            )
        if t.device != first.device:
            raise ValueError(
                f"{op}: expected all tensors on one device, but {first_name} is on {first.device} "
                f"and {name} on {t.device} ({describe(tensors)})"
            )
    if first.dtype not in SUPPORTED_DTYPES:
        why = (
            "; float64 is refused rather than silently computed in float32"
            if first.dtype == torch.float64
            else ""
        )
        raise TypeError(
            f"{op}: dtype {first.dtype} is not supported (supported: bfloat16, float16, "
            f"float32){why} ({describe(tensors)})"
        )
    if first.device.type not in DEVICES:
        raise RuntimeError(
            f"{op}: Triton kernels cannot run on {first.device.type} tensors (supported: "
            f"cuda, xpu, cpu with TRITON_INTERPRET=1, and meta) ({describe(tensors)})"
        )
    if first.device.type == "cpu" and CPU_UNAVAILABLE:
        raise RuntimeError(
            f"{op}: CPU tensors need the Triton interpreter ({CPU_UNAVAILABLE}) or a GPU "
            f"({describe(tensors)})"
        )


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor (about 1 s at
    the package's import): none exists before that module is imported."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


# Device types where the Triton kernels run (the CPU only under the interpreter).
_RUNNABLE_DEVICE_TYPES = frozenset(
    d for d in DEVICES if d != "cpu" or CPU_UNAVAILABLE is None
)


def transforms_active() -> bool:
    """Whether a torch.func transform or a forward-mode AD level is active (asked outside
    torch.compile only: Dynamo does not trace the query, and torch.compile over torch.func
    is left to the kernels)."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``."""
    return device.type in _RUNNABLE_DEVICE_TYPES


def check_approximate(op: str, approximate: str) -> None:
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(
            f"{op}: approximate must be 'tanh' or 'none', got {approximate!r}"
        )


def check_linear_shapes(
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
    check_bias(op, bias, weight, bn, wn)


def check_bias(op, bias, weight, bn="bias", wn="weight") -> None:
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"{op}: {bn} must have shape ({weight.shape[0]},), {wn}'s out_features, got "
            f"{tuple(bias.shape)}"
        )


def check_activation(op: str, activation: str | None) -> None:
    if activation is not None and (
        not isinstance(activation, str) or activation not in LINEAR_ACTIVATIONS
    ):
        raise ValueError(
            f"{op}: activation must be None, 'gelu' or 'gelu_tanh', got {activation!r}"
        )


def check_geglu_linear(
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
    check_approximate(op, approximate)
    check_tensors(
        op, x=x, w_gate=w_gate, w_up=w_up, **given(b_gate=b_gate, b_up=b_up), **more
    )
    if (b_gate is None) != (b_up is None):
        passed, missing = ("b_up", "b_gate") if b_gate is None else ("b_gate", "b_up")
        raise ValueError(
            f"{op}: pass both biases or neither, got {passed} but {missing} is None"
        )
    check_linear_shapes(op, x, w_gate, b_gate, ("x", "w_gate", "b_gate"))
    check_linear_shapes(op, x, w_up, b_up, ("x", "w_up", "b_up"))
    if w_gate.shape != w_up.shape:
        raise ValueError(
            f"{op}: w_gate and w_up must have the same shape [intermediate, hidden], got "
            f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}"
        )


def check_down_projection(op, w_gate, w_down, b_down) -> None:
    """geglu_mlp's down projection: [hidden_out, intermediate] with w_gate's intermediate."""
    inter = w_gate.shape[0]
    if w_down.dim() != 2 or w_down.shape[1] != inter:
        raise ValueError(
            f"{op}: w_down must be 2-D [hidden_out, intermediate] with intermediate = "
            f"w_gate.shape[0] = {inter}, got w_down of shape {tuple(w_down.shape)}"
        )
    check_bias(op, b_down, w_down, "b_down", "w_down")


def check_gelu_and_mul(op: str, out: torch.Tensor, x: torch.Tensor) -> None:
    """kernels-community ``activation`` semantics: ``out`` is ``[..., d]`` for ``x`` of
    ``[..., 2d]``; not differentiable (an out= function, as there)."""
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
    if torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(
            f"{op}: x requires grad, but {op}(out, x) writes into out and is not "
            f"differentiable (kernels-community activation semantics; x: shape "
            f"{tuple(x.shape)}, {x.dtype}, {x.device}). Use geglu(x[..., :d], x[..., d:]) "
            f"for a differentiable result, or call it under torch.no_grad()"
        )


def check_contiguous(op: str, **tensors: torch.Tensor | None) -> None:
    """Outputs the GEMM kernels write as contiguous rows (the stored pre-activations)."""
    bad = {n: t for n, t in tensors.items() if t is not None and not t.is_contiguous()}
    if bad:
        raise ValueError(f"{op}: these outputs must be contiguous ({describe(bad)})")
