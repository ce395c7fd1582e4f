"""The real torchvision trunks that need the new operators: ConvNeXt-Tiny and ShuffleNetV2, exact with forced tiles.

Random weights, eval mode, the trunk plus a pooled linear head, 240 x 272 px, float64. Before these
operators ConvNeXt tiled 0 graph nodes and ShuffleNetV2 18 of 367; now every trunk node runs tiled.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torchvision
from test_sft_exact import assert_same, reference, variant
from torch import nn


def trunk_and_head(name: str) -> nn.Sequential:
    torch.manual_seed(0)
    m = getattr(torchvision.models, name)()
    if name.startswith("convnext"):
        feats, c = m.features, 768
    else:
        feats, c = nn.Sequential(m.conv1, m.maxpool, m.stage2, m.stage3, m.stage4, m.conv5), 1024
    head = [("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)), ("fc", nn.Linear(c, 3))]
    return nn.Sequential(OrderedDict([("features", feats), *head])).double().eval()


# ConvNeXt-T's trunk: 9-11 s (measured): `make test` leaves it to CI (`make test-heavy`)
@pytest.mark.parametrize(
    ("name", "min_nodes"), [pytest.param("convnext_tiny", 190, marks=pytest.mark.heavy), ("shufflenet_v2_x1_0", 360)]
)
def test_torchvision_trunk_exact(name: str, min_nodes: int) -> None:
    model = trunk_and_head(name)
    x = torch.randn(1, 3, 240, 272, dtype=torch.float64, requires_grad=True)
    t = torch.randn(1, 3, dtype=torch.float64)
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=128, memory_budget="8GiB")
    assert_same(ref, var)
    plan = var[3].plan_for(tuple(x.shape), input_dtype=torch.float64)
    tiled = sum(len(s.layers) for s in plan.segments if s.mode == "tiled")
    assert all(s.mode == "tiled" and s.n_tiles > 1 for s in plan.segments)
    assert tiled >= min_nodes, f"only {tiled} graph nodes run tiled"
