"""The references and the error rule the tests share.

References: PyTorch eager, written once per public op. Called on the test's tensors they
are "eager" (PyTorch in the same dtype); called on float64 copies they are the reference.
``fwd_bwd`` runs any of them, or ours, forward then backward and collects the gradients.

The rule (QuACK's tests/test_linear.py), element by element against float64:

    max|out - ref| <= 2 * slack * max|eager - ref| + eps(dtype) * max|ref| + floor

- ``slack`` is 2 for bf16 under the Triton interpreter, else 1: the interpreter rounds
  fp32 -> bf16 toward zero (GPUs round to nearest even), so its bf16 error against
  float64 can be up to twice a correctly rounded result's.
- ``eps(dtype) * max|ref|``, one unit of rounding of the output dtype at the tensor's
  largest magnitude, is the built-in floor: below it no rounding can be judged, and
  without it a tiny tensor that eager happens to round exactly (error 0) would fail ours
  for rounding one element the other way. In float32 it is ~1e-7 relative, QuACK's 1e-6
  at unit scale; in fp16/bf16 it is one ulp at the largest element, far below a real bug.
- ``floor``: an extra absolute floor that a caller states a reason for (a sum that
  cancels, fp32 accumulation order), never a blanket tolerance.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_GPU

# The interpreter rounds fp32 -> bf16 by truncation (GPUs round to nearest even), so its
# bf16 error against float64 can be up to twice a correctly rounded result's.
INTERPRETED_BF16_SLACK = 2.0


def dtype_slack(dtype: torch.dtype) -> float:
    """How much further from float64 than eager a correct kernel of ours may land."""
    return INTERPRETED_BF16_SLACK if dtype == torch.bfloat16 and not HAS_GPU else 1.0


# --- PyTorch references, one per op ----------------------------------------------------


def eager_geglu(gate, up, approximate="tanh"):
    return F.gelu(gate, approximate=approximate) * up


def eager_activation(y, activation=None):
    """``linear``'s epilogue: None, 'gelu' (exact) or 'gelu_tanh'."""
    if activation is None:
        return y
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


def eager_linear(x, w, b=None, activation=None):
    return eager_activation(F.linear(x, w, b), activation)


def eager_geglu_linear(x, wg, wu, bg=None, bu=None, approximate="tanh"):
    return F.gelu(F.linear(x, wg, bg), approximate=approximate) * F.linear(x, wu, bu)


def eager_geglu_mlp(x, wg, wu, wd, bg=None, bu=None, bd=None, approximate="tanh"):
    return F.linear(eager_geglu_linear(x, wg, wu, bg, bu, approximate), wd, bd)


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    """The float64 GeGLU."""
    return eager_geglu(gate.double(), up.double(), approximate)


def cast(tensors, dtype):
    """``tensors`` (None kept) in ``dtype``: copies, not the test's layouts."""
    return [None if t is None else t.to(dtype) for t in tensors]


def fwd_bwd(fn, inputs, dy=None, needs_grad=None):
    """[fn(*inputs), *gradients of the inputs]: each input a detached leaf of its own
    layout (no copy); a None input, or one whose ``needs_grad`` is False, has gradient
    None; with no input needing one, no autograd at all. ``dy`` None means
    ``y.sum().backward()`` (an expanded incoming gradient), else ``dy`` in y's dtype."""
    if needs_grad is None:
        needs_grad = [t is not None for t in inputs]
    leaves = [
        None if t is None else t.detach().requires_grad_(g)
        for t, g in zip(inputs, needs_grad)
    ]
    if not any(needs_grad):
        with torch.no_grad():
            return [fn(*leaves)] + [None] * len(leaves)
    y = fn(*leaves)
    if dy is None:
        y.sum().backward()
    else:
        y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad if g else None for t, g in zip(leaves, needs_grad)]


# --- The rule --------------------------------------------------------------------------


def max_err(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, int]:
    """The largest element-wise |out - ref| in float64 and its flat index."""
    err = (out.double() - ref.double()).abs().flatten()
    i = int(err.argmax()) if not err.isnan().any() else int(err.isnan().nonzero()[0])
    return err[i].item(), i


def assert_close_to_ref(out, ref, eager, *, floor=0.0, slack=None, what=""):
    """``out`` within the module docstring's rule of the float64 ``ref``: at most twice
    (times ``slack``) eager's largest element-wise error, plus one unit of rounding at the
    largest magnitude and the caller's ``floor``."""
    assert out.shape == ref.shape == eager.shape, (out.shape, ref.shape, eager.shape)
    assert out.dtype == eager.dtype, f"{what}: {out.dtype}, eager {eager.dtype}"
    if out.numel() == 0:
        return
    assert torch.isfinite(out).all(), f"{what}: non-finite values in the output"
    s = dtype_slack(out.dtype) if slack is None else slack
    ours, i = max_err(out, ref)
    theirs, _ = max_err(eager, ref)
    scale = ref.double().abs().max().item()
    bound = 2.0 * s * theirs + torch.finfo(out.dtype).eps * scale + floor
    assert ours <= bound, (
        f"{what}: largest error {ours:.3e} at flat index {i} (ours "
        f"{out.flatten()[i].item():.6g}, float64 {ref.flatten()[i].item():.6g}) against "
        f"a bound of {bound:.3e} (PyTorch's largest error {theirs:.3e})"
    )


