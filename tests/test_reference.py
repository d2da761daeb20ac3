"""The shared error rule itself (``reference.assert_close_to_ref``): it fails one bad
element that a whole-tensor norm lets through, and passes what it should."""

import pytest
import torch
from reference import assert_close_to_ref, eager_geglu, geglu_ref


def _rel_norm_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_one_corrupted_element_fails():
    """A bf16 GeGLU of shape (9, 41, 4231) with one element off by 2: the Frobenius
    relative error (the rule before issue 17) barely moves, the element-wise rule fails."""
    gate = (torch.randn(9, 41, 4231) * 3).bfloat16()
    up = torch.randn(9, 41, 4231).bfloat16()
    ref, eager = geglu_ref(gate, up, "tanh"), eager_geglu(gate, up, "tanh")
    assert_close_to_ref(eager.clone(), ref, eager)  # eager meets the rule itself
    out = eager.clone()
    out.view(-1)[123_457] += 2
    assert _rel_norm_err(out, ref) <= 2 * _rel_norm_err(eager, ref) + 1e-6
    with pytest.raises(AssertionError, match="largest error .* at flat index 123457"):
        assert_close_to_ref(out, ref, eager)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_element_fails(bad):
    ref = torch.randn(50, 70, dtype=torch.float64)
    eager = ref.float()
    out = eager.clone()
    out[3, 4] = bad
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close_to_ref(out, ref, eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_floor_is_one_rounding_unit(dtype):
    """Eager exact (error 0) on a tiny tensor: ours one rounding unit off at the largest
    magnitude passes; two units fail."""
    ref = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    eager = ref.to(dtype)
    ulp = torch.finfo(dtype).eps * 2.0  # one unit at 2.0
    assert_close_to_ref(eager + torch.tensor([0, 0, ulp], dtype=dtype), ref, eager)
    with pytest.raises(AssertionError):
        assert_close_to_ref(
            eager + torch.tensor([0, 0, 2 * ulp], dtype=dtype), ref, eager
        )
