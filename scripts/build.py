"""Write build/torch-<backend>/ for every backend in build.toml, as kernel-builder's noarch
build does: the package's Python files, a generated ``_ops.py`` whose op namespace is unique
to this build, and ``metadata.json``. Usage:
``python scripts/build.py [--out build] [--repo-id owner/name]``."""

import argparse
import json
import shutil
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HUB = "https://huggingface.co"

OPS_PY = '''import torch

ops = torch.ops.{ops_name}


def add_op_namespace_prefix(op_name: str) -> str:
    """Prefix op by namespace."""
    return f"{ops_name}::{{op_name}}"
'''


def git_revision() -> str:
    """Short commit hash, with ``_dirty`` when tracked files differ from it."""
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if not rev:
        return "nogit"
    dirty = (
        subprocess.run(
            ["git", "diff", "--quiet", "HEAD"], cwd=ROOT, check=False
        ).returncode
        != 0
    )
    return f"{rev}_dirty" if dirty else rev


def hub_urls(repo_id: str, version: int) -> dict[str, str]:
    """metadata.json's ``upstream`` and ``source`` (``kernels info`` prints them): the
    kernel repository on the Hub, where this kernel is developed and published (there is
    no third-party upstream), and its ``v<version>`` branch, which holds this build's
    Python sources (a noarch Triton build ships its source as is)."""
    repo = f"{HUB}/kernels/{repo_id}"
    return {"upstream": repo, "source": f"{repo}/tree/v{version}"}


def build(out: Path, repo_id: str | None = None) -> list[Path]:
    """``repo_id`` (default: build.toml's ``[general.hub] repo-id``) names the Hub
    repository in the metadata."""
    config = tomllib.loads((ROOT / "build.toml").read_text())
    general = config["general"]
    # the file types the noarch build ships (kernel-builder's pyext): sources and tables
    pyext = config.get("torch-noarch", {}).get("pyext", ["py"])
    urls = hub_urls(repo_id or general["hub"]["repo-id"], general["version"])
    python_name = general["name"].replace("-", "_")
    src = ROOT / "torch-ext" / python_name
    rev = git_revision()
    variants = []
    for backend in general["backends"]:
        variant = out / f"torch-{backend}"
        if variant.exists():
            shutil.rmtree(variant)
        variant.mkdir(parents=True)
        files = sorted(f for ext in pyext for f in src.glob(f"*.{ext}"))
        for file in files:
            if file.name != "_ops.py":
                shutil.copy2(file, variant / file.name)
        build_id = f"_{python_name}_{backend}_{rev}"
        (variant / "_ops.py").write_text(OPS_PY.format(ops_name=build_id))
        metadata = {
            "name": general["name"],
            "id": build_id,
            "version": general["version"],
            "license": general["license"],
            **urls,
            "backend": {"type": backend},
            "python-depends": [],
        }
        (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        variants.append(variant)
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
