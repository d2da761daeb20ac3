"""Input checks of the FP8 functions (checks.py's rules: messages name every tensor's shape,
dtype and device, built only on error)."""

import torch

from ..checks import PLAIN_TENSORS, check_bias, describe, given, kernels_run_on
from ..launch import CPU_UNAVAILABLE

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
    """An FP8 GEMM's A (fp8/gemm.py): e4m3 with its scales, or 16-bit without them (quantized
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
    """fp8.gemm.later_split_k_counters: int32, contiguous, on the GEMM's device, a power of two
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
            f"{op}: {name} must be fp8.gemm.later_split_k_counters: contiguous int32 on "
            f"{device}, a power of two of them and at least {at_least}; got "
            f"{tuple(counters.shape)} {counters.dtype} on {counters.device}"
        )
