"""Property-based fuzzing of every public function against float64 references.

Hypothesis draws shapes (1-3 leading dims; sizes 0, 1, 2, odd ones up to 301 and tile
multiples up to 256; the work per example capped so the interpreter stays fast), layouts of every input and of the incoming
gradient (transposed, sliced, permuted, zero-stride expand; fused weight halves), dtypes
(float32/float16 everywhere, bfloat16 for the elementwise ones and, on a GPU, the GEMMs),
GeLU flavours, biases and which inputs require grad. Outputs and gradients must meet
``reference.assert_close_to_ref``: the largest element-wise error against float64 at
most twice eager's in the same dtype (bf16 slack in the interpreter) plus one unit of
rounding at the largest magnitude; GEMM results also get the fp32 accumulation floor
(``reference.accumulation_floor``), a linear's bias gradient ``bias_grad_floor``.

Seeds: by default every run is derandomized (``derandomize=True``, no example database):
the examples are a fixed function of this file, so CI and local runs see the same ones
and a failure reproduces as is; a tensor's values come from a torch.Generator seeded by
an integer hypothesis draws. Environment:
  FUZZ_EXAMPLES=<n>  examples per test (default: a count that keeps this file under
                     ~2 min on 2 CPU cores); on a GPU e.g. ``FUZZ_EXAMPLES=2000``.
  FUZZ_SEED=<int>    random search from that seed instead, to explore new examples;
                     rerun with the same seed (and FUZZ_EXAMPLES) to reproduce.
"""

import math
import os
from functools import partial

import torch
from conftest import HAS_GPU
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from reference import (
    assert_close_to_ref,
    bias_grad_floor,
    check_against_float64,
    eager_geglu,
    eager_geglu_linear,
    eager_geglu_mlp,
    eager_linear,
)

FUZZ_SEED = os.environ.get("FUZZ_SEED")
ELEMENTWISE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GEMM_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_GPU else [])
MAX_SIZE = 300
# Caps on the work per example: elements for the elementwise kernels, 32x32x32 tiles per
# GEMM (the interpreter's cost is about 7 ms a tile). A GPU takes far more.
SCALE = 64 if HAS_GPU else 1
ELEMENTWISE_BUDGET = 2**17 * SCALE
GEMM_TILES = 32 * SCALE


def fuzz(default_examples: int):
    """Hypothesis settings of this file (see the module docstring)."""
    examples = int(os.environ.get("FUZZ_EXAMPLES", default_examples))

    def wrap(test):
        test = settings(
            max_examples=examples,
            deadline=None,
            derandomize=FUZZ_SEED is None,
            database=None,
            # The session fixtures are reused across examples on purpose.
            suppress_health_check=[
                HealthCheck.function_scoped_fixture,
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
            ],
        )(test)
        return test if FUZZ_SEED is None else seed(int(FUZZ_SEED))(test)

    return wrap


