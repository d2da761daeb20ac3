"""scripts/upload.py without the network: the planned operations against fabricated remote
states, the calls made to a recording stand-in for HfApi, and ``--dry-run`` end to end;
what the release holds by kernels' conventions: the card (CARD.md filled in), the source
on main, and each variant's digest and provenance."""

import base64
import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, run_python
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.hf_api import GitRefInfo, GitRefs, RepoFile, RepoFolder

# huggingface_hub's HTTP client; the GPU image lacks it: the file skips there.
httpx2 = pytest.importorskip(
    "httpx2", reason="scripts/upload.py needs huggingface_hub's httpx2"
)
sys.path.insert(0, str(ROOT / "scripts"))
import upload

# upload.py lists benchmarks/ and names the build's commit through git.
pytestmark = pytest.mark.skipif(
    upload.git_revision() == "nogit", reason="releases are made from a git checkout"
)
REPO_ID = upload.GENERAL["hub"]["repo-id"]
BRANCH = f"v{upload.GENERAL['version']}"
MESSAGE = "fused-geglu v1, build abc1234"


def _refuse(*args, **kwargs):
    raise OSError(f"network access attempted: {args!r}")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", _refuse)
    monkeypatch.setattr(socket, "getaddrinfo", _refuse)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("build")
    return out, upload.build(out)


@pytest.fixture(scope="module")
def targets(built):
    return upload.local_files(*built, BRANCH)


def remote_holding(targets) -> upload.RemoteState:
    """A repository whose branches hold exactly the local files."""
    return upload.RemoteState(
        exists=True,
        branches={t.branch: {f.path: f.git_sha1 for f in t.files} for t in targets},
    )


def plan(targets, remote, dirty=False):
    return upload.plan(targets, remote, repo_id=REPO_ID, message=MESSAGE, dirty=dirty)


def test_local_files(built, targets):
    out, _ = built
    files, card = targets
    assert files.branch == BRANCH and card.branch == "main"
    paths = {f.path for f in files.files}
    for backend in upload.GENERAL["backends"]:
        assert f"build/torch-{backend}/metadata.json" in paths
        assert f"build/torch-{backend}/__init__.py" in paths
    # The interpreter's variant is built for the checkout, never uploaded; one uploaded
    # before is deleted.
    assert "cpu" not in upload.GENERAL["backends"]
    assert not [p for p in paths if p.startswith("build/torch-cpu/")]
    assert "build/torch-cpu/" in files.mirror
    benchmarks = {p for p in paths if p.startswith("benchmarks/")}
    runnable = {
        f"benchmarks/{p.name}" for p in upload.ROOT.glob("benchmarks/benchmark*.py")
    }
    # what `kernels benchmark` runs and their helper: no results, logs or one-off scripts
    assert runnable and benchmarks == runnable | {"benchmarks/bench_lib.py"}
    assert not [p for p in paths if "__pycache__" in p]
    # main: the card (build/CARD.md as README.md), its documents, and the source
    # kernel-builder builds from (the builds name this repository as their source).
    docs = sorted(f"docs/{p.name}" for p in (upload.ROOT / "docs").glob("*.md"))
    main = {f.path: f.source for f in card.files}
    assert main["README.md"] == out / "CARD.md"
    assert docs and set(docs) <= set(main)
    for path in ("build.toml", "flake.nix", "CARD.md"):
        assert main[path] == upload.ROOT / path
    src = upload.ROOT / "torch-ext" / "fused_geglu"
    sources = {
        p.relative_to(upload.ROOT).as_posix()
        for ext in ("py", "json")
        for p in src.rglob(f"*.{ext}")
        if "__pycache__" not in p.parts
        and p.name != "_ops.py"
        and p.relative_to(src).parts[0] != "precompiled"  # build products
    }
    assert sources and {p for p in main if p.startswith("torch-ext/")} == sources
    assert (
        set(main)
        == {"README.md", "build.toml", "flake.nix", "CARD.md"} | set(docs) | sources
    )
    assert card.mirror == ("docs/", "torch-ext/")


