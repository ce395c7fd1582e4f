"""ConvNeXt V2's global response normalization (timm's GlobalResponseNorm) as a multi-pass barrier: SFT equals
plain autograd in float64 (outputs, every parameter gradient, the input gradient, changed buffers), channels-last
and channels-first, in eval and with train-mode BatchNorm elsewhere in the net."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from test_sft_multipass import check, multipass_segments
from torch import nn

from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph

timm = pytest.importorskip("timm", reason="timm is an optional extra; the `test` extra installs it")
from timm.layers.grn import GlobalResponseNorm  # noqa: E402


def _grn(c: int, channels_last: bool) -> GlobalResponseNorm:
    g = GlobalResponseNorm(c, channels_last=channels_last)
    nn.init.uniform_(g.weight, -0.8, 0.8)  # timm initializes both to zero: the layer would be the identity
    nn.init.uniform_(g.bias, -0.3, 0.3)
    return g


class LastBlock(nn.Module):
    """ConvNeXt V2's MLP as timm writes it: channels-last Linear, GELU, GRN, Linear, with a residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 5, padding=2, groups=c)
        self.fc1, self.act, self.grn, self.fc2 = nn.Linear(c, 3 * c), nn.GELU(), _grn(3 * c, True), nn.Linear(3 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)  # (B, H, W, C)
        y = self.fc2(self.grn(self.act(self.fc1(y))))
        return x + y.permute(0, 3, 1, 2)


def grn_net(bn: bool) -> nn.Module:
    """A stem (with BatchNorm, train or eval by the model's mode), a channels-last GRN block, a stride-2 conv
    and a channels-first GRN."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8) if bn else nn.Identity(),
        nn.ReLU(),
        LastBlock(8),
        nn.Conv2d(8, 12, 3, stride=2, padding=1),
        nn.GELU(),
        _grn(12, False),
        nn.Conv2d(12, 12, 3, padding=1),
    )
    return nn.Sequential(
        OrderedDict([("features", trunk), ("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)),
                     ("fc", nn.Linear(12, 3))])
    )


@pytest.mark.parametrize(("tile", "train_bn"), [(16, False), (24, True), (10, True)])
def test_grn_forced_tiles_exact(tile: int, train_bn: bool) -> None:
    sft = check(lambda: grn_net(True), (2, 3, 45, 62), seed=3, train=train_bn, tile_size=tile, memory_budget="4GiB")
    kinds = sorted(b.kind for s in multipass_segments(sft) for b in s.barriers)
    assert kinds.count("grn") == 2, kinds
    assert ("batchnorm" in kinds) == train_bn
    assert all(s.regions.grid[0] * s.regions.grid[1] > 1 for s in multipass_segments(sft)), "must really tile"


def test_grn_one_segment() -> None:
    """Both GRNs in one tiled segment, the second depending on the first: two levels of sweeps."""
    sft = check(lambda: grn_net(False), (1, 3, 37, 50), seed=4, train=False, tile_size=12, memory_budget="4GiB",
                checkpoints=[])
    levels = sorted(b.level for s in multipass_segments(sft) for b in s.barriers)
    assert levels == [1, 2], levels


def test_grn_is_a_barrier_with_its_layout() -> None:
    facts = annotate(ModelGraph(grn_net(False).double().eval()), (1, 3, 32, 32), torch.float64, torch.float64)
    grns = [n for n in facts.nodes if n.spec.type_name == "GlobalResponseNorm"]
    assert [n.spec.extra.get("barrier") for n in grns] == ["grn", "grn"]
    assert [n.spec.spatial_dims for n in grns] == [(1, 2), (2, 3)]  # channels-last, then channels-first
    assert all(n.spec.tileable and n.spec.saves_input and n.spec.flops_per_output > 0 for n in grns)