# Empty and single, odd (masked tails everywhere), and multiples of the tile sizes.
SIZES = st.one_of(
    st.sampled_from([0, 1, 2]),
    st.integers(1, MAX_SIZE // 2).map(lambda n: 2 * n + 1),
    st.sampled_from([16, 32, 64, 128, 256]),
)
LEADING = st.lists(SIZES, min_size=1, max_size=3)


def fit(sizes: list[int], work, budget: int) -> list[int]:
    """``sizes`` with the largest halved until ``work(sizes)`` is at most ``budget``."""
    sizes = list(sizes)
    while work(sizes) > budget:
        i = sizes.index(max(sizes))
        sizes[i] = (sizes[i] + 1) // 2
    return sizes


def gemm_tiles(sizes: list[int]) -> int:
    """32x32x32 tiles of a GEMM; ``sizes``: the leading dims of M, then N and K."""
    *lead, n, k = sizes
    return math.prod(max(1, -(-d // 32)) for d in (math.prod(lead), n, k))


LAYOUTS = ["contiguous", "transposed", "sliced", "rows", "expanded", "permuted"]


@st.composite
def tensors(draw, shape, dtype, device, scale=1.0, layouts=LAYOUTS):
    """A tensor of ``shape`` in a drawn layout, ~N(0, scale^2) from a drawn seed."""
    shape, nd = list(shape), len(shape)
    layout = draw(st.sampled_from(layouts))
    if layout in ("transposed", "permuted", "rows") and nd < 2:
        layout = "sliced"
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def randn(base):
        return (torch.randn(base, generator=gen) * scale).to(device, dtype)

    if layout == "transposed":
        t = randn(shape[:-2] + shape[:-3:-1]).transpose(-1, -2)
    elif layout == "sliced":  # odd offset, element stride 2
        t = randn(shape[:-1] + [2 * shape[-1] + 1])[..., 1::2]
    elif layout == "rows":  # every other row of the first dim
        t = randn([2 * shape[0]] + shape[1:])[::2]
    elif layout == "expanded":  # stride 0 in one dim
        d = draw(st.integers(0, nd - 1))
        t = randn(shape[:d] + [1] + shape[d + 1 :]).expand(shape)
    elif layout == "permuted":  # all dims reversed in memory
        t = randn(shape[::-1]).permute(*range(nd - 1, -1, -1))
    else:
        t = randn(shape)
    assert list(t.shape) == shape
    return t


@fuzz(80)
@given(data=st.data())
def test_fuzz_geglu(fused_geglu, device, data):
    dims = fit(data.draw(LEADING) + [data.draw(SIZES)], math.prod, ELEMENTWISE_BUDGET)
    dtype = data.draw(st.sampled_from(ELEMENTWISE_DTYPES))
    approximate = data.draw(st.sampled_from(["tanh", "none"]))
    gate = data.draw(tensors(dims, dtype, device, scale=3.0))
    up = data.draw(tensors(dims, dtype, device))
    dy = data.draw(tensors(dims, dtype, device))
    needs_grad = data.draw(st.lists(st.booleans(), min_size=2, max_size=2))
    check_against_float64(
        partial(fused_geglu.geglu, approximate=approximate),
        partial(eager_geglu, approximate=approximate),
        [gate, up], dy, needs_grad=needs_grad,
    )  # fmt: skip


@fuzz(60)
@given(data=st.data())
def test_fuzz_gelu_and_mul(fused_geglu, device, data):
    dims = fit(
        data.draw(LEADING) + [data.draw(SIZES)], math.prod, ELEMENTWISE_BUDGET // 2
    )
    dtype = data.draw(st.sampled_from(ELEMENTWISE_DTYPES))
    approximate = data.draw(st.sampled_from(["tanh", "none"]))
    x = data.draw(tensors(dims[:-1] + [2 * dims[-1]], dtype, device, scale=2.0))
    # Any writable layout: a zero-stride out is refused (test_hardening).
    out_layouts = [layout for layout in LAYOUTS if layout != "expanded"]
    out = data.draw(tensors(dims, dtype, device, layouts=out_layouts)).fill_(math.nan)
    fn = {"tanh": fused_geglu.gelu_tanh_and_mul, "none": fused_geglu.gelu_and_mul}
    assert fn[approximate](out, x) is out
    gate, up = x[..., : dims[-1]], x[..., dims[-1] :]
    ref = eager_geglu(gate.double(), up.double(), approximate)
    assert_close_to_ref(out, ref, eager_geglu(gate, up, approximate))


@fuzz(80)
@given(data=st.data())
def test_fuzz_linear(fused_geglu, device, data):
    lead = data.draw(LEADING)
    n, k = data.draw(SIZES), data.draw(SIZES)
    *lead, n, k = fit(lead + [n, k], gemm_tiles, GEMM_TILES)
    dtype = data.draw(st.sampled_from(GEMM_DTYPES))
    activation = data.draw(st.sampled_from([None, "gelu", "gelu_tanh"]))
    x = data.draw(tensors(lead + [k], dtype, device))
    w = data.draw(tensors([n, k], dtype, device, scale=1 / math.sqrt(max(k, 1))))
    b = data.draw(st.none() | tensors([n], dtype, device))
    dy = data.draw(tensors(lead + [n], dtype, device))
    inputs = [x, w, b]
    needs_grad = [t is not None and data.draw(st.booleans()) for t in inputs]
    check_against_float64(
        partial(fused_geglu.linear, activation=activation),
        partial(eager_linear, activation=activation),
        inputs, dy, needs_grad=needs_grad, terms=max(math.prod(lead), n, k),
        floors=[0.0, 0.0, 0.0, bias_grad_floor(x, w, b, dy, activation)],
    )  # fmt: skip


@st.composite
def gate_up_weights(draw, i, h, dtype, device):
    """w_gate, w_up: separate tensors, or the two row halves of one [2I, H] weight."""
    scale = 1 / math.sqrt(max(h, 1))
    if draw(st.booleans()):
        w = draw(tensors([2 * i, h], dtype, device, scale=scale))
        halves = (w[:i], w[i:])
        return halves if draw(st.booleans()) else halves[::-1]
    return tuple(draw(tensors([i, h], dtype, device, scale=scale)) for _ in range(2))


@fuzz(35)
@given(data=st.data())
def test_fuzz_geglu_linear(fused_geglu, device, data):
    lead = data.draw(LEADING)
    *lead, i, h = fit(
        lead + [data.draw(SIZES), data.draw(SIZES)], gemm_tiles, GEMM_TILES
    )
    dtype = data.draw(st.sampled_from(GEMM_DTYPES))
    approximate = data.draw(st.sampled_from(["tanh", "none"]))
    x = data.draw(tensors(lead + [h], dtype, device))
    wg, wu = data.draw(gate_up_weights(i, h, dtype, device))
    biases = [None, None]
    if data.draw(st.booleans()):
        biases = [data.draw(tensors([i], dtype, device)) for _ in range(2)]
    dy = data.draw(tensors(lead + [i], dtype, device))
    inputs = [x, wg, wu, *biases]
    needs_grad = [t is not None and data.draw(st.booleans()) for t in inputs]
    check_against_float64(
        partial(fused_geglu.geglu_linear, approximate=approximate),
        partial(eager_geglu_linear, approximate=approximate),
        inputs, dy, needs_grad=needs_grad, terms=max(math.prod(lead), i, h),
    )  # fmt: skip


@fuzz(20)
@given(data=st.data())
def test_fuzz_geglu_mlp(fused_geglu, device, data):
    lead = data.draw(LEADING)
    *lead, i, h = fit(
        lead + [data.draw(SIZES), data.draw(SIZES)], gemm_tiles, GEMM_TILES // 2
    )
    dtype = data.draw(st.sampled_from(GEMM_DTYPES))
    approximate = data.draw(st.sampled_from(["tanh", "none"]))
    x = data.draw(tensors(lead + [h], dtype, device))
    wg, wu = data.draw(gate_up_weights(i, h, dtype, device))
    wd = data.draw(tensors([h, i], dtype, device, scale=1 / math.sqrt(max(i, 1))))
    biases = [None] * 3
    if data.draw(st.booleans()):
        biases = [data.draw(tensors([n], dtype, device)) for n in (i, i, h)]
    dy = data.draw(tensors(lead + [h], dtype, device))
    inputs = [x, wg, wu, wd, *biases]
    needs_grad = [t is not None and data.draw(st.booleans()) for t in inputs]
    check_against_float64(
        partial(fused_geglu.geglu_mlp, approximate=approximate),
        partial(eager_geglu_mlp, approximate=approximate),
        inputs, dy, needs_grad=needs_grad, terms=max(math.prod(lead), i, h),
    )  # fmt: skip
