"""Kernelized models under tensor parallelism (transformers' ``tp_plan="auto"``) and FSDP2
(``fully_shard``) on two ranks against the eager model: tests/distributed_worker.py, run
under torchrun with gloo on CPU processes (Triton interpreter) and, given two GPUs, NCCL."""

import subprocess
import sys

import pytest
import torch
from conftest import HAS_GPU, ROOT

# The interpreter run is the CPU machines' (Triton 3.9); GPU machines run NCCL instead.
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(HAS_GPU, reason="GPU machines run the NCCL check"),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("check", ["tp", "fsdp", "dtensor"])
def test_two_ranks(check, device, tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", "2", str(ROOT / "tests" / "distributed_worker.py"),
        check, device, str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(
        command, capture_output=True, text=True, timeout=600, check=False
    )
    report = run.stdout[-3000:] + run.stderr[-6000:]
    assert run.returncode == 0, report
    families = ["gemma", "gemma3"] if check != "dtensor" else [""]
    for rank in range(2):
        for family in families:
            assert f"rank {rank}: {check} {family}".strip() + " ok" in run.stdout, (
                report
            )
