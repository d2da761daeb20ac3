"""Drop-in ``forward`` replacements that ``kernels.kernelize`` swaps into models.

kernels' layer rules: no ``__init__``, no members but ``has_backward`` and
``can_torch_compile``; ``self`` is the original module, whose submodules are declared
here as annotations. Each forward has the signature of the forward it replaces. The route
(which kernels, or the module's own forward) is policy.py's: a layer runs our kernels only
where they reproduce the module's forward, and otherwise the module's own forward
(``own_forward``), with a warning naming the reason, once.
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import autograd, library
from .checks import (
    CPU_UNAVAILABLE,
    PLAIN_TENSORS,
    SUPPORTED_DTYPES,
    is_dtensor,
    kernels_run_on,
)
from .fp8.modules import fp8_output
from .gemm import NO_ACT
from .module_route import ModuleRoute, module_route
from .policy import (
    down_projection,
    eager_activation_pays,
    fuse_projections,
    linear,
)
from .reproduction import Family, is_identity_dropout

GEMMA_MLP = Family(
    "GeGLUMLP",
    ("gate_proj", "up_proj"),
    0,
    "down_proj",
    "act_fn",
    ("transformers.models.gemma.modeling_gemma:GemmaMLP",),
)
T5_GATED_DENSE = Family(
    "T5GeGLUDense",
    ("wi_0", "wi_1"),
    0,
    "wo",
    "act",
    ("transformers.models.t5.modeling_t5:T5DenseGatedActDense",),
)
MODERNBERT_MLP = Family(
    "ModernBertGeGLUMLP",
    ("Wi",),
    0,
    "Wo",
    "act",
    ("transformers.models.modernbert.modeling_modernbert:ModernBertMLP",),
)
DIFFUSERS_GEGLU = Family(
    "GEGLU", ("proj",), 1, None, None, ("diffusers.models.activations:GEGLU",)
)


def _checked_route(route, module: nn.Module, x: torch.Tensor, family: Family):
    """The module's route for ``x``, or None after warning that it runs its own forward."""
    reason = fallback_reason(route, x)
    if reason is None:
        return route
    if not torch.compiler.is_compiling():  # warned by the eager calls
        warn_fallback(module, family.name, reason, route.warned)
    return None


def own_forward(module: nn.Module):
    """The forward of the module's class: the nearest in its MRO that is not one of these
    layers' (a class that binds ours, ``class Mine(GemmaMLP): forward =
    GeGLUMLP.forward``, falls back to its base's, where calling ours again would
    recurse)."""
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is not None and forward not in LAYER_FORWARDS:
            return forward
    return nn.Module.forward


# --- What a layer does per call ---------------------------------------------------------


def trains_eager(route: ModuleRoute, x: torch.Tensor) -> bool:
    """Whether this call runs the module's own forward by training_kernel_min_elements,
    asked right after the one-launch path (which takes no call that autograd records;
    host time is both paths' cost): plain projections (the route knows the
    sizes), a one-op GeLU, a small ``x`` (of another last dim, the module's forward
    raises its own error), autograd recording. Asked of any tensor ``x``: the module's
    own forward is the answer for all."""
    return x.numel() < route.eager_training_inputs and autograd.needs_grad(
        x, *route.fusable
    )


def fallback_reason(route: ModuleRoute, x: torch.Tensor) -> str | None:
    """Why our kernels cannot run this call (None: they can)."""
    return route.fallback if route.fallback is not None else input_reason(x)


def input_reason(x: torch.Tensor) -> str | None:
    """Why our kernels cannot take ``x`` (None: they can)."""
    if not kernels_run_on(x.device):
        cpu = f" ({CPU_UNAVAILABLE})" if x.device.type == "cpu" else ""
        return (
            f"Triton kernels cannot run on {x.device.type} tensors in this process{cpu}"
        )
    if x.dtype not in SUPPORTED_DTYPES:
        return f"its input is {x.dtype} (the kernels take bfloat16, float16, float32)"
    return None