def test_source_elsewhere_is_not_uploaded(built, monkeypatch):
    """A build.toml ``source`` outside the Hub repository: main gets the card only."""
    out, variants = built
    github = "https://github.com/someone/fused-geglu"
    monkeypatch.setitem(upload.GENERAL, "source", github)
    assert not upload.source_on_hub(REPO_ID)
    _, card = upload.local_files(out, variants, BRANCH)
    paths = [f.path for f in card.files]
    assert paths[0] == "README.md" and all(p.startswith("docs/") for p in paths[1:])


def test_fresh_repository(targets):
    files, card = targets
    assert plan(targets, upload.RemoteState(exists=False)) == [
        upload.CreateRepo(REPO_ID),
        upload.CreateBranch(BRANCH),
        upload.Upload(BRANCH, files.files, (), MESSAGE),
        upload.Upload("main", card.files, (), MESSAGE),
    ]


def test_existing_repository_and_branch(targets):
    files, card = targets
    remote = upload.RemoteState(
        exists=True, branches={"main": {".gitattributes": "0" * 40}, BRANCH: {}}
    )
    assert plan(targets, remote) == [
        upload.Upload(BRANCH, files.files, (), MESSAGE),
        upload.Upload("main", card.files, (), MESSAGE),
    ]


def test_existing_repository_without_the_branch(targets):
    remote = upload.RemoteState(exists=True, branches={"main": {}})
    assert [type(op) for op in plan(targets, remote)] == [
        upload.CreateBranch,
        upload.Upload,
        upload.Upload,
    ]


def test_unchanged_tree_uploads_nothing(targets):
    files, card = targets
    remote = remote_holding(targets)
    # An LFS file is known by its sha256, not its blob id.
    lfs = files.files[-1]
    remote.branches[BRANCH][lfs.path] = lfs.sha256
    assert plan(targets, remote) == [
        upload.SkipUnchanged(BRANCH, tuple(f.path for f in files.files)),
        upload.SkipUnchanged("main", tuple(f.path for f in card.files)),
    ]


def test_changed_and_stale_files(targets):
    files, card = targets
    remote = remote_holding(targets)
    changed = files.files[0]
    remote.branches[BRANCH][changed.path] = "f" * 40
    remote.branches[BRANCH]["build/torch-cpu/removed.py"] = "e" * 40
    remote.branches[BRANCH]["build/torch-cuda/removed.py"] = "e" * 40
    remote.branches[BRANCH]["benchmarks/old.py"] = "e" * 40
    # Outside the mirrored directories: kept (another tool's variant, the branch's card).
    remote.branches[BRANCH]["build/torch210-cxx11-cu128-x86_64-linux/x.py"] = "e" * 40
    remote.branches[BRANCH]["README.md"] = "e" * 40
    upload_op, skip, skip_card = plan(targets, remote)
    assert upload_op == upload.Upload(
        BRANCH,
        (changed,),
        (
            "benchmarks/old.py",
            "build/torch-cpu/removed.py",
            "build/torch-cuda/removed.py",
        ),
        MESSAGE,
    )
    assert skip.paths == tuple(f.path for f in files.files[1:])
    assert skip_card == upload.SkipUnchanged("main", tuple(f.path for f in card.files))


@pytest.mark.parametrize("dirty", [False, True])
def test_dirty_tree_is_said(targets, dirty):
    operations = plan(targets, upload.RemoteState(exists=False), dirty=dirty)
    uploads = [op for op in operations if isinstance(op, upload.Upload)]
    assert len(uploads) == 2
    for op in uploads:
        assert ("dirty" in op.message) == dirty
        assert ("dirty working tree" in op.describe()) == dirty


def test_describe(targets):
    files, card = targets
    lines = [op.describe() for op in plan(targets, upload.RemoteState(exists=False))]
    assert lines[0] == f"create repo {REPO_ID} (type kernel)"
    assert lines[1] == f"create branch {BRANCH} (from main)"
    assert lines[2].startswith(f'upload {len(files.files)} file(s) to {BRANCH}: "')
    assert f"    + {files.files[0].path}" in lines[2].splitlines()
    assert lines[3].splitlines() == [
        f'upload {len(card.files)} file(s) to main: "{MESSAGE}"',
    ] + [f"    + {f.path}" for f in card.files]


