"""Models for tests/test_check_model.py, loaded by `wsitrain check-model check_model_nets:<function>`."""

from __future__ import annotations

import torch
from torch import nn


class Flip(nn.Module):
    """Mirrors the image: no tile of the output can be computed from the same tile of the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, dims=[3])


def _net(middle: nn.Module) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        middle,
        nn.Conv2d(6, 8, 3, stride=2, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(1),
        nn.Linear(8, 3),
    )


def small_net() -> nn.Module:
    return _net(nn.MaxPool2d(2))


def flip_net() -> nn.Module:
    return _net(Flip())


def not_a_model() -> str:
    return "a string"
