"""Write build/ as kernel-builder's noarch build does: ``torch-<backend>/`` for every
backend in build.toml (the package's files, a generated ``_ops.py`` whose op namespace is
unique to this build, and ``metadata.json`` with the digest of the variant's files and the
build's provenance), ``torch-cpu/`` for the Triton interpreter (tests and development
only: the upload leaves it out), and ``CARD.md``, the card template CARD.md filled in.
Usage: ``python scripts/build.py [--out build] [--repo-id owner/name]``."""

import argparse
import ast
import base64
import hashlib
import json
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
HUB = "https://huggingface.co"
# Built beside build.toml's backends, for this checkout only: on the CPU the kernels run
# only in the Triton interpreter (TRITON_INTERPRET=1 before triton is imported), a testing
# mode, so the published build does not claim the CPU (docs/development.md#backends).
LOCAL_BACKENDS = ("cpu",)
# metadata.json's provenance names the builder that made the build; kernel-builder did not.
BUILDER = "scripts/build.py"
DIGEST_ALGORITHM = "sha256"

OPS_PY = '''import torch

ops = torch.ops.{ops_name}


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"{ops_name}::{{op_name}}"
'''


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


class GitState(NamedTuple):
    commit: str  # the full object id of HEAD
    dirty: bool  # tracked files differ from HEAD, or untracked files would ship


def git_state() -> GitState | None:
    """HEAD and whether this build differs from it; None outside a git checkout."""
    commit = _git("rev-parse", "HEAD").stdout.strip()
    if not commit:
        return None
    untracked = _git("ls-files", "--others", "--exclude-standard", "--", "torch-ext")
    dirty = _git("diff", "--quiet", "HEAD").returncode != 0 or bool(
        untracked.stdout.strip()
    )
    return GitState(commit, dirty)


def git_revision() -> str:
    """The build id's suffix: the short commit hash, with ``_dirty`` when the build
    differs from it; ``nogit`` outside a git checkout."""
    state = git_state()
    if state is None:
        return "nogit"
    short = _git("rev-parse", "--short", state.commit).stdout.strip()
    return f"{short}_dirty" if state.dirty else short


def hub_repo_url(repo_id: str) -> str:
    """The kernel repository on the Hub; also what ``git clone`` takes."""
    return f"{HUB}/kernels/{repo_id}"


def source_url(general: dict, repo_id: str | None = None) -> str | None:
    """metadata.json's ``source``: build.toml's (a repository ``git clone`` takes, holding
    build.toml and flake.nix). Where that is build.toml's Hub repository, whose ``main``
    branch the upload fills with the source, ``repo_id`` (an upload elsewhere) replaces it."""
    source = general.get("source")
    if repo_id and source == hub_repo_url(general["hub"]["repo-id"]):
        return hub_repo_url(repo_id)
    return source


def variant_digest(variant: Path) -> dict:
    """The ``digest`` kernels verifies a variant's files against when it loads it: the
    base64 sha256 of every file by its path in the variant, but metadata.json (which
    holds the digest) and its signature at the top, and Python bytecode."""
    files = {}
    for path in sorted(variant.rglob("*")):
        relative = path.relative_to(variant)
        if (
            not path.is_file()
            or relative.as_posix() in ("metadata.json", "metadata.json.sigstore")
            or "__pycache__" in relative.parts
            or path.suffix == ".pyc"
        ):
            continue
        digest = hashlib.new(DIGEST_ALGORITHM, path.read_bytes()).digest()
        files[relative.as_posix()] = base64.b64encode(digest).decode()
    return {"algorithm": DIGEST_ALGORITHM, "files": files}


def provenance(state: GitState | None) -> dict:
    """The sources' git state (no ``kernel`` entry outside a git checkout) and the
    builder, which kernels requires: this script, not kernel-builder."""
    result: dict = {"kernel-builder": {"version": BUILDER}}
    if state is not None:
        result["kernel"] = {"commit": state.commit, "dirty": state.dirty}
    return result


def source_files(src: Path, pyext: list[str]) -> list[Path]:
    """The package's files a noarch build ships (kernel-builder's ``pyext``), in
    subpackages too; not the generated ``_ops.py`` or bytecode."""
    return sorted(
        path
        for ext in pyext
        for path in src.rglob(f"*.{ext}")
        if "__pycache__" not in path.relative_to(src).parts
        and path.relative_to(src) != Path("_ops.py")
    )


