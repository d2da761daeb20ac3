"""Input checks of the public functions: dense tensors of one supported dtype on one device
Triton can run on, and consistent shapes. Messages name every tensor's shape, dtype and
device; they are built only on error."""

import sys

import torch

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


FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
# Block scales: fp32, or e8m0 (transformers' scale_fmt="ue8m0"), decoded to fp32 once.
FP8_SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
FP8_ACT_DTYPES = (torch.bfloat16, torch.float16)


def fp8_scale_shape(weight: torch.Tensor) -> tuple[int, int]:
    """The [ceil(out/128), ceil(in/128)] block scales of a 128 x 128-block FP8 weight."""
    n, k = weight.shape
    return -(-n // 128), -(-k // 128)


def check_geglu_mlp_fp8(op: str, x, weights: dict, scales: dict, biases: dict) -> None:
    """geglu_mlp_fp8: x 16-bit [..., H]; e4m3 weights [I, H], [I, H], [N, I] with 128 x 128
    block scales; biases in x's dtype; one device; inference only."""
    tensors = {"x": x, **weights, **scales, **given(**biases)}
    for name, t in tensors.items():
        if type(t) not in PLAIN_TENSORS:
            raise TypeError(
                f"{op}: {name} must be a local torch.Tensor, got {type(t).__name__}"
            )
    device = x.device
    if any(t.device != device for t in tensors.values()):
        raise ValueError(
            f"{op}: expected all tensors on one device ({describe(tensors)})"
        )
    if not kernels_run_on(device):
        where = f"the CPU: {CPU_UNAVAILABLE}" if device.type == "cpu" else "a GPU"
        raise RuntimeError(
            f"{op}: Triton kernels cannot run on {device.type} tensors here ({where}) "
            f"({describe(tensors)})"
        )
    if x.dtype not in FP8_ACT_DTYPES or any(
        b.dtype != x.dtype for b in given(**biases).values()
    ):
        raise TypeError(
            f"{op}: x must be bfloat16 or float16 and the biases of x's dtype "
            f"({describe(tensors)})"
        )
    if any(w.dtype != FP8_WEIGHT_DTYPE or w.dim() != 2 for w in weights.values()):
        raise TypeError(
            f"{op}: the weights must be 2-D torch.float8_e4m3fn ({describe(tensors)})"
        )
    (gate, w_gate), (up, w_up), (down, w_down) = weights.items()
    hidden = x.shape[-1] if x.dim() else None
    if (
        w_gate.shape != w_up.shape
        or w_gate.shape[1] != hidden
        or (w_down.shape[1] != w_gate.shape[0])
    ):
        raise ValueError(
            f"{op}: expected x [..., H], {gate} and {up} [I, H], {down} [N, I] "
            f"({describe(tensors)})"
        )
    for (name, s), w in zip(scales.items(), weights.values()):
        if s.dtype not in FP8_SCALE_DTYPES or tuple(s.shape) != fp8_scale_shape(w):
            raise ValueError(
                f"{op}: {name} must be float32 or float8_e8m0fnu block scales of shape "
                f"{fp8_scale_shape(w)} (128 x 128 blocks) ({describe(tensors)})"
            )
    (b_gate, b_up, b_down) = biases.values()
    if (b_gate is None) != (b_up is None):
        raise ValueError(f"{op}: pass both gate and up biases or neither")
    for b, w, name in (
        (b_gate, w_gate, "b_gate"),
        (b_up, w_up, "b_up"),
        (b_down, w_down, "b_down"),
    ):
        check_bias(op, b, w, name)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, *biases.values())
    ):
        raise RuntimeError(
            f"{op}: inference only; x or a bias requires grad (call it under "
            f"torch.no_grad() or torch.inference_mode()) ({describe(tensors)})"
        )


def check_fp8_gemm_a(op: str, a: torch.Tensor, a_scale, max_16_bit_rows: int) -> None:
    """An FP8 GEMM's A (gemm.py): e4m3 with its scales, or 16-bit without them (quantized
    in the K loop) for at most ``max_16_bit_rows`` rows (0: never)."""
    e4m3 = a.dtype == torch.float8_e4m3fn
    rows = a.numel() // max(a.shape[-1], 1)
    if e4m3 != (a_scale is not None) or (not e4m3 and rows > max_16_bit_rows):
        allowed = (
            f", or 16-bit without them for at most {max_16_bit_rows} rows"
            if max_16_bit_rows
            else ""
        )
        raise ValueError(
            f"{op}: a must be torch.float8_e4m3fn with its scales{allowed}; got a of "
            f"shape {tuple(a.shape)}, {a.dtype}, {a.device}, "
            + ("without a_scale" if a_scale is None else "with an a_scale")
        )