# --- the Hub calls, against a recording stand-in for HfApi -----------------------------


class FakeApi:
    """Records every call; answers the listings from ``branches`` (None: no repository)."""

    def __init__(self, branches):
        self.branches = branches
        self.calls = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            if name == "list_repo_refs":
                if self.branches is None:
                    request = httpx2.Request("GET", "https://hub.invalid/api/kernels")
                    raise RepositoryNotFoundError(
                        "404", response=httpx2.Response(404, request=request)
                    )
                return GitRefs(
                    branches=[
                        GitRefInfo(
                            name=b, ref=f"refs/heads/{b}", target_commit="0" * 40
                        )
                        for b in self.branches
                    ],
                    converts=[],
                    tags=[],
                )
            if name == "list_repo_tree":
                return self.branches[kwargs["revision"]]

        return call


def test_every_call_uses_the_kernel_repo_type(targets):
    api = FakeApi(None)
    remote = upload.fetch_remote_state(api, REPO_ID, [t.branch for t in targets])
    assert remote == upload.RemoteState(exists=False)
    operations = plan(targets, remote)
    upload.execute(api, REPO_ID, operations)
    assert [name for name, _, _ in api.calls] == [
        "list_repo_refs",
        "create_repo",
        "create_branch",
        "create_commit",
        "create_commit",
    ]
    for _, args, kwargs in api.calls:
        assert args == (REPO_ID,) and kwargs["repo_type"] == "kernel"
    _, _, branch_call = api.calls[2]
    assert branch_call["branch"] == BRANCH and branch_call["exist_ok"]
    _, _, commit = api.calls[3]
    assert commit["revision"] == BRANCH and commit["commit_message"] == MESSAGE
    assert [op.path_in_repo for op in commit["operations"]] == [
        f.path for f in operations[2].files
    ]


def test_fetch_remote_state_reads_blob_and_lfs_ids():
    tree = [
        RepoFolder(path="build", oid="1" * 40),
        RepoFile(path="build/torch-cpu/ops.py", size=3, oid="2" * 40),
        RepoFile(
            path="benchmarks/big.json",
            size=9,
            oid="3" * 40,
            lfs={"size": 9, "oid": "4" * 64, "pointerSize": 130},
        ),
    ]
    api = FakeApi({"main": [], BRANCH: tree, "v0": []})
    remote = upload.fetch_remote_state(api, REPO_ID, [BRANCH, "main", "v2"])
    assert remote == upload.RemoteState(
        exists=True,
        branches={
            BRANCH: {
                "build/torch-cpu/ops.py": "2" * 40,
                "benchmarks/big.json": "4" * 64,
            },
            "main": {},
        },
    )
    for name, _, kwargs in api.calls:
        assert kwargs["repo_type"] == "kernel", name


# --- the checks ------------------------------------------------------------------------


def test_checks_catch_a_broken_build(built, tmp_path):
    out, variants = built
    bad = tmp_path / "build"
    shutil.copytree(out, bad)
    cpu, xpu = bad / "torch-cpu", bad / "torch-xpu"
    metadata = json.loads((cpu / "metadata.json").read_text())
    metadata["id"] = "_fused_geglu_cpu_0000000"
    metadata["version"] = 2
    (cpu / "metadata.json").write_text(json.dumps(metadata))
    metadata = json.loads((xpu / "metadata.json").read_text())
    del metadata["license"]
    (xpu / "metadata.json").write_text(json.dumps(metadata))
    (cpu / "extra.py").write_text("from fused_geglu.ops import geglu\nimport ops\n")
    rocm = bad / "torch-rocm"
    (rocm / "ops.py").write_text((rocm / "ops.py").read_text() + "# changed\n")
    metadata = json.loads((rocm / "metadata.json").read_text())
    metadata["provenance"]["kernel"]["commit"] = "0" * 40
    metadata["source"] = "https://huggingface.co/kernels/org/fused-geglu/tree/v1"
    (rocm / "metadata.json").write_text(json.dumps(metadata))
    (bad / "CARD.md").write_text((upload.ROOT / "CARD.md").read_text())
    rev = json.loads((out / "torch-cpu" / "metadata.json").read_text())["id"]
    rev = rev.removeprefix("_fused_geglu_cpu_")
    with pytest.raises(upload.CheckError) as error:
        upload.check(bad, [bad / v.name for v in variants], rev)
    message = str(error.value)
    assert "torch-xpu: kernels cannot read metadata.json" in message
    assert "missing field `license`" in message
    assert "torch-cpu: metadata version 2" in message
    assert f"torch-cpu: id '_fused_geglu_cpu_0000000' does not name {rev}" in message
    assert "torch-cpu/extra.py: absolute import ['fused_geglu.ops', 'ops']" in message
    assert "torch-cpu: digest: Unknown file: extra.py" in message
    assert "torch-rocm: digest: File hash mismatch for ops.py" in message
    assert "torch-rocm: provenance {'commit': '0000" in message
    assert "torch-rocm: metadata source 'https://huggingface.co/kernels/" in message
    assert "CARD.md: not CARD.md filled in for org/fused-geglu" in message
    assert "torch-cuda" not in message


