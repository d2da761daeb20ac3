"""Autograd beyond the first derivative: double backward, torch.func transforms and
forward-mode AD give eager's results (the op's PyTorch formula runs there); frozen weights
cost no weight-gradient GEMM; hooks on a layer's activation fire (its own forward)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from launches import spy_launches
from reference import eager_geglu, eager_geglu_linear, eager_linear


def ops(fused_geglu):
    """(ours, eager) pairs of functions of tensors, float32 inputs."""
    return {
        "geglu": (
            lambda g, u: fused_geglu.geglu(g, u, "tanh"),
            lambda g, u: eager_geglu(g, u, "tanh"),
        ),
        "geglu_halves": (  # one projection's halves, the gate second (diffusers' GEGLU)
            lambda y: fused_geglu.autograd.geglu_halves(y, 1, "tanh"),
            lambda y: eager_geglu(y[..., 3:], y[..., :3], "tanh"),
        ),
        "linear": (
            lambda x, w, b: fused_geglu.linear(x, w, b, "gelu"),
            lambda x, w, b: eager_linear(x, w, b, "gelu"),
        ),
        "geglu_linear": (
            lambda x, wg, wu: fused_geglu.geglu_linear(x, wg, wu, approximate="none"),
            lambda x, wg, wu: eager_geglu_linear(x, wg, wu, approximate="none"),
        ),
    }


def inputs(name, device):
    shapes = {
        "geglu": [(4, 6), (4, 6)],
        "geglu_halves": [(4, 6)],
        "linear": [(4, 5), (6, 5), (6,)],
        "geglu_linear": [(4, 5), (6, 5), (6, 5)],
    }[name]
    return [torch.randn(s, device=device, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("name", ["geglu", "geglu_halves", "linear", "geglu_linear"])
def test_double_backward(fused_geglu, device, name):
    """A gradient penalty: d/dθ ||d out / d inputs||², as eager computes it."""
    ours, eager = ops(fused_geglu)[name]
    args = inputs(name, device)
    results = []
    for fn in (ours, eager):
        xs = [a.detach().clone().requires_grad_() for a in args]
        grads = torch.autograd.grad(fn(*xs).square().sum(), xs, create_graph=True)
        penalty = sum(g.square().sum() for g in grads)
        results.append(torch.autograd.grad(penalty, xs))
    for o, e in zip(*results):
        torch.testing.assert_close(o, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["geglu", "geglu_halves", "linear", "geglu_linear"])
def test_torch_func_transforms(fused_geglu, device, name):
    """grad, vmap, jacrev and jvp (forward-mode AD) give eager's results."""
    ours, eager = ops(fused_geglu)[name]
    args = [a.detach() for a in inputs(name, device)]
    for transform in (
        lambda fn: torch.func.grad(lambda *a: fn(*a).square().sum())(*args),
        lambda fn: torch.func.vmap(fn, in_dims=(0,) + (None,) * (len(args) - 1))(
            torch.stack([args[0], 2 * args[0]]), *args[1:]
        ),
        lambda fn: torch.func.jacrev(fn)(*args),
        lambda fn: torch.func.jvp(
            fn, tuple(args), tuple(torch.ones_like(a) for a in args)
        ),
    ):
        torch.testing.assert_close(
            transform(ours), transform(eager), rtol=1e-4, atol=1e-5
        )


def _backward_gemms(run) -> list[str]:
    """The matrix products ``run`` calls (cuBLAS's aten ops: autograd.GeGLULinear's
    backward), by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        run()
    names = ("aten::mm", "aten::addmm_", "aten::addmm", "aten::matmul")
    return [e.name for e in p.events() if e.name in names]


@pytest.mark.parametrize("frozen", [True, False])
def test_frozen_weights_run_no_weight_gradient_gemm(
    fused_geglu, device, monkeypatch, frozen
):
    """Only the input needs a gradient (frozen projections, as in LoRA): backward runs the
    activation's gradient and dX's two GEMMs (the second accumulating), no weight-gradient
    GEMM; with trainable weights, their two too."""
    x = torch.randn(8, 16, device=device, requires_grad=True)
    wg, wu = (
        torch.randn(24, 16, device=device, requires_grad=not frozen) for _ in range(2)
    )
    h = fused_geglu.geglu_linear(x, wg, wu)
    launched = spy_launches(fused_geglu, monkeypatch)
    gemms = _backward_gemms(lambda: h.sum().backward())
    assert launched == ["geglu_bwd_kernel"], launched
    dx = ["aten::mm", "aten::addmm_"]
    assert gemms == (dx if frozen else [*dx, "aten::mm", "aten::mm"]), gemms
    assert (wg.grad is None) == frozen and x.grad is not None


def test_hooks_on_the_activation_fire(fused_geglu, device):
    """A forward hook on act_fn (activation capture, steering): the module's own forward
    runs, so the hook fires and its edit counts."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    mlp = GemmaMLP(GemmaConfig(hidden_size=16, intermediate_size=24)).to(device)
    eager = copy.deepcopy(mlp)
    captured = []
    for m in (mlp, eager):
        m.act_fn.register_forward_hook(
            lambda mod, i, out: captured.append(out) or 2 * out
        )
    x = torch.randn(3, 16, device=device)
    with pytest.warns(RuntimeWarning, match="carries hooks"):
        got = fused_geglu.layers.GeGLUMLP.forward.__get__(mlp)(x)
    torch.testing.assert_close(got, eager(x), rtol=0, atol=0)
    assert len(captured) == 2


