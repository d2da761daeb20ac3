"""The package as kernels sees it (its public API only): the build layout and metadata, and every way a
user loads it (local path, local layer, LOCAL_KERNELS override), all without network."""

import ast
import importlib.util
import inspect
import json
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import huggingface_hub.constants
import kernels
import pytest
import torch
from conftest import ROOT, run_python
from reference import assert_close_to_ref, eager_geglu, geglu_ref
from torch import nn
from transformers import Gemma2Config, Gemma3TextConfig, GemmaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP

GENERAL = tomllib.loads((ROOT / "build.toml").read_text())["general"]
REPO_ID = GENERAL["hub"]["repo-id"]
SOURCES = ROOT / "torch-ext" / GENERAL["name"].replace("-", "_")
# build/ holds build.toml's backends and the interpreter's CPU variant (scripts/build.py's
# LOCAL_BACKENDS: built for tests and development, not uploaded)
BACKENDS = GENERAL["backends"] + [b for b in ("cpu",) if b not in GENERAL["backends"]]


def _raise_no_network(*args, **kwargs):
    raise OSError(f"network access attempted: {args!r}")


@pytest.fixture
def no_network(monkeypatch):
    """Offline mode for huggingface_hub, and any socket connection or DNS lookup raises."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # kernels reads the constant, which huggingface_hub set from the env at import.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket.socket, "connect", _raise_no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", _raise_no_network)
    monkeypatch.setattr(socket, "getaddrinfo", _raise_no_network)


@pytest.fixture
def local_kernels(monkeypatch, no_network):
    """``LOCAL_KERNELS`` points REPO_ID at this checkout (kernels parses the variable's
    value at each lookup, caching by value)."""
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO_ID}={ROOT}")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """scripts/build.py run as `make build` runs it, into a fresh directory."""
    out = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build.py"), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return out


def head_revision() -> str:
    """HEAD's short hash, or "nogit" where the tree is no git checkout (as build.py says)."""
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return rev or "nogit"


def check_geglu(module, device):
    gate = torch.randn(3, 5, 257, device=device) * 3
    up = torch.randn(3, 5, 257, device=device)
    out = module.geglu(gate, up)
    ref, eager = geglu_ref(gate, up, "tanh"), eager_geglu(gate, up, "tanh")
    assert_close_to_ref(out, ref, eager)


# --- build layout and metadata ---------------------------------------------------------


