"""A kernelized module computes what the module would at that call, after a warm first
call, whatever changed since: hooks of every kind that our kernels would bypass, a class
whose forward was patched, an activation changed in place, a class that binds one of our
layers as its own forward. Each gives eager's result (our kernels, or the module's own
forward with a warning), never another number or a recursion."""

import copy
import functools
import json
import warnings

import pytest
import torch
from conftest import ROOT
from kernels import (
    LocalLayerRepository,
    Mode,
    kernelize,
    replace_kernel_forward_from_hub,
    use_kernel_mapping,
)
from test_families import LAYER_NAMES, MODULES
from torch import nn
from transformers import GemmaConfig
from transformers.activations import GELUActivation, GELUTanh
from transformers.models.gemma.modeling_gemma import GemmaMLP

replace_kernel_forward_from_hub(GemmaMLP, "GeGLUMLP")
LAYERS = {**LAYER_NAMES, GemmaMLP: "GeGLUMLP"}
FAMILIES = {
    "gemma": (
        lambda: GemmaMLP(
            GemmaConfig(
                hidden_size=32, intermediate_size=40, hidden_act="gelu_pytorch_tanh"
            )
        ),
        "gate_proj",
    ),
    **MODULES,
}
ACTIVATION = {"gemma": "act_fn", "t5": "act", "modernbert": "act"}


def pair(
    family: str,
    device: str,
    mode=Mode.INFERENCE,
    change=None,
    dtype=None,
    first=torch.no_grad,
    mapping=None,
):
    """(eager module, kernelized copy) of ``family`` (in ``dtype``: float16 takes the dual
    GEMM); ``change(module)`` applied to the eager one before the copy; the copy
    kernelized (our layers, and ``mapping``'s) and called once under ``first()`` (its
    route made)."""
    eager = FAMILIES[family][0]().to(device, dtype or torch.float32)
    if change is not None:
        change(eager)
    ours = copy.deepcopy(eager)
    mapping = {
        **{
            n: {device: LocalLayerRepository(ROOT, layer_name=n)}
            for n in set(LAYERS.values())
        },
        **(mapping or {}),
    }
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(ours, mode=mode, device=device)
    assert ours.forward.__func__.__qualname__.endswith(".forward")
    with first():
        ours(torch.randn(2, 3, 32, device=device, dtype=dtype or torch.float32))
    return eager, ours


def outputs(module, x, train: bool) -> dict:
    """The output and, with ``train``, the input's and parameters' gradients."""
    x = x.detach().requires_grad_(train)
    with torch.set_grad_enabled(train):
        out = module(x)
    result = {"out": out.detach()}
    if train:
        out.square().sum().backward()
        result["x.grad"] = x.grad
        for name, p in module.named_parameters():
            result[name] = p.grad
            p.grad = None
    return result


