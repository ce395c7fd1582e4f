"""A model in channels_last memory format (as a user converts it for speed) through SFT: plain autograd's results."""

from __future__ import annotations

import pytest
import torch
from sft_models import MODELS
from test_sft_exact import assert_same, make, reference, variant
from torch import nn


def _bn_train() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16, momentum=0.3), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, stride=2), nn.Conv2d(16, 6, 1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3),
    )  # fmt: skip


@pytest.mark.parametrize(("name", "tile"), [("resnet_bottleneck", 16), ("dense", 24), ("vgg_chain", 32)])
def test_channels_last_models_tile_exactly(name: str, tile: int) -> None:
    model, x, t = make(name, (2, 3, 45, 62))
    ref_model = MODELS[name]().double()
    ref_model.load_state_dict(model.state_dict())
    model = model.to(memory_format=torch.channels_last)
    xc = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    var = variant(model, xc, t, tile_size=tile, memory_budget="4GiB")
    assert_same(reference(ref_model, x, t), var)
    plan = var[3].plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert any(s.n_tiles > 1 for s in plan.segments), "the test must really tile"


def test_channels_last_train_mode_batchnorm_tiles_exactly() -> None:
    torch.manual_seed(2)
    model, ref_model = _bn_train().double(), _bn_train().double()
    ref_model.load_state_dict(model.state_dict())
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 37, 51, dtype=torch.float64)
    t = torch.randn(2, 3, dtype=torch.float64)
    ref = reference(ref_model, x.requires_grad_(True), t)
    var = variant(model, x.contiguous(memory_format=torch.channels_last), t, tile_size=12, memory_budget="4GiB")
    assert_same(ref, var)
    for a, b in zip(ref_model.buffers(), model.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-13)
