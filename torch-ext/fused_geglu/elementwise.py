"""Host side of the elementwise GeGLU kernels: tile configurations and launches.

Contiguous operands are processed as one long row (tuning.flat_tile's tiles); strided
ones (e.g. the halves of one ``[M, 2N]`` projection output) as row tiles through their
strides. A launch plan is cached per (direction, variant, dtype, shapes, strides).
"""

import torch

from .activation import geglu_bwd_kernel, geglu_fwd_kernel
from .launch import BoundedCache, Launcher, cdiv
from .tuning import flat_tile, row_tile_config


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """A 2-D [rows, cols] view of ``t`` over its leading dims, or None when their strides
    cannot be expressed as one row stride (e.g. a permuted batch)."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """2-D rows of an input; copies only in the case ``_rows_view`` cannot express."""
    if t.shape[-1] == 0:
        return t.reshape(t.shape[:-1].numel(), 0)
    rows = _rows_view(t)
    return rows if rows is not None else t.reshape(-1, t.shape[-1])


_PLANS = BoundedCache(256)


def _plan(kernel, approx_tanh: bool, rows: tuple[torch.Tensor, ...], flat: bool):
    """(launcher, grid, (M, N, *strides)) for [M, N] views ``rows`` (the outputs last), or
    with ``flat`` for contiguous tensors of one size, seen as one row."""
    first = rows[0]
    # the device too: a launcher's compiled kernel is loaded on one device
    if flat:
        key = (id(kernel), approx_tanh, first.dtype, first.device, first.numel())
    else:
        key = (
            id(kernel),
            approx_tanh,
            first.dtype,
            first.device,
            first.shape,
            *(t.stride() for t in rows),
        )
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    if flat:
        M, N = 1, first.numel()
        block_m = 1
        block_n, num_warps = flat_tile(first.device, kernel is geglu_bwd_kernel)
        strides = [(0, 1)] * len(rows)
    else:
        M, N = first.shape
        block_m, block_n, num_warps = row_tile_config(
            N, first.element_size(), first.device
        )
        strides = [t.stride() for t in rows]
    grid_m, grid_n = cdiv(M, block_m), cdiv(N, block_n)
    # Largest offset a program can form (masked lanes included) against int32's range.
    reach = max(
        grid_m * block_m * abs(sm) + grid_n * block_n * abs(sn) for sm, sn in strides
    )
    constexprs = {
        "APPROX_TANH": approx_tanh,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "INT64": reach >= 2**31,
        "num_warps": num_warps,
        "num_stages": 1,
    }
    ints = (M, N, *(s for st in strides for s in st))
    plan = Launcher(kernel, constexprs), grid_m * grid_n, ints
    _PLANS[key] = plan
    return plan


def geglu_forward(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, approximate: str
) -> None:
    """out = round(gelu(gate)) * up; the three tensors share a shape, ``out`` may be any view."""
    if gate.numel() == 0:
        return
    tanh = approximate == "tanh"
    if gate.is_contiguous() and up.is_contiguous() and out.is_contiguous():
        launcher, grid, ints = _plan(geglu_fwd_kernel, tanh, (gate, up, out), True)
        launcher(grid, gate, up, out, *ints)
        return
    g, u, o = as_rows(gate), as_rows(up), _rows_view(out)
    if o is None:
        tmp = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        geglu_forward(gate, up, tmp, approximate)
        out.copy_(tmp)
        return
    launcher, grid, ints = _plan(geglu_fwd_kernel, tanh, (g, u, o), False)
    launcher(grid, g, u, o, *ints)


def geglu_backward(
    dout: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: str,
    dgate: torch.Tensor | None = None,
    dup: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of out = gelu(gate) * up: into ``dgate`` and ``dup`` when given (any
    views of gate's shape, ``gate`` and ``up`` themselves included: in place), else into
    new contiguous tensors shaped like ``gate``."""
    if dgate is None:
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty_like(dgate)
    if gate.numel() == 0:
        return dgate, dup
    tanh = approximate == "tanh"
    operands = (dout, gate, up, dgate, dup)
    if all(t.is_contiguous() for t in operands):
        launcher, grid, ints = _plan(geglu_bwd_kernel, tanh, operands, True)
        launcher(grid, *operands, *ints)
        return dgate, dup
    rows = tuple(as_rows(t) for t in operands[:3]) + tuple(
        _rows_view(t) for t in operands[3:]
    )
    # `is`, not `None in rows`: that compares tensors with None, an exception each.
    if any(r is None for r in rows):  # an output whose rows no 2-D view describes
        d, u = geglu_backward(dout, gate, up, approximate)
        return dgate.copy_(d), dup.copy_(u)
    launcher, grid, ints = _plan(geglu_bwd_kernel, tanh, rows, False)
    launcher(grid, *rows, *ints)
    return dgate, dup
