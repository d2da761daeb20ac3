"""The FP8 GeGLU MLP (transformers' FineGrainedFP8: e4m3 weights in 128 x 128 blocks,
activations quantized per token and 128 columns) against a float64 reference of the same
quantized model. The Triton interpreter runs e4m3 products exactly, so the kernels run
here as on the GPU; ``quantize_rows``' conversion to e4m3 is checked value by value."""

import pytest
import torch
from conftest import HAS_GPU, ROOT, run_python
from launches import spy_launches, spy_unused_arguments
from reference import (
    FP8,
    accumulation_floor,
    assert_close_to_ref,
    eager_geglu,
    fp8_dequantize_weight,
    fp8_quantize_rows,
    fp8_quantize_weight,
)

DTYPES = [torch.bfloat16, torch.float16]
# The error of an e4m3 product over one 128-wide K block relative to the sum of its terms'
# magnitudes: Hopper's e4m3 MMA keeps about 13 bits of its running sum (on the H200 at
# most 1.4e-4 measured, below 2^-12); the interpreter's products are fp32.
E4M3_MMA_ACCURACY = 2.0**-12 if HAS_GPU else 2.0**-20


def fp8_params(h, i, n, device, bias, dtype=torch.bfloat16, power_of_two=False):
    """((w_gate, w_up, w_down) e4m3, their fp32 scales, biases or Nones) of random weights
    whose blocks span magnitudes (the scales differ block to block)."""
    weights, scales = [], []
    for rows, cols in ((i, h), (i, h), (n, i)):
        w = torch.randn(rows, cols) / cols**0.5
        w *= torch.exp2(torch.randint(-3, 3, (rows, 1)).float())
        q, s = fp8_quantize_weight(w, power_of_two)
        weights.append(q.to(device))
        scales.append(s.to(device))
    biases = [None] * 3
    if bias:
        biases = [torch.randn(m, dtype=dtype, device=device) for m in (i, i, n)]
    return tuple(weights), tuple(scales), tuple(biases)


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The distance from |v| (in units of its scale) to the next e4m3 value: 2^(e - 3),
    e = max(floor(log2 |v|), -6)."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return torch.exp2(e - 3)


