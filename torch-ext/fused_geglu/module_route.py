"""Each module's route: what a layer reads from its module (operands, the activation's
approximation, the reason to fall back), made once and kept while everything it was read
from is unchanged (checked per call by identities and counters, not walks)."""

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .checks import PLAIN_TENSORS, is_dtensor
from .fp8.modules import fp8_route_operands
from .gemm import gelu_code
from .launch import has_tma, made_from_tables, prepare_cublas
from .one_launch import OneLaunchMLP
from .reproduction import (
    _REPRODUCED,
    Family,
    gelu_approximation,
    hooked,
    is_one_op_gelu,
)
from .tuning import table


@dataclass
class ModuleRoute:
    """What a layer reads from its module once: valid while ``watched`` is unchanged."""

    watched: tuple
    fallback: str | None  # the reason to run the module's own forward
    approximate: str = "none"
    projections: tuple = ()  # the projection modules
    fusable: tuple | None = None  # their local (weight, bias) pairs for the dual GEMM
    down: nn.Module | None = None
    down_operands: tuple | None = None  # the down projection's (weight, bias)
    # (w_gate, w_up, w_down, b_gate, b_up, b_down) for the MLP in one launch, and its
    # launch prepared for them (eager routes: built outside torch.compile)
    mlp: tuple | None = None
    mlp_launch: OneLaunchMLP | None = None
    # FP8Linear projections: ((w_gate, w_up, w_down), fp32 scales, biases), and the one
    # launch prepared for them (eager routes)
    fp8: tuple | None = None
    fp8_launches: dict = field(default_factory=dict)  # x's dtype -> OneLaunchMLP
    warned: set = field(default_factory=set)  # the reasons already warned of (eager)
    # training_kernel_min_elements: whether the GeLU is one PyTorch op, and (plain
    # projections) the input size below which a training call runs the module's forward
    one_op_gelu: bool = False
    eager_training_inputs: int = 0


# id(module) -> its route; an entry leaves with its module (weakref.finalize), and all
# when a launch table changes (its thresholds and one-launch plans were read from one).
_ROUTES: dict[int, ModuleRoute] = made_from_tables({})


_module_globals = nn.modules.module


_GLOBAL_HOOKS = (
    _module_globals._global_forward_hooks,
    _module_globals._global_forward_pre_hooks,
    _module_globals._global_backward_hooks,
    _module_globals._global_backward_pre_hooks,
)


_GLOBALLY_HOOKED = (
    "a global module hook is registered (torch.nn.modules.module.register_module_*_hook),"
    " which fires for each of its submodules"
)


def _plain_linear_operands(m: nn.Module) -> tuple | None:
    """``(weight, bias)`` of an ``nn.Linear`` itself (no subclass: LoRA, quantised) whose
    call is exactly ``F.linear`` on local tensors: no hooks, no instance-level forward
    (patched, kernelized or tensor-parallel), no DTensor weight; else None."""
    if type(m) is not nn.Linear or hooked(m) or "forward" in m.__dict__:
        return None
    weight = m._parameters["weight"]
    return None if is_dtensor(weight) else (weight, m._parameters["bias"])


_PARAMETERS = ("weight", "bias", "weight_scale_inv")  # weight_scale_inv: FP8Linear's