# --- the command line ------------------------------------------------------------------


def run_upload(*args):
    """scripts/upload.py in a fresh interpreter in which every connection raises."""
    script = f"""
        import runpy, sys

        sys.path.insert(0, {str(ROOT / "scripts")!r})
        sys.argv = ["upload.py", *{list(args)!r}]
        runpy.run_path({str(ROOT / "scripts" / "upload.py")!r}, run_name="__main__")
    """
    result = run_python(script, no_network=True, HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def test_dry_run(tmp_path):
    out = tmp_path / "build"
    stdout = run_upload("--dry-run", "--out", str(out))
    dirty = bool(upload.git_status())
    variants = [out / f"torch-{b}" for b in upload.GENERAL["backends"]]
    files, _ = upload.local_files(out, variants, BRANCH)
    lines = stdout.splitlines()
    assert "dry run, nothing sent; remote assumed: no repository yet" in lines
    assert f"  create repo {REPO_ID} (type kernel)" in lines
    assert f"  create branch {BRANCH} (from main)" in lines
    (v_line,) = [
        line for line in lines if line.startswith(f"  upload {len(files.files)}")
    ]
    assert v_line.startswith(f"  upload {len(files.files)} file(s) to {BRANCH}: ")
    assert "      + build/torch-cuda/metadata.json" in lines
    assert not [line for line in lines if "build/torch-cpu/" in line]
    # main: the card, and the source kernel-builder builds (build.toml's `source`)
    for path in ("README.md", "build.toml", "flake.nix", "CARD.md"):
        assert f"      + {path}" in lines
    assert "      + torch-ext/fused_geglu/__init__.py" in lines
    assert (
        "DIRTY working tree: this upload is not a committed state:" in lines
    ) == dirty
    assert ("(dirty working tree)" in v_line) == dirty
    assert f'  fused_geglu = get_kernel("{REPO_ID}", version=1)' in lines


def test_dry_run_against_an_unchanged_remote(tmp_path, targets):
    # The remote holds this tree's files; the build ids name the same commit.
    state = tmp_path / "remote.json"
    state.write_text(
        json.dumps({"exists": True, "branches": remote_holding(targets).branches})
    )
    stdout = run_upload(
        "--dry-run", "--out", str(tmp_path / "build"), "--remote-state", str(state)
    )
    assert "create" not in stdout and "+ " not in stdout
    assert f"  skip {len(targets[0].files)} unchanged file(s) on {BRANCH}" in stdout
    assert "nothing to upload: the Hub holds every file" in stdout


# --- the release's metadata and card, by kernels' conventions ---------------------------


def sha256_files(variant):
    """The digest kernels records (kernel-builder's `hash`), recomputed here: base64
    sha256 of every file by its path in the variant, but metadata.json and bytecode."""
    return {
        path.relative_to(variant).as_posix(): base64.b64encode(
            hashlib.sha256(path.read_bytes()).digest()
        ).decode()
        for path in variant.rglob("*")
        if path.is_file()
        and path.relative_to(variant).as_posix() != "metadata.json"
        and "__pycache__" not in path.parts
    }


def test_digests_cover_every_file(built):
    _, variants = built
    for variant in variants:
        metadata = json.loads((variant / "metadata.json").read_text())
        assert metadata["digest"]["algorithm"] == "sha256"
        files = sha256_files(variant)
        assert "_ops.py" in files and "tuning_NVIDIA_H200.json" in files
        assert metadata["digest"]["files"] == files, variant.name
        # kernels' own check, as its loaders run it
        parsed = upload.Metadata.read_from_file(variant / "metadata.json")
        assert upload.digest_problem(variant, parsed) is None


def test_kernels_refuses_a_changed_file(built, tmp_path):
    """get_local_kernel verifies the files it loads against the digest: a changed file,
    or one the build did not have, and the variant does not load."""
    from kernels import get_local_kernel

    out, _ = built
    for change in ("edit", "add"):
        checkout = tmp_path / change
        shutil.copytree(out, checkout / "build")
        cpu = checkout / "build" / "torch-cpu"
        if change == "edit":
            (cpu / "ops.py").write_text((cpu / "ops.py").read_text() + "# changed\n")
            expected = "File hash mismatch for ops.py"
        else:
            (cpu / "extra.py").write_text("")
            expected = "Unknown file: extra.py"
        with pytest.raises(RuntimeError, match="do not match the digest") as error:
            get_local_kernel(checkout, backend="cpu")
        assert expected in str(error.value)


def test_provenance_names_the_commit(built):
    _, variants = built
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"],
        cwd=upload.ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    for variant in variants:
        metadata = json.loads((variant / "metadata.json").read_text())
        provenance = metadata["provenance"]
        # kernels requires a kernel-builder entry; it names the builder that ran
        assert provenance["kernel-builder"] == {"version": "scripts/build.py"}
        assert provenance["kernel"]["commit"] == head
        # the id's `_dirty` and the provenance's flag say the same
        assert provenance["kernel"]["dirty"] == metadata["id"].endswith("_dirty")
        parsed = upload.Metadata.read_from_file(variant / "metadata.json")
        assert str(parsed.provenance.kernel.commit) == head


def test_source_and_upstream(built):
    """`source`: a repository `git clone` takes, holding build.toml and flake.nix (the
    Hub repository, main branch: test_local_files); no `upstream`, the kernel is not a
    copy of another repository's."""
    _, variants = built
    source = f"https://huggingface.co/kernels/{REPO_ID}"
    assert upload.GENERAL["source"] == source and "upstream" not in upload.GENERAL
    for variant in variants:
        metadata = json.loads((variant / "metadata.json").read_text())
        assert metadata["source"] == source and "upstream" not in metadata
        assert "/tree/" not in metadata["source"]


def test_card(built, targets):
    """build/CARD.md: CARD.md filled in as kernel-builder's fill-card fills it."""
    out, _ = built
    card = (out / "CARD.md").read_text()
    assert card.startswith("---\nlibrary_name: kernels\nlicense: apache-2.0\n")
    assert "{{" not in card and "{%" not in card
    assert f'get_kernel("{REPO_ID}", version=1, trust_remote_code=trust)' in card
    init = (upload.ROOT / "torch-ext" / "fused_geglu" / "__init__.py").read_text()
    (names,) = re.findall(r"__all__ = \[(.*?)\]", init, re.DOTALL)
    functions = [n for n in re.findall(r'"(\w+)"', names) if n != "layers"]
    section = card.split("## Available functions\n\n")[1].split("\n\n")[0]
    assert section.splitlines() == [f"- `{name}`" for name in functions]
    layers = card.split("## Available layers\n\n")[1].split("\n\n")[0]
    assert "- `GeGLUMLP`" in layers.splitlines()
    backends = " and ".join(
        ", ".join(f"`{b}`" for b in upload.GENERAL["backends"]).rsplit(", ", 1)
    )
    assert f"Backends {backends} " in card
    assert f"git clone https://huggingface.co/kernels/{REPO_ID}\n" in card
    assert f"kernels benchmark {REPO_ID} --version 1" in card
    # relative links resolve on main, where the card sits beside what it links
    _, main = targets
    on_main = {f.path for f in main.files}
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", card):
        if not re.match(r"\w+://", target):
            assert target in on_main, target
