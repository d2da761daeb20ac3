"""No state that one launch leaves changes a later result: the one-launch MLP's sums and
arrival count and split-K's counters, which launches leave zero for the next, after a
launch interrupted part-way (Ctrl-C in a notebook: the interpreter runs a kernel's
programs in Python) and under two threads. On a GPU a launched kernel runs to its end
and launches on one stream run in order; these are the interpreter's cases."""

import threading

import pytest
import torch
from conftest import HAS_GPU
from reference import (
    accumulation_floor,
    assert_close_to_ref,
    cast,
    eager_geglu_mlp,
    eager_linear,
)

pytestmark = pytest.mark.skipif(
    HAS_GPU,
    reason="a GPU kernel cannot be interrupted part-way; the interpreter's case",
)
HIDDEN, INTER = 72, 200
# the one-launch MLP's dtype in the interpreter (16-bit operands: the dual GEMM)
F16 = torch.float16


def mlp_params():
    wg, wu = (torch.randn(INTER, HIDDEN) / HIDDEN**0.5 for _ in range(2))
    return wg.to(F16), wu.to(F16), (torch.randn(HIDDEN, INTER) / INTER**0.5).to(F16)


def x_of(tokens, generator=None):
    return torch.randn(tokens, HIDDEN, generator=generator).to(F16)


def check_mlp(fused_geglu, x, params):
    with torch.no_grad():
        out = fused_geglu.geglu_mlp(x, *params)
    ref = eager_geglu_mlp(*cast([x, *params], torch.float64))
    eager = eager_geglu_mlp(x, *params)
    assert_close_to_ref(out, ref, eager, floor=accumulation_floor(ref, INTER))


def interrupt_at_program(monkeypatch, program: int) -> None:
    """The next interpreted launch raises KeyboardInterrupt as its ``program``-th program
    starts (the earlier ones have run)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    real, started = builder.set_grid_idx, []

    def set_grid_idx(*idx):
        started.append(idx)
        if len(started) == program:
            raise KeyboardInterrupt
        return real(*idx)

    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)


@pytest.mark.parametrize("program", [2, 5])
def test_an_interrupted_mlp_launch_changes_no_later_result(
    fused_geglu, monkeypatch, program
):
    """The one-launch MLP (up to 16 tokens) interrupted after some of its programs added
    their partial sums: later calls, with other inputs, are right."""
    params = mlp_params()
    with monkeypatch.context() as patch:
        interrupt_at_program(patch, program)
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            fused_geglu.geglu_mlp(x_of(4), *params)
    for tokens in (4, 16, 1):
        check_mlp(fused_geglu, x_of(tokens), params)


def test_an_interrupted_split_k_launch_changes_no_later_result(
    fused_geglu, monkeypatch
):
    """A split-K GEMM (one token, K split over programs that count their tile's arrivals)
    interrupted part-way: the next call's sums and counters start from zero."""
    x, w = torch.randn(1, 1000), torch.randn(64, 1000) / 1000**0.5
    with monkeypatch.context() as patch:
        interrupt_at_program(patch, 3)
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            fused_geglu.linear(x, w, activation="gelu")
    for _ in range(2):
        x = torch.randn(1, 1000)
        out = fused_geglu.linear(x, w, activation="gelu")
        ref = eager_linear(*cast([x, w], torch.float64), activation="gelu")
        assert_close_to_ref(out, ref, eager_linear(x, w, activation="gelu"))


def test_two_threads_calling_one_function(fused_geglu):
    """Two threads calling geglu_mlp and linear at once each get their own right results,
    and so do calls after the threads have joined."""
    params = mlp_params()
    errors = []

    def calls(seed: int):
        gen = torch.Generator().manual_seed(seed)
        try:
            for tokens in (3, 16, 2):
                x = x_of(tokens, gen)
                check_mlp(fused_geglu, x, params)
        except BaseException as error:  # noqa: BLE001 (reported by the main thread)
            errors.append(error)

    threads = [threading.Thread(target=calls, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_mlp(fused_geglu, x_of(5), params)
