"""The whole GeGLU MLP of a few tokens in one launch (decode): the host side of
one_launch_mlp_kernel (gemm_kernels.py) and, with e4m3 weights, of
one_launch_mlp_fp8_kernel (fp8/kernels.py).

  one_launch_mlp(x, w_gate, w_up, w_down, out, act)
                        out = round(h @ w_down^T + bias_down), h = round(act(gate)) * up,
                        for at most ONE_LAUNCH_MAX_TOKENS rows
  OneLaunchMLP          the same for one module's weights, what depends only on them
                        worked out once: the layers' decode path, where host time is the cost

The kernel's fp32 sums and arrival count live in scratch kept per (device, stream) and left
zero by every launch; a CUDA graph capture takes fresh zeroed ones (launch.stream_scratch).
"""

import torch

from .checks import transforms_active
from .fp8.kernels import one_launch_mlp_fp8_kernel
from .gemm import input_precision, rows_of
from .gemm_kernels import one_launch_mlp_kernel
from .launch import (
    SHARED_SCRATCH,
    BoundedCache,
    Launcher,
    cdiv,
    current_device_and_stream,
    stream_scratch,
)
from .tuning import ONE_LAUNCH_MAX_TOKENS, one_launch_config, table

# The fp32 sums [M, N] and the arrival count, both zero between launches (the last program
# of each launch zeroes them).
_SCRATCH: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
SHARED_SCRATCH.append(_SCRATCH)
_PLANS = BoundedCache(256)


def one_launch_mlp(
    x: torch.Tensor,  # [M, H], M <= ONE_LAUNCH_MAX_TOKENS
    w_gate: torch.Tensor,  # [I, H]
    w_up: torch.Tensor,  # [I, H]
    w_down: torch.Tensor,  # [N, I]
    out: torch.Tensor,  # [M, N]
    activation: int,
    *,
    bias_gate: torch.Tensor | None = None,  # [I]
    bias_up: torch.Tensor | None = None,  # [I]
    bias_down: torch.Tensor | None = None,  # [N]
    scales: tuple | None = None,  # FP8: (gate_scale, up_scale, down_scale), fp32
) -> None:
    """out = round(h @ w_down^T + bias_down), h = round(act(gate)) * up as gemm_gated's, in
    one launch. Its fp32 sums are added in an order that varies between launches. With
    ``scales``, e4m3 weights with 128 x 128 block scales, and x and h quantized as
    gemm_fp8's A operands (geglu_mlp_fp8)."""
    M, H, stride_x = rows_of(x)
    I, N = w_gate.shape[0], w_down.shape[0]
    if M > ONE_LAUNCH_MAX_TOKENS:
        raise ValueError(
            f"one_launch_mlp takes at most {ONE_LAUNCH_MAX_TOKENS} rows, got x of shape "
            f"{tuple(x.shape)}"
        )
    if M == 0 or N == 0:
        return
    if I == 0:  # no intermediate columns (no programs): the down projection is its bias
        if bias_down is None:
            out.zero_()
        else:
            out.copy_(bias_down.expand_as(out))
        return
    strides = (
        *stride_x, *w_gate.stride(), *w_up.stride(), *w_down.stride(), *rows_of(out)[2],
        None if bias_gate is None else bias_gate.stride(0),
        None if bias_up is None else bias_up.stride(0),
        None if bias_down is None else bias_down.stride(0),
        *_scale_strides(scales),
    )  # fmt: skip
    grid, launcher = _plan(
        M, H, I, N, x.dtype, x.device, activation, strides, scales is not None
    )
    sums, arrivals = stream_scratch(_SCRATCH, x.device, M * N, 1, True)
    launcher(
        grid, x, w_gate, w_up, w_down, bias_gate, bias_up, bias_down, out, sums,
        arrivals, *(scales or ()), M, H, I, N, *strides,
    )  # fmt: skip


def one_launch_fits(x: torch.Tensor, graph_max_tokens: int = 0) -> bool:
    """Whether one launch may compute the MLP of a call on ``x``: 1 to
    ONE_LAUNCH_MAX_TOKENS rows, atomics allowed (not deterministic), and outside a CUDA
    graph capture, or inside one for at most ``graph_max_tokens`` rows (the table's
    ``one_launch_graph_max_tokens`` for 16-bit weights)."""
    hidden = x.shape[-1]
    m = x.numel() // hidden if hidden else 0
    if (
        not 0 < m <= ONE_LAUNCH_MAX_TOKENS
        or torch.are_deterministic_algorithms_enabled()
    ):
        return False
    return m <= graph_max_tokens or not (
        x.is_cuda and torch.cuda.is_current_stream_capturing()
    )


def _scale_strides(scales: tuple | None) -> tuple:
    """The FP8 kernel's scale strides: the gate's (the up's are the same) and the down's."""
    return () if scales is None else (*scales[0].stride(), *scales[2].stride())