def test_build_writes_one_variant_per_backend(built):
    """A variant per backend, and the card (CARD.md filled in, as kernel-builder's Nix
    build writes it beside the variants)."""
    assert sorted(p.name for p in built.iterdir()) == sorted(
        [f"torch-{b}" for b in BACKENDS] + ["CARD.md"]
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_metadata_matches_build_toml(built, backend):
    path = built / f"torch-{backend}" / "metadata.json"
    assert json.loads(path.read_text())["python-depends"] == []
    metadata = kernels.Metadata.read_from_file(path)
    assert str(metadata.name) == GENERAL["name"]
    assert metadata.version == GENERAL["version"]
    assert metadata.license == GENERAL["license"]
    assert str(metadata.backend.backend_type) == backend
    assert metadata.python_depends == [] and metadata.kernel_depends == []
    # build.toml's: no upstream, the Hub repository as the source
    assert metadata.upstream is None
    assert (
        metadata.source
        == GENERAL["source"]
        == f"https://huggingface.co/kernels/{REPO_ID}"
    )
    assert metadata.digest is not None and metadata.provenance is not None
    prefix = f"_{metadata.name.python_name}_{backend}_"
    assert metadata.id.startswith(prefix), metadata.id
    assert metadata.id.removeprefix(prefix).removesuffix("_dirty") == head_revision()


def test_kernels_info_names_the_repository(built, tmp_path):
    """`kernels info` on a checkout prints no Upstream and the Hub repository as Source."""
    pytest.importorskip("sigstore", reason="kernels' CLI needs sigstore")
    (tmp_path / "build").symlink_to(built)
    result = subprocess.run(
        [sys.executable, "-c", "from kernels.cli import main; main()"]
        + ["info", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    repo = f"https://huggingface.co/kernels/{REPO_ID}"
    assert "Upstream: -\n" in result.stdout
    assert f"Source: {repo}\n" in result.stdout


def test_build_repo_id_override(tmp_path):
    """`build.py --repo-id` (upload.py passes its --repo-id, and uploads the source
    there) names that repository as the source."""
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build.py"), "--out", str(tmp_path)]
        + ["--repo-id", "someone/other-geglu"],
        check=True,
        capture_output=True,
    )
    metadata = kernels.Metadata.read_from_file(tmp_path / "torch-cpu" / "metadata.json")
    assert metadata.source == "https://huggingface.co/kernels/someone/other-geglu"
    assert 'get_kernel("someone/other-geglu"' in (tmp_path / "CARD.md").read_text()


def test_ids_unique_per_backend(built):
    ids = {
        kernels.Metadata.read_from_file(variant / "metadata.json").id
        for variant in built.glob("torch-*")
    }
    assert len(ids) == len(BACKENDS)


@pytest.mark.parametrize("backend", BACKENDS)
def test_variant_is_sources_plus_ops(built, backend):
    """The package's files (subpackages too) as they are, plus _ops.py and metadata.json;
    the CUDA kernels of `make precompile` (precompiled/) in the CUDA variant only."""
    variant = built / f"torch-{backend}"
    pyext = tomllib.loads((ROOT / "build.toml").read_text())["torch-noarch"]["pyext"]
    sources = {
        s.relative_to(SOURCES).as_posix(): s
        for e in pyext
        for s in SOURCES.rglob(f"*.{e}")
        if s.name != "_ops.py"
        and "__pycache__" not in s.parts
        and (backend == "cuda" or s.relative_to(SOURCES).parts[0] != "precompiled")
    }
    assert any(s.endswith(".json") for s in sources), "the tuning tables ship"
    files = {
        p.relative_to(variant).as_posix()
        for p in variant.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert files == set(sources) | {"_ops.py", "metadata.json"}
    for name, source in sources.items():
        assert (variant / name).read_bytes() == source.read_bytes()
    # _ops.py's namespace is the build id, so two builds can be loaded side by side.
    build_id = json.loads((variant / "metadata.json").read_text())["id"]
    spec = importlib.util.spec_from_file_location(
        f"{build_id}_ops_check", variant / "_ops.py"
    )
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    assert ops.ops.name == build_id
    assert ops.add_op_namespace_prefix("geglu") == f"{build_id}::geglu"


# --- loading ----------------------------------------------------------------------------


def test_get_local_kernel(fused_geglu, device):
    backend = "cpu" if device == "cpu" else "rocm" if torch.version.hip else "cuda"
    variant = Path(fused_geglu.__file__).parent
    assert variant == ROOT / "build" / f"torch-{backend}"
    assert (
        fused_geglu.__name__
        == json.loads((variant / "metadata.json").read_text())["id"]
    )
    check_geglu(fused_geglu, device)


def test_all_is_a_literal_list_of_loaded_names(fused_geglu):
    tree = ast.parse((SOURCES / "__init__.py").read_text())
    (value,) = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    assert isinstance(value, ast.List), "__all__ must be a literal list"
    names = ast.literal_eval(value)
    assert names == fused_geglu.__all__
    missing = [name for name in names if not hasattr(fused_geglu, name)]
    assert not missing, f"__all__ names missing on the module: {missing}"


def test_local_layer_repository(fused_geglu):
    layer = kernels.LocalLayerRepository(ROOT, layer_name="GeGLUMLP").load()
    assert layer is fused_geglu.layers.GeGLUMLP
    # kernels' layer rules (kernels.layer.layer._validate_layer), spelled out.
    assert issubclass(layer, nn.Module)
    assert layer.__init__ is nn.Module.__init__, "a layer must not define __init__"
    extra = {n for n, _ in inspect.getmembers(layer)} - {
        n for n, _ in inspect.getmembers(nn.Module)
    }
    assert extra <= {"has_backward", "can_torch_compile"}, extra
    assert layer.has_backward is True and layer.can_torch_compile is True


@pytest.mark.parametrize(
    "mlp_cls, config",
    [
        (GemmaMLP, GemmaConfig(hidden_size=16, intermediate_size=24)),
        (Gemma2MLP, Gemma2Config(hidden_size=16, intermediate_size=24)),
        (Gemma3MLP, Gemma3TextConfig(hidden_size=16, intermediate_size=24)),
    ],
    ids=["gemma", "gemma2", "gemma3"],
)
def test_layer_passes_kernelize_validation(fused_geglu, device, mlp_cls, config):
    """kernelize validates a layer against the class it replaces before it swaps the
    forward: each MLP we replace takes our forward through kernels' public API."""
    kernels.replace_kernel_forward_from_hub(mlp_cls, "GeGLUMLP")
    model = nn.Sequential(mlp_cls(config)).to(device)
    x = torch.randn(2, 3, 16, device=device)
    with torch.no_grad():
        expected = model(x)
    layer = kernels.LocalLayerRepository(ROOT, layer_name="GeGLUMLP")
    with kernels.use_kernel_mapping(
        {"GeGLUMLP": {device: layer}}, inherit_mapping=False
    ):
        kernels.kernelize(model, mode=kernels.Mode.INFERENCE, device=device)
    assert model[0].forward.__func__.__qualname__ == "GeGLUMLP.forward"
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "pin", [{"revision": "main"}, {"version": 1}], ids=["revision", "version"]
)
def test_get_kernel_with_local_override(fused_geglu, device, local_kernels, pin):
    """get_kernel consults LOCAL_KERNELS before the Hub, so both pins load offline."""
    module = kernels.get_kernel(REPO_ID, **pin)
    assert module.__name__ == fused_geglu.__name__
    check_geglu(module, device)


@pytest.mark.parametrize(
    "pin", [{"revision": "main"}, {"version": 1}], ids=["revision", "version"]
)
def test_layer_repository_with_local_override(
    fused_geglu, local_kernels, monkeypatch, tmp_path, pin
):
    """LayerRepository consults LOCAL_KERNELS before the Hub with either pin: both load
    offline from an empty cache."""
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    layer = kernels.LayerRepository(REPO_ID, layer_name="GeGLUMLP", **pin).load()
    assert layer.__qualname__ == "GeGLUMLP"
    assert layer.__module__ == f"{fused_geglu.__name__}.layers"


def test_loading_makes_no_network_access(device):
    """A fresh interpreter in which any connection raises loads the build and runs it."""
    script = f"""
        import sys
        from pathlib import Path

        import torch
        from kernels import get_local_kernel

        module = get_local_kernel(Path({str(ROOT)!r}))
        x = torch.randn(4, 8, device={device!r})
        assert torch.isfinite(module.geglu(x, x)).all()
        # DTensor support is lazy: importing torch.distributed.tensor takes about 1 s.
        assert "torch.distributed.tensor" not in sys.modules
    """
    result = run_python(script, no_network=True, HF_HUB_OFFLINE="1", LOCAL_KERNELS=None)
    assert result.returncode == 0, result.stderr


# Each way the interpreter cannot run our kernels: (what the script does before loading
# the package, TRITON_INTERPRET in its environment, the fix the errors name).
UNUSABLE_INTERPRETERS = {
    "set after triton's import": (
        'import torch, triton; os.environ["TRITON_INTERPRET"] = "1"',
        None,
        "set it before the first `import triton`",
    ),
    "Triton 3.6 under NumPy 2.4": (
        'import numpy, torch, triton; triton.__version__, numpy.__version__ = "3.6.0", "2.4.0"',
        "1",
        "install numpy<2.4 or Triton 3.7 or later",
    ),
}


@pytest.mark.parametrize("case", UNUSABLE_INTERPRETERS)
def test_unusable_interpreter_is_named(case):
    """Where the interpreter cannot run our kernels (TRITON_INTERPRET=1 set after triton
    was imported, its library already jitted for the GPU; Triton before 3.7 under NumPy
    2.4, triton-lang/triton#9171): a function refuses CPU tensors and a kernelized layer
    runs its module's own forward with a warning, both naming the fix, instead of
    Triton's error."""
    prelude, interpret, fix = UNUSABLE_INTERPRETERS[case]
    script = f"""
        import os, warnings
        from pathlib import Path
        {prelude}
        from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping
        from kernels import get_local_kernel, replace_kernel_forward_from_hub
        from transformers import GemmaConfig
        from transformers.models.gemma.modeling_gemma import GemmaMLP

        fix = {fix!r}
        module = get_local_kernel(Path({str(ROOT)!r}))
        x = torch.randn(4, 16)
        try:
            module.geglu(x, x)
            raise AssertionError("no error")
        except RuntimeError as error:
            assert fix in str(error), error
        replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
        mlp = torch.nn.Sequential(GemmaMLP(GemmaConfig(hidden_size=16, intermediate_size=24)))
        with torch.no_grad():
            expected = mlp(x)
        layer = LocalLayerRepository(Path({str(ROOT)!r}), layer_name="GeGLUMLP")
        with use_kernel_mapping({{"GeGLUMLP": {{"cpu": layer}}}}, inherit_mapping=False):
            kernelize(mlp, mode=Mode.INFERENCE, device="cpu")
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            got = mlp(x)
        assert any(fix in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert torch.equal(got, expected)
    """
    result = run_python(script, no_network=True, TRITON_INTERPRET=interpret)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(
    "triton_version, numpy_version, fails",
    [
        ("3.6.0", "2.4.0", True),
        ("3.6.1+git0123abc", "2.10.1", True),
        ("3.6.0", "2.3.5", False),
        ("3.7.1", "2.4.6", False),
        ("3.10.0", "2.4.6", False),
    ],
)
def test_interpreter_index_fails(fused_geglu, triton_version, numpy_version, fails):
    """The versions whose interpreter cannot index with a program id (Triton before 3.7,
    NumPy 2.4 or later), compared as numbers: 3.10 is after 3.7."""
    assert (
        fused_geglu.launch.interpreter_index_fails(triton_version, numpy_version)
        is fails
    )
