"""Version discipline: code pinned to ``version=N`` keeps working on the ``vN`` branch.
api/public_api.json records the public API (``__all__`` and its signatures, every layer's
forward) at build.toml's version. Removing or changing an entry needs a version bump;
adding one only needs re-recording (``python scripts/upload.py --record-api``)."""

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import upload

VERSION = upload.GENERAL["version"]
API = {
    "geglu": "(gate, up)",
    "layers": "module",
    "layers.GeGLUMLP.forward": "(self, x)",
}


def test_public_api_is_recorded(fused_geglu):
    """If this fails, its message says what to do: re-record, or bump the version."""
    problem = upload.api_problem(
        upload.read_api_record(), upload.public_api(fused_geglu), VERSION
    )
    assert problem is None, problem


def test_public_api_covers_all_and_every_layer(fused_geglu):
    api = upload.public_api(fused_geglu)
    assert set(fused_geglu.__all__) <= api.keys()
    assert api["layers"] == "module"
    assert api["geglu"].startswith("(gate: torch.Tensor, up: torch.Tensor")
    for name in ("GeGLUMLP", "Linear"):
        assert api[f"layers.{name}.forward"].startswith("(self, ")


def test_unchanged_api_passes():
    assert upload.api_problem({"version": 1, "api": API}, API, 1) is None


@pytest.mark.parametrize(
    "api",
    [
        {k: v for k, v in API.items() if k != "geglu"},
        {**API, "layers.GeGLUMLP.forward": "(self, hidden_states)"},
        {k: v for k, v in API.items() if k != "geglu"} | {"geglu2": "(gate, up)"},
    ],
    ids=["removed", "changed", "renamed"],
)
def test_removing_or_changing_needs_a_bump(api):
    problem = upload.api_problem({"version": 1, "api": API}, api, 1)
    assert "changed incompatibly" in problem
    assert "bump `version` in build.toml to 2" in problem
    assert "python scripts/upload.py --record-api" in problem
    # After the bump, re-recording is all that is left.
    problem = upload.api_problem({"version": 1, "api": API}, api, 2)
    assert problem.startswith("build.toml says version 2, the record 1: run `python")


def test_adding_needs_no_bump():
    api = {**API, "layers.GEGLU.forward": "(self, hidden_states)"}
    problem = upload.api_problem({"version": 1, "api": API}, api, 1)
    assert "new public API entries ['layers.GEGLU.forward']" in problem
    assert "no version bump" in problem
    assert "run `python scripts/upload.py --record-api` and commit" in problem


def test_version_never_goes_down():
    problem = upload.api_problem({"version": 2, "api": API}, API, 1)
    assert "versions only go up" in problem


def test_missing_record():
    assert "api/public_api.json is missing" in upload.api_problem(None, API, 1)


def test_record_api_refuses_a_breaking_change_without_a_bump(fused_geglu, tmp_path):
    path = tmp_path / "public_api.json"
    recorded = upload.record_api(fused_geglu, VERSION, path)
    assert upload.read_api_record(path) == recorded
    assert recorded == {"version": VERSION, "api": upload.public_api(fused_geglu)}
    # A record with an entry this build lacks: re-recording would hide a removal.
    path.write_text(
        path.read_text().replace('"geglu":', '"geglu_old": "(x)",\n    "geglu":')
    )
    with pytest.raises(upload.CheckError, match="geglu_old: \\(x\\) -> \\(removed\\)"):
        upload.record_api(fused_geglu, VERSION, path)
    assert upload.record_api(fused_geglu, VERSION + 1, path)["version"] == VERSION + 1
