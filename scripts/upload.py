"""Release the kernel to the Hub (``make upload``): build build/, check it, then bring the
Hub's kernel repository up to date. The repository and its ``v<version>`` branch are
created when missing; build.toml's variants and the benchmarks ``kernels benchmark`` runs
go to that branch; to ``main`` the card (CARD.md filled in, as README.md), docs/ and, where
build.toml's ``source`` is the Hub repository, the source kernel-builder builds
(build.toml, flake.nix, CARD.md, torch-ext/); files whose content the Hub already has are
skipped.

``--dry-run`` does everything but the network and prints the operations, planned against
a repository that does not exist yet or against ``--remote-state FILE`` (JSON:
``{"exists": true, "branches": {"v1": {"<path>": "<git blob id or LFS sha256>"}}}``).
``--record-api`` rewrites api/public_api.json (see tests/test_api_version.py).
The token comes from huggingface_hub's usual sources (``HF_TOKEN``, ``hf auth login``).
"""

import argparse
import ast
import hashlib
import inspect
import json
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.hf_api import RepoFile
from kernels import Metadata, get_local_kernel

from build import (
    LOCAL_BACKENDS,
    ROOT,
    build,
    git_revision,
    git_state,
    hub_repo_url,
    source_files,
    source_url,
)

CONFIG = tomllib.loads((ROOT / "build.toml").read_text())
GENERAL = CONFIG["general"]
PYTHON_NAME = GENERAL["name"].replace("-", "_")
API_RECORD = ROOT / "api" / "public_api.json"
MAIN = "main"
# The documents the card links, on MAIN beside it.
DOCS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
# What kernel-builder needs to build the kernel (build.toml's ``source`` must hold
# build.toml and flake.nix), and the card's template; torch-ext/ comes with them.
SOURCE = ["build.toml", "flake.nix", "CARD.md"]
# The variants uploaded: build.toml's backends (build/ also holds LOCAL_BACKENDS').
PUBLISHED = tuple(f"torch-{backend}" for backend in GENERAL["backends"])
# huggingface_hub 2.x knows the "kernel" repository type (constants.REPO_TYPE_KERNEL) for
# create_repo, create_branch, create_commit and the listings; kernels 0.17 resolves
# versions and downloads builds with repo_type="kernel", so releases go there.
REPO_TYPE = "kernel"


# --- the plan: pure functions of the local files and the remote state ------------------


@dataclass(frozen=True)
class LocalFile:
    path: str  # in the repository
    source: Path
    git_sha1: str  # the Hub's blob id for a regular file
    sha256: str  # the Hub's id for an LFS file

    @classmethod
    def read(cls, path: str, source: Path) -> "LocalFile":
        data = source.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return cls(path, source, blob, hashlib.sha256(data).hexdigest())


@dataclass(frozen=True)
class BranchFiles:
    """What a branch must hold: ``files``, and nothing else under the ``mirror`` prefixes."""

    branch: str
    files: tuple[LocalFile, ...]
    mirror: tuple[str, ...] = ()


@dataclass(frozen=True)
class RemoteState:
    exists: bool
    # branch -> path -> git blob id, or sha256 for an LFS file
    branches: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class CreateRepo:
    repo_id: str

    def describe(self) -> str:
        return f"create repo {self.repo_id} (type {REPO_TYPE})"


@dataclass(frozen=True)
class CreateBranch:
    branch: str

    def describe(self) -> str:
        return f"create branch {self.branch} (from {MAIN})"


@dataclass(frozen=True)
class Upload:
    """One commit: ``files`` added or replaced, ``deletes`` removed."""

    branch: str
    files: tuple[LocalFile, ...]
    deletes: tuple[str, ...]
    message: str

    def describe(self) -> str:
        head = f"upload {len(self.files)} file(s) to {self.branch}"
        if self.deletes:
            head += f", delete {len(self.deletes)}"
        lines = [f'{head}: "{self.message}"']
        lines += [f"    + {f.path}" for f in self.files]
        lines += [f"    - {path}" for path in self.deletes]
        return "\n".join(lines)


