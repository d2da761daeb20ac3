"""The route policy, used by ``geglu_mlp`` and by every layer: which kernel computes each
part of a GeGLU MLP, and when a layer must leave a module to its own forward.

Measured on the H200 (benchmarks/NOTES.md):
- gate/up: the dual GEMM (one kernel) where the TMA kernel runs, for 16-bit operands: in
  inference gate and up never reach memory; in training it stores them for backward,
  which writes their gradients over them and runs cuBLAS (autograd.GeGLULinear).
  Elsewhere the projections (cuBLAS) and the fused activation.
- down: after the dual GEMM, our GEMM where its tiles fill the GPU (the MLP is then two
  kernels); otherwise cuBLAS, which splits K. Under torch.compile always cuBLAS: a branch
  on the token count would recompile.
- linear (``linear``, ``layers.Linear``, and no activation): in training cuBLAS, whose
  backward was faster on every measured shape; in inference our GEMM.
- the activation in training: ours, except below the tuning table's
  ``training_kernel_min_elements`` outputs where the module's GeLU is one PyTorch op:
  there eager's ops (the module's own forward) cost less host time than our autograd
  Function saves GPU time.
- decode (at most MLP_MAX_TOKENS tokens, inference, where the dual GEMM runs), eager
  calls: the whole MLP in one launch (gemm.geglu_mlp_small), at half the host time of the
  two kernels and 2-30% more GPU time (1 to 16 tokens). In a CUDA graph or under
  torch.compile the host time is not spent per call, so the two kernels run there; and with
  ``torch.use_deterministic_algorithms(True)``, since the one launch's fp32 sums are
  atomic.
- FP8 (transformers' ``FP8Linear`` projections: e4m3 weights, 128 x 128 block scales,
  dynamic activations; inference): as decode above, eager calls the whole MLP in one
  launch (in a CUDA graph the two kernels took 17-38% less GPU time at 1 to 16 tokens);
  else the dual GEMM handing h to the down GEMM quantized, x quantized in the dual GEMM
  up to 32 tokens (two kernels), by a kernel of its own beyond (three); the down GEMM
  swapped and split up to 512 tokens where the TMA kernel's tiles would leave SMs idle
  (gemm.fp8_swap_ab), cuBLAS's block-scaled GEMM from 2048 on Hopper
  (gemm.fp8_cublas_applies), the TMA kernel between and elsewhere. From 2048 tokens,
  where cuBLAS's GEMM applies to all three projections, gate and up are its too, and one
  kernel forms and quantizes h between (five kernels and cuBLAS's memsets, faster than
  our dual GEMM there: Triton 3.6 waits for each K block's MMA before scaling it).
  In training an FP8 projection runs its own forward.

A layer runs our kernels only where they reproduce the module's forward. Anywhere else it
runs the module's own forward and warns once, naming the reason.
"""

import functools
import importlib
import inspect
import math
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import autograd, library
from .checks import (
    FP8_ACT_DTYPES,
    FP8_SCALE_DTYPES,
    FP8_WEIGHT_DTYPE,
    PLAIN_TENSORS,
    SUPPORTED_DTYPES,
    fp8_scale_shape,
    is_dtensor,
    kernels_run_on,
)
from .gemm import (
    NO_ACT,
    MLPLaunch,
    gelu_code,
    tma_applies,
    tma_tiles_fill_gpu,
)
from .launch import CPU_UNAVAILABLE, has_tma, made_from_tables
from .tuning import MLP_MAX_TOKENS, table


def eager_activation_pays(outputs: int, *tensors) -> bool:
    """Whether a one-op GeLU's activation of ``outputs`` elements over ``tensors`` runs
    eager's ops (the table's ``training_kernel_min_elements``): a small call that
    autograd records."""
    least = table(tensors[0].device).training_kernel_min_elements
    return outputs < least and autograd.needs_grad(*tensors)