def check_mlp(out, x, weights, scales, biases, approximate, fused_geglu, what="",
              h_pair=None):  # fmt: skip
    """``out`` against float64, stage by stage on the CPU. x quantized as ours does (equal to
    transformers' scheme: test_quantize_rows_is_transformers_scheme); then h =
    round(act(gate)) * up as our dual GEMM hands it over (e4m3 and scales) within one e4m3
    step of float64's h (the quantization of a value on a rounding boundary may go either
    way: the products before it round differently in every implementation, as
    transformers' and the float64 model's do); then ``out`` within the rule of float64's
    down projection of that h, against the same product in fp32 rounded to x's dtype.
    An FP8 path's largest error against the float64 model is set by which h values land
    on the other side of a boundary (one step moves an output by up to 1/14 of h's largest
    value): the model-level comparison with transformers' path is the GPU benchmark's.
    ``h_pair``: (e4m3 h, scales) as the path under test formed them, where that is not
    the dual GEMM."""
    f = fused_geglu
    m, hidden = x.shape
    (wg, wu, wd), (sg, su, sd), (bg, bu, bd) = weights, scales, biases
    inter = wg.shape[0]
    x_q = torch.empty(m, hidden, dtype=FP8, device=x.device)
    x_s = torch.empty(-(-hidden // 128), m, device=x.device)
    f.fp8.gemm.quantize_fp8(x, x_q, x_s)
    if h_pair is None:
        h_q = torch.empty(m, inter, dtype=FP8, device=x.device)
        h_s = torch.empty(-(-inter // 128), m, device=x.device)
        act = f.gemm.gelu_code(approximate)
        # h as the paths under test form it: x quantized in the dual GEMM up to
        # FP8_QUANT_A_ROWS rows (the one launch's products are those), apart beyond
        a, a_s = (x, None) if m <= f.tuning.FP8_QUANT_A_ROWS else (x_q, x_s)
        f.fp8.gemm.gemm_gated_fp8(
            a, a_s, wg, sg, wu, su, h_q, h_s, act, x.dtype, bias_gate=bg, bias_up=bu
        )
    else:
        h_q, h_s = h_pair
    cpu = lambda t: None if t is None else t.cpu()
    xd = x_q.cpu().double() * x_s.cpu().double().T.repeat_interleave(128, 1)[:, :hidden]

    def product(q, s, b):
        w = fp8_dequantize_weight(q.cpu(), s.cpu())
        out = xd @ w.T
        return out if b is None else out + b.cpu().double(), xd.abs() @ w.abs().T

    # h's range from gate and up each off by one unit of x's dtype (truncation in the
    # interpreter, a rounding on the GPU) and by the products' accumulation, and GeLU's
    # and the product's own roundings.
    (gate, gate_terms), (up, up_terms) = product(wg, sg, bg), product(wu, su, bu)
    e = torch.finfo(x.dtype).eps
    gate_off = e * gate.abs() + E4M3_MMA_ACCURACY * gate_terms
    up_off = e * up.abs() + E4M3_MMA_ACCURACY * up_terms
    corners = torch.stack(
        [
            eager_geglu(gate + a * gate_off, up + b * up_off, approximate)
            for a in (-1, 1)
            for b in (-1, 1)
        ]
    )
    lo, hi = corners.amin(0), corners.amax(0)
    lo, hi = lo - 2 * e * lo.abs(), hi + 2 * e * hi.abs()
    h_s64 = h_s.cpu().double().T.repeat_interleave(128, 1)[:, :inter]
    h = h_q.cpu().double() * h_s64
    step = e4m3_step(torch.maximum(lo.abs(), hi.abs()) / h_s64.clamp_min(1e-30)) * h_s64
    bad = ((h < lo - step) | (h > hi + step)).nonzero()
    assert not len(bad), (
        f"{what}: {len(bad)} elements of h more than one e4m3 step off, e.g. "
        f"{h[tuple(bad[0])]} against float64's {lo[tuple(bad[0])]} to {hi[tuple(bad[0])]}"
    )
    wd64 = fp8_dequantize_weight(wd.cpu(), sd.cpu())
    ref = h @ wd64.T + (0 if bd is None else cpu(bd).double())
    eager = (h.float() @ wd64.float().T + (0 if bd is None else cpu(bd).float())).to(
        x.dtype
    )
    floor = accumulation_floor(ref, inter)
    floor += E4M3_MMA_ACCURACY * (h.abs() @ wd64.abs().T).max().item()
    assert_close_to_ref(out.cpu(), ref, eager, floor=floor, what=what)


def test_e4m3_rounding_of_every_value(fused_geglu, device):
    """quantize_rows' conversion rounds to nearest even and saturates, as the GPU's
    cvt.rn.satfinite (and torch's cast below 464): every 16-bit value up to 448, every
    midpoint between e4m3 neighbours and one fp32 unit either side of it. A row whose
    largest magnitude is 448 has scale 1, so q = e4m3(x)."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = codes[codes.isfinite() & (codes >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    values = torch.cat(
        [
            torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16)
            .view(torch.bfloat16)
            .float(),
            mids,
            mids.nextafter(torch.tensor(0.0)),
            mids.nextafter(torch.tensor(1e9)),
            -mids,
        ]
    )
    values = values[values.isfinite() & (values.abs() <= 448)]
    width = 127  # each row: 127 values, then 448 (its scale 1)
    values = torch.cat([values, values.new_zeros(-len(values) % width)])
    rows = torch.cat(
        [values.view(-1, width), values.new_full((len(values) // width, 1), 448.0)], 1
    )
    x = rows.to(device)
    q = torch.empty(x.shape, dtype=FP8, device=device)
    s = torch.empty(1, x.shape[0], device=device)
    fused_geglu.fp8.gemm.quantize_fp8(x, q, s)
    assert torch.equal(s.cpu(), torch.ones_like(s.cpu()))
    expected = rows.to(FP8).float()
    got = q.float().cpu()
    bad = (got != expected).nonzero()
    assert not len(bad), (
        f"{len(bad)} values, e.g. {rows[tuple(bad[0])]} -> {got[tuple(bad[0])]}, expected {expected[tuple(bad[0])]}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_rows_is_transformers_scheme(fused_geglu, device, dtype):
    """Per row and 128 columns: s = amax / 448, q = e4m3(x / max(s, 1e-12)); a ragged last
    block, zero rows (s = 0, q = 0) and rows of very different magnitudes. The
    interpreter divides exactly, as the reference: equal. The GPU divides approximately
    (Triton's fp32 division): within one e4m3 step of it."""
    x = torch.randn(37, 300) * torch.exp2(torch.randint(-8, 8, (37, 1)).float())
    x[3] = 0
    x = x.to(dtype).to(device)
    q = torch.full(x.shape, float("nan"), device=device).to(FP8)
    s = torch.full((3, 37), float("nan"), device=device)
    fused_geglu.fp8.gemm.quantize_fp8(x, q, s)
    ref_q, ref_s = fp8_quantize_rows(x.cpu())
    if HAS_GPU:
        torch.testing.assert_close(s.cpu(), ref_s.T, rtol=2e-7, atol=0)
        ours = q.float().cpu() * s.cpu().T.repeat_interleave(128, 1)[:, :300]
        refs = ref_q.float() * ref_s.repeat_interleave(128, 1)[:, :300]
        assert ((ours - refs).abs() <= refs.abs() / 8 + 1e-30).all()
    else:
        assert torch.equal(s.cpu(), ref_s.T)
        assert torch.equal(q.float().cpu(), ref_q.float())


@pytest.mark.parametrize("tokens", [1, 7, 16, 32])
@pytest.mark.parametrize("hidden", [256, 200], ids=["even-K", "ragged-K"])
def test_dual_gemm_quantizes_a_16_bit_x_as_quantize_fp8(
    fused_geglu, device, tokens, hidden
):
    """gemm_gated_fp8 over a 16-bit x (quantized in its K loop, with the swapped e4m3
    product) hands over the h and scales that quantize_fp8 then gemm_gated_fp8 over the
    e4m3 x do: equal in the interpreter (the same operations). On the GPU the swapped
    product is Hopper's e4m3 MMA (about 13 bits of running sum), the other one in f16
    with fp32 sums: h within one e4m3 step plus what the MMA's error in gate and up
    moves it. Past FP8_QUANT_A_ROWS rows a 16-bit x is refused."""
    f, inter = fused_geglu.fp8.gemm, 384
    (wg, wu, _), (sg, su, _), (bg, bu, _) = fp8_params(hidden, inter, 256, device, True)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    x_q = torch.empty(tokens, hidden, dtype=FP8, device=device)
    x_s = torch.empty(-(-hidden // 128), tokens, device=device)
    f.quantize_fp8(x, x_q, x_s)
    outs = []
    for a, a_scale in ((x_q, x_s), (x, None)):
        h = torch.full((tokens, inter), float("nan"), device=device).to(FP8)
        h_s = torch.full((3, tokens), float("nan"), device=device)
        f.gemm_gated_fp8(a, a_scale, wg, sg, wu, su, h, h_s, f.GELU_TANH, x.dtype,
                         bias_gate=bg, bias_up=bu)  # fmt: skip
        outs.append((h.float().cpu(), h_s.cpu()))
    (h1, s1), (h2, s2) = outs
    if HAS_GPU:
        v1, v2 = (h * s.T.repeat_interleave(128, 1) for h, s in outs)
        scale = torch.maximum(s1, s2).T.repeat_interleave(128, 1)
        step = e4m3_step(torch.maximum(v1.abs(), v2.abs()) / scale) * scale
        # |d h| <= |gelu'(gate)| |up| |d gate| + |gelu(gate)| |d up|, gelu' <= 1.13
        xd = (
            x_q.cpu().double()
            * x_s.cpu().double().T.repeat_interleave(128, 1)[:, :hidden]
        )
        w = [fp8_dequantize_weight(q.cpu(), s.cpu()) for q, s in ((wg, sg), (wu, su))]
        (gate, up), (gate_terms, up_terms) = (
            [xd @ wi.T + b.cpu().double() for wi, b in zip(w, (bg, bu))],
            [xd.abs() @ wi.abs().T for wi in w],
        )
        mma = E4M3_MMA_ACCURACY * (
            1.13 * up.abs() * gate_terms + gate.abs() * up_terms
        )  # fmt: skip
        assert ((v1 - v2).abs() <= step * (1 + 2**-7) + 2 * mma.float()).all()
    else:
        assert torch.equal(s1, s2) and torch.equal(h1, h2)
    most = fused_geglu.tuning.FP8_QUANT_A_ROWS
    wide = torch.randn(most + 1, hidden, dtype=x.dtype, device=device)
    with pytest.raises(ValueError, match=f"at most {most} rows"):
        f.gemm_gated_fp8(wide, None, wg, sg, wu, su, h, h_s, f.GELU_TANH, x.dtype)
    # A and its scales must agree: e4m3 with them, 16-bit without (the dual GEMM only)
    for a, a_scale in ((x, x_s), (x_q, None)):
        with pytest.raises(ValueError, match="float8_e4m3fn with its scales"):
            f.gemm_gated_fp8(a, a_scale, wg, sg, wu, su, h, h_s, f.GELU_TANH, x.dtype)
    out = torch.empty(tokens, inter, dtype=x.dtype, device=device)
    for a, a_scale in ((x, None), (x, x_s), (x_q, None)):
        with pytest.raises(ValueError, match="float8_e4m3fn with its scales"):
            f.gemm_fp8(a, a_scale, wg, sg, out)


@pytest.mark.parametrize(
    ("tokens", "shape"), [(1, (256, 384, 256)), (5, (200, 320, 130)), (16, (256, 384, 256)),
                          (24, (256, 384, 256)), (40, (256, 384, 256)),
                          (100, (256, 384, 256)),
                          (130, (200, 320, 130)), (130, (256, 384, 256)),
                          (600, (256, 384, 256))],
)  # fmt: skip
@pytest.mark.parametrize(
    ("dtype", "bias", "approximate"),
    [(torch.bfloat16, True, "tanh"), (torch.float16, False, "none")],
    ids=["bf16-bias-tanh", "fp16-exact"],
)
def test_geglu_mlp_fp8(fused_geglu, device, monkeypatch, tokens, shape, dtype, bias, approximate):  # fmt: skip
    """geglu_mlp_fp8 within the rule of float64, in one launch up to 16 tokens and as two
    or three kernels beyond (and at any size with deterministic algorithms: no atomics;
    x quantized in the dual GEMM up to FP8_QUANT_A_ROWS tokens); ragged sizes (H 200,
    I 320, N 130: partial scale blocks)."""
    h, i, n = shape
    weights, scales, biases = fp8_params(h, i, n, device, bias, dtype)
    x = torch.randn(tokens, h, dtype=dtype, device=device)
    launched = spy_launches(fused_geglu, monkeypatch)
    out = fused_geglu.geglu_mlp_fp8(
        x, weights[0], scales[0], weights[1], scales[1], weights[2], scales[2], *biases,
        approximate=approximate,
    )  # fmt: skip
    tma = tokens > 64 and h % 16 == 0 and i % 16 == 0  # TMA: rows of 16-byte multiples
    quantized_apart = tokens > fused_geglu.tuning.FP8_QUANT_A_ROWS
    kernels = ["quantize_fp8_kernel"] * quantized_apart
    kernels.append("gemm_fp8_tma_kernel" if tma else "gemm_fp8_kernel")
    # the down GEMM: swapped products (the portable kernel) up to 64 tokens, and up to
    # the table's fp8_swap_rows where the TMA kernel's tiles are fewer than the programs (one per SM;
    # 4 in the interpreter: 130 tokens take the TMA kernel there); none of these shapes
    # reaches cuBLAS (its K, 320 or 384, is not a multiple of 512)
    swapped = fused_geglu.tuning.fp8_swap_ab(tokens, n, False, False, x.device)
    kernels.append("gemm_fp8_tma_kernel" if tma and not swapped else "gemm_fp8_kernel")
    one_launch = tokens <= fused_geglu.tuning.ONE_LAUNCH_MAX_TOKENS
    assert launched == (["one_launch_mlp_fp8_kernel"] if one_launch else kernels)
    check_mlp(out, x, weights, scales, biases, approximate, fused_geglu)  # fmt: skip
    if one_launch:
        launched.clear()
        with torch.no_grad():
            torch.use_deterministic_algorithms(True)
            try:
                kernels_out = fused_geglu.geglu_mlp_fp8(
                    x, weights[0], scales[0], weights[1], scales[1], weights[2],
                    scales[2], *biases, approximate=approximate,
                )  # fmt: skip
            finally:
                torch.use_deterministic_algorithms(False)
        assert launched == [
            "gemm_fp8_kernel",
            "gemm_fp8_kernel",
        ]  # x quantized in the first
        check_mlp(kernels_out, x, weights, scales, biases,
                  approximate, fused_geglu, "two kernels")  # fmt: skip


def _cublas_stand_in(fused_geglu, monkeypatch, calls):
    """On the CPU, cuBLAS's block-scaled GEMM replaced by its definition (float64 products
    of the dequantized operands, rounded to the output dtype), checking the operands it is
    handed as cuBLAS would; on the GPU, the real one, its operands recorded."""
    gemm = fused_geglu.fp8.gemm
    real = fused_geglu.fp8.mlp.gemm_fp8_cublas

    def stand_in(a, a_scale, b, b_scale, dtype):
        rows, k = a.shape
        assert rows % gemm.FP8_CUBLAS_ROWS == 0 and a_scale.is_contiguous()
        assert a_scale.shape == (-(-k // 128), rows) and b_scale.is_contiguous()
        calls.append(rows)
        if HAS_GPU:
            return real(a, a_scale, b, b_scale, dtype)
        a64 = a.double() * a_scale.double().T.repeat_interleave(128, 1)[:, :k]
        return (a64 @ fp8_dequantize_weight(b, b_scale).T).to(dtype)

    monkeypatch.setattr(fused_geglu.fp8.mlp, "gemm_fp8_cublas", stand_in)
    if not HAS_GPU:
        monkeypatch.setattr(gemm, "has_cublas_fp8_blocks", lambda device: True)


@pytest.mark.parametrize("past", [1, 2], ids=["unpadded", "3-padding-rows"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_down_gemm_by_cublas(
    fused_geglu, device, monkeypatch, table_fields, past, dtype
):
    """From FP8_CUBLAS_MIN_ROWS tokens the down GEMM is cuBLAS's block-scaled GEMM where it
    applies (on the H200; on the CPU a stand-in, from 128 rows): h's rows padded to a
    multiple of 4 (3 padding rows, whose products are discarded), h's scales written with
    the padded stride by the dual GEMM; within the rule of float64; three kernels. Gate
    and up (K = 256) are not cuBLAS's: its weight scales want K blocks in fours."""
    h, i, n = 256, 512, 256  # the down GEMM's K = 512
    weights, scales, biases = fp8_params(h, i, n, device, False, dtype)
    calls = []
    _cublas_stand_in(fused_geglu, monkeypatch, calls)
    if HAS_GPU and not fused_geglu.fp8.gemm.has_cublas_fp8_blocks(torch.device(device)):
        pytest.skip(
            "cuBLAS's block-scaled FP8 GEMM is measured and taken on Hopper only"
        )
    if not HAS_GPU:  # the interpreter's dual GEMM at 2048 rows would take minutes
        table_fields(fp8_cublas_min_rows=128)
    tokens = fused_geglu.tuning.table(weights[2].device).fp8_cublas_min_rows - 1 + past
    assert fused_geglu.fp8.gemm.fp8_cublas_applies(
        tokens, weights[2], scales[2], None, dtype
    )
    x = torch.randn(tokens, h, dtype=dtype, device=device)
    launched = spy_launches(fused_geglu, monkeypatch)
    out = fused_geglu.geglu_mlp_fp8(
        x, weights[0], scales[0], weights[1], scales[1], weights[2], scales[2]
    )
    assert calls == [-(-tokens // 4) * 4]
    assert launched == ["quantize_fp8_kernel", "gemm_fp8_tma_kernel"]
    assert out.shape == (tokens, n) and out.is_contiguous()
    check_mlp(out, x, weights, scales, biases, "tanh", fused_geglu)
    if HAS_GPU:  # the whole forward: x's quantization, the dual GEMM, cuBLAS's GEMM
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]
        ) as p:
            fused_geglu.geglu_mlp_fp8(
                x, weights[0], scales[0], weights[1], scales[1], weights[2], scales[2]
            )
            torch.cuda.synchronize()
        gpu = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = [e.name for e in gpu if "memset" not in e.name.lower()]
        assert len(kernels) == 3, kernels


def _cublas_case(fused_geglu, device, monkeypatch, table_fields, dtype, bias: bool):
    """(tokens, weights, scales, biases, cuBLAS calls) for the all-cuBLAS route's tests:
    K = 512 for all three products (cuBLAS's weight scales want 4 blocks); on the CPU the
    stand-in from 128 rows; ``bias``: the gate's and the up's."""
    weights, scales, biases = fp8_params(512, 512, 256, device, bias, dtype)
    biases = (biases[0], biases[1], None)
    calls = []
    _cublas_stand_in(fused_geglu, monkeypatch, calls)
    if HAS_GPU and not fused_geglu.fp8.gemm.has_cublas_fp8_blocks(torch.device(device)):
        pytest.skip(
            "cuBLAS's block-scaled FP8 GEMM is measured and taken on Hopper only"
        )
    if not HAS_GPU:
        table_fields(fp8_cublas_min_rows=128)
    rows = fused_geglu.tuning.table(weights[2].device).fp8_cublas_min_rows
    return rows, weights, scales, biases, calls


@pytest.mark.parametrize(
    "past, approximate, rank",
    [(1, "tanh", 2), (2, "none", 3)],
    ids=["unpadded-tanh", "3-padding-rows-exact-3d"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mlp_by_cublas(
    fused_geglu, device, monkeypatch, table_fields, past, approximate, rank, dtype
):
    """From FP8_CUBLAS_MIN_ROWS tokens, where cuBLAS's block-scaled GEMM applies to all
    three projections (on the H200; on the CPU a stand-in, from 128 rows), it computes
    gate, up and the down product, over rows padded to a multiple of 4: x quantized, then
    h = round(act(gate)) * up quantized in one kernel; within the rule of float64; our two
    kernels and cuBLAS's three (torch's and cuBLAS's memsets and copies aside)."""
    min_rows, weights, scales, biases, calls = _cublas_case(
        fused_geglu, device, monkeypatch, table_fields, dtype, False
    )
    tokens = min_rows - 1 + past
    x = torch.randn(tokens, 512, dtype=dtype, device=device)
    quantized = []  # h and its scales, as the route hands them to the down product
    quantize = fused_geglu.fp8.mlp.quantize_fp8

    def spy(x, q, s, **kwargs):
        quantize(x, q, s, **kwargs)
        quantized.append((q.clone(), s.clone()))

    monkeypatch.setattr(fused_geglu.fp8.mlp, "quantize_fp8", spy)
    launched = spy_launches(fused_geglu, monkeypatch)
    mlp = lambda: fused_geglu.geglu_mlp_fp8(
        x.view(1, tokens, 512) if rank == 3 else x, weights[0], scales[0], weights[1],
        scales[1], weights[2], scales[2], approximate=approximate,
    )  # fmt: skip
    out = mlp()
    assert calls == [-(-tokens // 4) * 4] * 3
    assert launched == ["quantize_fp8_kernel", "quantize_fp8_kernel"]
    assert out.shape == ((1, tokens, 256) if rank == 3 else (tokens, 256))
    assert out.is_contiguous()
    check_mlp(out.view(tokens, 256), x, weights, scales, biases, approximate,
              fused_geglu, h_pair=quantized[1])  # fmt: skip
    if HAS_GPU:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA]
        ) as p:
            mlp()
            torch.cuda.synchronize()
        gpu = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        # torch._scaled_mm copies these small scale tensors (a memcpy, or its copy kernel
        # for 3 padding rows; not at Gemma-2B's shapes, benchmarks/fp8.py's kernel lists),
        # and cuBLAS sets its workspace
        kernels = [
            e.name
            for e in gpu
            if not e.name.lower().startswith(("memset", "memcpy"))
            and "direct_copy_kernel" not in e.name
        ]
        ours = [k for k in kernels if k == "quantize_fp8_kernel"]
        assert len(ours) == 2 and len(kernels) == 5, kernels


def test_mlp_by_cublas_down_only_with_gate_and_up_biases(
    fused_geglu, device, monkeypatch, table_fields
):
    """Biases on gate and up keep them in the dual GEMM (which adds them before rounding;
    cuBLAS's route takes none); the down product is still cuBLAS's."""
    min_rows, weights, scales, biases, calls = _cublas_case(
        fused_geglu, device, monkeypatch, table_fields, torch.bfloat16, True
    )
    x = torch.randn(min_rows, 512, dtype=torch.bfloat16, device=device)
    launched = spy_launches(fused_geglu, monkeypatch)
    out = fused_geglu.geglu_mlp_fp8(
        x, weights[0], scales[0], weights[1], scales[1], weights[2], scales[2],
        b_gate=biases[0], b_up=biases[1],
    )  # fmt: skip
    assert calls == [min_rows]
    assert launched == ["quantize_fp8_kernel", "gemm_fp8_tma_kernel"]
    check_mlp(out, x, weights, scales, biases, "tanh", fused_geglu)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_fp8_of_geglu(fused_geglu, device, approximate, dtype):
    """quantize_fp8 with ``up`` quantizes round(act(gate)) * up: equal to our activation
    (eager's bit for bit on the GPU, tests/test_activation.py) quantized apart, its
    scales into the leading columns of a wider buffer (the rows cuBLAS pads); an up of
    other strides or dtype, up without a GeLU or a GeLU without up, scales not
    [blocks, rows] with unit column stride and a non-contiguous q are refused."""
    gemm = fused_geglu.fp8.gemm
    m, k = 37, 300
    gate, up = (torch.randn(m, k, dtype=dtype, device=device) * 4 for _ in range(2))
    act = gemm.GELU_TANH if approximate == "tanh" else gemm.GELU
    q = torch.full((m, k), float("nan"), device=device).to(FP8)
    s = torch.full((3, m + 3), float("nan"), device=device)
    gemm.quantize_fp8(gate, q, s[:, :m], up=up, activation=act)
    assert s[:, m:].isnan().all()
    h = fused_geglu.geglu(gate, up, approximate)
    ref_q = torch.empty(m, k, dtype=FP8, device=device)
    ref_s = torch.empty(3, m, device=device)
    gemm.quantize_fp8(h, ref_q, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(s[:, :m], ref_s)
    with pytest.raises(ValueError, match="must match x"):
        gemm.quantize_fp8(gate, q, s[:, :m], up=up.T.contiguous().T, activation=act)
    with pytest.raises(ValueError, match="must match x"):
        gemm.quantize_fp8(gate, q, s[:, :m], up=up.float(), activation=act)
    with pytest.raises(ValueError, match="come together"):
        gemm.quantize_fp8(gate, q, s[:, :m], activation=act)  # no up
    with pytest.raises(ValueError, match="come together"):
        gemm.quantize_fp8(gate, q, s[:, :m], up=up)  # no activation
    with pytest.raises(ValueError, match="s must be"):
        gemm.quantize_fp8(gate, q, torch.empty(m, 3, device=device).T)
    with pytest.raises(ValueError, match="q must be"):
        gemm.quantize_fp8(gate, q.T.contiguous().T, s[:, :m])


def test_fp8_cublas_applies(fused_geglu, device, monkeypatch):
    """cuBLAS takes the FP8 down GEMM only where it reproduces ours: from
    FP8_CUBLAS_MIN_ROWS rows, no bias, a 16-bit output, N a multiple of 128, K of 512,
    row-major weights, contiguous weight scales."""
    gemm = fused_geglu.fp8.gemm
    monkeypatch.setattr(gemm, "has_cublas_fp8_blocks", lambda device: True)
    w = torch.zeros(256, 1024, dtype=FP8, device=device)
    s = torch.ones(2, 8, device=device)
    rows = fused_geglu.tuning.table(w.device).fp8_cublas_min_rows
    applies = lambda m=rows, w=w, s=s, bias=None, dtype=torch.bfloat16: (
        gemm.fp8_cublas_applies(m, w, s, bias, dtype)
    )
    assert applies() and applies(dtype=torch.float16)
    assert not applies(m=rows - 1)
    assert not applies(bias=torch.zeros(256, device=device))
    assert not applies(dtype=torch.float32)
    assert not applies(w=w[:, :640], s=s[:, :5].contiguous())  # K = 640
    assert not applies(w=w[:200], s=s)  # N = 200
    assert not applies(s=torch.ones(8, 2, device=device).T)  # transposed scales
    assert not applies(
        w=torch.zeros(1024, 256, dtype=FP8, device=device).T
    )  # column-major
    monkeypatch.setattr(gemm, "has_cublas_fp8_blocks", lambda device: False)
    assert not applies()


@pytest.mark.parametrize("m", [40, 70], ids=["portable", "tma"])
def test_dual_gemm_writes_padded_h_scales(fused_geglu, device, m):
    """h's scales into the leading columns of a wider buffer (the rows cuBLAS pads) equal
    those of a buffer of M columns; a column stride other than 1 is refused."""
    weights, scales, _ = fp8_params(256, 256, 128, device, False)
    gemm = fused_geglu.fp8.gemm
    x = torch.randn(m, 256, dtype=torch.bfloat16, device=device)
    x_q = torch.empty(m, 256, dtype=FP8, device=device)
    x_s = torch.empty(2, m, device=device)
    gemm.quantize_fp8(x, x_q, x_s)
    outs = []
    for cols in (m, m + 2):
        h = torch.empty(m, 256, dtype=FP8, device=device)
        h_s = torch.full((2, cols), float("nan"), device=device)
        gemm.gemm_gated_fp8(x_q, x_s, weights[0], scales[0], weights[1], scales[1],
                            h, h_s[:, :m], gemm.GELU_TANH, torch.bfloat16)  # fmt: skip
        assert h_s[:, m:].isnan().all()
        outs.append((h.view(torch.uint8), h_s[:, :m]))
    assert torch.equal(*(o[0] for o in outs)) and torch.equal(*(o[1] for o in outs))
    with pytest.raises(ValueError, match="h_scale must be"):
        gemm.gemm_gated_fp8(x_q, x_s, weights[0], scales[0], weights[1], scales[1], h,
                            torch.empty(m, 2, device=device).T, gemm.GELU_TANH,
                            torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="h_scale must be"):  # fewer columns than rows
        gemm.gemm_gated_fp8(x_q, x_s, weights[0], scales[0], weights[1], scales[1], h,
                            torch.empty(2, m - 1, device=device), gemm.GELU_TANH,
                            torch.bfloat16)  # fmt: skip


def test_fp8_gemms_refuse_scales_they_would_misread(fused_geglu, device):
    """The FP8 GEMMs index x's scales as k * M + row and read one stride pair for the gate's
    and the up's scales: a padded x-scale buffer (rows M + 3 apart, as cuBLAS's rows pad
    it), e8m0 or wrongly shaped weight scales, scales on another device and up scales of
    other strides are refused by name; the same scales made contiguous give the result of
    x's own buffer."""
    weights, scales, _ = fp8_params(256, 256, 128, device, False)
    gemm = fused_geglu.fp8.gemm
    m = 40
    x = torch.randn(m, 256, dtype=torch.bfloat16, device=device)
    x_q = torch.empty(m, 256, dtype=FP8, device=device)
    padded = torch.full((2, m + 3), float("nan"), device=device)
    gemm.quantize_fp8(x, x_q, padded[:, :m])
    x_s = padded[:, :m].contiguous()
    h = torch.empty(m, 256, dtype=FP8, device=device)
    h_s = torch.empty(2, m, device=device)

    def dual(a_scale=x_s, gate_scale=scales[0], up_scale=scales[1]):
        gemm.gemm_gated_fp8(x_q, a_scale, weights[0], gate_scale, weights[1], up_scale,
                            h, h_s, gemm.GELU_TANH, torch.bfloat16)  # fmt: skip

    def down(a_scale=x_s, b_scale=scales[2]):
        out = torch.empty(m, 128, dtype=torch.bfloat16, device=device)
        gemm.gemm_fp8(x_q, a_scale, weights[2], b_scale, out)

    with pytest.raises(ValueError, match=r"a_scale must be .*rows 40 apart"):
        dual(a_scale=padded[:, :m])
    with pytest.raises(ValueError, match=r"a_scale must be .*rows 40 apart"):
        down(a_scale=padded[:, :m])
    with pytest.raises(
        ValueError, match=r"a_scale must be \[128-column blocks, rows\] = \[2, 40\]"
    ):
        dual(a_scale=x_s[:1])
    e8m0 = scales[0].to(torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="gate_scale must be .* float32"):
        dual(gate_scale=e8m0)
    with pytest.raises(ValueError, match=r"b_scale must be .* = \[1, 2\]"):
        down(b_scale=scales[0])
    with pytest.raises(
        ValueError, match="up_scale must be .*with gate_scale's strides"
    ):
        dual(up_scale=scales[1].T.contiguous().T)
    if device == "cuda":
        with pytest.raises(ValueError, match="up_scale must be .* on cuda"):
            dual(up_scale=scales[1].cpu())
    down()
    empty = torch.empty(0, 128, dtype=torch.bfloat16, device=device)
    gemm.gemm_fp8(
        x_q[:0], torch.empty(2, 0, device=device), weights[2], scales[2], empty
    )
    dual()
    first = h.view(torch.uint8).clone(), h_s.clone()
    dual(a_scale=padded[:, :m].contiguous())
    assert torch.equal(first[0], h.view(torch.uint8)) and torch.equal(first[1], h_s)


def test_ue8m0_scales(fused_geglu, device):
    """Scales stored as e8m0 (scale_fmt="ue8m0": powers of two) give the fp32 scales'
    result exactly."""
    weights, scales, _ = fp8_params(256, 256, 128, device, False, power_of_two=True)
    x = torch.randn(3, 256, dtype=torch.bfloat16, device=device)
    e8m0 = [s.to(torch.float8_e8m0fnu) for s in scales]
    assert all(torch.equal(a.float(), b) for a, b in zip(e8m0, scales))
    args = lambda s: (x, weights[0], s[0], weights[1], s[1], weights[2], s[2])
    assert torch.equal(
        fused_geglu.geglu_mlp_fp8(*args(e8m0)), fused_geglu.geglu_mlp_fp8(*args(scales))
    )


def test_geglu_mlp_fp8_errors(fused_geglu, device):
    """Clear errors naming what is wrong: training, weight and scale dtypes and shapes."""
    weights, scales, _ = fp8_params(128, 128, 128, device, False)
    x = torch.randn(2, 128, dtype=torch.bfloat16, device=device)
    call = fused_geglu.geglu_mlp_fp8

    def args(**over):
        a = {
            "x": x,
            "w_gate": weights[0],
            "gate_scale": scales[0],
            "w_up": weights[1],
            "up_scale": scales[1],
            "w_down": weights[2],
            "down_scale": scales[2],
        }
        return a | over  # fmt: skip

    with pytest.raises(RuntimeError, match="inference only"):
        call(**args(x=x.clone().requires_grad_()))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        call(**args(x=x.float()))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        call(**args(w_up=weights[1].to(torch.bfloat16)))
    with pytest.raises(ValueError, match=r"block scales of shape \(1, 1\)"):
        call(**args(up_scale=scales[1].repeat(2, 1)))
    with pytest.raises(ValueError, match=r"\[I, H\]"):
        call(**args(x=torch.randn(2, 64, dtype=torch.bfloat16, device=device)))


def _fp8_gemma_mlp(device, hidden=256, inter=384, block=(128, 128), scheme="dynamic",
                   ue8m0=False, bias=False):  # fmt: skip
    """A GemmaMLP whose projections are transformers' FP8Linear, as FineGrainedFP8Config
    loads them, with our quantized random weights (``ue8m0``: power-of-two scales stored
    as e8m0; ``bias``: trainable biases)."""
    from transformers import GemmaConfig
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = GemmaConfig(
        hidden_size=hidden, intermediate_size=inter, hidden_act="gelu_pytorch_tanh"
    )
    mlp = GemmaMLP(config)
    weights, scales, _ = fp8_params(
        hidden, inter, hidden, device, False, power_of_two=ue8m0
    )
    for name, w, s in zip(("gate_proj", "up_proj", "down_proj"), weights, scales):
        proj = FP8Linear(
            w.shape[1], w.shape[0], block_size=block, activation_scheme=scheme,
            scale_fmt="ue8m0" if ue8m0 else "float", has_bias=bias,
        )  # fmt: skip
        proj.weight = torch.nn.Parameter(w, requires_grad=False)
        if block == (128, 128):
            proj.weight_scale_inv = torch.nn.Parameter(
                s.to(torch.float8_e8m0fnu) if ue8m0 else s, requires_grad=not ue8m0
            )
        if bias:
            proj.bias = torch.nn.Parameter(
                torch.randn(w.shape[0], dtype=torch.bfloat16)
            )
        setattr(mlp, name, proj.to(device))
    return mlp, weights, scales


@pytest.mark.parametrize("tokens", [1, 16, 70])
def test_layer_runs_fp8_projections(fused_geglu, device, monkeypatch, tokens):
    """GeGLUMLP over FP8Linear projections runs the FP8 kernels in inference, within the
    rule; with an input that requires grad (training: FP8Linear's backward), per-tensor
    scales or static activation scales, the route leaves the module to its own
    forward."""
    mlp, weights, scales = _fp8_gemma_mlp(device)
    layer, family = fused_geglu.layers.GeGLUMLP, fused_geglu.layers.GEMMA_MLP
    x = torch.randn(tokens, 256, dtype=torch.bfloat16, device=device)
    launched = spy_launches(fused_geglu, monkeypatch)
    with torch.no_grad():
        out = layer.forward(mlp, x)
    one_launch = tokens <= fused_geglu.tuning.ONE_LAUNCH_MAX_TOKENS
    assert launched[0] == (
        "one_launch_mlp_fp8_kernel" if one_launch else "quantize_fp8_kernel"
    )
    check_mlp(out, x, weights, scales, [None] * 3, "tanh", fused_geglu)  # fmt: skip

    r = fused_geglu.module_route.module_route(mlp, family)
    assert r.fp8 is not None
    assert fused_geglu.layers.mlp_output(r, x.clone().requires_grad_()) is None
    for block, scheme in (((64, 64), "dynamic"), ((128, 128), "static")):
        other, _, _ = _fp8_gemma_mlp(device, block=block, scheme=scheme)
        assert fused_geglu.module_route.module_route(other, family).fp8 is None, (
            block,
            scheme,
        )


def test_layer_follows_fp8_scales_swapped(fused_geglu, device):
    """The route watches the block scales too: new scales, a new result."""
    mlp, weights, scales = _fp8_gemma_mlp(device)
    layer = fused_geglu.layers.GeGLUMLP
    x = torch.randn(2, 256, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        before = layer.forward(mlp, x)
        mlp.down_proj.weight_scale_inv.data = mlp.down_proj.weight_scale_inv.data * 2
        after = layer.forward(mlp, x)
    assert torch.equal(after, before * 2)  # a power of two scales every sum exactly
    scaled = list(scales)
    scaled[2] = scales[2] * 2
    check_mlp(after, x, weights, scaled, [None] * 3, "tanh", fused_geglu)  # fmt: skip


def test_fp8_op_compiles(fused_geglu, device):
    """Under torch.compile(fullgraph=True) the FP8 MLP is one opaque op (its kernels, never
    the one launch: a branch on the token count would recompile); its result within the
    rule."""
    weights, scales, _ = fp8_params(128, 128, 128, device, False)
    x = torch.randn(20, 128, dtype=torch.bfloat16, device=device)
    fn = torch.compile(fused_geglu.geglu_mlp_fp8, fullgraph=True)
    out = fn(x, weights[0], scales[0], weights[1], scales[1], weights[2], scales[2])
    check_mlp(out, x, weights, scales, [None] * 3, "tanh", fused_geglu)


def test_down_gemm_per_output_dtype(fused_geglu, device):
    """The FP8 down GEMM writes x's dtype: one call in bf16 and one in fp16 of the same
    shapes and operands each get their own kernel (a launcher compiled for one output dtype
    once served the other: an output of 1e10)."""
    weights, scales, _ = fp8_params(128, 256, 128, device, False)
    h = torch.randn(16, 256, device=device)
    q, s = fp8_quantize_rows(h.cpu())
    q, s = q.to(device), s.T.contiguous().to(device)
    ref = (q.double() * s.double().T.repeat_interleave(128, 1)) @ fp8_dequantize_weight(
        weights[2].cpu(), scales[2].cpu()
    ).to(device).T
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        out = torch.full((16, 128), float("nan"), dtype=dtype, device=device)
        fused_geglu.fp8.gemm.gemm_fp8(q, s, weights[2], scales[2], out)
        eager = ref.to(dtype)
        floor = E4M3_MMA_ACCURACY * ref.abs().max().item() * 16
        assert_close_to_ref(out, ref, eager, floor=floor, what=str(dtype))
    # (the interpreter compiles nothing: there the plans keyed per output dtype show it)
    plans = [k for k in fused_geglu.fp8.gemm._PLANS if k[:3] == (16, 128, 256)]
    assert {k[4] for k in plans} >= {torch.bfloat16, torch.float16}


def test_modernbert_over_fp8_projections(fused_geglu, device):
    """ModernBertGeGLUMLP over an FP8Linear Wi ([2I, H]: its halves split at a scale block)
    and Wo runs the FP8 MLP, the first half activated; a Wi whose halves would split a
    scale block is left to its own forward."""
    from transformers import ModernBertConfig
    from transformers.integrations.finegrained_fp8 import FP8Linear
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    def mlp_of(inter):
        mlp = ModernBertMLP(
            ModernBertConfig(hidden_size=128, intermediate_size=inter, mlp_dropout=0.0)
        ).eval()
        params = []
        for name in ("Wi", "Wo"):
            w = getattr(mlp, name).weight.detach()
            q, s = fp8_quantize_weight(w)
            proj = FP8Linear(w.shape[1], w.shape[0], block_size=(128, 128))
            proj.weight = torch.nn.Parameter(q.to(device), requires_grad=False)
            proj.weight_scale_inv = torch.nn.Parameter(s.to(device))
            setattr(mlp, name, proj)
            params.append((q.to(device), s.to(device)))
        return mlp.to(device), params

    mlp, ((wi, si), (wo, so)) = mlp_of(256)
    route = fused_geglu.module_route.module_route(
        mlp, fused_geglu.layers.MODERNBERT_MLP
    )
    assert route.fp8 is not None
    x = torch.randn(20, 128, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        out = fused_geglu.layers.ModernBertGeGLUMLP.forward(mlp, x)
    # ModernBERT's act is exact GeLU (hidden_activation "gelu")
    weights = (wi[:256], wi[256:], wo)
    scales = (si[:2], si[2:], so)
    check_mlp(out, x, weights, scales, [None] * 3, "none", fused_geglu)
    odd, _ = mlp_of(192)
    assert (
        fused_geglu.module_route.module_route(
            odd, fused_geglu.layers.MODERNBERT_MLP
        ).fp8
        is None
    )


def test_layer_follows_ue8m0_scales_updated_in_place(fused_geglu, device):
    """e8m0 scales are decoded into an fp32 copy once per route: an in-place update of the
    e8m0 parameter (load_state_dict copies in place) makes a new route, not a stale copy."""
    mlp, _, _ = _fp8_gemma_mlp(device, ue8m0=True)
    layer = fused_geglu.layers.GeGLUMLP
    x = torch.randn(1, 256, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        before = layer.forward(mlp, x)
        state = mlp.state_dict()
        state["down_proj.weight_scale_inv"] = (
            state["down_proj.weight_scale_inv"].float() * 2
        ).to(torch.float8_e8m0fnu)
        mlp.load_state_dict(state)
        after = layer.forward(mlp, x)
    assert torch.equal(after, before * 2)


def test_layer_leaves_trainable_fp8_biases_to_the_module(fused_geglu, device):
    """FP8Linear's own forward gives its biases gradients (``output.add_(bias)``) even when
    x needs none: with grad enabled the route leaves such a module to its own forward;
    under no_grad it runs the FP8 kernels."""
    mlp, _, _ = _fp8_gemma_mlp(device, bias=True)
    r = fused_geglu.module_route.module_route(mlp, fused_geglu.layers.GEMMA_MLP)
    x = torch.randn(3, 256, dtype=torch.bfloat16, device=device)
    assert fused_geglu.layers.mlp_output(r, x) is None
    with torch.no_grad():
        assert fused_geglu.layers.mlp_output(r, x) is not None


def test_one_launch_fp8_limits(fused_geglu, device):
    """The FP8 one-launch kernel takes up to ONE_LAUNCH_MAX_TOKENS rows, every row within the
    rule of float64 (launches of 2 to 16 rows in turn; on the H200 rows past the first
    read zeros before the fix of docs/decisions/0003-one-launch-decode-mlp.md), and refuses more rather than
    compute them."""
    most = fused_geglu.tuning.ONE_LAUNCH_MAX_TOKENS
    weights, scales, biases = fp8_params(256, 384, 256, device, True)
    for rows in range(2, most + 1) if HAS_GPU else (2, most):
        x = torch.randn(rows, 256, dtype=torch.bfloat16, device=device)
        out = torch.full((rows, 256), float("nan"), dtype=torch.bfloat16, device=device)
        fused_geglu.one_launch.one_launch_mlp(
            x, *weights, out, fused_geglu.gemm.GELU_TANH, bias_gate=biases[0],
            bias_up=biases[1], bias_down=biases[2], scales=scales,
        )  # fmt: skip
        check_mlp(out, x, weights, scales, biases, "tanh", fused_geglu, f"{rows} rows")
    scratch = fused_geglu.one_launch._SCRATCH.values()
    assert all(not s.any() and not a.any() for s, a in scratch)  # left zero
    x = torch.randn(most + 1, 256, dtype=torch.bfloat16, device=device)
    out = torch.empty(most + 1, 256, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=f"at most {most} rows"):
        fused_geglu.one_launch.one_launch_mlp(
            x, *weights, out, fused_geglu.gemm.GELU_TANH, scales=scales
        )


def test_dual_gemm_clears_the_down_gemms_counters(fused_geglu, device):
    """gemm_gated_fp8's ``clear`` zeroes later_split_k_counters whatever they held, and
    gemm_fp8's split-K over them sums as over its own (equal), leaving them zero: in a CUDA
    graph the down GEMM's counters need no memset node. Counters of the wrong kind are
    refused."""
    gemm = fused_geglu.fp8.gemm
    (w_gate, w_up, w_down), scales, _ = fp8_params(256, 1024, 256, device, False)
    x = torch.randn(1, 256, dtype=torch.bfloat16, device=device)
    outputs = []
    for clear in (False, True):
        h = torch.empty(1, 1024, dtype=FP8, device=device)
        h_scale = torch.empty(8, 1, dtype=torch.float32, device=device)
        counters = gemm.later_split_k_counters(x.device).fill_(7) if clear else None
        gemm.gemm_gated_fp8(
            x, None, w_gate, scales[0], w_up, scales[1], h, h_scale, gemm.GELU_TANH,
            torch.bfloat16, clear=counters,
        )  # fmt: skip
        if clear:
            assert not counters.any()
        out = torch.full((1, 256), float("nan"), dtype=torch.bfloat16, device=device)
        gemm._PLANS.clear()
        gemm.gemm_fp8(h, h_scale, w_down, scales[2], out, counters=counters)
        assert [p.split for p in gemm._PLANS.values()] == [2]  # the down GEMM splits K
        if clear:
            assert not counters.any()
        outputs.append((h.view(torch.uint8), h_scale, out))
    for a, b in zip(*outputs):
        assert torch.equal(a, b)
    h, h_scale, out = outputs[0]
    few = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="later_split_k_counters"):
        gemm.gemm_fp8(h.view(FP8), h_scale, w_down, scales[2], out, counters=few)
    odd = torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="power of two"):
        gemm.gemm_gated_fp8(
            x, None, w_gate, scales[0], w_up, scales[1], h.view(FP8), h_scale,
            gemm.GELU_TANH, torch.bfloat16, clear=odd,
        )  # fmt: skip


def test_split_k_slices_take_their_k_blocks_scales(fused_geglu, device):
    """gemm_fp8 at decode splits K into uneven slices (18 K blocks, the last ragged, in
    slices of 5, 5, 5 and 3) whose loops load each block's scales a step ahead: within
    rounding of float64 where A's and the weight's scales change by up to 2^8 from one
    K block to the next (a block scaled by a neighbour's scale would be off by as much)."""
    gemm = fused_geglu.fp8.gemm
    m, n, k = 3, 64, 17 * 128 + 40
    magnitudes = torch.exp2(torch.randint(-4, 5, (2, 18)).float())  # x's, w's per block
    columns = magnitudes.repeat_interleave(128, 1)[:, :k]
    x = (torch.randn(m, k) * columns[0]).to(device, torch.bfloat16)
    w_q, w_s = fp8_quantize_weight(torch.randn(n, k) / k**0.5 * columns[1])
    w_q, w_s = w_q.to(device), w_s.to(device)
    a = torch.empty(m, k, dtype=FP8, device=device)
    a_scale = torch.empty(18, m, device=device)
    gemm.quantize_fp8(x, a, a_scale)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
    gemm._PLANS.clear()
    gemm.gemm_fp8(a, a_scale, w_q, w_s, out)
    assert [p.split for p in gemm._PLANS.values()] == [4]
    a64 = a.cpu().double() * a_scale.cpu().double().T.repeat_interleave(128, 1)[:, :k]
    w64 = fp8_dequantize_weight(w_q.cpu(), w_s.cpu())
    ref, terms = a64 @ w64.T, a64.abs() @ w64.abs().T
    # one bf16 step (the interpreter rounds toward zero), the products' sums
    bound = ref.abs() * 2.0**-7 + terms * (E4M3_MMA_ACCURACY + 2.0**-20)
    assert ((out.cpu().double() - ref).abs() <= bound).all()


def test_decode_gemms_read_weights_through_tma(fused_geglu, device, monkeypatch):
    """Up to 64 rows the FP8 GEMMs read weights that TMA can describe as they lie through
    descriptors (B_TMA), other weights through pointers: the same h and output at 16
    tokens (both swapped, one order of sums), both within the float64 rule at 40 (there
    the dual GEMM's products swap with TMA)."""
    gemm = fused_geglu.fp8.gemm
    weights, scales, biases = fp8_params(256, 384, 256, device, True)
    w = weights[0]
    assert gemm.fp8_weights_through_tma(64, w, weights[1])
    assert not gemm.fp8_weights_through_tma(65, w, weights[1])  # the TMA kernel's
    assert not gemm.fp8_weights_through_tma(16, w.T.contiguous().T, None)  # transposed
    assert not gemm.fp8_weights_through_tma(16, w[:, 8:], None)  # 8-byte-aligned rows
    assert not gemm.fp8_weights_through_tma(16, w.to(torch.bfloat16), None)
    real = gemm.fp8_weights_through_tma
    for tokens in (16, 40):
        x = torch.randn(tokens, 256, dtype=torch.bfloat16, device=device)
        outputs = []
        for through_tma in (True, False):
            monkeypatch.setattr(
                gemm, "fp8_weights_through_tma",
                lambda M, b, b_up, on=through_tma: on and real(M, b, b_up),
            )  # fmt: skip
            gemm._PLANS.clear()
            # the two kernels, not the one launch
            torch.use_deterministic_algorithms(True)
            try:
                out = fused_geglu.geglu_mlp_fp8(
                    x, weights[0], scales[0], weights[1], scales[1], weights[2],
                    scales[2], *biases, approximate="tanh",
                )  # fmt: skip
            finally:
                torch.use_deterministic_algorithms(False)
            assert [p.b_tma for p in gemm._PLANS.values()] == [through_tma] * 2
            check_mlp(out, x, weights, scales, biases, "tanh", fused_geglu,
                      f"{tokens} tokens, TMA {through_tma}")  # fmt: skip
            outputs.append(out)
        if tokens <= 16:
            assert torch.equal(*outputs)
    gemm._PLANS.clear()


@pytest.mark.parametrize("layout", ["two tensors", "gate first", "up first"])
def test_decode_dual_gemm_stacks_its_weights(fused_geglu, device, monkeypatch, layout):
    """Through TMA the decode dual GEMM that quantizes x itself (up to FP8_QUANT_A_ROWS
    tokens) reads gate and up as one box of a descriptor over both (STACKED; ``up
    first``: the up weight at the lower address), each weight's rows scaled by its own
    block scales: the MLP within the float64 rule at 16 and 32 tokens, h's scales set by
    its own columns, and on the GPU equal to two descriptors' (the same products and
    scalings); at 40 tokens two descriptors."""
    gemm = fused_geglu.fp8.gemm
    # I = 320: the last 128-row tile's box reaches past each weight's rows (zeros there,
    # not the other weight's first rows where both lie in one buffer)
    weights, scales, biases = fp8_params(256, 320, 256, device, True)
    wg, wu, wd = weights
    if layout != "two tensors":  # (those in whichever order the allocator placed them)
        both = torch.cat((wg, wu) if layout == "gate first" else (wu, wg))
        lo, hi = both[:320], both[320:]
        wg, wu = (lo, hi) if layout == "gate first" else (hi, lo)
        assert (wg.data_ptr() < wu.data_ptr()) == (layout == "gate first")
    weights = (wg, wu, wd)
    real = gemm.stacked_weights
    for tokens in (16, 32, 40):
        x = torch.randn(tokens, 256, dtype=torch.bfloat16, device=device)
        outputs = []
        for stacked in (True, False):
            stacks = stacked and tokens <= fused_geglu.tuning.FP8_QUANT_A_ROWS
            monkeypatch.setattr(
                gemm,
                "stacked_weights",
                lambda *a, on=stacked: real(*a) if on else None,
            )
            gemm._PLANS.clear()
            torch.use_deterministic_algorithms(True)  # the two kernels
            try:
                out = fused_geglu.geglu_mlp_fp8(
                    x, wg, scales[0], wu, scales[1], wd, scales[2], *biases,
                    approximate="tanh",
                )  # fmt: skip
            finally:
                torch.use_deterministic_algorithms(False)
            dual = [p for p in gemm._PLANS.values() if p.constexprs["GATED"]]
            used = [launcher is not None for launcher in dual[0].launchers]
            up_first = wu.data_ptr() < wg.data_ptr()
            expected = [True, stacks and not up_first, stacks and up_first]
            assert len(dual) == 1 and dual[0].b_tma and used == expected
            check_mlp(out, x, weights, scales, biases, "tanh", fused_geglu,
                      f"{layout}, {tokens} tokens, stacked {stacks}")  # fmt: skip
            outputs.append(out)
            if tokens <= fused_geglu.tuning.FP8_QUANT_A_ROWS:
                # each 128-column block of h is scaled by its own columns' largest
                # value (448 in e4m3), not by a box's rows past the weight's end
                h = torch.empty(tokens, 320, dtype=FP8, device=device)
                h_s = torch.empty(3, tokens, device=device)
                gemm.gemm_gated_fp8(
                    x, None, wg, scales[0], wu, scales[1], h, h_s, gemm.GELU_TANH,
                    x.dtype, bias_gate=biases[0], bias_up=biases[1],
                )  # fmt: skip
                padded = torch.zeros(tokens, 384)
                padded[:, :320] = h.float().abs().cpu()
                assert (padded.view(tokens, 3, 128).amax(-1) == 448).all(), layout
        if HAS_GPU:
            assert torch.equal(*outputs)
    gemm._PLANS.clear()


def test_stacked_dual_gemm_over_split_k(fused_geglu, device, monkeypatch):
    """The stacked dual GEMM split over K (one output tile, 9 K blocks, the last ragged):
    the same h and scales as through two descriptors, each slice's scales its own."""
    gemm = fused_geglu.fp8.gemm
    (wg, wu, _), (sg, su, _), _ = fp8_params(1040, 128, 128, device, False)
    x = torch.randn(16, 1040, dtype=torch.bfloat16, device=device)
    real = gemm.stacked_weights
    results = []
    for stacked in (True, False):
        monkeypatch.setattr(
            gemm, "stacked_weights", lambda *a, on=stacked: real(*a) if on else None
        )
        gemm._PLANS.clear()
        h = torch.empty(16, 128, dtype=FP8, device=device)
        h_s = torch.full((1, 16), float("nan"), device=device)
        gemm.gemm_gated_fp8(x, None, wg, sg, wu, su, h, h_s, gemm.GELU, x.dtype)
        (plan,) = gemm._PLANS.values()
        assert (
            plan.split > 1
            and plan.stacks
            and (plan.launchers[1:] != [None] * 2) == stacked
        )
        results.append((h.view(torch.uint8), h_s))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    gemm._PLANS.clear()


def test_counters_unused_without_split_k(fused_geglu, device, monkeypatch):
    """Counters handed to a gemm_fp8 whose plan does not split K (the MLP hands them to
    every down GEMM it captures on the portable kernels) reach its kernel as None, as
    without them: one launcher sees None at the same positions in every call (a capture
    that handed them, then an eager call that did not, failed on the H200)."""
    gemm = fused_geglu.fp8.gemm
    (_, _, w_down), scales, _ = fp8_params(128, 128, 256, device, False)
    a = torch.empty(16, 128, dtype=FP8, device=device)
    a_scale = torch.empty(1, 16, dtype=torch.float32, device=device)
    gemm.quantize_fp8(
        torch.randn(16, 128, dtype=torch.bfloat16, device=device), a, a_scale
    )
    unused = spy_unused_arguments(fused_geglu, monkeypatch)
    gemm._PLANS.clear()
    outputs = []
    for counters in (gemm.later_split_k_counters(a.device).zero_(), None):
        out = torch.full((16, 256), float("nan"), dtype=torch.bfloat16, device=device)
        gemm.gemm_fp8(a, a_scale, w_down, scales[2], out, counters=counters)
        outputs.append(out)
    assert [p.split for p in gemm._PLANS.values()] == [1]  # one K block: no split
    assert [len(patterns) for patterns in unused.values()] == [1]
    assert torch.equal(*outputs) and not outputs[0].isnan().any()


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
def test_fp8_mlp_in_cuda_graph(fused_geglu, device, monkeypatch):
    """Captured in a CUDA graph, geglu_mlp_fp8 runs the two kernels (x quantized in the
    dual GEMM), also at the token counts that eager calls run in one launch, and nothing
    else: the dual GEMM zeroes the down GEMM's split-K counters (no memset node); the
    replays give what those kernels give eagerly (deterministic split-K sums: equal), and
    the eager one launch is within the rule (its down product sums in f16 MMAs, the down
    GEMM's in e4m3: not equal). So also where the table takes 16-bit captures of every
    one-launch token count in one launch."""
    weights, scales, biases = fp8_params(256, 1024, 256, device, True)
    launched = spy_launches(fused_geglu, monkeypatch)
    max_tokens = fused_geglu.tuning.ONE_LAUNCH_MAX_TOKENS
    use = fused_geglu.tuning.use(device, one_launch_graph_max_tokens=max_tokens)
    with use:
        for tokens in (1, max_tokens):
            x = torch.randn(tokens, 256, dtype=torch.bfloat16, device=device)
            args = (x, *(t for pair in zip(weights, scales) for t in pair))
            with torch.no_grad():
                one_launch = fused_geglu.geglu_mlp_fp8(*args, *biases).clone()
                assert launched == ["one_launch_mlp_fp8_kernel"], tokens
                check_mlp(one_launch, x, weights, scales, biases, "tanh", fused_geglu)
                torch.use_deterministic_algorithms(True)
                try:  # the two kernels eagerly (compiled before the capture)
                    expected = fused_geglu.geglu_mlp_fp8(*args, *biases).clone()
                finally:
                    torch.use_deterministic_algorithms(False)
                launched.clear()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = fused_geglu.geglu_mlp_fp8(*args, *biases)
            assert launched == ["gemm_fp8_kernel", "gemm_fp8_kernel"], tokens
            assert any(
                p.split > 1 for p in fused_geglu.fp8.gemm._PLANS.values()
            )  # the down's
            launched.clear()
            for _ in range(3):
                out.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, expected), tokens
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA]
            ) as p:
                graph.replay()
                torch.cuda.synchronize()
            gpu = [
                e.name
                for e in p.events()
                if e.device_type == torch.autograd.DeviceType.CUDA
            ]
            assert gpu == ["gemm_fp8_kernel", "gemm_fp8_kernel"], (tokens, gpu)


# A fresh process: no kernel of the capture path has run before the warm-up.
_COLD_CAPTURE = """
import importlib.util, sys
import torch
sys.path.insert(0, {tests!r})
from reference import fp8_quantize_weight
tree = {tree!r}
spec = importlib.util.spec_from_file_location(
    "fused_geglu", tree + "/__init__.py", submodule_search_locations=[tree]
)
fg = importlib.util.module_from_spec(spec)
sys.modules["fused_geglu"] = fg
spec.loader.exec_module(fg)
torch.manual_seed(0)
h, i = 256, 384
fp8 = [fp8_quantize_weight(torch.randn(r, c) / c**0.5) for r, c in ((i, h), (i, h), (h, i))]
(wg, sg), (wu, su), (wd, sd) = [(q.cuda(), s.cuda()) for q, s in fp8]
bf = [torch.randn(r, c, device="cuda", dtype=torch.bfloat16) / c**0.5
      for r, c in ((i, h), (i, h), (h, i))]
calls = {{
    "fp8": lambda x: fg.geglu_mlp_fp8(x, wg, sg, wu, su, wd, sd),
    "bf16": lambda x: fg.geglu_mlp(x, *bf),
}}
x = torch.randn({tokens}, h, dtype=torch.bfloat16, device="cuda")
call = calls[{kind!r}]
with torch.no_grad():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the usual warm-up: eager, on a side stream
        expected = call(x).clone()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(x)
    graph.replay()
    torch.cuda.synchronize()
    if {kind!r} == "fp8":  # the captured kernels eagerly: the warm-up's one launch sums
        torch.use_deterministic_algorithms(True)  # its down product in f16 MMAs
        expected = call(x)
        torch.use_deterministic_algorithms(False)
        assert torch.equal(out, expected)
torch.testing.assert_close(out, expected, atol=0, rtol=2**-7)
print("replayed")
"""


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["fp8", "bf16"])
@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_cold_capture_after_eager_warm_up(kind, tokens):
    """A capture after the usual eager warm-up, in a fresh process, at token counts whose
    eager calls take the one launch while the capture takes the two kernels (their first
    launch, inside the capture), or the one launch again (bf16 at 1 token where the GPU's
    table says so): the replay gives the eager result (FP8: the captured kernels' eager
    result, equal). A cold FP8 capture at 16 tokens failed on the H200
    (docs/decisions/0003-one-launch-decode-mlp.md)."""
    code = _COLD_CAPTURE.format(
        tests=str(ROOT / "tests"), tree=str(ROOT / "build" / "torch-cuda"),
        tokens=tokens, kind=kind,
    )  # fmt: skip
    run = run_python(code)
    assert run.returncode == 0 and "replayed" in run.stdout, run.stderr[-3000:]
