"""Every launch table and dispatch threshold, per GPU.

A ``Tuning`` holds what was measured on one GPU: the 16-bit GEMM tiles by shape class, the
one-launch MLP's tiles, the elementwise tiles, and the sizes where the route changes
kernels. Tables ship beside this file as ``tuning_<GPU name>.json`` (spaces as ``_``),
each written by ``benchmarks/tune.py --write`` from a sweep on that GPU; ``table(device)``
takes the one named for the device's GPU, else:

- a Hopper or Blackwell data-center GPU (compute capability 9.x, 10.x: the TMA kernel)
  takes the measured table of its architecture with the nearest SM count, then the
  longest shared name (an H800, GH200 or H20 the H100's or H200's; Blackwell the H200's
  numbers, not measured there);
- any other GPU (Ampere, Ada, ROCm, XPU: the portable kernel) the H200's numbers, which
  size the portable kernel's tiles for 227 KB of shared memory (a launch that overflows
  retries with fewer stages: launch.Launcher);
- the Triton interpreter ``INTERPRETER``: small tiles, numpy pays per program.

The FP8 tiles (``fp8_config``) and the sizes fixed by a kernel's shape (one-launch rows,
the FP8 dual GEMM's token tile) are the same on every GPU: the H200's, not measured on the
H100. The measurements behind each table: the files its ``source`` names.
"""

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .fp8.kernels import FP8_BLOCK
from .launch import INTERPRETED, cdiv, clear_plans, num_programs


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def constexprs(self) -> dict:
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


# The GEMM shape classes a table sizes (16-bit operands), as gemm_config picks them.
GEMM_CLASSES = (
    "decode16_single",  # M <= 16: one row tile, weight streaming
    "decode16_gated",
    "decode64_single",  # M <= 64: one row tile (32 rows up to 32 tokens)
    "decode64_gated",  # BLOCK_N halved where N <= 4096 (more programs)
    "tma_single",  # TMA kernel (Hopper, Blackwell), N >= 4096
    "tma_single_narrow",  # N < 4096
    "tma_gated",
    "tma_extra_tiles",  # a Z tile per stage (backward) or a C tile to add: 3 stages fit
    "portable_single",  # other GPUs
    "portable_gated",
)


@dataclass(frozen=True)
class Tuning:
    """One GPU's launch tables and thresholds (JSON keys: the field names)."""

    gpu: str
    # where it was measured: (major, minor) compute capability and SM count
    capability: tuple | None
    sms: int | None
    # {class: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)}, GEMM_CLASSES
    gemm: dict
    # one_launch_mlp_kernel: BLOCK_I (halved where the intermediate columns would fill less than
    # half the SMs), BLOCK_K, BLOCK_N, BLOCK_FINAL, num_warps, num_stages
    one_launch: dict
    # the most tokens a CUDA graph capture computes in one launch (16-bit weights; FP8 and
    # larger captures the two kernels): 0 where the two kernels took less GPU time
    one_launch_graph_max_tokens: int
    # contiguous operands, one long row: (elements per program, warps), per direction
    flat_forward: tuple
    flat_backward: tuple
    # strided operands: elements a program streams (rows stacked up to it)
    row_tile_elements: int
    # training calls below this many activation outputs, whose GeLU is one PyTorch op, run
    # eager's ops (our autograd Function's host time outweighs its GPU time saved)
    training_kernel_min_elements: int
    # (fewest, most) rows of an inference linear without activation that cuBLAS computes:
    # faster there than the decode tiles; (0, 0): none
    linear_cublas_rows: tuple
    # the fewest rows whose FP8 GEMM cuBLAS computes (where it applies: Hopper)
    fp8_cublas_min_rows: int
    # the most rows of a swapped, split-K FP8 down GEMM where TMA tiles leave SMs idle
    fp8_swap_rows: int
    # the sweeps behind the numbers (benchmarks/results/...), or how they were chosen
    source: tuple = field(default=(), compare=False)

    def gemm_config(self, shape_class: str) -> GemmConfig:
        return GemmConfig(*self.gemm[shape_class])

    @classmethod
    def from_json(cls, text: str) -> "Tuning":
        data = json.loads(text)
        data["gemm"] = {k: tuple(v) for k, v in data["gemm"].items()}
        for key in ("capability", "flat_forward", "flat_backward", "source"):
            data[key] = tuple(data.get(key, ()))
        data["linear_cublas_rows"] = tuple(data["linear_cublas_rows"])
        table = cls(**data)
        missing = set(GEMM_CLASSES) - set(table.gemm)
        if missing:
            raise ValueError(f"tuning table for {table.gpu} lacks {sorted(missing)}")
        return table

    def to_json(self) -> str:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["gemm"] = {k: list(self.gemm[k]) for k in GEMM_CLASSES}
        return json.dumps(data, indent=1) + "\n"