def assert_all_close(ours, refs, eagers, *, floors=(), what=""):
    """``assert_close_to_ref`` on each (out, ref, eager) triple of three lists (as from
    ``fwd_bwd``), skipping those whose ``ours`` is None; ``floors`` by position."""
    floors = list(floors) + [0.0] * (len(ours) - len(floors))
    for n, (o, r, e, floor) in enumerate(zip(ours, refs, eagers, floors)):
        assert (o is None) == (r is None) == (e is None), f"{what}[{n}]"
        if o is not None:
            assert_close_to_ref(o, r, e, floor=floor, what=f"{what}[{n}]")


def check_against_float64(ours_fn, eager_fn, inputs, dy=None, *, needs_grad=None, floors=(), terms=1, what=""):  # fmt: skip
    """Ours, the float64 reference and eager, forward and backward through ``fwd_bwd``,
    under the rule: output first, then each input's gradient, each with its ``floors``
    entry (by position) or, if larger, ``accumulation_floor`` of ``terms``-long sums.
    Returns ours: ``[out, *grads]``."""
    ours = fwd_bwd(ours_fn, inputs, dy, needs_grad)
    ref = fwd_bwd(eager_fn, cast(inputs, torch.float64), dy, needs_grad)
    eager = fwd_bwd(eager_fn, inputs, dy, needs_grad)
    floors = list(floors) + [0.0] * (len(ref) - len(floors))
    if terms > 1:
        floors = [
            f if r is None else max(f, accumulation_floor(r, terms))
            for f, r in zip(floors, ref)
        ]
    assert_all_close(ours, ref, eager, floors=floors, what=what)
    return ours


def accumulation_floor(ref: torch.Tensor, terms: int) -> float:
    """fp32 accumulation over ``terms`` products in another order than eager's: a random
    walk of sqrt(terms) fp32 units at the reference's largest magnitude. Which order lands
    closer is chance (on the H200 at 8192 fp32 rows cuBLAS's was 5.5e-8 from float64
    against our 1.2e-6, relative)."""
    if ref.numel() == 0:
        return 0.0
    eps32 = torch.finfo(torch.float32).eps
    return eps32 * math.sqrt(max(terms, 1)) * ref.double().abs().max().item()


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN, so that an element the kernel misses fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def bias_grad_floor(x, w, b, dy, activation=None) -> float:
    """The bias gradient's own floor: db_j = sum_i dZ_ij with dZ = dY * act'(Z), each term
    rounded to x's dtype (as eager's gelu_backward output is), so db_j moves by a random
    walk of about eps * ||dZ[:, j]||, large against db_j where the sum cancels. Which of two
    implementations lands closer is then chance: eager was 9.2e-4 from float64 (relative)
    where ours, with a 0.57-ulp pre-activation against eager's double-rounded one, was
    6.2e-3. 0 without a bias."""
    if b is None or x.numel() == 0 or w.numel() == 0:
        return 0.0
    z = F.linear(*cast([x, w, b], torch.float64)).requires_grad_()
    (dz,) = torch.autograd.grad(eager_activation(z, activation), z, dy.double())
    dz = dz.reshape(-1, z.shape[-1])
    return torch.finfo(x.dtype).eps * dz.norm(dim=0).max().item()