@dataclass(frozen=True)
class SkipUnchanged:
    branch: str
    paths: tuple[str, ...]

    def describe(self) -> str:
        return f"skip {len(self.paths)} unchanged file(s) on {self.branch}"


Operation = CreateRepo | CreateBranch | Upload | SkipUnchanged


def plan(
    local_files: Sequence[BranchFiles],
    remote: RemoteState,
    *,
    repo_id: str,
    message: str,
    dirty: bool,
) -> list[Operation]:
    """The operations that make ``remote`` hold ``local_files``, in order."""
    if dirty:
        message += " (dirty working tree)"
    operations: list[Operation] = [] if remote.exists else [CreateRepo(repo_id)]
    for target in local_files:
        if target.branch != MAIN and target.branch not in remote.branches:
            operations.append(CreateBranch(target.branch))
        remote_files = remote.branches.get(target.branch, {})
        changed = tuple(
            f
            for f in target.files
            if remote_files.get(f.path) not in (f.git_sha1, f.sha256)
        )
        local_paths = {f.path for f in target.files}
        deletes = tuple(
            sorted(
                path
                for path in remote_files
                if path.startswith(target.mirror) and path not in local_paths
            )
        )
        if changed or deletes:
            operations.append(Upload(target.branch, changed, deletes, message))
        if unchanged := tuple(f.path for f in target.files if f not in changed):
            operations.append(SkipUnchanged(target.branch, unchanged))
    return operations


# --- the local side ----------------------------------------------------------------------


def benchmark_files() -> list[Path]:
    """What ``kernels benchmark`` runs (benchmarks/benchmark*.py) and the helper module
    they import; not the GPU comparison scripts or their results."""
    here = ROOT / "benchmarks"
    return sorted(here.glob("benchmark*.py")) + [here / "bench_lib.py"]


def source_on_hub(repo_id: str) -> bool:
    """Whether the builds name the Hub repository as their ``source``: then its main
    branch must hold the source (``git clone`` of the repository checks out main)."""
    return source_url(GENERAL, repo_id) == hub_repo_url(repo_id)


def main_files(out: Path, repo_id: str) -> list[LocalFile]:
    """The card (build/CARD.md, as README.md), the documents it links and, where the
    Hub repository is the source, what kernel-builder builds from (not the kernels
    `make precompile` compiled: build products, shipped in the CUDA build)."""
    files = [LocalFile.read("README.md", out / "CARD.md")]
    files += [LocalFile.read(path, ROOT / path) for path in DOCS]
    if source_on_hub(repo_id):
        files += [LocalFile.read(path, ROOT / path) for path in SOURCE]
        pyext = CONFIG.get("torch-noarch", {}).get("pyext", ["py"])
        src = ROOT / "torch-ext" / PYTHON_NAME
        files += [
            LocalFile.read(path.relative_to(ROOT).as_posix(), path)
            for path in source_files(src, pyext)
            if path.relative_to(src).parts[0] != "precompiled"
        ]
    return files