# --- the card: CARD.md filled in as kernel-builder's `fill-card` fills it ---------------


def _literal_all(init: Path) -> list[str]:
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            getattr(target, "id", None) == "__all__" for target in node.targets
        ):
            return list(ast.literal_eval(node.value))
    return []


def card_context(general: dict, repo_id: str, source: str | None) -> dict:
    """The variables kernel-builder gives the template: ``functions`` (``__all__`` but
    ``layers``), ``layers`` (the classes defined in layers.py when ``__all__`` names
    ``layers``), ``has_benchmark`` (benchmarks/benchmark.py exists) and build.toml's."""
    src = ROOT / "torch-ext" / general["name"].replace("-", "_")
    names = _literal_all(src / "__init__.py")
    layers = None
    if "layers" in names and (src / "layers.py").exists():
        tree = ast.parse((src / "layers.py").read_text())
        layers = [n.name for n in tree.body if isinstance(n, ast.ClassDef)] or None
    return {
        "repo_id": repo_id,
        "version": general["version"],
        "functions": [n for n in names if n != "layers"] or None,
        "layers": layers,
        "has_benchmark": (ROOT / "benchmarks" / "benchmark.py").exists(),
        "upstream": general.get("upstream"),
        "source": source,
        "license": general["license"].lower(),
    }


def render_card(template: str, context: dict) -> str:
    """kernel-builder renders with minijinja (``trim_blocks``); jinja2 (torch's
    dependency) renders the same template syntax alike."""
    import jinja2

    env = jinja2.Environment(
        trim_blocks=True, undefined=jinja2.StrictUndefined, keep_trailing_newline=True
    )
    return env.from_string(template).render(context)


# --- the build ----------------------------------------------------------------------------


def build(out: Path, repo_id: str | None = None) -> list[Path]:
    """Writes ``out`` and returns its variants, build.toml's backends first. ``repo_id``
    (default: build.toml's ``[general.hub] repo-id``) is the Hub repository the card
    names (and ``source``, where that is the Hub repository)."""
    config = tomllib.loads((ROOT / "build.toml").read_text())
    general = config["general"]
    # the file types the noarch build ships (kernel-builder's pyext): sources and tables
    pyext = config.get("torch-noarch", {}).get("pyext", ["py"])
    repo_id = repo_id or general["hub"]["repo-id"]
    source = source_url(general, repo_id)
    python_name = general["name"].replace("-", "_")
    src = ROOT / "torch-ext" / python_name
    state = git_state()
    rev = git_revision()
    backends = list(general["backends"])
    backends += [b for b in LOCAL_BACKENDS if b not in backends]
    variants = []
    for backend in backends:
        variant = out / f"torch-{backend}"
        if variant.exists():
            shutil.rmtree(variant)
        variant.mkdir(parents=True)
        for file in source_files(src, pyext):
            if backend != "cuda" and file.relative_to(src).parts[0] == "precompiled":
                continue  # CUDA binaries (make precompile): the CUDA variant's only
            target = variant / file.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, target)
        build_id = f"_{python_name}_{backend}_{rev}"
        (variant / "_ops.py").write_text(OPS_PY.format(ops_name=build_id))
        metadata = {
            "name": general["name"],
            "id": build_id,
            "version": general["version"],
            "license": general["license"],
            # build.toml's, as kernel-builder writes them: absent when not given (this
            # kernel has no upstream, it copies no other repository's code)
            **({"upstream": general["upstream"]} if "upstream" in general else {}),
            **({"source": source} if source else {}),
            "backend": {"type": backend},
            "python-depends": [],
            "digest": variant_digest(variant),
            "provenance": provenance(state),
        }
        (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        variants.append(variant)
    card = render_card(
        (ROOT / "CARD.md").read_text(), card_context(general, repo_id, source)
    )
    (out / "CARD.md").write_text(card)
    return variants


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "build")
    parser.add_argument("--repo-id", help="the Hub repository (default: build.toml's)")
    args = parser.parse_args()
    for variant in build(args.out, args.repo_id):
        print(
            f"wrote {variant.relative_to(ROOT) if variant.is_relative_to(ROOT) else variant}"
        )
