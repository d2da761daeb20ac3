"""Drop-in ``forward`` replacements that ``kernels.kernelize`` swaps into models.

kernels' layer rules: no ``__init__``, no members but ``has_backward`` and
``can_torch_compile``; ``self`` is the original module, whose submodules are declared
here as annotations. Each forward has the signature of the forward it replaces and
calls no other method of its class (module-level helpers only).
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .gemm import dual_gemm_is_fast, tma_applies, tma_fills_gpu
from .ops import geglu, geglu_linear, is_dtensor, kernels_run_on, linear, needs_grad

# transformers' tanh-GeLU modules (ACT2FN "gelu_pytorch_tanh", "gelu_python_tanh",
# "gelu_new", "gelu_fast") all compute 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
_TANH_GELU_CLASSES = (
    "GELUTanh",
    "PytorchGELUTanh",
    "NewGELUActivation",
    "FastGELUActivation",
)
# ACT2FN "gelu" and "gelu_python": 0.5 x (1 + erf(x / sqrt(2))).
_EXACT_GELU_CLASSES = ("GELUActivation",)


def gelu_approximation(
    act_fn: nn.Module, flag: str = "config.hidden_activation / hidden_act"
) -> str:
    """The ``approximate`` argument that reproduces ``act_fn`` exactly, or a ValueError
    that names the activation and ``flag``, the config field that chose it."""
    name = type(act_fn).__name__
    if name in _TANH_GELU_CLASSES:
        return "tanh"
    if name in _EXACT_GELU_CLASSES:
        return "none"
    if isinstance(act_fn, nn.GELU):
        return act_fn.approximate
    raise ValueError(
        f"fused-geglu computes GeLU (exact or tanh) only; the module's activation "
        f"{name} ({act_fn!r}) is not one, so this layer must not replace it "
        f"(check {flag})"
    )


def _kernels_run_on(x: torch.Tensor, layer: str) -> bool:
    """Whether our kernels run on x's device. If not (e.g. a model kernelized for CUDA, then
    moved to the CPU of a process without the Triton interpreter, or to MPS), say so: the
    layer then runs the original module's forward with PyTorch, kernels' own fallback."""
    if kernels_run_on(x.device):
        return True
    warnings.warn(
        f"fused-geglu {layer}: Triton kernels cannot run on {x.device.type} tensors in this "
        f"process (the CPU needs TRITON_INTERPRET=1 before triton is imported); running "
        f"the original forward with PyTorch",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


class GeGLUMLP(nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Gemma, Gemma2, Gemma3 and any MLP
    with ``gate_proj``/``up_proj``/``down_proj`` and a GeLU-family ``act_fn``."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: nn.Module

    has_backward = True
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _kernels_run_on(x, "GeGLUMLP"):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        approximate = gelu_approximation(self.act_fn)
        h, fused = _geglu_two_projections(x, self.gate_proj, self.up_proj, approximate)
        return _project_down(h, self.down_proj, fused)


class Linear(nn.Module):
    """``nn.Linear``: ``input @ weight.T + bias`` with the bias in the GEMM epilogue."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    has_backward = True
    can_torch_compile = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # A DTensor weight (tensor-parallel, FSDP): DTensor's linear does the collectives.
        if is_dtensor(self.weight) or not _kernels_run_on(input, "Linear"):
            return F.linear(input, self.weight, self.bias)
        return linear(input, self.weight, self.bias)