def fuse_projections(x: torch.Tensor) -> bool:
    """Whether the dual GEMM computes gelu(gate) * up for ``x`` (see the module docstring);
    under autocast the projections' own forwards choose the dtype."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return False
    device = x.device
    return (
        has_tma(device)
        and not is_dtensor(x)
        and not torch.is_autocast_enabled(device.type)
    )


def linear(x, weight, bias, activation: int) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` by the policy (arguments already checked): our GEMM with
    its epilogue, except where autograd records a call without an activation. There
    cuBLAS (``F.linear``) runs: our forward+backward measured 1.19x eager's time at 8192 x
    16384 x 2048 and 1.14-1.65x on the four training shapes of benchmarks/NOTES.md, and
    without an activation there is no epilogue to fuse."""
    if activation == NO_ACT and autograd.needs_grad(x, weight, bias):
        return F.linear(x, weight, bias)
    return autograd.linear(x, weight, bias, activation)


def mlp_in_one_launch(x: torch.Tensor) -> bool:
    """Whether one launch computes the MLP of ``x`` where the dual GEMM (16-bit) or the FP8
    kernels would run (see the module docstring): an eager call (not compiled, not
    captured in a CUDA graph: there no host time is spent per call, and the two kernels
    take less GPU time), few tokens, atomics allowed."""
    return not torch.compiler.is_compiling() and _one_launch_fits(x)


def _one_launch_fits(x: torch.Tensor) -> bool:
    """``mlp_in_one_launch`` for an eager call."""
    hidden = x.shape[-1]
    m = x.numel() // hidden if hidden else 0
    return (
        0 < m <= MLP_MAX_TOKENS
        and not torch.are_deterministic_algorithms_enabled()
        and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
    )


def fp8_scale(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as the kernels read them: fp32 (e8m0 decoded: powers of two, exact)."""
    return scale if scale.dtype == torch.float32 else scale.float()


def geglu_mlp_fp8(x, weights: tuple, scales: tuple, biases: tuple, approximate: str):
    """The FP8 MLP by the policy's route (arguments checked; ``scales`` fp32). The gate's and
    the up's scales are read with one stride: made contiguous where theirs differ."""
    s_gate, s_up, s_down = scales
    if s_gate.stride() != s_up.stride():
        s_gate, s_up = s_gate.contiguous(), s_up.contiguous()
    (w_gate, w_up, w_down), (b_gate, b_up, b_down) = weights, biases
    return library.geglu_mlp_fp8(
        x, w_gate, s_gate, w_up, s_up, w_down, s_down, b_gate, b_up, b_down,
        approximate, mlp_in_one_launch(x),
    )  # fmt: skip


def down_projection(h, weight, bias, fused: bool) -> torch.Tensor:
    """``h @ weight.T + bias`` by the kernel the policy picks (h is 2-D or more)."""
    if fused and not torch.compiler.is_compiling() and h.shape[-1] == weight.shape[1]:
        m = math.prod(h.shape[:-1])
        n, k = weight.shape
        if tma_applies(m, h.dtype, h.device) and tma_tiles_fill_gpu(
            m, n, k, h.dtype, h.device
        ):
            return linear(h, weight, bias, NO_ACT)  # a trainable down weight: cuBLAS
    return F.linear(h, weight, bias)


def geglu_mlp(x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate):
    """``down(gelu(gate(x)) * up(x))`` by the policy's route (arguments already checked)."""
    training = autograd.needs_grad(x, w_gate, w_up, w_down, b_gate, b_up, b_down)
    outputs = math.prod(x.shape[:-1]) * w_gate.shape[0]
    if training and outputs < table(x.device).training_kernel_min_elements:
        h = autograd.geglu_formula(
            F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up), approximate
        )
        return F.linear(h, w_down, b_down)
    fused = fuse_projections(x)
    if fused and not training and mlp_in_one_launch(x):
        return autograd.geglu_mlp_inference(
            x, w_gate, w_up, w_down, b_gate, b_up, b_down, approximate
        )
    if fused:
        h = autograd.geglu_linear(x, w_gate, w_up, b_gate, b_up, approximate)
    else:
        gate, up = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
        h = autograd.geglu(gate, up, approximate, owned=True)
    return down_projection(h, w_down, b_down, fused)