def ulps_apart(ours: torch.Tensor, eager: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values lie between ``ours`` and ``eager`` (0:
    the same bits; NaN against NaN counts as 0, NaN against a number as a huge distance)."""
    bits = {2: torch.int16, 4: torch.int32}[ours.element_size()]

    def ordered(t):
        # Sign-magnitude bits onto a line where adjacent floats are adjacent integers
        # (-0 just below +0).
        i = t.contiguous().view(bits).long()
        return torch.where(i < 0, -(i & (2 ** (8 * t.element_size() - 1) - 1)) - 1, i)

    nan = ours.isnan() | eager.isnan()
    apart = (ordered(ours) - ordered(eager)).abs()
    both_nan = ours.isnan() & eager.isnan()
    return torch.where(nan, torch.where(both_nan, 0, 2**40), apart)


def assert_same_bits(ours: torch.Tensor, eager: torch.Tensor, what: str = "") -> None:
    ours, eager = ours.flatten(), eager.flatten()
    bad = ulps_apart(ours, eager).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {bad.numel()} of {ours.numel()} elements differ from eager's bits, "
        f"e.g. ours {ours[bad[:4]].tolist()} eager {eager[bad[:4]].tolist()}"
    )


def assert_within_erff_ulp(ours, eager, gate, up, dy, what):
    """Where only erff differs (by one ulp, 2^-24 near |erf| = 1): 1 + erf moves by as
    much, so a result by at most |gate| 2^-23 |up| |dy| (each factor at least 1), or an
    ulp of its dtype; NaN where eager has NaN."""
    ours, eager = ours.double().flatten(), eager.double().flatten()
    factors = (
        up.double().abs().clamp(min=1) * dy.double().abs().clamp(min=1)
    ).flatten()
    bound = gate.double().abs().flatten() * 2**-23 * factors
    bound += eager.abs() * torch.finfo(gate.dtype).eps
    same = (ours == eager) | (ours.isnan() & eager.isnan())
    bad = (~same & ~((ours - eager).abs() <= bound)).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{what}: {ours[bad[:4]].tolist()} vs {eager[bad[:4]].tolist()}"
    )


# ROCm's PyTorch uses other math libraries and compilers: no bit-for-bit promise there.
CUDA_ONLY = pytest.mark.skipif(torch.version.hip is not None, reason="CUDA's libdevice")


def bit_for_bit(fused_geglu, approximate: str) -> bool:
    """Whether the GPU's GeLU must be eager's bit for bit: always for tanh (no erff), and
    for the exact GeLU where the kernels link torch's toolkit libdevice. They link it
    wherever one is installed (a libdevice dropped after a failed link fails here)."""
    launch = fused_geglu.launch
    if not launch._USER_LIBDEVICE:
        assert launch.TOOLKIT_LIBDEVICE == launch._toolkit_libdevice()
    return approximate == "tanh" or launch.TOOLKIT_LIBDEVICE is not None


# --- FP8 (transformers' FineGrainedFP8: 128 x 128 weight blocks, dynamic activations) ---

FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128


def fp8_quantize_weight(w: torch.Tensor, power_of_two: bool = False):
    """(e4m3 weight, fp32 scales [ceil(N/128), ceil(K/128)]) with weight * scale ~ w per
    128 x 128 block, scale = amax / 448 (``power_of_two``: rounded up to a power of two,
    as ue8m0 scales are)."""
    n, k = w.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.zeros(rows * FP8_BLOCK, cols * FP8_BLOCK, dtype=torch.float32)
    padded[:n, :k] = w.float().cpu()
    blocks = padded.view(rows, FP8_BLOCK, cols, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    scale = scale.clamp_min(1e-12)
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(FP8)
    return q.view(padded.shape)[:n, :k].contiguous().to(w.device), scale.to(w.device)


def fp8_dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 weight an FP8Linear stands for."""
    n, k = q.shape
    s = scale.double().repeat_interleave(FP8_BLOCK, 0)[:n]
    return q.double() * s.repeat_interleave(FP8_BLOCK, 1)[:, :k]


def fp8_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' dynamic activation quantization, in x's precision at least fp32: per
    row and 128 columns s = amax / 448, q = e4m3(x / max(s, 1e-12)). Returns (e4m3 q of x's
    shape, s [..., ceil(K/128)])."""
    work = x.double() if x.dtype == torch.float64 else x.float()
    k = x.shape[-1]
    blocks = -(-k // FP8_BLOCK)
    padded = torch.zeros(
        *x.shape[:-1], blocks * FP8_BLOCK, dtype=work.dtype, device=x.device
    )
    padded[..., :k] = work
    padded = padded.unflatten(-1, (blocks, FP8_BLOCK))
    s = padded.abs().amax(-1) / 448.0
    q = (padded / s.clamp_min(1e-12)[..., None]).clamp(-448, 448)
    q = q.float().to(FP8).flatten(-2)[..., :k]
    return q, s


def fp8_linear(x, q, scale, bias=None, *, exact: bool):
    """An FP8Linear's output: ``exact``, the float64 product of x's quantization with the
    dequantized weight (the reference); else transformers' path in x's dtype (fp32
    quantization and products, output rounded to x's dtype, then the bias added)."""
    xq, xs = fp8_quantize_rows(x)
    k = x.shape[-1]
    dtype = torch.float64 if exact else torch.float32
    xd = xq.to(dtype) * xs.to(dtype).repeat_interleave(FP8_BLOCK, -1)[..., :k]
    out = xd @ fp8_dequantize_weight(q, scale).to(dtype).T
    if exact:
        return out if bias is None else out + bias.double()
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def fp8_geglu_mlp(x, weights, scales, biases, approximate, *, exact: bool):
    """The FP8 GemmaMLP: FP8Linear projections around act(gate) * up (float64 with
    ``exact``, else eager's rounding in x's dtype)."""
    if exact:
        x = x.double()
    (wg, wu, wd), (sg, su, sd), (bg, bu, bd) = weights, scales, biases
    gate = fp8_linear(x, wg, sg, bg, exact=exact)
    up = fp8_linear(x, wu, su, bu, exact=exact)
    return fp8_linear(eager_geglu(gate, up, approximate), wd, sd, bd, exact=exact)