def check_fp8_gemm_scales(
    op: str, a: torch.Tensor, a_scale, b, b_scale, up=None, b_name: str = "b_scale"
) -> None:
    """An FP8 GEMM's block scales as its kernels read them, on ``a``'s device: a_scale (an
    e4m3 ``a``) as check_fp8_row_scales' unpadded ones; b_scale [N/128, K/128] fp32;
    ``up``: (b_up, up_scale), up_scale of b_scale's shape and strides (the kernels take
    one pair)."""
    device = a.device
    up = () if up is None else (("up_scale", *up),)
    for name, w, s in ((b_name, b, b_scale), *up):
        want = fp8_scale_shape(w)
        if (
            s.dtype != torch.float32
            or s.shape != want
            or s.device != device
            or (name == "up_scale" and s.stride() != b_scale.stride())
        ):
            same = f", with {b_name}'s strides" if name == "up_scale" else ""
            raise ValueError(
                f"{op}: {name} must be the weight's [N/128, K/128] = [{want[0]}, "
                f"{want[1]}] float32 block scales on {device}{same}; got shape "
                f"{tuple(s.shape)}, {s.dtype}, {s.device}, strides {s.stride()}"
            )
    if a_scale is not None:
        rows, blocks = a.numel() // max(a.shape[-1], 1), -(-a.shape[-1] // 128)
        check_fp8_row_scales(op, a_scale, blocks, rows, device, "a_scale", padded=False)


def check_fp8_row_scales(op: str, scale: torch.Tensor, blocks: int, rows: int, device,
                         name: str, *, padded: bool) -> None:  # fmt: skip
    """Per-row block scales: [blocks, rows] fp32 on ``device`` with unit column stride, its
    rows at least ``rows`` apart where the kernel takes their stride (``padded``: the
    scales it writes, a padded buffer's leading columns being fine), else exactly
    ``rows`` apart (the scales it reads, indexed as block * rows + row)."""
    row_stride = scale.stride(0)
    if (
        scale.shape != (blocks, rows)
        or scale.dtype != torch.float32
        or scale.device != device
        or scale.stride(1) != 1
        or (row_stride < rows if padded else blocks > 1 and 0 < rows != row_stride)
    ):
        apart = f"at least {rows}" if padded else f"{rows}"
        raise ValueError(
            f"{op}: {name} must be [128-column blocks, rows] = [{blocks}, {rows}] fp32 "
            f"on {device} with unit column stride and rows {apart} apart; got shape "
            f"{tuple(scale.shape)} {scale.dtype} on {scale.device}, strides "
            f"{scale.stride()}"
        )


def check_fp8_quantize_operands(op: str, x, up, q, s, rows: int, cols: int) -> None:
    """quantize_fp8's operands: ``up`` (or None) x's twin in shape, strides, dtype and
    device; q [rows, cols] e4m3, contiguous; s its scales (check_fp8_row_scales)."""
    if up is not None and (
        up.shape != x.shape
        or up.stride() != x.stride()
        or up.dtype != x.dtype
        or up.device != x.device
    ):
        raise ValueError(
            f"{op}: up {tuple(up.shape)} {up.dtype} on {up.device} (strides "
            f"{up.stride()}) must match x {tuple(x.shape)} {x.dtype} on {x.device} "
            f"(strides {x.stride()})"
        )
    if (
        q.shape != (rows, cols)
        or q.dtype != torch.float8_e4m3fn
        or not q.is_contiguous()
    ):
        raise ValueError(
            f"{op}: q must be [{rows}, {cols}] float8_e4m3fn, contiguous; got "
            f"{tuple(q.shape)} {q.dtype}, strides {q.stride()}"
        )
    check_fp8_row_scales(op, s, -(-cols // 128), rows, x.device, "s", padded=True)


def check_split_k_counters(op: str, name: str, counters, device, at_least: int) -> None:
    """gemm.later_split_k_counters: int32, contiguous, on the GEMM's device, a power of two
    of them (the kernel zeroes them in one block) and at least one per program."""
    if counters is None:
        return
    n = counters.numel()
    if (
        counters.dtype != torch.int32
        or not counters.is_contiguous()
        or counters.device != device
        or n & (n - 1)
        or n < at_least
    ):
        raise ValueError(
            f"{op}: {name} must be gemm.later_split_k_counters: contiguous int32 on "
            f"{device}, a power of two of them and at least {at_least}; got "
            f"{tuple(counters.shape)} {counters.dtype} on {counters.device}"
        )


def check_contiguous(op: str, **tensors: torch.Tensor | None) -> None:
    """Outputs the GEMM kernels write as contiguous rows (the stored pre-activations)."""
    bad = {n: t for n, t in tensors.items() if t is not None and not t.is_contiguous()}
    if bad:
        raise ValueError(f"{op}: these outputs must be contiguous ({describe(bad)})")
