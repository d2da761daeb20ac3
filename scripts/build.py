"""Write build/torch-<backend>/ for every backend in build.toml, as kernel-builder's noarch
build does: the package's Python files, a generated ``_ops.py`` whose op namespace is unique
to this build, and ``metadata.json``. Usage: ``python scripts/build.py [--out build]``."""

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent

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


def build(out: Path) -> list[Path]:
    general = tomllib.loads((ROOT / "build.toml").read_text())["general"]
    python_name = general["name"].replace("-", "_")
    src = ROOT / "torch-ext" / python_name
    rev = git_revision()
    variants = []
    for backend in general["backends"]:
        variant = out / f"torch-{backend}"
        if variant.exists():
            shutil.rmtree(variant)
        variant.mkdir(parents=True)
        for file in sorted(src.glob("*.py")):
            if file.name != "_ops.py":
                shutil.copy2(file, variant / file.name)
        build_id = f"_{python_name}_{backend}_{rev}"
        (variant / "_ops.py").write_text(OPS_PY.format(ops_name=build_id))
        metadata = {
            "name": general["name"],
            "id": build_id,
            "version": general["version"],
            "license": general["license"],
            "backend": {"type": backend},
            "python-depends": [],
        }
        (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        variants.append(variant)
    return variants


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "build")
    for variant in build(parser.parse_args().out):
        print(
            f"wrote {variant.relative_to(ROOT) if variant.is_relative_to(ROOT) else variant}"
        )