def warn_fallback(
    module: nn.Module, layer: str, reason: str, warned: set | None = None
) -> None:
    """Warns that the module runs its own forward, once per reason in ``warned`` (the
    module's route's; Python's warning filters then show one of identical messages)."""
    if warned is None or reason not in warned:
        if warned is not None:
            warned.add(reason)
        warnings.warn(
            f"fused-geglu {layer}: {type(module).__name__} runs its own forward: "
            f"{reason}",
            RuntimeWarning,
            stacklevel=4,
        )


def mlp_output(route: ModuleRoute, x: torch.Tensor, dropout: nn.Module | None = None):
    """The module's output for ``x`` in one launch (``dropout``: the module's dropout
    between the activation and the down projection, which must be the identity), or None
    where the route does not take it: the layers' fast path, asked first. ``route.mlp``
    holds only weights the dual GEMM takes, so an ``x`` of their dtype and device, of a
    plain type, outside autocast and torch.func transforms, meets the rest of
    ``fuse_projections`` and ``input_reason``. Eager calls only: module_route prepares
    ``mlp_launch`` outside torch.compile."""
    launch = route.mlp_launch
    if launch is None:
        return None if route.fp8 is None else fp8_output(route, x, dropout)
    if not launch.takes(x) or not (dropout is None or is_identity_dropout(dropout)):
        return None
    if x.is_contiguous() and not library.profiler_enabled():
        return launch(x)
    return library.one_launch_mlp.eager(x, *launch.operands, route.approximate)


