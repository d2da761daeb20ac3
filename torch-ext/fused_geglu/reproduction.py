"""Whether our kernels reproduce what a module computes: the GeGLU families and the forwards
each reproduces (compared by bytecode fingerprint), the GeLU modules and the approximation
each computes, and the hooks a call would fire."""

import functools
import importlib
import inspect
import sys
import types
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

# transformers' tanh-GeLU modules (ACT2FN "gelu_pytorch_tanh", "gelu_python_tanh",
# "gelu_new", "gelu_fast") compute 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); its
# "gelu" and "gelu_python", 0.5 x (1 + erf(x / sqrt(2))).
_TANH_GELU_CLASSES = (
    "GELUTanh",
    "PytorchGELUTanh",
    "NewGELUActivation",
    "FastGELUActivation",
)


_EXACT_GELU_CLASSES = ("GELUActivation",)


def is_one_op_gelu(act_fn: nn.Module) -> bool:
    """Whether ``act_fn`` computes its GeLU as one ``F.gelu`` call (nn.GELU, transformers'
    GELUActivation and GELUTanh), not a formula of several ops (NewGELUActivation, ...)."""
    if type(act_fn) is nn.GELU:
        return True
    act = getattr(act_fn, "act", None)
    return act is F.gelu or (
        isinstance(act, functools.partial) and act.func is F.gelu and not act.args
    )


def gelu_approximation(act_fn: nn.Module) -> str | None:
    """The ``approximate`` that reproduces ``act_fn`` exactly, or None if it is no GeLU
    (or no longer computes what its class defines)."""
    name = type(act_fn).__name__
    if name in _TANH_GELU_CLASSES:
        approximate = "tanh"
    elif name in _EXACT_GELU_CLASSES:
        approximate = "none"
    elif type(act_fn) is nn.GELU:
        approximate = act_fn.approximate
    else:
        return None
    return approximate if _as_defined(act_fn, approximate) else None


def _kernels_layer(module: nn.Module, forward) -> bool:
    """Whether the instance ``forward`` is a Hub layer's that ``kernels.kernelize`` put
    there (transformers maps its GELUTanh and GELUActivation to kernels-community's
    ``activation``): by kernels' contract it computes what the class's forward does."""
    return (
        "_kernel_repo" in module.__dict__
        and isinstance(forward, types.MethodType)
        and forward.__self__ is module
    )


def _as_defined(act_fn: nn.Module, approximate: str) -> bool:
    """Whether a GeLU module computes what its class defines: the class's own forward
    (none patched on the class, none on the instance but a kernels Hub layer's) and,
    where it holds its function (transformers' GELUActivation and GELUTanh:
    ``self.act``), one its class sets for this approximation: F.gelu, or the class's own
    formula bound to it."""
    cls = type(act_fn)
    forward = act_fn.__dict__.get("forward")
    if (forward is not None and not _kernels_layer(act_fn, forward)) or not (
        _forward_as_written(cls)
    ):
        return False
    if "act" not in act_fn.__dict__:
        return True
    fn = act_fn.__dict__["act"]
    if approximate == "none" and fn is F.gelu:
        return True
    if isinstance(fn, functools.partial):
        return (
            fn.func is F.gelu
            and not fn.args
            and fn.keywords == {"approximate": approximate}
        )
    formula = "_gelu_tanh_python" if approximate == "tanh" else "_gelu_python"
    return getattr(fn, "__self__", None) is act_fn and getattr(
        fn, "__func__", None
    ) is cls.__dict__.get(formula)


def _code_key(code: types.CodeType, doc: str | None = None) -> tuple:
    """Bytecode and everything it refers to, line numbers aside: names, variables, flags,
    and constants with their types (1, 1.0 and True differ; nested code by its own key)."""
    consts = tuple(
        _code_key(c) if isinstance(c, types.CodeType) else (type(c), c)
        for c in code.co_consts
        if not (doc is not None and isinstance(c, str) and c == doc)
    )
    return (
        code.co_code, code.co_names, code.co_varnames, code.co_argcount,
        code.co_kwonlyargcount, code.co_flags, consts,
    )  # fmt: skip