def local_files(
    out: Path,
    variants: Sequence[Path],
    branch: str,
    repo_id: str = GENERAL["hub"]["repo-id"],
) -> list[BranchFiles]:
    """build.toml's variants and the benchmark files for ``branch``, main's files (see
    main_files); stale files under the mirrored folders get deleted, a LOCAL_BACKENDS
    variant's too."""
    files = [
        LocalFile.read(f"build/{path.relative_to(out).as_posix()}", path)
        for variant in variants
        if variant.name in PUBLISHED
        for path in sorted(variant.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    ]
    files += [
        LocalFile.read(f"benchmarks/{path.name}", path) for path in benchmark_files()
    ]
    built = {variant.name for variant in variants}
    mirror = tuple(
        f"build/{name}/"
        for name in sorted(built | {f"torch-{b}" for b in LOCAL_BACKENDS})
    ) + ("benchmarks/",)
    return [
        BranchFiles(branch, tuple(files), mirror),
        BranchFiles(MAIN, tuple(main_files(out, repo_id)), ("docs/", "torch-ext/")),
    ]


def git_status() -> list[str]:
    """``git status --porcelain``: no lines when the working tree is clean."""
    return subprocess.run(
        ["git", "status", "--porcelain"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()


class CheckError(Exception):
    pass


def absolute_package_imports(source: str) -> list[str]:
    """Imports of the package or its modules by absolute name (a build must import itself
    relatively: kernels loads each build under its own module name)."""
    src = ROOT / "torch-ext" / PYTHON_NAME
    modules = {p.stem for p in src.glob("*.py")}
    subpackages = {p.name for p in src.iterdir() if p.is_dir()} - {"__pycache__"}
    own = {PYTHON_NAME, "_ops"} | modules | subpackages
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in own]
    return found


def check(
    out: Path,
    variants: Sequence[Path],
    rev: str,
    repo_id: str = GENERAL["hub"]["repo-id"],
) -> list[str]:
    """Checks the build as users get it and returns the variants loaded through kernels;
    raises CheckError listing every problem."""
    problems = []
    backends = list(GENERAL["backends"])
    backends += [b for b in LOCAL_BACKENDS if b not in backends]
    expected = {f"torch-{backend}" for backend in backends}
    if {v.name for v in variants} != expected:
        problems.append(f"variants {sorted(v.name for v in variants)} != {expected}")
    state = git_state()
    for variant in variants:
        backend = variant.name.removeprefix("torch-")
        try:  # kernels requires every key build.py writes
            metadata = Metadata.read_from_file(variant / "metadata.json")
        except ValueError as error:
            problems.append(
                f"{variant.name}: kernels cannot read metadata.json: {error}"
            )
            continue
        raw = json.loads((variant / "metadata.json").read_text())
        for key in ("name", "version", "license"):
            if raw.get(key) != GENERAL[key]:
                problems.append(f"{variant.name}: metadata {key} {raw.get(key)!r}")
        wanted = {"upstream": GENERAL.get("upstream")}
        wanted["source"] = source_url(GENERAL, repo_id)
        for key, url in wanted.items():
            if raw.get(key) != url:
                problems.append(f"{variant.name}: metadata {key} {raw.get(key)!r}")
        if raw.get("backend") != {"type": backend}:
            problems.append(f"{variant.name}: metadata backend {raw.get('backend')}")
        if raw.get("id") != f"_{PYTHON_NAME}_{backend}_{rev}":
            problems.append(f"{variant.name}: id {raw.get('id')!r} does not name {rev}")
        if problem := digest_problem(variant, metadata):
            problems.append(f"{variant.name}: {problem}")
        kernel = raw.get("provenance", {}).get("kernel")
        if state is not None and kernel != dict(state._asdict()):
            problems.append(f"{variant.name}: provenance {kernel} is not {state}")
        for source in sorted(variant.rglob("*.py")):
            if found := absolute_package_imports(source.read_text()):
                name = source.relative_to(variant).as_posix()
                problems.append(f"{variant.name}/{name}: absolute import {found}")
    card = (out / "CARD.md").read_text() if (out / "CARD.md").exists() else ""
    if f'get_kernel("{repo_id}"' not in card or "{{" in card or "{%" in card:
        problems.append(f"CARD.md: not CARD.md filled in for {repo_id}")
    if problems:
        raise CheckError("\n".join(problems))

    # The current backend's variant and the CPU one: those this machine can import.
    current = get_local_kernel(out)
    modules = {current, get_local_kernel(out, backend="cpu")}
    loaded = sorted(Path(module.__file__).parent.name for module in modules)
    for module in modules:
        variant = Path(module.__file__).parent
        if module.__name__ != json.loads((variant / "metadata.json").read_text())["id"]:
            problems.append(f"{variant.name}: loaded as {module.__name__}")
        if missing := [name for name in module.__all__ if not hasattr(module, name)]:
            problems.append(f"{variant.name}: __all__ names missing: {missing}")
    if not problems:
        api = public_api(current)
        if problem := api_problem(read_api_record(), api, GENERAL["version"]):
            problems.append(problem)
    if problems:
        raise CheckError("\n".join(problems))
    return loaded


def digest_problem(variant: Path, metadata: Metadata) -> str | None:
    """What kernels' verification of the variant's files against metadata.json's digest
    finds (its loaders refuse such a variant), or None: kernels' own check, on every
    variant, not only those this machine loads."""
    # kernels' Rust core (kernels 0.19; imported here, so that importing this module
    # needs no particular kernels release)
    from kernels._rust import Digest, DigestValidationError

    expected = metadata.digest
    if expected is None:
        return "metadata.json has no digest"
    try:
        expected.validate(Digest.hash_variant(expected.algorithm, variant))
    except DigestValidationError as error:
        return "digest: " + "; ".join(str(v) for v in error.violations)
    return None


# --- the public API record (tests/test_api_version.py) ----------------------------------

RECORD_CMD = "`python scripts/upload.py --record-api`"


def public_api(module) -> dict[str, str]:
    """Every name of ``__all__`` (a callable's signature, else its type) and the forward
    signature of every layer (nn.Module subclass) defined in ``layers``."""
    api = {}
    for name in module.__all__:
        obj = getattr(module, name)
        api[name] = str(inspect.signature(obj)) if callable(obj) else type(obj).__name__
    layers = module.layers
    for name, obj in vars(layers).items():
        if (
            isinstance(obj, type)
            and issubclass(obj, torch.nn.Module)
            and obj.__module__ == layers.__name__
        ):
            api[f"layers.{name}.forward"] = str(inspect.signature(obj.forward))
    return dict(sorted(api.items()))


def read_api_record(path: Path = API_RECORD) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def breaking_changes(
    record: dict | None, api: dict[str, str], version: int
) -> list[str]:
    """What ``api`` removes or changes from ``record`` without a version bump."""
    if record is None or version > record["version"]:
        return []
    if version < record["version"]:
        return [f"version: {record['version']} -> {version} (versions only go up)"]
    old = record["api"]
    return [
        f"{name}: {old[name]} -> {api.get(name, '(removed)')}"
        for name in sorted(old)
        if api.get(name) != old[name]
    ]


def api_problem(record: dict | None, api: dict[str, str], version: int) -> str | None:
    """What to do so that the record holds ``api`` at ``version``; None when it does."""
    redo = f"run {RECORD_CMD} and commit {API_RECORD.relative_to(ROOT)}"
    if record == {"version": version, "api": api}:
        return None
    if record is None:
        return f"{API_RECORD.relative_to(ROOT)} is missing: {redo}"
    if broken := breaking_changes(record, api, version):
        return (
            f"the public API of version {version} changed incompatibly:\n  "
            + "\n  ".join(broken)
            + f"\nCode pinned to version={version} would break. Either bump `version` in "
            f"build.toml to {version + 1} (a new v{version + 1} branch on the Hub), then "
            f"{redo}; or restore these entries (add new names beside them). An entry "
            "that was never released may be deleted from the record by hand."
        )
    if version > record["version"]:
        return (
            f"build.toml says version {version}, the record {record['version']}: {redo}"
        )
    added = sorted(api.keys() - record["api"].keys())
    return (
        f"new public API entries {added}: additions are backwards compatible and need "
        f"no version bump; {redo}"
    )


def record_api(module, version: int, path: Path = API_RECORD) -> dict:
    """Writes the record of ``module``'s API; refuses a breaking change without a bump."""
    record = read_api_record(path)
    api = public_api(module)
    if breaking_changes(record, api, version):
        raise CheckError(api_problem(record, api, version))
    path.parent.mkdir(exist_ok=True)
    new = {"version": version, "api": api}
    path.write_text(json.dumps(new, indent=2) + "\n")
    return new


# --- the Hub ------------------------------------------------------------------------------


def fetch_remote_state(
    api: HfApi, repo_id: str, branches: Sequence[str]
) -> RemoteState:
    try:
        refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    except RepositoryNotFoundError:
        return RemoteState(exists=False)
    existing = {ref.name for ref in refs.branches}
    return RemoteState(
        exists=True,
        branches={
            branch: {
                entry.path: entry.lfs.sha256 if entry.lfs else entry.blob_id
                for entry in api.list_repo_tree(
                    repo_id, recursive=True, revision=branch, repo_type=REPO_TYPE
                )
                if isinstance(entry, RepoFile)
            }
            for branch in branches
            if branch in existing
        },
    )


def execute(api: HfApi, repo_id: str, operations: Sequence[Operation]) -> None:
    for op in operations:
        match op:
            case CreateRepo():
                api.create_repo(repo_id, repo_type=REPO_TYPE, exist_ok=True)
            case CreateBranch():
                api.create_branch(
                    repo_id, branch=op.branch, repo_type=REPO_TYPE, exist_ok=True
                )
            case Upload():
                api.create_commit(
                    repo_id,
                    operations=[
                        CommitOperationAdd(
                            path_in_repo=f.path, path_or_fileobj=f.source
                        )
                        for f in op.files
                    ]
                    + [CommitOperationDelete(path_in_repo=p) for p in op.deletes],
                    commit_message=op.message,
                    revision=op.branch,
                    repo_type=REPO_TYPE,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo-id", default=GENERAL["hub"]["repo-id"])
    parser.add_argument("--dry-run", action="store_true", help="no network")
    parser.add_argument("--remote-state", type=Path, help="with --dry-run: JSON file")
    parser.add_argument("--out", type=Path, default=ROOT / "build", help="build dir")
    parser.add_argument("--record-api", action="store_true", help=f"write {API_RECORD}")
    args = parser.parse_args()
    if args.remote_state and not args.dry_run:
        parser.error("--remote-state needs --dry-run")
    version = GENERAL["version"]

    if args.record_api:
        build(args.out)
        try:
            record = record_api(get_local_kernel(args.out), version)
        except CheckError as error:
            sys.exit(str(error))
        print(f"recorded {len(record['api'])} API entries of version {version}")
        return

    rev = git_revision()
    if rev == "nogit":
        sys.exit("not a git checkout: a release's build id names its commit")
    variants = build(args.out, args.repo_id)
    try:
        loaded = check(args.out, variants, rev, args.repo_id)
    except CheckError as error:
        sys.exit(f"checks failed, nothing uploaded:\n{error}")

    branch = f"v{version}"
    print(f"{GENERAL['name']} version {version}, build {rev}")
    published = [v for v in variants if v.name in PUBLISHED]
    on_main = "card and source" if source_on_hub(args.repo_id) else "card"
    print(
        f"-> {REPO_TYPE} repository {args.repo_id}, branch {branch} ({on_main} on {MAIN})"
    )
    print(
        f"checked {len(variants)} variants (metadata, digests, provenance, build ids, "
        f"relative imports); loaded {', '.join(loaded)} with kernels.get_local_kernel; "
        f"uploading {', '.join(v.name for v in published)}"
    )
    if status := git_status():
        print("DIRTY working tree: this upload is not a committed state:")
        print("\n".join(f"  {line}" for line in status))

    targets = local_files(args.out, variants, branch, args.repo_id)
    if args.dry_run:
        if args.remote_state:
            state = json.loads(args.remote_state.read_text())
            remote = RemoteState(state["exists"], state.get("branches", {}))
            print(f"dry run, nothing sent; remote state from {args.remote_state}")
        else:
            remote = RemoteState(exists=False)
            print("dry run, nothing sent; remote assumed: no repository yet")
    else:
        api = HfApi()
        remote = fetch_remote_state(api, args.repo_id, [t.branch for t in targets])
    operations = plan(
        targets,
        remote,
        repo_id=args.repo_id,
        message=f"{GENERAL['name']} v{version}, build {rev}",
        dirty=bool(status),
    )
    print("operations:")
    print("\n".join(textwrap.indent(op.describe(), "  ") for op in operations))
    if all(isinstance(op, SkipUnchanged) for op in operations):
        print("nothing to upload: the Hub holds every file")
    if not args.dry_run:
        execute(api, args.repo_id, operations)
        print(f"done: {api.endpoint}/kernels/{args.repo_id}")
    print(
        "load it with:\n"
        "  from kernels import get_kernel\n"
        f'  {PYTHON_NAME} = get_kernel("{args.repo_id}", version={version})\n'
        f"unless {args.repo_id.split('/')[0]} is a trusted kernel publisher, add "
        f'trust_remote_code=["{args.repo_id}"]'
    )


if __name__ == "__main__":
    main()
