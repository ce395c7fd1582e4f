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


def exact_in_place(m: nn.Module) -> bool:
    """Does ``m``'s in-place form compute the same output and input gradient, bit for bit, as its out-of-place form?

    Only activations whose in-place backward reads the result and decides from it exactly as the out-of-place
    backward does from the input: ReLU (both forms keep the result), LeakyReLU with a slope >= 0 (the result is
    positive exactly where the input is; torch refuses a negative slope in place), ReLU6 and Hardtanh with
    min < max (the result lies strictly inside (min, max) exactly where the input does). Not ELU & co (their
    backward from the result computes exp differently: other bits), nor SiLU, Hardswish, Mish (in place, autograd
    clones the input: no byte saved). Exact types only: a subclass may change forward.
    """
    t = type(m)
    if t is nn.ReLU:
        return True
    if t is nn.LeakyReLU:
        return float(m.negative_slope) >= 0.0
    if t in (nn.ReLU6, nn.Hardtanh):
        return float(m.min_val) < float(m.max_val)
    return False


def known_activation(m: nn.Module) -> bool:
    """One of torch.nn's elementwise activations."""
    return isinstance(m, tuple(ACTIVATIONS))


def is_pointwise_module(m: nn.Module) -> bool:
    """Modules that declare themselves pointwise (wsitrain's InputNormalization does)."""
    return bool(getattr(m, "sft_pointwise", False)) or type(m).__name__ == "InputNormalization"
