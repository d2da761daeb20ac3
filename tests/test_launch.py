"""The launch machinery's own logic (launch.Launcher), on fake kernels: the direct launch
after the first, the fallback to Triton's launch where the launcher refuses the call, and
to Triton's libdevice where the toolkit's cannot be linked."""

import types

import pytest
import torch


class FakeKernel:
    """Stands for a JITFunction and its compiled kernel at once: ``kernel[(grid,)](...)``
    is Triton's launch (recorded; returns the compiled kernel, itself), and ``run`` the
    compiled kernel's launcher, which records or refuses the call."""

    function, packed_metadata = "function", "metadata"

    def __init__(self, launcher_refuses: bool = False, compile_error=None):
        self.params = [types.SimpleNamespace(name="BLOCK", is_constexpr=True)]
        self.calls = []
        self.launcher_refuses = launcher_refuses
        # compile_error(constexprs): the exception Triton's launch raises, or None
        self.compile_error = compile_error or (lambda constexprs: None)

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            if (error := self.compile_error(constexprs)) is not None:
                raise error
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


def test_prepared_direct_launch(fused_geglu, monkeypatch):
    """``launch_aligned``: nothing before a first launch compiled the kernel, or under a
    launch hook; after it, the caller's stream and arguments (addresses as ints) go to
    the compiled kernel's launcher unchanged."""
    kernel = FakeKernel(launcher_refuses=False)
    launcher = launcher_for(fused_geglu, monkeypatch, kernel)
    x = torch.zeros(8)
    assert launcher.launch_aligned(3, 0, 55, (x, 5)) is False
    assert kernel.calls == []
    launcher(3, x, 5)
    address = x.data_ptr()
    assert launcher.launch_aligned(3, 0, 55, (address, 5)) is True
    assert kernel.calls[1] == (
        "direct", 3, 1, 1, 55, "function", "metadata", None, None, None, address, 5, 16
    )  # fmt: skip
    # The compiled kernel was loaded on device 0: nothing for another device.
    assert launcher.launch_aligned(3, 1, 55, (address, 5)) is False
    monkeypatch.setattr(fused_geglu.launch, "_launch_hooks_set", lambda: True)
    assert launcher.launch_aligned(3, 0, 55, (address, 5)) is False
    assert len(kernel.calls) == 2


def test_no_direct_launch_on_another_device(fused_geglu, monkeypatch):
    """A compiled kernel is loaded on the device of its first launch: with another device
    current (a model spread over GPUs), the launch goes through Triton, which keeps a
    compiled kernel per device."""
    kernel = FakeKernel(launcher_refuses=False)
    launcher = launcher_for(fused_geglu, monkeypatch, kernel)
    current = [0]
    getters = (lambda: current[0], lambda device: 70 + device)
    monkeypatch.setattr(fused_geglu.launch, "_stream_getters", lambda: getters)
    for device in (0, 1, 1, 0, 0):
        current[0] = device
        launcher(3, torch.zeros(8), 5)
    assert [c[0] for c in kernel.calls] == [
        "triton", "triton", "direct", "triton", "direct"
    ]  # fmt: skip
    assert kernel.calls[2][4] == 71 and kernel.calls[4][4] == 70  # each device's stream


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


@pytest.fixture
def toolkit_libdevice(fused_geglu, monkeypatch):
    """A toolkit libdevice in the compile options, as on a CUDA machine that has one."""
    launch = fused_geglu.launch
    path = "/usr/local/cuda-99.0/nvvm/libdevice/libdevice.10.bc"
    monkeypatch.setattr(launch, "TOOLKIT_LIBDEVICE", path)
    monkeypatch.setattr(launch, "COMPILE_OPTIONS", {"extern_libs": {"libdevice": path}})
    return launch


def test_unlinkable_toolkit_libdevice_falls_back_to_tritons(
    fused_geglu, monkeypatch, toolkit_libdevice
):
    """A launch that fails with the toolkit's libdevice and succeeds without it: it warns,
    and this and every later launcher compile without it."""

    def refuses_bitcode(constexprs):
        if "extern_libs" in constexprs:
            return RuntimeError("bitcode too new for this LLVM")
        return None

    kernel = FakeKernel(compile_error=refuses_bitcode)
    launcher = launcher_for(fused_geglu, monkeypatch, kernel)
    assert "extern_libs" in launcher.constexprs
    with pytest.warns(RuntimeWarning, match="could not link .*bitcode too new"):
        launcher(2, torch.zeros(8), 7)
    assert [c[0] for c in kernel.calls] == ["triton"]
    assert "extern_libs" not in kernel.calls[0][3]
    assert toolkit_libdevice.TOOLKIT_LIBDEVICE is None
    assert "extern_libs" not in toolkit_libdevice.COMPILE_OPTIONS
    assert (
        "extern_libs" not in launcher_for(fused_geglu, monkeypatch, kernel).constexprs
    )


def test_other_compile_errors_keep_the_toolkit_libdevice(
    fused_geglu, monkeypatch, toolkit_libdevice
):
    """An error that the launch without the toolkit's libdevice raises too is raised as
    it was, with its cause (Triton's CompilationError carries the compiler's message
    there), and the toolkit's libdevice stays."""
    cause = TypeError("Return type mismatch")

    def real_bug(constexprs):
        error = ValueError("a real bug")
        error.__cause__ = cause
        return error

    kernel = FakeKernel(compile_error=real_bug)
    launcher = launcher_for(fused_geglu, monkeypatch, kernel)
    with pytest.raises(ValueError, match="a real bug") as raised:
        launcher(2, torch.zeros(8), 7)
    assert raised.value.__cause__ is cause
    assert toolkit_libdevice.TOOLKIT_LIBDEVICE is not None
    assert "extern_libs" in toolkit_libdevice.COMPILE_OPTIONS
    assert "extern_libs" in launcher.constexprs


@pytest.mark.gpu
def test_direct_launch_works_with_this_triton(fused_geglu, device):
    """This Triton's compiled-kernel launcher takes the direct launch's arguments (Triton
    3.6 to 3.9 keep its signature): the second call launches directly, equal to the
    first."""
    gate, up = (torch.randn(64, 256, device=device) for _ in range(2))
    first = fused_geglu.geglu(gate, up)
    second = fused_geglu.geglu(gate, up)
    launch = fused_geglu.launch
    assert launch.direct_launch_works, launch.direct_launch_error
    assert torch.equal(first, second)