def geglu_projections(route: ModuleRoute, x: torch.Tensor, family: Family):
    """(gelu(gate) * up of the module's projections for ``x``, whether the dual GEMM
    computed it). Otherwise the projections' own forwards (cuBLAS, or whatever wraps them:
    LoRA, quantised, hooked, autocast) and our fused activation."""
    fusable = route.fusable
    if fusable is not None:
        w_gate, w_up, b_gate, b_up = fusable
        # The module's own forward would raise for another dtype, size or device.
        if (
            w_gate.dtype is x.dtype
            and x.shape[-1] == w_gate.shape[1]
            and w_gate.device == x.device
            and fuse_projections(x)
        ):
            return autograd.geglu_linear(
                x, w_gate, w_up, b_gate, b_up, route.approximate
            ), True
    # Plain nn.Linear projections without hooks (and no global hook: module_route) hand
    # their outputs to no one else: the activation's backward may overwrite them.
    owned = route.fusable is not None
    if len(route.projections) == 2:
        gate, up = route.projections[0](x), route.projections[1](x)
        if route.one_op_gelu and eager_activation_pays(gate.numel(), gate, up):
            return autograd.geglu_formula(gate, up, route.approximate), False
        return activation(gate, up, route.approximate, owned), False
    y = route.projections[0](x)
    if route.one_op_gelu and eager_activation_pays(y.numel() // 2, y):
        return autograd.geglu_halves_formula(
            y, family.gate_half, route.approximate
        ), False
    return halves_activation(y, family.gate_half, route.approximate, owned), False


def activation(
    gate: torch.Tensor, up: torch.Tensor, approximate: str, owned: bool = False
) -> torch.Tensor:
    """``gelu(gate) * up`` for the projections' outputs: our kernel where it computes
    exactly that (one shape, dtype and device it runs on; DTensors of one shape through
    their sharding rule), else eager's formula (broadcasting, mixed or other dtypes).
    ``owned``: autograd.GeGLU's."""
    plain = type(gate) in PLAIN_TENSORS and type(up) in PLAIN_TENSORS
    if (
        gate.shape == up.shape
        and gate.dtype is up.dtype
        and gate.dtype in SUPPORTED_DTYPES
        and gate.device == up.device
        and kernels_run_on(gate.device)
        and (plain or (is_dtensor(gate) and is_dtensor(up)))
    ):
        if not plain:
            library.register_dtensor_rules()
        return autograd.geglu(gate, up, approximate, owned)
    return autograd.geglu_formula(gate, up, approximate)


def halves_activation(
    y: torch.Tensor, gate_half: int, approximate: str, owned: bool = False
) -> torch.Tensor:
    """``gelu(gate) * up`` over the halves of ``y`` (``gate_half``: which is the gate): one
    op on y where our kernel runs on it (its gradient then needs no concatenation), else
    ``activation`` of its chunks (a DTensor, an odd last dim: eager's result or error)."""
    if (
        type(y) in PLAIN_TENSORS
        and y.dim() > 0
        and y.shape[-1] % 2 == 0
        and y.dtype in SUPPORTED_DTYPES
        and kernels_run_on(y.device)
    ):
        return autograd.geglu_halves(y, gate_half, approximate, owned)
    halves = y.chunk(2, dim=-1)
    return activation(halves[gate_half], halves[1 - gate_half], approximate, owned)


def project_down(route: ModuleRoute, h: torch.Tensor, fused: bool) -> torch.Tensor:
    """The module's down projection of ``h``."""
    operands = route.down_operands
    if operands is not None and operands[0].dtype == h.dtype:
        return down_projection(h, operands[0], operands[1], fused)
    return route.down(h)


# --- The layers ------------------------------------------------------------------------


class GeGLUMLP(nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Gemma, Gemma2, Gemma3 and every MLP
    whose forward is GemmaMLP's, with a GeLU ``act_fn``."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: nn.Module

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = module_route(self, GEMMA_MLP)
        out = mlp_output(route, x)
        if out is not None:
            return out
        if trains_eager(route, x):
            return own_forward(self)(self, x)
        route = _checked_route(route, self, x, GEMMA_MLP)
        if route is None:
            return own_forward(self)(self, x)
        h, fused = geglu_projections(route, x, GEMMA_MLP)
        return project_down(route, h, fused)


class T5GeGLUDense(nn.Module):
    """transformers' ``T5DenseGatedActDense`` (T5 v1.1, Flan-T5) and its copies with the
    same forward (MT5, UMT5, ...): ``wo(dropout(act(wi_0(x)) * wi_1(x)))``, with a GeLU
    ``act`` (``feed_forward_proj="gated-gelu"``). ``self.dropout`` is applied where the
    original applies it, so in training it draws the same random numbers. As the original,
    the GeGLU output is cast to ``wo.weight``'s dtype when they differ (``wo`` is kept in
    float32 by ``_keep_in_fp32_modules``) unless that weight is int8 (quantised)."""

    wi_0: nn.Linear
    wi_1: nn.Linear
    wo: nn.Linear
    dropout: nn.Dropout
    act: nn.Module

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        route = module_route(self, T5_GATED_DENSE)
        out = mlp_output(route, hidden_states, self.dropout)
        if out is not None:
            return out
        if trains_eager(route, hidden_states):
            return own_forward(self)(self, hidden_states)
        route = _checked_route(route, self, hidden_states, T5_GATED_DENSE)
        if route is None:
            return own_forward(self)(self, hidden_states)
        hidden_states, fused = geglu_projections(route, hidden_states, T5_GATED_DENSE)
        hidden_states = self.dropout(hidden_states)
        # The original's condition, verbatim (transformers issue 20287).
        if (
            isinstance(self.wo.weight, torch.Tensor)
            and hidden_states.dtype != self.wo.weight.dtype
            and self.wo.weight.dtype != torch.int8
        ):
            hidden_states = hidden_states.to(self.wo.weight.dtype)
        return project_down(route, hidden_states, fused)


class ModernBertGeGLUMLP(nn.Module):
    """transformers' ``ModernBertMLP``: ``input, gate = Wi(x).chunk(2, dim=-1)``, then
    ``Wo(drop(act(input) * gate))``. The FIRST half of ``Wi`` is activated; ``self.drop``
    is applied where the original applies it."""

    Wi: nn.Linear
    act: nn.Module
    drop: nn.Dropout
    Wo: nn.Linear

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        route = module_route(self, MODERNBERT_MLP)
        out = mlp_output(route, hidden_states, self.drop)
        if out is not None:
            return out
        if trains_eager(route, hidden_states):
            return own_forward(self)(self, hidden_states)
        route = _checked_route(route, self, hidden_states, MODERNBERT_MLP)
        if route is None:
            return own_forward(self)(self, hidden_states)
        h, fused = geglu_projections(route, hidden_states, MODERNBERT_MLP)
        return project_down(route, self.drop(h), fused)


# diffusers' message, which its GEGLU passes to diffusers.utils.deprecate.
_SCALE_DEPRECATION = (
    "`scale` is deprecated and will be removed in version 1.0.0. The `scale` argument "
    "is deprecated and will be ignored. Please remove it, as passing it will raise an "
    "error in the future. `scale` should directly be passed while calling the underlying "
    "pipeline component i.e., via `cross_attention_kwargs`."
)


class GEGLU(nn.Module):
    """diffusers' ``diffusers.models.activations.GEGLU`` (``FeedForward(...,
    activation_fn="geglu")``): ``hidden_states, gate = proj(x).chunk(2, dim=-1)``, then
    ``hidden_states * gelu(gate)`` with exact GeLU. The SECOND half of ``proj`` is
    activated. Extra positional arguments or ``scale=`` are ignored with diffusers'
    FutureWarning, as the original does. (The original's NPU branch, ``npu_geglu`` with
    tanh GeLU, is not reproduced: this package has no NPU build.)"""

    proj: nn.Linear

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, *args, **kwargs) -> torch.Tensor:
        route = module_route(self, DIFFUSERS_GEGLU)
        if trains_eager(route, hidden_states):
            return own_forward(self)(self, hidden_states, *args, **kwargs)
        route = _checked_route(route, self, hidden_states, DIFFUSERS_GEGLU)
        if route is None:
            return own_forward(self)(self, hidden_states, *args, **kwargs)
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            warnings.warn(_SCALE_DEPRECATION, FutureWarning)
        return geglu_projections(route, hidden_states, DIFFUSERS_GEGLU)[0]


class Linear(nn.Module):
    """``nn.Linear``: ``input @ weight.T + bias`` with the bias in the GEMM epilogue; in
    training, ``F.linear`` itself (policy.linear)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if own_forward(self) is not nn.Linear.forward:  # a subclass with its own
            warn_fallback(self, "Linear", "its forward is not nn.Linear's")
            return own_forward(self)(self, input)
        weight, bias = self.weight, self.bias
        # A DTensor weight (tensor-parallel, FSDP): DTensor's linear does the collectives.
        # Mixed dtypes, sizes or devices: F.linear's own error.
        if (
            is_dtensor(weight)
            or weight.dtype is not input.dtype
            or input.dim() == 0
            or input.shape[-1] != weight.shape[1]
            or weight.device != input.device
            or (bias is not None and bias.shape != weight.shape[:1])
        ):
            return F.linear(input, weight, bias)
        reason = input_reason(input)
        if reason is not None:
            warn_fallback(self, "Linear", reason)
            return F.linear(input, weight, bias)
        return linear(input, weight, bias, NO_ACT)


def _halves_geglu(module: nn.Module, x: torch.Tensor, approximate: str, layer: str):
    """kernels-community ``activation`` semantics: ``gelu(x[..., :d]) * x[..., d:]``,
    differentiable; the module's own forward where our kernel does not run (an odd last
    dim, another dtype or device)."""
    if x.dim() == 0 or x.shape[-1] % 2:
        reason = f"its input of shape {tuple(x.shape)} has no even last dim"
    else:
        reason = input_reason(x)
    if reason is None:
        if is_dtensor(x):  # through activation()'s sharding rules
            return halves_activation(x, 0, approximate)
        # the op for any other tensor, FakeTensors (torch.export) too
        return autograd.geglu_halves(x, 0, approximate)
    warn_fallback(module, layer, reason)
    return own_forward(module)(module, x)


class GeluAndMul(nn.Module):
    """kernels-community ``activation``'s ``GeluAndMul``: ``gelu(x[..., :d]) *
    x[..., d:]`` with exact GeLU, for ``x`` of ``[..., 2d]``; also differentiable."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _halves_geglu(self, x, "none", "GeluAndMul")


class GeluTanhAndMul(nn.Module):
    """As ``GeluAndMul`` with the tanh approximation of GeLU."""

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _halves_geglu(self, x, "tanh", "GeluTanhAndMul")


# The layers' forwards (own_forward passes over them).
LAYER_FORWARDS = frozenset(
    layer.forward
    for layer in (GeGLUMLP, T5GeGLUDense, ModernBertGeGLUMLP, GEGLU, Linear,
                  GeluAndMul, GeluTanhAndMul)
)  # fmt: skip