def _identity(value):
    """What ``_unchanged`` compares ``value`` with later (``identity() is value``): a weak
    reference where ``value`` takes one (a patched forward or function may hold the parent
    module, which a strong one would keep alive; an id could be reused by its
    replacement), else a function returning ``value`` (None, str, int: immutable)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def _watched(module: nn.Module, family: Family) -> tuple:
    """Everything a route depends on: the module's class and its forward; per submodule,
    the module, its weight, bias and FP8 block scales (identity), whether it has hooks,
    an instance-level (patched) forward and, for the activation, its public attributes
    (``_identity``), its class's forward;
    and, as a flat list, the parameters' data pointers, shapes, strides and whether they
    require grad (views made of them link to autograd or not; ``module.to()``
    or pruning swap a parameter's data in place: cached views, and the prepared launch's
    sizes and addresses, would be stale) and the scales' versions (e8m0 scales are
    decoded into a copy, which an in-place ``load_state_dict`` would leave stale).
    ``_unchanged`` compares them on every call."""
    mods = module._modules
    children, datas, versions = [], [], []
    for name in family.children:
        m = mods.get(name)
        if m is None:
            children.append((name, None, (), False, _identity(None), None, ()))
            continue
        params = m._parameters
        members = tuple((key, params.get(key)) for key in _PARAMETERS)
        for key, t in members:
            if type(t) in PLAIN_TENSORS:
                datas.append((t, t.data_ptr(), t.shape, t.stride(), t.requires_grad))
                if key == "weight_scale_inv":
                    versions.append((t, t._version))
        # the activation's settings (nn.GELU's approximate, GELUActivation's function)
        attrs = tuple(
            (key, _identity(value))
            for key, value in vars(m).items()
            if name == family.act and key[0] != "_" and key != "training"
        )
        children.append(
            (name, m, members, hooked(m), _identity(m.__dict__.get("forward")),
             type(m).forward, attrs)
        )  # fmt: skip
    cls = type(module)
    return cls, cls.forward, tuple(children), tuple(datas), tuple(versions)


def _unchanged(module: nn.Module, watched: tuple) -> bool:
    """Whether ``_watched(module, ...)`` would equal ``watched``: identity tests, reads of
    the modules' own dicts (afresh: a library may replace one, as DeepSpeed's ZeRO does
    ``_parameters``) and the tensors' queries; no calls of its own."""
    cls, forward, children, datas, versions = watched
    if type(module) is not cls or cls.forward is not forward:  # a class patched later
        return False
    mods = module._modules
    for name, m, members, was_hooked, forward, cls_forward, attrs in children:
        if mods.get(name) is not m:
            return False
        if m is None:
            continue
        params = m._parameters
        for key, member in members:
            if params.get(key) is not member:
                return False
        state = m.__dict__
        if (
            bool(
                m._forward_hooks
                or m._forward_pre_hooks
                or m._backward_hooks
                or m._backward_pre_hooks
            )
            is not was_hooked
            or forward() is not state.get("forward")
            or type(m).forward is not cls_forward
        ):
            return False
        for key, value in attrs:
            if value() is not state.get(key):
                return False
    for t, pointer, shape, strides, grad in datas:
        if (
            t.data_ptr() != pointer
            or t.shape != shape
            or t.stride() != strides
            or t.requires_grad is not grad
        ):
            return False
    for t, version in versions:
        if t._version != version:
            return False
    return True


def _tp_colwise_shards(m: nn.Module) -> tuple | None:
    """``(weight, bias)`` local shards of an ``nn.Linear`` that transformers' tensor-parallel
    plan made column-wise ("colwise": weight and bias ``Shard(0)``, this rank's output
    features kept local). In inference its forward is then exactly ``F.linear`` on these
    shards, with no collective. None for any other module or style: those keep their own
    forward, collectives included."""
    forward = m.__dict__.get("forward")
    if (
        type(m) is not nn.Linear
        or hooked(m)
        or not is_dtensor(m.weight)
        or getattr(forward, "__name__", None) != "tp_forward"
    ):
        return None
    from torch.distributed.tensor import Shard  # imported: m.weight is a DTensor

    # transformers installs the style as a closure over ``self`` (the style object) and
    # ``original_forward``; read both rather than guess the style from placements.
    cells = dict(zip(forward.__code__.co_freevars, forward.__closure__ or ()))
    style = cells["self"].cell_contents if "self" in cells else None
    original = (
        cells["original_forward"].cell_contents if "original_forward" in cells else None
    )
    colwise = (Shard(0),)
    if (
        type(style).__name__ != "ColwiseParallel"
        or not type(style).__module__.startswith("transformers.")
        or style.output_layouts != Shard(-1)
        or not style.use_local_output
        or getattr(original, "__func__", None) is not nn.Linear.forward
        or getattr(m, "_hf_quantized_needs_local_tp", False)
        or m.weight.placements != colwise
        or m.weight.device_mesh.ndim != 1
        or (
            m.bias is not None
            and (not is_dtensor(m.bias) or m.bias.placements != colwise)
        )
    ):
        return None
    return m.weight.to_local(), None if m.bias is None else m.bias.to_local()


def _linear_operands(m: nn.Module) -> tuple | None:
    """``(weight, bias)`` such that, in inference, ``m(x)`` is ``F.linear(x, weight, bias)``:
    a plain ``nn.Linear``'s own parameters, or a tensor-parallel column-wise shard's."""
    return _plain_linear_operands(m) or _tp_colwise_shards(m)