def _unwrapped_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` itself: not a subclass (LoRA, quantised), no hooks."""
    return type(m) is nn.Linear and not m._forward_hooks and not m._forward_pre_hooks


def _plain_linear_operands(m: nn.Module) -> tuple | None:
    """``(weight, bias)`` of an unwrapped ``nn.Linear`` that computes exactly ``F.linear``
    on local tensors: no instance-level ``forward`` (patched, kernelized or
    tensor-parallel), no DTensor weight (sharded: its forward needs collectives); else
    None. Each module attribute is read once: ~1 us apiece per call."""
    if not _unwrapped_linear(m) or "forward" in m.__dict__:
        return None
    weight = m.weight
    return None if is_dtensor(weight) else (weight, m.bias)


def _tp_colwise_shards(m: nn.Module) -> tuple | None:
    """``(weight, bias)`` local shards of an ``nn.Linear`` that transformers' tensor-parallel
    plan made column-wise ("colwise": weight and bias ``Shard(0)``, this rank's output
    features kept local). In inference its forward is then exactly ``F.linear`` on these
    shards, with no collective. None for any other module or style: those keep their own
    forward, collectives included."""
    forward = m.__dict__.get("forward")
    if (
        not _unwrapped_linear(m)
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


def _linear_operands(m: nn.Module, x: torch.Tensor) -> tuple | None:
    """``(weight, bias)`` of x's dtype such that, in inference, ``m(x)`` is
    ``F.linear(x, weight, bias)``: a plain ``nn.Linear``'s own parameters, or a
    tensor-parallel column-wise shard's; None for anything else."""
    operands = _plain_linear_operands(m) or _tp_colwise_shards(m)
    return operands if operands and operands[0].dtype == x.dtype else None


def _dual_gemm_applies(x: torch.Tensor) -> bool:
    """Whether our GeGLU dual GEMM may replace the projections of ``x`` (given operands it
    can read, in inference): 16-bit x on a GPU with TMA, no autocast. On the H200 it beats
    cuBLAS + a fused activation at 1 to 8192 tokens (benchmarks/results/*-compare.json).
    In training cuBLAS's backward GEMMs and our fused activation were faster and lighter."""
    return (
        dual_gemm_is_fast(x)
        and not is_dtensor(x)
        and not torch.is_autocast_enabled(x.device.type)
    )


def _project_down(h: torch.Tensor, proj: nn.Module, fused: bool) -> torch.Tensor:
    """``proj(h)``; after our dual GEMM, where our TMA GEMM's tiles fill the GPU, our GEMM
    instead: the MLP is then two kernels (cuBLAS adds a memset there) and 2% faster (H200,
    8192 tokens). Where they do not (fewer tiles than SMs: Gemma-2B's down projection below
    about 2000 tokens), cuBLAS, which splits K. Not under torch.compile: a branch on the
    token count would recompile."""
    operands = None
    if fused and not torch.compiler.is_compiling():
        operands = _plain_linear_operands(proj)
    if operands:
        weight, bias = operands
        m = h.shape[:-1].numel()
        n, k = weight.shape
        if tma_applies(m, h) and tma_fills_gpu(m, n, k, h):
            return linear(h, weight, bias)
        return F.linear(h, weight, bias)  # proj(h) without the module call's host time
    return proj(h)


def _geglu_two_projections(
    x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module, approximate: str
) -> tuple[torch.Tensor, bool]:
    """``gelu(gate_proj(x)) * up_proj(x)``, and whether our dual GEMM computed it; otherwise
    the projections' own forwards (cuBLAS, or whatever wraps them: LoRA, quantised, hooked,
    autocast) and our fused activation."""
    if _dual_gemm_applies(x):
        gate, up = _linear_operands(gate_proj, x), _linear_operands(up_proj, x)
        if gate and up and not needs_grad(x, *gate, *up):
            (w_gate, b_gate), (w_up, b_up) = gate, up
            return geglu_linear(x, w_gate, w_up, b_gate, b_up, approximate), True
    return geglu(gate_proj(x), up_proj(x), approximate), False


def _geglu_fused_projection(
    x: torch.Tensor, proj: nn.Module, gate_half: int, approximate: str
) -> tuple[torch.Tensor, bool]:
    """``gelu(halves[gate_half]) * halves[1 - gate_half]`` for
    ``halves = proj(x).chunk(2, dim=-1)``, and whether our dual GEMM computed it (reading
    the weight's halves as row slices: the output's halves, also of a tensor-parallel
    shard); otherwise the projection's output halves are views that the activation kernel
    reads through their row stride. No copy either way."""
    operands = _linear_operands(proj, x) if _dual_gemm_applies(x) else None
    if operands and operands[0].shape[0] % 2 == 0 and not needs_grad(x, *operands):
        weight, bias = operands
        w = weight.chunk(2)
        b = (None, None) if bias is None else bias.chunk(2)
        g, u = gate_half, 1 - gate_half
        return geglu_linear(x, w[g], w[u], b[g], b[u], approximate), True
    halves = proj(x).chunk(2, dim=-1)
    return geglu(halves[gate_half], halves[1 - gate_half], approximate), False


class T5GeGLUDense(nn.Module):
    """transformers' ``T5DenseGatedActDense`` (T5 v1.1, Flan-T5) and its copies with the
    same forward: ``MT5DenseGatedActDense``, ``UMT5DenseGatedActDense`` (and Udop,
    Pix2Struct, Pop2Piano). ``wo(dropout(act(wi_0(x)) * wi_1(x)))``.

    ``act`` must be a GeLU (``feed_forward_proj="gated-gelu"`` gives ``gelu_new``, tanh);
    any other activation raises a ValueError. ``self.dropout`` is applied to the GeGLU
    output exactly where the original applies it, so in training it draws the same random
    numbers from the same generator: same seed, same mask. As the original, the GeGLU
    output is cast to ``wo.weight``'s dtype when they differ (``wo`` is kept in float32 by
    ``_keep_in_fp32_modules``) unless that weight is int8 (quantised).
    """

    wi_0: nn.Linear
    wi_1: nn.Linear
    wo: nn.Linear
    dropout: nn.Dropout
    act: nn.Module

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states):
        if _kernels_run_on(hidden_states, "T5GeGLUDense"):
            approximate = gelu_approximation(
                self.act, "config.feed_forward_proj / config.dense_act_fn"
            )
            hidden_states, fused = _geglu_two_projections(
                hidden_states, self.wi_0, self.wi_1, approximate
            )
        else:
            gate = self.act(self.wi_0(hidden_states))
            hidden_states, fused = gate * self.wi_1(hidden_states), False
        hidden_states = self.dropout(hidden_states)
        # The original's condition, verbatim (transformers issue 20287).
        if (
            isinstance(self.wo.weight, torch.Tensor)
            and hidden_states.dtype != self.wo.weight.dtype
            and self.wo.weight.dtype != torch.int8
        ):
            hidden_states = hidden_states.to(self.wo.weight.dtype)
        return _project_down(hidden_states, self.wo, fused)


class ModernBertGeGLUMLP(nn.Module):
    """transformers' ``ModernBertMLP``: ``input, gate = Wi(x).chunk(2, dim=-1)``, then
    ``Wo(drop(act(input) * gate))``. The FIRST half of ``Wi`` is activated.

    ``act`` is ``ACT2FN[config.hidden_activation]`` (default ``"gelu"``, exact); a non-GeLU
    activation raises a ValueError. ``self.drop`` is applied where the original applies
    it (same random numbers in training).
    """

    Wi: nn.Linear
    act: nn.Module
    drop: nn.Dropout
    Wo: nn.Linear

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _kernels_run_on(hidden_states, "ModernBertGeGLUMLP"):
            input, gate = self.Wi(hidden_states).chunk(2, dim=-1)
            return self.Wo(self.drop(self.act(input) * gate))
        approximate = gelu_approximation(self.act, "config.hidden_activation")
        h, fused = _geglu_fused_projection(hidden_states, self.Wi, 0, approximate)
        return _project_down(self.drop(h), self.Wo, fused)


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
    tanh GeLU, is not reproduced: this package has no NPU build.)
    """

    proj: nn.Linear

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, *args, **kwargs) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            warnings.warn(_SCALE_DEPRECATION, FutureWarning)
        if not _kernels_run_on(hidden_states, "GEGLU"):
            hidden_states, gate = self.proj(hidden_states).chunk(2, dim=-1)
            return hidden_states * F.gelu(gate)
        return _geglu_fused_projection(hidden_states, self.proj, 1, "none")[0]
