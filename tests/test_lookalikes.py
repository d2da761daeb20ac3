"""Modules a user could register against our layers: those whose forward the layer
reproduces run our kernels; look-alikes (same submodule names, a forward that does more)
run their own forward, bit for bit, with a warning that names the reason. The classes come
from an audit of transformers 5.22.2 and diffusers 0.42.1 (docs/supported-modules.md)."""

import copy
import warnings

import pytest
import torch
from diffusers.models.activations import GEGLU
from transformers.models.gemma2.configuration_gemma2 import Gemma2Config
from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
from transformers.models.gemma3n.configuration_gemma3n import Gemma3nTextConfig
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP
from transformers.models.gte.configuration_gte import GteConfig
from transformers.models.gte.modeling_gte import GteMLP
from transformers.models.longt5.configuration_longt5 import LongT5Config
from transformers.models.longt5.modeling_longt5 import LongT5DenseGatedActDense
from transformers.models.modernbert_decoder.configuration_modernbert_decoder import (
    ModernBertDecoderConfig,
)
from transformers.models.modernbert_decoder.modeling_modernbert_decoder import (
    ModernBertDecoderMLP,
)
from transformers.models.mt5.configuration_mt5 import MT5Config
from transformers.models.mt5.modeling_mt5 import MT5DenseGatedActDense
from transformers.models.t5gemma.configuration_t5gemma import T5GemmaModuleConfig
from transformers.models.t5gemma.modeling_t5gemma import T5GemmaMLP

H, I = 16, 40
T5_SIZES = {"d_model": H, "d_ff": I, "feed_forward_proj": "gated-gelu"}


def t5gemma_config():
    config = T5GemmaModuleConfig(hidden_size=H, intermediate_size=I)
    config.dropout_rate = 0.1  # its model config passes this down to the MLP's
    return config


class ScaledGelu(GEGLU):
    """A user's GEGLU whose helper differs: the forward's bytecode is GEGLU's."""

    def gelu(self, gate):
        return 2 * super().gelu(gate)


# (module, layer); the look-alikes' reasons in docs/supported-modules.md.
LOOKALIKES = {
    "Gemma3nTextMLP": (
        lambda: Gemma3nTextMLP(
            Gemma3nTextConfig(
                hidden_size=H,
                intermediate_size=[I],
                num_hidden_layers=1,
                activation_sparsity_pattern=[0.95],
            )
        ),
        "GeGLUMLP",
    ),
    "GteMLP": (
        lambda: GteMLP(GteConfig(hidden_size=H, intermediate_size=I)),
        "GeGLUMLP",
    ),
    "T5GemmaMLP": (lambda: T5GemmaMLP(t5gemma_config()), "GeGLUMLP"),
    "LongT5DenseGatedActDense": (
        lambda: LongT5DenseGatedActDense(LongT5Config(**T5_SIZES)),
        "T5GeGLUDense",
    ),
    "GEGLU subclass overriding gelu": (lambda: ScaledGelu(H, I), "GEGLU"),
}
REPRODUCED = {
    "Gemma2MLP": (
        lambda: Gemma2MLP(Gemma2Config(hidden_size=H, intermediate_size=I)),
        "GeGLUMLP",
    ),
    "MT5DenseGatedActDense": (
        lambda: MT5DenseGatedActDense(MT5Config(**T5_SIZES)),
        "T5GeGLUDense",
    ),
    "ModernBertDecoderMLP": (
        lambda: ModernBertDecoderMLP(
            ModernBertDecoderConfig(hidden_size=H, intermediate_size=I)
        ),
        "ModernBertGeGLUMLP",
    ),
}


def run_layer(fused_geglu, make, layer, device):
    torch.manual_seed(0)
    module = make().to(device).eval()
    x = torch.randn(3, H, device=device)
    forward = getattr(fused_geglu.layers, layer).forward
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = forward(module, x)
        expected = module(x)
    ours = [str(w.message) for w in caught if "fused-geglu" in str(w.message)]
    return got, expected, ours


@pytest.mark.parametrize("name", LOOKALIKES)
def test_lookalike_runs_its_own_forward(fused_geglu, device, name):
    make, layer = LOOKALIKES[name]
    got, expected, warned = run_layer(fused_geglu, make, layer, device)
    assert torch.equal(got, expected)
    assert len(warned) == 1 and "runs its own forward" in warned[0], warned


@pytest.mark.parametrize("name", REPRODUCED)
def test_reproduced_forward_runs_our_kernels(fused_geglu, device, monkeypatch, name):
    from launches import spy_launches

    make, layer = REPRODUCED[name]
    launched = spy_launches(fused_geglu, monkeypatch)
    got, expected, warned = run_layer(fused_geglu, make, layer, device)
    assert warned == [] and launched, (warned, launched)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernelize_mlps(fused_geglu, device):
    """One call replaces every MLP a layer reproduces, reports them, leaves look-alikes."""
    from kernels import Mode

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {name: make() for name, (make, _) in {**REPRODUCED, **LOOKALIKES}.items()}
    ).to(device)
    eager = copy.deepcopy(model).eval()
    replaced = fused_geglu.kernelize_mlps(
        model.eval(), mode=Mode.INFERENCE, device=device
    )
    assert replaced == {name: layer for name, (_, layer) in REPRODUCED.items()}
    x = torch.randn(3, H, device=device)
    with torch.no_grad():
        for name, module in model.items():
            torch.testing.assert_close(module(x), eager[name](x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("layer", "approximate"), [("GeluAndMul", "none"), ("GeluTanhAndMul", "tanh")]
)
def test_gelu_and_mul_layers(fused_geglu, device, layer, approximate):
    """kernels-community activation semantics, differentiable; an odd last dim runs the
    module's own forward (here: its own error)."""

    class Activation(torch.nn.Module):
        def forward(self, x):
            d = x.shape[-1] // 2
            return (
                torch.nn.functional.gelu(x[..., :d], approximate=approximate)
                * x[..., d:]
            )

    module = Activation()
    forward = getattr(fused_geglu.layers, layer).forward.__get__(module)
    x = torch.randn(3, 5, 8, device=device, requires_grad=True)
    got, expected = forward(x), module(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    (dx,) = torch.autograd.grad(got.sum(), x)
    (dx_eager,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(dx, dx_eager, rtol=1e-5, atol=1e-6)
    odd = torch.randn(2, 7, device=device)
    with (
        pytest.raises(RuntimeError, match="must match"),
        pytest.warns(RuntimeWarning, match="no even last dim"),
    ):
        forward(odd)
    # torch.export traces FakeTensors through it: the graph holds our op, not eager's.
    module.forward = forward
    exported = torch.export.export(module, (torch.randn(4, 8, device=device),))
    ops = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert len(ops) == 1 and ops[0].endswith(".geglu_halves.default"), ops