def _new_route(module: nn.Module, family: Family, watched: tuple) -> ModuleRoute:
    cls = type(module)
    missing = [name for name in family.children if name not in module._modules]
    if missing:
        return ModuleRoute(watched, f"it has no submodule {', '.join(missing)}")
    if not family.reproduces(cls):
        return ModuleRoute(
            watched,
            f"{cls.__module__}.{cls.__qualname__}.forward is not one that {family.name} "
            f"reproduces (it may do more than {family.name}'s computation)",
        )
    approximate, one_op_gelu = "none", True  # no act: the forward calls F.gelu
    if family.act is not None:
        act_fn = module._modules.get(family.act)
        approximate = gelu_approximation(act_fn) if act_fn is not None else None
        if approximate is None:
            return ModuleRoute(
                watched, f"its activation {act_fn!r} is not a GeLU (exact or tanh)"
            )
        if hooked(act_fn):
            return ModuleRoute(
                watched, f"its activation {family.act} carries hooks, which must fire"
            )
        one_op_gelu = is_one_op_gelu(act_fn)
    projections = tuple(module._modules[name] for name in family.projections)
    operands = tuple(_linear_operands(p) for p in projections)
    fusable = None
    if all(operands):
        if len(operands) == 2:
            (w_gate, b_gate), (w_up, b_up) = operands
        else:
            (weight, bias), g = operands[0], family.gate_half
            # views that autograd links to the projection's parameters, also where the
            # route is made in a no_grad call (module_route: in any mode)
            with torch.enable_grad():
                w = weight.chunk(2)
                b = (None, None) if bias is None else bias.chunk(2)
            w_gate, w_up, b_gate, b_up = w[g], w[1 - g], b[g], b[1 - g]
        if w_gate.shape == w_up.shape and (b_gate is None) == (b_up is None):
            fusable = (w_gate, w_up, b_gate, b_up)
    eager_training_inputs = 0
    if fusable is not None and one_op_gelu and fusable[0].numel():
        intermediate, hidden = fusable[0].shape
        least = table(fusable[0].device).training_kernel_min_elements
        rows = -(-least // intermediate)
        eager_training_inputs = rows * hidden
    down = module._modules[family.down] if family.down else None
    down_operands = _plain_linear_operands(down) if down is not None else None
    mlp = None
    if fusable is not None and down_operands is not None:
        w_gate, w_up, b_gate, b_up = fusable
        w_down, b_down = down_operands
        operands = (w_gate, w_up, w_down, b_gate, b_up, b_down)
        # What fuse_projections asks of x, asked of the weights once: a call whose x has
        # their dtype, device and a plain type needs no more.
        if (
            w_down.shape[1] == w_gate.shape[0]
            and w_gate.dtype in (torch.float16, torch.bfloat16)
            and has_tma(w_gate.device)
            and all(
                t is None or (type(t) in PLAIN_TENSORS and t.dtype is w_gate.dtype
                              and t.device == w_gate.device)
                for t in operands
            )
        ):  # fmt: skip
            mlp = operands
    fp8 = None if fusable is not None else fp8_route_operands(projections, down, family)
    return ModuleRoute(
        watched, None, approximate, projections, fusable, down, down_operands, mlp,
        fp8=fp8, one_op_gelu=one_op_gelu, eager_training_inputs=eager_training_inputs,
    )  # fmt: skip


_TRANSFORMED = (
    "its parameters are torch.func transform tensors (functional_call under grad, vmap "
    "or jvp), which the kernels cannot read"
)


def _transformed_parameters(module: nn.Module, family: Family) -> bool:
    """Whether a submodule's parameter is a torch.func transform's tensor (no storage)."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    mods = module._modules
    for name in family.children:
        m = mods.get(name)
        if m is not None and any(
            t is not None and wrapped(t) for t in m._parameters.values()
        ):
            return True
    return False


def module_route(module: nn.Module, family: Family) -> ModuleRoute:
    """The module's route, re-derived only when what it depends on changed; under
    torch.compile derived while tracing (Dynamo guards on what it reads instead)."""
    if any(_GLOBAL_HOOKS):  # for this call only
        return ModuleRoute((), _GLOBALLY_HOOKED)
    if torch.compiler.is_compiling():
        return _new_route(module, family, ())
    route = _ROUTES.get(id(module))
    if route is None or not _unchanged(module, route.watched):
        if _transformed_parameters(module, family):  # for this call only
            return ModuleRoute((), _TRANSFORMED)
        if route is not None and route.watched[1] is not type(module).forward:
            _REPRODUCED.clear()  # the class's forward was replaced: compared again
        if route is None:
            weakref.finalize(module, _ROUTES.pop, id(module), None)
        watched = _watched(module, family)
        # outside inference mode: the route's views (and their link to autograd) serve
        # later calls of every mode
        with torch.inference_mode(False):
            route = _ROUTES[id(module)] = _new_route(module, family, watched)
            if route.mlp is not None and route.mlp[0].numel() and route.mlp[2].shape[0]:
                route.mlp_launch = OneLaunchMLP(
                    *route.mlp, gelu_code(route.approximate)
                )
                prepare_cublas(route.mlp[0].device, route.mlp[0].dtype)
    return route