def _forward_fingerprint(cls: type) -> tuple | None:
    """What makes two classes' forwards compute the same thing: the forward's code key, its
    defaults, and the class methods it calls (``self.gelu``: an override changes the
    result without changing the forward's bytecode). None for a forward that is not a
    plain function (decorated, built in): not comparable."""
    forward = inspect.getattr_static(cls, "forward", None)
    if not isinstance(forward, types.FunctionType) or hasattr(forward, "__wrapped__"):
        return None
    code = forward.__code__
    methods = tuple(
        (name, inspect.getattr_static(cls, name, None))
        for name in code.co_names
        if isinstance(
            inspect.getattr_static(cls, name, None),
            (types.FunctionType, staticmethod, classmethod, property),
        )
    )
    defaults = tuple(
        (type(d), repr(d))
        for d in (
            *(forward.__defaults__ or ()),
            *(forward.__kwdefaults__ or {}).items(),
        )
    )
    return _code_key(code, forward.__doc__), defaults, methods


@dataclass(frozen=True)
class Family:
    """A GeGLU MLP's structure: submodule names, which forwards it reproduces."""

    name: str
    projections: tuple[str, ...]  # (gate, up), or (fused,) whose halves are gate and up
    gate_half: int  # fused: which half is the gate
    down: str | None
    act: str | None  # None: exact GeLU, fixed by the forward
    # "module:Class" whose forward the layer reproduces; a class whose forward has the same
    # bytecode (a copy, e.g. Gemma2MLP of GemmaMLP) is reproduced too.
    references: tuple[str, ...]

    @property
    def children(self) -> tuple[str, ...]:
        """The submodules a route reads (a plain property: torch.compile replays a
        cached_property's first write into the instance dict, and a guard on that dict
        then fails on the next call, recompiling)."""
        return tuple(n for n in (*self.projections, self.down, self.act) if n)

    def reproduces(self, cls: type) -> bool:
        return _reproduces(self.references, cls.__module__, cls.__qualname__)


_REPRODUCED: dict[tuple, bool] = {}


def _reproduces(references: tuple[str, ...], module: str, qualname: str) -> bool:
    key = (references, module, qualname)
    known = _REPRODUCED.get(key)
    if known is None:
        cls = sys.modules.get(module)
        for name in qualname.split("."):  # a class local to a function: not found, None
            cls = getattr(cls, name, None)
        fingerprint = None if cls is None else _forward_fingerprint(cls)
        known = fingerprint is not None and any(
            fingerprint == _forward_fingerprint(ref)
            for ref in _reference_classes(references)
            if _forward_as_written(ref)  # a reference patched since: none to compare
        )
        _REPRODUCED[key] = known
    return known


# torch.compile runs it while tracing and keeps the answer (inspect and importlib do not
# trace; its arguments are constants; a class's forward does not change under a compiled
# model). This is what torch.compiler.assume_constant_result sets, without importing
# torch._dynamo at the package's import (3-4 s, and torch.distributed.tensor with it);
# tests/test_families.py checks that the two agree.
_reproduces._dynamo_marked_constant = True


def _forward_as_written(cls: type) -> bool:
    """Whether ``cls.forward`` is the one its class body defines (none assigned since)."""
    forward = getattr(cls, "forward", None)
    return (
        getattr(forward, "__qualname__", None) == f"{cls.__qualname__}.forward"
        and getattr(forward, "__module__", None) == cls.__module__
    )


def _reference_classes(references: tuple[str, ...]) -> list[type]:
    """The reference classes that are installed (imported once, when a route is first made)."""
    classes = []
    for ref in references:
        module, name = ref.split(":")
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return classes


def hooked(m: nn.Module) -> bool:
    """Whether a module carries hooks that a call of it fires (forward, forward-pre,
    backward, backward-pre): our kernels would skip them."""
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
    )


def is_identity_dropout(dropout: nn.Module) -> bool:
    """An ``nn.Dropout`` that returns its input: in eval mode, or p = 0, with no hooks."""
    return (
        type(dropout) is nn.Dropout
        and (not dropout.training or dropout.p == 0)
        and not hooked(dropout)
    )
