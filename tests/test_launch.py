"""The launch machinery's own logic (launch.Launcher), on fake kernels: the direct launch
after the first, and the fallback to Triton's launch where the launcher refuses the call."""

import types

import torch


class FakeKernel:
    """Stands for a JITFunction and its compiled kernel at once: ``kernel[(grid,)](...)``
    is Triton's launch (recorded; returns the compiled kernel, itself), and ``run`` the
    compiled kernel's launcher, which records or refuses the call."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, launcher_refuses: bool):
        self.params = [types.SimpleNamespace(name="BLOCK", is_constexpr=True)]
        self.calls = []
        self.launcher_refuses = launcher_refuses

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            self.calls.append(("triton", grid, args, constexprs))
            return self

        return run

    def run(self, *args):
        if self.launcher_refuses:
            raise TypeError("launcher takes other arguments")
        self.calls.append(("direct", *args))


def launcher_for(fused_geglu, monkeypatch, kernel):
    launch = fused_geglu.launch
    monkeypatch.setattr(launch, "JITFunction", FakeKernel)
    monkeypatch.setattr(launch, "direct_launch_works", True)
    monkeypatch.setattr(launch, "_stream_getters", lambda: (lambda: 0, lambda d: 77))
    return launch.Launcher(kernel, {"BLOCK": 16, "num_warps": 4, "num_stages": 2})


def test_direct_launch_after_the_first(fused_geglu, monkeypatch):
    kernel = FakeKernel(launcher_refuses=False)
    launcher = launcher_for(fused_geglu, monkeypatch, kernel)
    x = torch.zeros(8)
    launcher(3, x, 5)
    launcher(3, x, 5)
    assert [c[0] for c in kernel.calls] == ["triton", "direct"]
    # grid, stream, the compiled function, then every parameter (constexprs too)
    assert kernel.calls[1] == (
        "direct", 3, 1, 1, 77, "function", "metadata", None, None, None, x, 5, 16
    )  # fmt: skip
    misaligned = torch.zeros(9)[1:]  # 4 bytes off 16-byte alignment
    launcher(3, misaligned, 5)
    assert kernel.calls[2][0] == "triton"


def test_refused_launcher_falls_back_to_triton(fused_geglu, monkeypatch):
    kernel = FakeKernel(launcher_refuses=True)
    launcher = launcher_for(fused_geglu, monkeypatch, kernel)
    x = torch.zeros(8)
    for _ in range(3):
        launcher(2, x, 7)
    # Every call launched once, through Triton's own launch; the direct path is off.
    assert [c[0] for c in kernel.calls] == ["triton"] * 3
    assert fused_geglu.launch.direct_launch_works is False


def test_toolkit_version_read_from_version_json_or_cuda_h(fused_geglu, tmp_path):
    """Which CUDA toolkit's libdevice the kernels link (torch's major.minor only): the
    version comes from version.json, else from cuda.h; a directory with neither is none."""
    version_of = fused_geglu.launch._toolkit_version
    json_root, header_root, empty = (tmp_path / n for n in ("json", "header", "empty"))
    for root in (json_root, header_root / "include", empty):
        root.mkdir(parents=True)
    (json_root / "version.json").write_text('{"cuda": {"version": "13.0.88"}}')
    (header_root / "include" / "cuda.h").write_text(
        "#ifndef CUDA_H\n#define CUDA_VERSION 12080\n#endif\n"
    )
    assert version_of(str(json_root)) == "13.0"
    assert version_of(str(header_root)) == "12.8"
    assert version_of(str(empty)) is None
