"""ResNeSt's split attention (timm's SplitAttn: radix-summed global mean, fc layers, radix softmax, weighted sum
of the 5-D radix map) as a squeeze-excitation barrier: SFT equals plain autograd in float64, in eval and with
train-mode BatchNorm (inside the attention's fc chain too), radix 1, 2 and 4."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from test_sft_multipass import check, multipass_segments
from torch import nn

from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph

timm = pytest.importorskip("timm", reason="timm is an optional extra; the `test` extra installs it")
from timm.layers.split_attn import SplitAttn  # noqa: E402


def splat_net(radix: int) -> nn.Module:
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        SplitAttn(8, 8, radix=radix, rd_channels=4, norm_layer=nn.BatchNorm2d, groups=1),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        SplitAttn(8, 12, stride=1, radix=radix, rd_channels=4),
    )
    return nn.Sequential(
        OrderedDict([("features", trunk), ("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)),
                     ("fc", nn.Linear(12, 3))])
    )


@pytest.mark.parametrize(("radix", "train", "tile"), [(2, False, 16), (4, True, 12), (1, True, 24)])
def test_split_attention_forced_tiles_exact(radix: int, train: bool, tile: int) -> None:
    sft = check(lambda: splat_net(radix), (2, 3, 45, 62), seed=5, train=train, tile_size=tile, memory_budget="4GiB")
    segs = multipass_segments(sft)
    assert [b.kind for s in segs for b in s.barriers].count("squeeze") == 2
    assert all(s.regions.grid[0] * s.regions.grid[1] > 1 for s in segs), "must really tile"


def test_split_attention_layout() -> None:
    """The weighted sum multiplies the (B, radix, C, H, W) map: its image axes are dims 3 and 4."""
    facts = annotate(ModelGraph(splat_net(2).double().eval()), (1, 3, 32, 32), torch.float64, torch.float64)
    muls = [n for n in facts.nodes if n.name.endswith("(mul)")]
    assert muls and all(n.spec.tileable and n.spec.spatial_dims == (3, 4) and len(n.shape) == 5 for n in muls)
    assert sum(1 for n in facts.nodes if (n.spec.extra or {}).get("barrier") == "squeeze") == 2
