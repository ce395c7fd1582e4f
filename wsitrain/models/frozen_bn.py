"""Frozen BatchNorm: eval-mode statistics forever, trainable affine parameters.

Whole-slide training runs batch 1 on tiles, where batch statistics would differ per tile and break
the engine's exactness; running statistics from pretraining are the only consistent choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FrozenBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d that ignores ``train()``: it always normalizes with its running statistics."""

    def train(self, mode: bool = True) -> FrozenBatchNorm2d:
        super().train(False)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Eval-mode batch norm without BatchNorm's Python checks on the input (``input.dim()``), so a default
        # torch.fx tracer that does not treat this class as a leaf traces through it into one F.batch_norm call.
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


def freeze_batchnorm(model: nn.Module) -> nn.Module:
    """Freeze every BatchNorm2d of ``model`` in place (and return it).

    The class of each module is swapped rather than the module replaced, so parameters keep their
    identity (an optimizer built earlier still holds them) and ``isinstance(m, nn.BatchNorm2d)`` holds.
    """
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d) and not isinstance(m, FrozenBatchNorm2d):
            m.__class__ = FrozenBatchNorm2d
            m.training = False
    return model
