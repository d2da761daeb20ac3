"""The README (the Hub card) and docs/: every Python example parses, each kernel mapping
keys on the device that kernelize is given, relative links resolve, and the README's CPU
example runs as written (offline, in the Triton interpreter)."""

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT, run_python

DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^( *)```python\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


def python_blocks(path: Path) -> list[str]:
    return [
        "\n".join(line.removeprefix(indent) for line in body.splitlines())
        for indent, body in FENCE.findall(path.read_text())
    ]


EXAMPLES = [
    pytest.param(code, id=f"{path.relative_to(ROOT).as_posix()}-{i}")
    for path in DOCS
    for i, code in enumerate(python_blocks(path))
]


def test_examples_found():
    assert len(python_blocks(ROOT / "README.md")) >= 5
    assert len(EXAMPLES) >= 7


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_parses(code):
    ast.parse(code)


def kernelize_devices(code: str) -> set[str]:
    return set(re.findall(r"kernelize\([^)]*device=\"(\w+)\"", code))


def mapping_devices(code: str) -> set[str]:
    """The device keys of the mappings: ``{"Layer": {"cuda": ...}}``."""
    return set(re.findall(r"\{\"\w+\": \{\"(\w+)\":", code))


def test_mapping_device_helpers():
    code = 'm = {"GeGLUMLP": {"cuda": r}}\nkernelize(m, mode=M, device="cpu")'
    assert mapping_devices(code) == {"cuda"} and kernelize_devices(code) == {"cpu"}


@pytest.mark.parametrize("code", EXAMPLES)
def test_mapping_keys_on_the_kernelize_device(code):
    """kernelize(device="cpu") with a mapping keyed on "cuda" replaces nothing, silently."""
    if kernelize_devices(code):
        assert mapping_devices(code) == kernelize_devices(code)


def test_hub_loads_pass_trust_remote_code():
    """The package's organisation is not a trusted publisher: without trust_remote_code,
    kernels refuses every Hub load in the README."""
    for code in python_blocks(ROOT / "README.md"):
        calls = len(re.findall(r"get_kernel\(|LayerRepository\(\n?\s*repo_id=", code))
        calls += code.count("use_kernels=True")
        assert code.count("trust_remote_code") >= calls, code


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if not re.match(r"\w+://", target):
            assert (path.parent / target).exists(), f"{path.name}: {target}"


def test_readme_has_one_results_block():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("<!-- results:start -->") == 1
    assert readme.count("<!-- results:end -->") == 1
    assert len(readme.splitlines()) <= 300


def test_readme_cpu_example_runs(fused_geglu):
    """The README's CPU example as written, from the checkout's root, with no network;
    then its MLPs run the kernel's GeGLUMLP forward."""
    (code,) = [c for c in python_blocks(ROOT / "README.md") if 'device="cpu"' in c]
    check = """
import sys

for layer in model.model.layers:
    forward = layer.mlp.forward.__func__
    assert forward.__qualname__ == "GeGLUMLP.forward", forward
    assert forward.__module__.startswith("_fused_geglu_"), forward.__module__
assert logits.shape == (1, 8, 256) and bool(logits.isfinite().all())
print("kernelized")
"""
    result = run_python(
        f"import os\nos.chdir({str(ROOT)!r})\n{code}\n{check}",
        no_network=True,
        HF_HUB_OFFLINE="1",
        TRITON_INTERPRET=None,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kernelized" in result.stdout