def assert_same(got: dict, expected: dict):
    """Equal up to rounding: float16 results by our kernels against eager's differ by a
    few units in their last place, of the largest element for sums such as weight
    gradients (the module's own forward gives eager's exactly)."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if value.dtype == torch.float16:
            rtol, atol = 1e-2, 1e-2 * value.abs().max().item()
        else:
            rtol = atol = 1e-5
        torch.testing.assert_close(got[key], value, rtol=rtol, atol=atol, msg=key)


def linears_only(hook):
    """``hook`` applied to nn.Linear modules only (the projections)."""
    return lambda m, *args: hook(m, *args) if isinstance(m, nn.Linear) else None


# kind: (register, hook); each changes what the projections compute or return.
GLOBAL_HOOKS = {
    "forward": (
        nn.modules.module.register_module_forward_hook,
        linears_only(lambda m, args, out: out * 1.5),
    ),
    "forward_pre": (
        nn.modules.module.register_module_forward_pre_hook,
        linears_only(lambda m, args: (args[0] * 0.5,)),
    ),
    "full_backward": (
        nn.modules.module.register_module_full_backward_hook,
        linears_only(
            lambda m, gin, gout: tuple(None if g is None else 3 * g for g in gin)
        ),
    ),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("kind", GLOBAL_HOOKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_global_module_hooks_fire(device, family, kind, dtype):
    """A global module hook registered after the first call fires for the projections
    as in eager (the module runs its own forward, warning why)."""
    register, hook = GLOBAL_HOOKS[kind]
    train = kind == "full_backward"
    mode = Mode.TRAINING if train else Mode.INFERENCE
    eager, ours = pair(family, device, mode, dtype=dtype)
    x = torch.randn(3, 5, 32, device=device, dtype=dtype)
    handle = register(hook)
    try:
        expected = outputs(eager, x, train)
        with pytest.warns(RuntimeWarning, match="global module hook"):
            got = outputs(ours, x, train)
    finally:
        handle.remove()
    assert_same(got, expected)
    # Hooks removed: our kernels (no fallback warning), eager's results.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert_same(outputs(ours, x, train), outputs(eager, x, train))


@pytest.mark.parametrize(
    "family, where",
    [(f, "gate") for f in FAMILIES] + [(f, "activation") for f in ACTIVATION],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_backward_hooks_on_submodules_fire(device, family, where, dtype):
    """A full backward hook registered after the first call on the gate projection (or
    the activation module) fires in training as in eager, scaling the gradient it passes
    on."""
    eager, ours = pair(family, device, Mode.TRAINING, dtype=dtype)
    name = FAMILIES[family][1] if where == "gate" else ACTIVATION[family]
    calls = {}
    for label, module in (("eager", eager), ("ours", ours)):
        sub = getattr(module, name)

        def hook(m, gin, gout, label=label):
            calls[label] = calls.get(label, 0) + 1
            return tuple(None if g is None else 3 * g for g in gin)

        sub.register_full_backward_hook(hook)
    x = torch.randn(3, 5, 32, device=device, dtype=dtype)
    expected = outputs(eager, x, True)
    got = outputs(ours, x, True)
    assert_same(got, expected)
    assert calls["ours"] == calls["eager"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_class_forward_patched_after_the_first_call(device, family, monkeypatch):
    """A library patching the module's class after the route was made: the patched
    forward is what the module computes, with a warning."""
    eager, ours = pair(family, device)
    cls = type(eager)
    original = cls.forward

    def patched(self, *args, **kwargs):
        return original(self, *args, **kwargs) * 0.5

    monkeypatch.setattr(cls, "forward", patched)
    x = torch.randn(3, 5, 32, device=device)
    expected = outputs(eager, x, False)
    with pytest.warns(RuntimeWarning, match="is not one that"):
        got = outputs(ours, x, False)
    assert_same(got, expected)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert_same(outputs(ours, x, False), outputs(eager, x, False))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_class_binding_our_layer_forward(fused_geglu, device, family):
    """``class Mine(GemmaMLP): forward = GeGLUMLP.forward``: its result is the base
    class's, also where our kernels cannot run (float64): no recursion."""
    eager, _ = pair(family, device)
    layer = getattr(fused_geglu.layers, LAYERS[type(eager)])
    mine = copy.deepcopy(eager)
    mine.__class__ = type("Mine", (type(eager),), {"forward": layer.forward})
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(3, 5, 32, device=device, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # our kernels or the base's
            got = outputs(mine.to(dtype), x, False)
        assert_same(got, outputs(eager.to(dtype), x, False))


def gelu_module(approximate: str):
    return nn.GELU(approximate=approximate)


# change(act) applied in place after the first call -> what the activation then computes
ACTIVATION_CHANGES = {
    "nn.GELU approximate": (
        lambda: nn.GELU(approximate="tanh"),
        lambda act: setattr(act, "approximate", "none"),
    ),
    "GELUActivation function": (
        GELUActivation,
        lambda act: setattr(
            act, "act", functools.partial(torch.nn.functional.gelu, approximate="tanh")
        ),
    ),
    "GELUTanh function": (GELUTanh, lambda act: setattr(act, "act", torch.relu)),
    "instance forward": (
        GELUTanh,
        lambda act: setattr(act, "forward", lambda x: torch.relu(x)),
    ),
}


@pytest.mark.parametrize("change", ACTIVATION_CHANGES)
@pytest.mark.parametrize("family", ACTIVATION)
def test_activation_changed_after_the_first_call(device, family, change, monkeypatch):
    """The activation's attributes, function or forward changed in place after the route
    was made: our kernels with the new GeLU, or the module's own forward."""
    make, mutate = ACTIVATION_CHANGES[change]
    name = ACTIVATION[family]
    eager, ours = pair(
        family, device, change=lambda m: setattr(m, name, make().to(device))
    )
    mutate(getattr(eager, name))
    mutate(getattr(ours, name))
    x = torch.randn(3, 5, 32, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert_same(outputs(ours, x, False), outputs(eager, x, False))


@pytest.mark.parametrize("family", ACTIVATION)
def test_activation_class_patched_after_the_first_call(device, family, monkeypatch):
    """nn.GELU's class forward replaced after the route was made (every instance's)."""
    name = ACTIVATION[family]
    eager, ours = pair(family, device, change=lambda m: setattr(m, name, nn.GELU()))
    monkeypatch.setattr(nn.GELU, "forward", lambda self, x: torch.relu(x))
    x = torch.randn(3, 5, 32, device=device)
    expected = outputs(eager, x, False)
    with pytest.warns(RuntimeWarning, match="is not a GeLU"):
        got = outputs(ours, x, False)
    assert_same(got, expected)


def hub_gelu_tanh(tmp_path, source: str) -> LocalLayerRepository:
    """A Hub kernel of one layer, ``GeluTanh``, whose forward returns ``source`` of
    ``input`` (kernels-community ``activation``'s layer, to which transformers maps
    GELUTanh), in the layout kernels loads (a build variant per backend ours has)."""
    for ours in (ROOT / "build").glob("torch-*"):
        variant = tmp_path / "build" / ours.name
        variant.mkdir(parents=True)
        metadata = json.loads((ours / "metadata.json").read_text())
        metadata.update(name="hub-gelu", id=f"_hub_gelu_{ours.name}")
        del metadata["digest"]  # ours lists our files
        (variant / "metadata.json").write_text(json.dumps(metadata))
        (variant / "__init__.py").write_text("from . import layers\n")
        (variant / "layers.py").write_text(
            "import torch\n\n\nclass GeluTanh(torch.nn.Module):\n"
            "    def forward(self, input):\n"
            f"        return {source}\n"
        )
    return LocalLayerRepository(tmp_path, layer_name="GeluTanh")


def test_activation_kernelized_from_the_hub(device, tmp_path):
    """transformers' GELUTanh kernelized with a Hub layer (as ``use_kernels=True`` maps
    it to kernels-community's ``activation``): by kernels' contract the layer computes
    the class's GeLU, so our kernels run (no warning) and give eager's result."""
    repo = hub_gelu_tanh(
        tmp_path, "torch.nn.functional.gelu(input, approximate='tanh')"
    )
    x = torch.randn(3, 5, 32, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        eager, ours = pair("gemma", device, mapping={"GeluTanh": {device: repo}})
        got = outputs(ours, x, False)
    assert "forward" in ours.act_fn.__dict__, "the Hub layer was not installed"
    assert_same(got, outputs(eager, x, False))


@pytest.mark.parametrize("first", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_training_after_a_no_grad_first_call(device, family, dtype, first):
    """The route made in a no_grad or inference_mode call (``pair``'s first call) serves
    training calls: every parameter gets eager's gradient; a projection frozen
    afterwards (requires_grad_(False)) gets none, as in eager."""
    eager, ours = pair(family, device, Mode.TRAINING, dtype=dtype, first=first)
    x = torch.randn(3, 5, 32, device=device, dtype=dtype)
    assert_same(outputs(ours, x, True), outputs(eager, x, True))
    gate = FAMILIES[family][1]
    for module in (eager, ours):
        getattr(module, gate).requires_grad_(False)
    got, expected = outputs(ours, x, True), outputs(eager, x, True)
    assert (
        {k for k, v in got.items() if v is None}
        == {k for k, v in expected.items() if v is None}
        != set()
    )
    assert_same(
        {k: v for k, v in got.items() if v is not None},
        {k: v for k, v in expected.items() if v is not None},
    )
