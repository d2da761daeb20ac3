"""Which Triton kernels a call launched, recorded at the package's one launch point."""


def spy_launches(fused_geglu, monkeypatch) -> list[str]:
    """A list that receives the name of each kernel launched from now on (through a
    Launcher's call, or its prepared direct launch where that launched)."""
    launcher = fused_geglu.launch.Launcher
    launched = []
    real_call, real_aligned = launcher.__call__, launcher.launch_aligned

    def call(self, grid, *args):
        launched.append(self.kernel.__name__)
        return real_call(self, grid, *args)

    def launch_aligned(self, *args):
        done = real_aligned(self, *args)
        if done:
            launched.append(self.kernel.__name__)
        return done

    monkeypatch.setattr(launcher, "__call__", call)
    monkeypatch.setattr(launcher, "launch_aligned", launch_aligned)
    return launched


def spy_unused_arguments(fused_geglu, monkeypatch) -> dict[int, set[tuple[int, ...]]]:
    """A dict that receives, per Launcher (by id), the positions of the None arguments of
    each call from now on: a launcher's direct launch needs the same ones every call."""
    launcher = fused_geglu.launch.Launcher
    unused = {}
    real_call = launcher.__call__

    def call(self, grid, *args):
        nones = tuple(i for i, a in enumerate(args) if a is None)
        unused.setdefault(id(self), set()).add(nones)
        return real_call(self, grid, *args)

    monkeypatch.setattr(launcher, "__call__", call)
    return unused