_HERE = Path(__file__).resolve().parent


def _shipped() -> dict[str, Tuning]:
    """The tables shipped beside this file, by GPU name."""
    tables = (
        Tuning.from_json(p.read_text()) for p in sorted(_HERE.glob("tuning_*.json"))
    )
    return {t.gpu: t for t in tables}


SHIPPED = _shipped()
# GPUs without a table of their own: the H200's numbers (see the module docstring)
DEFAULT = SHIPPED["NVIDIA H200"]
INTERPRETER = Tuning(
    gpu="Triton interpreter",
    capability=None,
    sms=None,
    gemm=dict.fromkeys(GEMM_CLASSES, (32, 64, 32, 4, 4, 1)),
    one_launch={
        "BLOCK_I": 32,
        "BLOCK_K": 32,
        "BLOCK_N": 32,
        "BLOCK_FINAL": 64,
        "num_warps": 4,
        "num_stages": 1,
    },
    one_launch_graph_max_tokens=0,  # the interpreter captures no graphs
    flat_forward=(16384, 4),
    flat_backward=(16384, 4),
    row_tile_elements=8192,
    training_kernel_min_elements=DEFAULT.training_kernel_min_elements,
    linear_cublas_rows=(0, 0),  # tests size the route themselves
    fp8_cublas_min_rows=DEFAULT.fp8_cublas_min_rows,
    fp8_swap_rows=DEFAULT.fp8_swap_rows,
    source=("moderate tiles: the interpreter pays per program, not per element",),
)


def _nearest(props) -> Tuning:
    """The table for a GPU with none of its own (the module docstring's heuristic); ties
    in SM count (H100 and H200 both have 132) go to the longer shared name prefix (an
    "NVIDIA H200 NVL" the H200's)."""
    if torch.version.hip is not None or props.major not in (9, 10):  # ROCm: no TMA
        return DEFAULT
    measured = [
        t for t in SHIPPED.values() if t.capability and t.capability[0] == props.major
    ]
    if not measured:
        return DEFAULT
    return min(
        measured,
        key=lambda t: (
            abs(t.sms - props.multi_processor_count),
            -len(os.path.commonprefix([t.gpu, props.name])),
        ),
    )


# device -> its table (a dict: torch.compile traces the route policy that reads it)
_TABLES: dict[torch.device, Tuning] = {}


def table(device: torch.device) -> Tuning:
    """The launch table for ``device``."""
    t = _TABLES.get(device)
    if t is None:
        if INTERPRETED or device.type == "cpu":
            t = INTERPRETER
        elif device.type == "cuda":
            # get_device_properties: torch.compile folds it into a constant
            props = torch.cuda.get_device_properties(device)
            t = SHIPPED.get(props.name) or _nearest(props)
        else:  # XPU, ...: not measured
            t = DEFAULT
        _TABLES[device] = t
    return t


