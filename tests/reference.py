"""float64 references and the error rule the tests share."""

import torch
import torch.nn.functional as F

# The interpreter rounds fp32 -> bf16 by truncation (GPUs round to nearest even), so its
# bf16 error against float64 can be up to twice a correctly rounded result's.
INTERPRETED_BF16_SLACK = 2.0


def geglu_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str) -> torch.Tensor:
    return F.gelu(gate.double(), approximate=approximate) * up.double()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close_to_ref(out, ref, eager, *, slack: float = 1.0, floor: float = 1e-6):
    """Our error against the float64 reference is at most twice PyTorch's own error in the
    same dtype (``eager``), with a floor for float32 where both are ~1e-7."""
    assert torch.isfinite(out).all(), "non-finite values in the output"
    ours, theirs = rel_err(out, ref), rel_err(eager, ref)
    assert ours <= 2.0 * slack * theirs + floor, (
        f"error {ours:.3e} vs PyTorch's {theirs:.3e}"
    )


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN, so that an element the kernel misses fails the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