# --- Layers -----------------------------------------------------------------------------

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


def _is_one_op_gelu(act_fn: nn.Module) -> bool:
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
    mlp_launch: MLPLaunch | None = None
    # FP8Linear projections: ((w_gate, w_up, w_down), fp32 scales, biases), and the one
    # launch prepared for them (eager routes)
    fp8: tuple | None = None
    fp8_launches: dict = field(default_factory=dict)  # x's dtype -> MLPLaunch
    warned: set = field(default_factory=set)  # the reasons already warned of (eager)
    # training_kernel_min_elements: whether the GeLU is one PyTorch op, and (plain
    # projections) the input size below which a training call runs the module's forward
    one_op_gelu: bool = False
    eager_training_inputs: int = 0


# id(module) -> its route; an entry leaves with its module (weakref.finalize), and all
# when a launch table changes (its thresholds and one-launch plans were read from one).
_ROUTES: dict[int, ModuleRoute] = made_from_tables({})


def _hooked(m: nn.Module) -> bool:
    """Whether a module carries hooks that a call of it fires (forward, forward-pre,
    backward, backward-pre): our kernels would skip them."""
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
    )


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
    if type(m) is not nn.Linear or _hooked(m) or "forward" in m.__dict__:
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
            (name, m, members, _hooked(m), _identity(m.__dict__.get("forward")),
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
    for name, m, members, hooked, forward, cls_forward, attrs in children:
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
            is not hooked
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
        or _hooked(m)
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


def _fp8_linear_operands(m: nn.Module) -> tuple | None:
    """``(weight, block scales, bias)`` of transformers' ``FP8Linear`` (the class itself)
    in the form the FP8 kernels reproduce: a 2-D e4m3 weight, 128 x 128 block scales
    (fp32 or e8m0), dynamic activation scales, no hooks or instance-level forward; else
    None (per-tensor or static scales, other blocks: its own forward)."""
    cls = type(m)
    if (
        cls.__name__ != "FP8Linear"
        or not cls.__module__.startswith("transformers.")
        or _hooked(m)
        or "forward" in m.__dict__
        or getattr(m, "activation_scheme", None) != "dynamic"
        or tuple(getattr(m, "block_size", None) or ()) != (128, 128)
    ):
        return None
    params = m._parameters
    weight, scale, bias = (
        params.get(n) for n in ("weight", "weight_scale_inv", "bias")
    )
    if (
        type(weight) not in PLAIN_TENSORS
        or weight.dtype != FP8_WEIGHT_DTYPE
        or weight.dim() != 2
        or type(scale) not in PLAIN_TENSORS
        or scale.dtype not in FP8_SCALE_DTYPES
        or tuple(scale.shape) != fp8_scale_shape(weight)
        or scale.device != weight.device
        or not (bias is None or (type(bias) in PLAIN_TENSORS and bias.device == weight.device))
    ):  # fmt: skip
        return None
    return weight, scale, bias


def _fp8_operands(projections: tuple, down: nn.Module | None, family: Family):
    """The FP8 route's ((w_gate, w_up, w_down), fp32 scales, biases) where every projection
    is an FP8Linear the kernels take (a fused one split at a 128-row block boundary),
    else None."""
    if down is None:
        return None
    operands = tuple(_fp8_linear_operands(p) for p in (*projections, down))
    if not all(operands):
        return None
    if len(projections) == 2:
        (w_gate, s_gate, b_gate), (w_up, s_up, b_up), (w_down, s_down, b_down) = (
            operands
        )
    else:
        (weight, scale, bias), (w_down, s_down, b_down) = operands
        if weight.shape[0] % 256:  # the halves must start on a scale block
            return None
        g = family.gate_half
        w, s = weight.chunk(2), scale.chunk(2)
        b = (None, None) if bias is None else bias.chunk(2)
        w_gate, w_up, s_gate, s_up, b_gate, b_up = (
            w[g],
            w[1 - g],
            s[g],
            s[1 - g],
            b[g],
            b[1 - g],
        )
    if (
        w_gate.shape != w_up.shape
        or w_down.shape[1] != w_gate.shape[0]
        or (b_gate is None) != (b_up is None)
    ):
        return None
    scales = tuple(fp8_scale(t).detach() for t in (s_gate, s_up, s_down))
    return (w_gate, w_up, w_down), scales, (b_gate, b_up, b_down)


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
        if _hooked(act_fn):
            return ModuleRoute(
                watched, f"its activation {family.act} carries hooks, which must fire"
            )
        one_op_gelu = _is_one_op_gelu(act_fn)
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
    fp8 = None if fusable is not None else _fp8_operands(projections, down, family)
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
                route.mlp_launch = MLPLaunch(*route.mlp, gelu_code(route.approximate))
    return route


def trains_eager(route: ModuleRoute, x: torch.Tensor) -> bool:
    """Whether this call runs the module's own forward by training_kernel_min_elements,
    asked first (host time is this path's cost): plain projections (the route knows the
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
        return None if route.fp8 is None else _fp8_output(route, x, dropout)
    if (
        type(x) is not torch.Tensor
        or x.dtype is not launch.dtype
        or x.dim() == 0
        or x.shape[-1] != launch.hidden
        or x.device != launch.device
        or autograd.needs_grad(x, *launch.operands)
        or not _one_launch_fits(x)
        or torch.is_autocast_enabled(launch.device_type)
        or autograd.transforms_active()
        or not (dropout is None or _is_identity(dropout))
    ):
        return None
    if x.is_contiguous() and not library.profiler_enabled():
        return launch(x)
    return library.geglu_mlp.eager(x, *launch.operands, route.approximate)


def _fp8_output(route: ModuleRoute, x: torch.Tensor, dropout: nn.Module | None):
    """``mlp_output`` for FP8Linear projections: the FP8 kernels, where they reproduce the
    module's forward: no gradient for x or a bias (FP8Linear's own forward serves
    training), x of the biases' 16-bit dtype, size and device, no autocast or torch.func
    transform, an identity dropout."""
    (w_gate, w_up, w_down), scales, biases = route.fp8
    compiling = torch.compiler.is_compiling()
    if (
        not (compiling or type(x) is torch.Tensor)
        or x.dtype not in FP8_ACT_DTYPES
        or x.dim() == 0
        or x.shape[-1] != w_gate.shape[1]
        or x.device != w_gate.device
        or not kernels_run_on(x.device)
        or autograd.needs_grad(x, *biases)  # FP8Linear's own forward records it
        or any(b is not None and b.dtype is not x.dtype for b in biases)
        or torch.is_autocast_enabled(x.device.type)
        or not (compiling or not autograd.transforms_active())
        or not (dropout is None or _is_identity(dropout))
    ):
        return None
    if (
        not compiling
        and x.is_contiguous()
        and _one_launch_fits(x)  # eager, outside a capture: the prepared launch
        and w_gate.numel()
        and w_down.shape[0]
        and scales[0].stride() == scales[1].stride()
        and not library.profiler_enabled()
    ):
        launch = route.fp8_launches.get(x.dtype)
        if launch is None:
            launch = route.fp8_launches[x.dtype] = MLPLaunch(
                w_gate, w_up, w_down, *biases, gelu_code(route.approximate), scales,
                x.dtype,
            )  # fmt: skip
        return launch(x)
    return geglu_mlp_fp8(x, (w_gate, w_up, w_down), scales, biases, route.approximate)


def _is_identity(dropout: nn.Module) -> bool:
    """An ``nn.Dropout`` that returns its input: in eval mode, or p = 0, with no hooks."""
    return (
        type(dropout) is nn.Dropout
        and (not dropout.training or dropout.p == 0)
        and not _hooked(dropout)
    )


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
