"""Runs the suite on the GPU when there is one, else on the CPU through the Triton
interpreter. The interpreter must be chosen before triton is first imported."""

import contextlib
import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Prepended by run_python(no_network=True): any connection attempt raises.
_NO_NETWORK = """
import socket

def _refuse(*args, **kwargs):
    raise OSError("network access attempted")

socket.socket.connect = socket.socket.connect_ex = _refuse
socket.getaddrinfo = socket.create_connection = _refuse
"""


def run_python(
    code: str, *, no_network: bool = False, **env: str | None
) -> subprocess.CompletedProcess:
    """``code`` (dedented) in a fresh interpreter; ``env`` sets variables, or removes those
    given None. Its exit status, stdout and stderr are the caller's to check."""
    environ = dict(os.environ)
    for name, value in env.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    code = (_NO_NETWORK if no_network else "") + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (skipped on the CPU interpreter)"
    )


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU; this run uses the Triton interpreter on the CPU"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if HAS_GPU else "cpu"


@pytest.fixture(scope="session")
def fused_geglu():
    """The package as users load it: the built tree through kernels.get_local_kernel."""
    from kernels import get_local_kernel

    if not (ROOT / "build" / "torch-cpu" / "metadata.json").exists():
        pytest.fail("build/ is missing: run `make build` (make test does it)")
    return get_local_kernel(ROOT)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _training_kernels_at_every_size(fused_geglu, device):
    """Tests run tiny shapes: training calls there take our kernels, as large ones do
    (the tuning table's training_kernel_min_elements leaves small one-op-GeLU training calls to eager's
    ops; test_families.py tests that threshold with its own values)."""
    with fused_geglu.tuning.use(device, training_kernel_min_elements=0):
        yield


@pytest.fixture
def table_fields(fused_geglu, device):
    """``table_fields(**fields)``: the device's launch table with ``fields`` replaced until
    the test ends (tuning.use)."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(
            fused_geglu.tuning.use(device, **fields)
        )