def _plan(
    M, H, I, N, dtype, device, activation: int, strides: tuple, fp8: bool
) -> tuple:
    """(grid, launcher); ``strides``: the kernel's stride arguments, None for an absent
    bias; ``fp8``: whether the weights are e4m3 (their scales' strides end ``strides``)."""
    key = (M, H, I, N, dtype, device, activation, strides)
    plan = _PLANS.get(key)
    if plan is None:
        if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            # Eager calls of up to ONE_LAUNCH_MAX_TOKENS rows take this one launch and never
            # reach cuBLAS; a CUDA graph captured after them may run the down projection
            # there (route.down_projection), and cuBLAS cannot create its handle inside
            # a capture: created now, as an eager warm-up of the module's own forward
            # would have.
            with torch.cuda.device(device):
                torch.cuda.current_blas_handle()
        cfg = one_launch_config(I, dtype, device, fp8)
        biases = strides[-7:-4] if fp8 else strides[-3:]
        constexprs = {
            "HAS_BIAS": biases[0] is not None,
            "HAS_DOWN_BIAS": biases[2] is not None,
            "ACTIVATION": activation,
            "EVEN_K": H % cfg["BLOCK_K"] == 0,
            "INPUT_PRECISION": input_precision(dtype),
            "BLOCK_M": ONE_LAUNCH_MAX_TOKENS,  # one row tile holds every token
            **cfg,
        }
        kernel = one_launch_mlp_fp8_kernel if fp8 else one_launch_mlp_kernel
        plan = _PLANS[key] = (cdiv(I, cfg["BLOCK_I"]), Launcher(kernel, constexprs))
    return plan


class OneLaunchMLP:
    """``one_launch_mlp`` for one module's weights: a call on a contiguous ``x`` of 1 to
    ONE_LAUNCH_MAX_TOKENS rows, in the weights' dtype (FP8: ``dtype``) and on their
    device, that one_launch_fits (the caller's checks: the layers' routes), allocates
    the output and launches."""

    __slots__ = ("activation", "addresses", "device", "device_index", "device_type",
                 "dtype", "graph_max_tokens", "hidden", "operands", "plans", "scales",
                 "sizes", "strides", "weights_need_grad")  # fmt: skip

    def __init__(self, w_gate, w_up, w_down, b_gate, b_up, b_down, activation: int,
                 scales: tuple | None = None, dtype: torch.dtype | None = None):  # fmt: skip
        """``scales`` and ``dtype`` (x's) for e4m3 weights, as one_launch_mlp's."""
        (I, H), N = w_gate.shape, w_down.shape[0]
        self.operands = (w_gate, w_up, w_down, b_gate, b_up, b_down)
        self.scales = scales or ()
        # The operands' and scales' addresses, for the direct launch, where all are
        # 16-byte aligned (None otherwise): valid while the route stands (it watches
        # their data pointers), the tensors kept alive by ``operands`` and ``scales``.
        addresses = tuple(
            None if t is None else t.data_ptr() for t in (*self.operands, *self.scales)
        )
        aligned = all(a is None or a % 16 == 0 for a in addresses)
        self.addresses = addresses if aligned else None
        self.dtype, self.device, self.activation = (
            dtype or w_gate.dtype,
            w_gate.device,
            activation,
        )
        self.device_type = self.device.type  # what the route's autocast check asks
        self.device_index = w_gate.get_device()  # -1 on the CPU (the interpreter)
        # fixed while the route stands (a changed table drops the routes)
        self.graph_max_tokens = (
            0 if scales else table(self.device).one_launch_graph_max_tokens
        )
        self.hidden, self.sizes = H, (H, I, N)
        # Every stride argument after x's (H, 1): the weights', out's (N, 1), the biases',
        # the scales'.
        self.strides = (
            *w_gate.stride(), *w_up.stride(), *w_down.stride(), N, 1,
            *(None if b is None else b.stride(0) for b in (b_gate, b_up, b_down)),
            *_scale_strides(scales),
        )  # fmt: skip
        self.plans = {}  # rows -> (grid, launcher): at most ONE_LAUNCH_MAX_TOKENS entries
        # fixed while the route stands (it watches the parameters' requires_grad)
        self.weights_need_grad = any(
            t is not None and t.requires_grad for t in self.operands
        )

    def takes(self, x) -> bool:
        """Whether this launch computes what the module's projections would for ``x``: a
        plain tensor of the weights' dtype, hidden size and device, no call that autograd
        records, one_launch_fits, outside autocast and torch.func transforms."""
        return (
            type(x) is torch.Tensor
            and x.dtype is self.dtype
            and x.dim() > 0
            and x.shape[-1] == self.hidden
            and x.device == self.device
            and not (
                torch.is_grad_enabled() and (x.requires_grad or self.weights_need_grad)
            )
            and one_launch_fits(x, self.graph_max_tokens)
            and not torch.is_autocast_enabled(self.device_type)
            and not transforms_active()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        device, stream = current_device_and_stream()
        if device != self.device_index:
            # Triton launches on the current device; with the model spread over GPUs
            # (device_map="auto") it may not be the weights'.
            with torch.cuda.device(self.device):
                return self(x)
        H, I, N = self.sizes
        M = x.numel() // H
        # empty_like: x's shape when N == H (the usual down projection), fewer steps
        out = torch.empty_like(x) if N == H else x.new_empty((*x.shape[:-1], N))
        plan = self.plans.get(M)
        if plan is None:
            fixed = (self.dtype, self.device, self.activation, (H, 1, *self.strides))
            plan = self.plans[M] = _plan(M, H, I, N, *fixed, bool(self.scales))
        grid, launcher = plan
        # takes() let a capture through only at these rows
        capturing = (
            M <= self.graph_max_tokens and torch.cuda.is_current_stream_capturing()
        )
        sums, arrivals = stream_scratch(
            _SCRATCH, self.device, M * N, 1, True, capturing=capturing, stream=stream
        )
        sizes = (M, H, I, N, H, 1, *self.strides)
        # out and the scratch come from the allocator (aligned)
        addresses = self.addresses
        if not (
            addresses is not None
            and not x.data_ptr() & 15
            and launcher.launch_aligned(
                grid,
                device,
                stream,
                (x, *addresses[:6], out, sums, arrivals, *addresses[6:], *sizes),
            )
        ):
            launcher(grid, x, *self.operands, out, sums, arrivals, *self.scales, *sizes)
        return out
