"""One call that kernelizes every GeGLU MLP of a model through ``kernels.kernelize``."""

import torch
from torch import nn

from . import layers

# The layers that replace whole MLPs, with the structure each reproduces.
_MLP_LAYERS = {
    family.name: family
    for family in (
        layers.GEMMA_MLP,
        layers.T5_GATED_DENSE,
        layers.MODERNBERT_MLP,
        layers.DIFFUSERS_GEGLU,
    )
}


class _ThisPackage:
    """A ``kernels`` layer repository for this package as loaded (no download, no second
    import): ``load`` returns the layer class."""

    def __init__(self, layer_name: str):
        self.layer_name = layer_name

    def load(self) -> type[nn.Module]:
        return getattr(layers, self.layer_name)

    def __eq__(self, other):
        return isinstance(other, _ThisPackage) and other.layer_name == self.layer_name

    def __hash__(self):
        return hash((_ThisPackage, self.layer_name))

    def __repr__(self):
        return f"fused-geglu layers.{self.layer_name}"


def _matching_layer(module: nn.Module) -> str | None:
    """The name of the layer whose forward reproduces ``module``'s class, if any."""
    cls = type(module)
    for name, family in _MLP_LAYERS.items():
        if all(c in module._modules for c in family.children) and family.reproduces(
            cls
        ):
            return name
    return None


def kernelize_mlps(
    model: nn.Module, *, mode, device: str | torch.device | None = None
) -> dict[str, str]:
    """Kernelizes every GeGLU MLP of ``model`` whose forward one of our layers reproduces
    (``kernels.kernelize`` with ``mode`` and ``device``, one MLP module at a time: other
    layers are left as they are), and returns ``{qualified module name: layer}``.

    A class without ``kernel_layer_name`` gets it through kernels'
    ``replace_kernel_forward_from_hub``, which marks the class itself, as
    ``transformers``' hub-kernel decorator does. Modules whose activation is no GeLU are
    replaced too and run their own forward at their first call, with a warning.
    """
    from kernels import kernelize, replace_kernel_forward_from_hub, use_kernel_mapping

    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device_type = torch.device(device).type
    replaced = {}
    for qualified, module in model.named_modules():
        layer = _matching_layer(module)
        if layer is None:
            continue
        cls = type(module)
        if not hasattr(cls, "kernel_layer_name"):
            replace_kernel_forward_from_hub(cls, layer)
        mapping = {cls.kernel_layer_name: {device_type: _ThisPackage(layer)}}
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(module, mode=mode, device=device_type)
        replaced[qualified] = layer
    return replaced
