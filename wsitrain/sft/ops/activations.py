"""The element-wise activations the engine knows (torch.nn's) and modules that declare themselves pointwise: one
vocabulary for the operator registry and for timm's norm-act layers (``norm_act.py``)."""

from __future__ import annotations

from torch import nn

# Pointwise activations: (saves input, saves output) of the out-of-place form. In-place forms save
# their output (which is their input's storage).
ACTIVATIONS: dict[type, tuple[bool, bool]] = {
    nn.ReLU: (False, True),
    nn.ReLU6: (True, False),
    nn.LeakyReLU: (True, False),
    nn.ELU: (False, True),
    nn.CELU: (False, True),
    nn.SELU: (False, True),
    nn.GELU: (True, False),
    nn.SiLU: (True, False),
    nn.Mish: (True, False),
    nn.Sigmoid: (False, True),
    nn.Tanh: (False, True),
    nn.Hardswish: (True, False),
    nn.Hardsigmoid: (True, False),
    nn.Hardtanh: (True, False),
    nn.Softplus: (True, False),
    nn.PReLU: (True, False),
}
def known_activation(m: nn.Module) -> bool:
    """One of torch.nn's elementwise activations."""
    return isinstance(m, tuple(ACTIVATIONS))


def is_pointwise_module(m: nn.Module) -> bool:
    """Modules that declare themselves pointwise (wsitrain's InputNormalization does)."""
    return bool(getattr(m, "sft_pointwise", False)) or type(m).__name__ == "InputNormalization"