def test_gelu_and_mul_refuses_grad(fused_geglu, device):
    x = torch.randn(4, 8, device=device, requires_grad=True)
    out = torch.empty(4, 4, device=device)
    with pytest.raises(RuntimeError, match="not differentiable.*geglu"):
        fused_geglu.gelu_and_mul(out, x)
    with torch.no_grad():
        fused_geglu.gelu_and_mul(out, x)
    torch.testing.assert_close(out, F.gelu(x[:, :4]) * x[:, 4:], rtol=1e-5, atol=1e-6)


def _spy_activation_backward(fused_geglu, monkeypatch) -> list[str]:
    """Names the activation backward each call took: "in place" or "allocated"."""
    library, taken = fused_geglu.library, []
    in_place, allocated = library.geglu_grad_in_place.eager, library.geglu_grad.eager

    def spy(name, fn):
        return lambda *args: taken.append(name) or fn(*args)

    halves = library.geglu_halves_grad.eager
    monkeypatch.setattr(library.geglu_grad_in_place, "eager", spy("in place", in_place))
    monkeypatch.setattr(library.geglu_grad, "eager", spy("allocated", allocated))
    monkeypatch.setattr(library.geglu_halves_grad, "eager", spy("allocated", halves))
    return taken


@pytest.mark.parametrize("family", ["gemma", "modernbert"])
def test_layer_activation_backward_writes_over_gate_and_up(fused_geglu, device, monkeypatch, family):  # fmt: skip
    """In a layer's training step the activation's backward writes dgate and dup over the
    projections' outputs, which only it holds (no allocation), with eager's gradients;
    a retained graph keeps them (allocating), so its second backward gives the same."""
    from transformers import GemmaConfig, ModernBertConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    if family == "gemma":
        config = GemmaConfig(hidden_size=32, intermediate_size=48, hidden_act="gelu_pytorch_tanh")  # fmt: skip
        module, layer = GemmaMLP(config), fused_geglu.layers.GeGLUMLP
    else:
        config = ModernBertConfig(hidden_size=32, intermediate_size=48, mlp_dropout=0.0)
        module, layer = ModernBertMLP(config), fused_geglu.layers.ModernBertGeGLUMLP
    module = module.to(device)
    ours = copy.deepcopy(module)
    ours.forward = layer.forward.__get__(ours)
    x = torch.randn(3, 4, 32, device=device, requires_grad=True)
    taken = _spy_activation_backward(fused_geglu, monkeypatch)

    def grads(m, **kwargs):
        x.grad = None
        m.zero_grad()
        out = m(x)
        out.square().sum().backward(**kwargs)
        return out, [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]

    out_eager, expected = grads(module)
    out, got = grads(ours)
    assert taken == ["in place"]
    torch.testing.assert_close(out, out_eager)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    taken.clear()
    x.grad = None
    ours.zero_grad()
    loss = ours(x).square().sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    loss.backward()
    assert taken == ["allocated", "in place"]
    torch.testing.assert_close(x.grad, first)


def test_geglu_backward_keeps_the_callers_tensors(fused_geglu, device, monkeypatch):
    """``geglu`` on the caller's tensors allocates its gradients: gate and up keep their
    values after backward."""
    gate = torch.randn(4, 6, device=device, requires_grad=True)
    up = torch.randn(4, 6, device=device, requires_grad=True)
    g, u = gate * 1, up * 1  # non-leaf, as a layer's projections
    before = g.detach().clone(), u.detach().clone()
    taken = _spy_activation_backward(fused_geglu, monkeypatch)
    fused_geglu.geglu(g, u, "tanh").sum().backward()
    assert taken == ["allocated"]
    assert torch.equal(g, before[0]) and torch.equal(u, before[1])