def _key(device: torch.device | str) -> torch.device:
    """``device`` as tensors name it (a GPU with its index)."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, getattr(torch, device.type).current_device())
    return device


def set_table(device: torch.device | str, tuning: Tuning | None) -> None:
    """``tuning`` for launches on ``device`` from now on (None: the device's own again);
    the plans made from the previous table are dropped."""
    if tuning is None:
        _TABLES.pop(_key(device), None)
    else:
        _TABLES[_key(device)] = tuning
    clear_plans()


@contextmanager
def use(device: torch.device | str, tuning: Tuning | None = None, **fields):
    """``tuning`` (or the device's table with ``fields`` replaced) for launches on
    ``device`` inside the block (set_table), the table before it after."""
    key = _key(device)
    before = _TABLES.get(key)
    set_table(key, replace(tuning or table(key), **fields))
    try:
        yield _TABLES[key]
    finally:
        set_table(key, before)


# --- 16-bit GEMMs -----------------------------------------------------------------------


def gemm_config(
    M: int,
    N: int,
    dtype: torch.dtype,
    device: torch.device,
    gated: bool,
    tma: bool,
    extra_tiles: bool,
) -> GemmConfig:
    """A 16-bit (or fp32) GEMM's launch configuration by shape class (GEMM_CLASSES) from
    ``device``'s table. Decode classes: 32-row tiles up to 32 tokens, a gated GEMM's
    BLOCK_N halved where N <= 4096; fp32 operands (twice the bytes) halve BLOCK_K, and
    keep 3 stages in the decode classes (the interpreter's tiles stay as they are)."""
    t = table(device)
    kind = "gated" if gated else "single"
    fp32 = dtype == torch.float32 and not INTERPRETED
    if M <= 64:
        cfg = t.gemm_config(f"decode{16 if M <= 16 else 64}_{kind}")
        if INTERPRETED:
            return cfg
        if 16 < M <= 32:
            cfg = replace(cfg, block_m=32)
        if M > 16 and gated and N <= 4096:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        if fp32:
            cfg = replace(
                cfg, block_k=cfg.block_k // 2, num_stages=min(cfg.num_stages, 3)
            )
        return cfg
    if tma:
        narrow = "_narrow" if not gated and N < 4096 else ""
        return t.gemm_config(
            "tma_extra_tiles" if extra_tiles else f"tma_{kind}{narrow}"
        )
    cfg = t.gemm_config(f"portable_{kind}")
    return replace(cfg, block_k=cfg.block_k // 2) if fp32 else cfg


# Split-K: each program sums at least this many K-tiles (shorter loops barely pipeline).
_MIN_K_TILES_PER_SPLIT = 4
_MAX_SPLIT_K = 8


def split_k(tiles: int, k_tiles: int, programs: int) -> int:
    """Programs per output tile for a decode GEMM: doubled while the grid stays within one
    program per SM (Gemma-2B's down projection, 32 tiles of 64 columns, splits 4)."""
    split = 1
    while (
        split < _MAX_SPLIT_K
        and 2 * split * tiles <= programs
        and k_tiles >= 2 * split * _MIN_K_TILES_PER_SPLIT
    ):
        split *= 2
    return split


# --- The whole MLP in one launch (decode, one_launch.py) ------------------------------------------------

# The most tokens one_launch_mlp takes: its one row tile (BLOCK_M); its fp32 sums grow
# with the tokens.
ONE_LAUNCH_MAX_TOKENS = 16


def one_launch_config(
    I: int, dtype: torch.dtype, device: torch.device, fp8: bool
) -> dict:
    """one_launch_mlp_kernel's tiles: one program per BLOCK_I intermediate columns, as many as
    fit one wave of the GPU (halved where the columns would fill less than half the SMs);
    the last program reads the sums back BLOCK_FINAL columns at a time. fp32 tiles (twice
    the bytes) half as wide. FP8: every tile but BLOCK_FINAL is the 128-wide scale block,
    the down product swapped, 4 stages (the H200's)."""
    if fp8:
        return {"BLOCK_I": FP8_BLOCK, "BLOCK_K": FP8_BLOCK, "BLOCK_N": FP8_BLOCK,
                "BLOCK_FINAL": 2 * FP8_BLOCK if INTERPRETED else 1024,
                "num_warps": 4 if INTERPRETED else 8,
                "num_stages": 1 if INTERPRETED else 4}  # fmt: skip
    cfg = dict(table(device).one_launch)
    if INTERPRETED:
        return cfg
    if cdiv(I, cfg["BLOCK_I"]) < num_programs(device) // 2:
        cfg["BLOCK_I"] //= 2
    if dtype == torch.float32:
        cfg["BLOCK_K"] //= 2
        cfg["BLOCK_N"] //= 2
    return cfg


# --- Elementwise GeGLU ------------------------------------------------------------------


def flat_tile(device: torch.device, backward: bool) -> tuple[int, int]:
    """(elements per program, warps) for contiguous operands seen as one long row."""
    t = table(device)
    return t.flat_backward if backward else t.flat_forward


def row_tile_config(
    n_cols: int, elem_bytes: int, device: torch.device
) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for strided [M, N] operands.

    A row tile spans up to 16 bytes x 32 lanes x 8 warps (2048 bf16 / 1024 fp32 columns),
    so every load is a 16-byte vector; rows are stacked until a program streams the
    table's ``row_tile_elements``. Where the columns leave more than 1/8 of the last
    tile's lanes idle (ModernBERT's 1152: 44% at 2048), narrower tiles, down to 256
    columns, with the fewest idle lanes (1152: five of 256).
    """
    vec = 16 // elem_bytes
    n = max(n_cols, 1)
    widest = min(1 << (n - 1).bit_length(), vec * 32 * 8)
    candidates = [widest >> i for i in range(4) if widest >> i >= min(256, widest)]
    idle = {b: cdiv(n, b) * b - n for b in candidates}
    block_n = next(
        (b for b in candidates if idle[b] * 8 <= cdiv(n, b) * b),
        min(candidates, key=lambda b: (idle[b], -b)),
    )
    return max(1, table(device).row_tile_elements // block_n), block_n, 8


# --- FP8 (the H200's tiles on every GPU) --------------------------------------------------

# The most rows whose FP8 dual GEMM quantizes a 16-bit A itself (QUANT_A, swapped
# products): one token tile (fp8_config's 32 rows); beyond, each token tile would
# quantize x again.
FP8_QUANT_A_ROWS = 32


def fp8_config(M: int, gated: bool, tma: bool, swap: bool, b_tma: bool) -> GemmConfig:
    """FP8 GEMMs: BLOCK_K is the scale block (128); a gated GEMM's BLOCK_N too (it
    quantizes h per 128 columns), and a single one's divides it. Decode (up to 64 rows):
    tokens in tiles of 16 up to 16 rows and of 32 beyond (swapped products), a weight
    tile's token tiles adjacent programs (they share it through L2); unswapped, one
    64-row tile (Hopper's e4m3 MMA takes 64 rows); the gated GEMM with 8 warps, 4 stages
    (3 at 32 rows: two programs per SM), the single one with 8 warps up to 16 rows, 4
    beyond, 4 stages with its weight through TMA (``b_tma``) and 3 without. The swapped
    single GEMM past 64 rows (``swap``): tokens in tiles of 64 up to 128 rows, 128
    beyond. The H200's sweeps (design.md, FP8)."""
    block_n = FP8_BLOCK if gated else 64
    if INTERPRETED:
        return GemmConfig(32, block_n, FP8_BLOCK, 4, 4, 1)
    if M <= 64:
        rows = 16 if M <= 16 else 32 if swap else 64
        if gated:
            warps, stages = 8, 3 if rows == 32 else 4
        else:
            warps, stages = (8, 4) if rows == 16 else (4, 4 if b_tma else 3)
        return GemmConfig(rows, block_n, FP8_BLOCK, cdiv(M, rows), warps, stages)
    if swap:
        rows = 64 if M <= 128 else 128  # tokens per tile
        return GemmConfig(rows, block_n, FP8_BLOCK, 1, 4, 4)
    if tma:
        return GemmConfig(128, FP8_BLOCK, FP8_BLOCK, 8 if gated else 16, 8, 4)
    return GemmConfig(64, FP8_BLOCK, FP8_BLOCK, 8, 4, 3)


def fp8_swap_ab(
    M: int,
    N: int,
    gated: bool,
    quant_a: bool,
    device: torch.device,
    b_tma: bool = False,
) -> bool:
    """Whether an FP8 GEMM runs SWAP_AB on the portable kernel (the weight tile as the MMA's
    rows, on Hopper's e4m3 MMA whatever the tokens): the single (down) GEMM up to 64 rows,
    and up to the table's ``fp8_swap_rows`` where the TMA kernel would have fewer tiles
    than SMs; the gated one where it quantizes its A itself (QUANT_A, at most
    FP8_QUANT_A_ROWS rows) or reads its weights through TMA (``b_tma``: up to 64 rows)."""
    if quant_a or (M <= 64 and (b_tma or not gated)):
        return True
    tma_tiles = cdiv(M, FP8_BLOCK) * cdiv(N, FP8_BLOCK)
    return (
        not gated
        and M <= table(device).fp8_swap_rows
        and tma_tiles < num_programs(device)
    )
