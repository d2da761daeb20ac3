"""The launch tables (tuning.py): the shipped tables, which table a GPU gets, a table set
for a block and undone after it, and the configurations read from a table."""

import json
import types

import pytest
import torch
from conftest import ROOT

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
FILES = sorted((ROOT / "torch-ext" / "fused_geglu").glob("tuning_*.json"))


def test_every_shipped_table_is_whole_and_round_trips(fused_geglu):
    tuning = fused_geglu.tuning
    assert {json.loads(f.read_text())["gpu"] for f in FILES} == {H100, H200}
    for path in FILES:
        table = tuning.Tuning.from_json(path.read_text())
        assert path.name == "tuning_" + table.gpu.replace(" ", "_") + ".json"
        assert set(table.gemm) == set(tuning.GEMM_CLASSES)
        assert all(len(tiles) == 6 for tiles in table.gemm.values())
        assert table.capability == (9, 0) and table.sms == 132 and table.source
        assert tuning.Tuning.from_json(table.to_json()) == table
        assert tuning.SHIPPED[table.gpu] == table


def test_a_table_missing_a_shape_class_is_refused(fused_geglu):
    data = json.loads(FILES[0].read_text())
    del data["gemm"]["tma_gated"]
    with pytest.raises(ValueError, match="lacks \\['tma_gated'\\]"):
        fused_geglu.tuning.Tuning.from_json(json.dumps(data))


# GPU name, compute capability, SMs -> the table it gets (the module docstring's rule).
GPUS = [
    (H100, (9, 0), 132, H100),
    (H200, (9, 0), 132, H200),
    ("NVIDIA H100 PCIe", (9, 0), 114, H100),  # no table: Hopper, nearest SMs
    ("NVIDIA H20", (9, 0), 78, H200),  # SMs tie, then the name
    ("NVIDIA H200 NVL", (9, 0), 132, H200),  # SMs tie: the longer shared name
    ("NVIDIA H100 NVL", (9, 0), 132, H100),
    ("NVIDIA B200", (10, 0), 148, H200),  # Blackwell: no measured table, the default
    ("NVIDIA A100-SXM4-80GB", (8, 0), 108, H200),  # portable kernel: the default
    ("NVIDIA L40S", (8, 9), 142, H200),
]


@pytest.mark.parametrize(
    "name, capability, sms, expected", GPUS, ids=[g[0] for g in GPUS]
)
def test_table_by_gpu(fused_geglu, monkeypatch, name, capability, sms, expected):
    tuning = fused_geglu.tuning
    props = types.SimpleNamespace(
        name=name, major=capability[0], minor=capability[1], multi_processor_count=sms
    )
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    device = torch.device("cuda", 5)
    try:
        assert tuning.table(device).gpu == expected
    finally:
        tuning.set_table(device, None)


def test_other_gpus_get_the_default_table(fused_geglu, monkeypatch):
    """A ROCm GPU (no TMA kernel, whatever its capability number) and an XPU get the
    default table, not the interpreter's or a Hopper's."""
    tuning = fused_geglu.tuning
    props = types.SimpleNamespace(
        name="AMD Instinct MI300X", major=9, minor=4, multi_processor_count=304
    )
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    for device in (torch.device("cuda", 5), torch.device("xpu", 0)):
        try:
            assert tuning.table(device) is tuning.DEFAULT, device
        finally:
            tuning.set_table(device, None)


def test_use_sets_a_table_for_the_block_and_drops_plans(fused_geglu, device):
    tuning, launch = fused_geglu.tuning, fused_geglu.launch
    dev = torch.tensor(0.0, device=device).device
    before = tuning.table(dev)
    x = torch.randn(3, 8, device=device)
    fused_geglu.geglu(x, x)
    assert any(launch._PLAN_CACHES), "no plan made"
    with tuning.use(device, row_tile_elements=1024) as table:
        assert not any(launch._PLAN_CACHES)
        assert tuning.table(dev) is table and table.row_tile_elements == 1024
        assert table.gemm == before.gemm
        with tuning.use(device, tuning.SHIPPED[H100]):
            assert tuning.table(dev).gpu == H100
        assert tuning.table(dev) is table
    assert tuning.table(dev) is before


# (M, N, dtype, gated, tma) -> (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) on the
# H200's table and the H100's, where they differ (the narrow down GEMM's GROUP_M).
BF16, FP32 = torch.bfloat16, torch.float32
CONFIGS = [
    ((1, 16384, BF16, True, False), (16, 128, 128, 1, 8, 4), None),
    ((1, 2048, FP32, False, False), (16, 64, 64, 1, 4, 3), None),
    ((20, 2048, BF16, True, False), (32, 32, 128, 1, 4, 4), None),
    ((40, 16384, BF16, True, False), (64, 64, 128, 1, 4, 4), None),
    ((8192, 16384, BF16, True, True), (128, 128, 64, 16, 8, 3), None),
    ((8192, 16384, BF16, False, True), (128, 256, 64, 16, 8, 3), None),
    ((8192, 2048, BF16, False, True), (128, 256, 64, 8, 8, 3), (128, 256, 64, 4, 8, 3)),
    ((8192, 2048, FP32, False, False), (128, 128, 32, 8, 4, 4), None),
]


@pytest.mark.parametrize("call, h200, h100", CONFIGS, ids=str)
def test_gemm_config_from_the_table(fused_geglu, monkeypatch, call, h200, h100):
    tuning = fused_geglu.tuning
    monkeypatch.setattr(tuning, "INTERPRETED", False)
    M, N, dtype, gated, tma = call
    device = torch.device("cuda", 5)
    for gpu, expected in ((H200, h200), (H100, h100 or h200)):
        with tuning.use(device, tuning.SHIPPED[gpu]):
            cfg = tuning.gemm_config(M, N, dtype, device, gated, tma, False)
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps,
                cfg.num_stages) == expected, gpu  # fmt: skip
