"""Frozen BatchNorm: eval-mode statistics forever, trainable affine parameters.

Whole-slide training runs batch 1 on tiles, where batch statistics would differ per tile and break
the engine's exactness; running statistics from pretraining are the only consistent choice.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


class FrozenBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d that ignores ``train()``: it always normalizes with its running statistics."""

    sft_frozen_bn = True

    def train(self, mode: bool = True) -> FrozenBatchNorm2d:
        super().train(False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eval-mode batch norm without BatchNorm's Python checks on the input (``input.dim()``), so a default
        # torch.fx tracer that does not treat this class as a leaf traces through it into one F.batch_norm call.
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


def _frozen_train(self: nn.Module, mode: bool = True) -> nn.Module:
    nn.Module.train(self, False)
    return self


@functools.cache
def _frozen_subclass(cls: type[nn.BatchNorm2d]) -> type[nn.BatchNorm2d]:
    """``cls`` with ``train()`` pinned to eval. For BatchNorm2d subclasses with their own forward (timm's
    BatchNormAct2d adds an activation): swapping them to FrozenBatchNorm2d would drop that forward.
    Cached so every layer of one class gets the same frozen class (deterministic, comparable types)."""
    return type(
        f"Frozen{cls.__name__}", (cls,), {"train": _frozen_train, "sft_frozen_bn": True, "__module__": __name__}
    )


def is_frozen_bn(m: nn.Module) -> bool:
    """Whether ``m`` is a BatchNorm frozen by ``freeze_batchnorm``."""
    return isinstance(m, nn.BatchNorm2d) and bool(getattr(m, "sft_frozen_bn", False))


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Freeze every BatchNorm2d of ``model`` in place (and return it).

    The class of each module is swapped rather than the module replaced, so parameters keep their
    identity (an optimizer built earlier still holds them) and ``isinstance(m, nn.BatchNorm2d)`` holds.
    """
    for m in model.modules():
        # a BatchNorm without running statistics always normalises with its batch's (attention.norm: slide): it has
        # nothing to freeze
        if isinstance(m, nn.BatchNorm2d) and not is_frozen_bn(m) and m.running_mean is not None:
            m.__class__ = FrozenBatchNorm2d if type(m) is nn.BatchNorm2d else _frozen_subclass(type(m))
            m.training = False
    return model