def test_owned_activation_backward_never_reads_overwritten_data(fused_geglu, device):
    """The overwrite bumps gate's and up's version counters: a node that saved gate and
    runs its backward after ours (created before ours: autograd runs later nodes first)
    meets PyTorch's in-place error; one that runs before ours sees the original values."""
    geglu = fused_geglu.autograd.geglu
    x = torch.randn(4, 6, device=device, requires_grad=True)
    gate, up = x * 2, x * 3
    version = gate._version
    h = geglu(gate, up, "tanh", owned=True)
    h.sum().backward()
    assert gate._version > version and up._version > version

    gate, up = x * 2, x * 3
    earlier = gate.sin()  # saves gate; its backward runs after ours
    h = geglu(gate, up, "tanh", owned=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (h.sum() + earlier.sum()).backward()

    x.grad = None
    gate, up = x * 2, x * 3
    h = geglu(gate, up, "tanh", owned=True)
    later = gate.sin()  # its backward runs before ours
    (h.sum() + later.sum()).backward()
    ref = x.detach().requires_grad_()
    g_ref, u_ref = ref * 2, ref * 3
    (F.gelu(g_ref, approximate="tanh") * u_ref + g_ref.sin()).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


@pytest.mark.parametrize("family", ["modernbert", "diffusers", "gelu_and_mul"])
def test_halves_backward_concatenates_nothing(fused_geglu, device, family):
    """A layer over one projection's halves (ModernBERT's Wi, diffusers' proj, the
    GeluAndMul layer's input) returns their gradient as one tensor: the training step runs
    no concatenation (through chunk or slice views, autograd joins the halves' gradients
    into a copy of the projection's output's size), with eager's gradients."""
    from diffusers.models.activations import GEGLU
    from transformers import ModernBertConfig
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    layers = fused_geglu.layers
    if family == "modernbert":
        config = ModernBertConfig(hidden_size=32, intermediate_size=48, mlp_dropout=0.0)
        module, layer = ModernBertMLP(config), layers.ModernBertGeGLUMLP
    elif family == "diffusers":
        module, layer = GEGLU(32, 40), layers.GEGLU
    else:
        module, layer = torch.nn.Linear(32, 80), None
    module = module.to(device)
    x = torch.randn(3, 4, 32, device=device, requires_grad=True)

    def step(ours: bool):
        x.grad = None
        module.zero_grad()
        if layer is not None:
            out = layer.forward(module, x) if ours else module(x)
        else:  # GeluAndMul over a projection's output: gelu(y[..., :40]) * y[..., 40:]
            y = module(x)
            out = (
                layers.GeluAndMul.forward(None, y)
                if ours
                else F.gelu(y[..., :40]) * y[..., 40:]
            )
        with torch.profiler.profile() as prof:
            out.square().sum().backward()
        names = {e.name for e in prof.events()}
        return (
            out.detach(),
            [x.grad.clone()] + [p.grad.clone() for p in module.parameters()],
            names,
        )

    # chunk's backward concatenates; a slice's writes into zeros, then the two add up
    joins = {"aten::cat", "aten::slice_backward"}
    out_eager, expected, eager_names = step(False)
    assert joins & eager_names  # the test can see them
    out, got, names = step(True)
    assert not joins & names, sorted(n for n in names if n.startswith("aten::"))
    torch.testing.assert_close(out, out_eager)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


def test_owned_halves_backward_never_reads_overwritten_data(fused_geglu, device):
    """geglu_halves over a tensor it owns writes y's gradient over y and bumps y's version:
    a node that saved y (or a view of it) and runs its backward after ours meets PyTorch's
    in-place error; without that node, eager's gradient."""
    geglu_halves = fused_geglu.autograd.geglu_halves
    x = torch.randn(4, 6, device=device, requires_grad=True)
    y = x * 2
    version = y._version
    geglu_halves(y, 1, "tanh", owned=True).sum().backward()
    assert y._version > version
    for saved in (lambda y: y.sin(), lambda y: y[:, :3].sin()):
        y = x * 2
        earlier = saved(y)  # saves y; its backward runs after ours
        h = geglu_halves(y, 1, "tanh", owned=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (h.sum() + earlier.sum()).backward()
    x.grad = None
    y = x * 2
    geglu_halves(y, 1, "tanh", owned=True).sum().backward()
    ref = x.detach().requires_grad_()
    y_ref = ref * 2
    (F.gelu(y_ref[:, 3:], approximate="tanh") * y_ref[:, :3]).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)
