"""Multi-pass segments that fold the global pool, and squeeze-excitation written by hand on (B, C) values.

Float64, exact against plain autograd (outputs, every parameter gradient, the input gradient, BatchNorm's
running statistics), with the helpers of ``test_sft_multipass``: batch 2, a non-square image, ragged tiles.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from sft_models_modern import SE_FORMS, AddGate, head, se_form_net
from test_sft_multipass import MBConv, assert_bf16_no_worse, check, multipass_segments
from torch import nn
from torchvision.models.resnet import BasicBlock

import wsitrain.sft.planning.options as options
from wsitrain.models import build
from wsitrain.sft import SFT, plan
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.barriers import SQUEEZE

SHAPE = (2, 3, 45, 62)
KIND = {"avg": "avg", "mean": "avg", "max": "max", "amax": "amax"}


class GlobalPool(nn.Module):
    """The global pooling forms the fused pool folds: module, ``mean``, adaptive max, ``amax``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.avg = nn.AdaptiveAvgPool2d(1)
        self.max = nn.AdaptiveMaxPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "avg":
            return self.avg(x).flatten(1)
        if self.how == "max":
            return self.max(x).flatten(1)
        if self.how == "amax":
            return torch.amax(x, dim=(-2, -1))
        return x.mean((2, 3))


def _constant_channel(conv: nn.Conv2d) -> nn.Conv2d:
    """Channel 0 becomes 0.3 everywhere (zero weights, bias 0.3, then ReLU): its maximum ties across all tiles."""
    with torch.no_grad():
        conv.weight[0].zero_()
        conv.bias[0] = 0.3
    return conv


def resnet_like(pool: str) -> nn.Module:
    """Residual blocks with BatchNorm (train mode in the tests), a stride-2 downsample, a 1x1 conv, a global pool."""
    down = nn.Sequential(nn.Conv2d(8, 12, 1, 2, bias=False), nn.BatchNorm2d(12))
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        BasicBlock(8, 8),
        BasicBlock(8, 12, 2, down),
        _constant_channel(nn.Conv2d(12, 6, 1)),
        nn.ReLU(),
    )
    return nn.Sequential(OrderedDict([("features", trunk), ("pool", GlobalPool(pool)), ("fc", nn.Linear(6, 3))]))


def se_like(pool: str) -> nn.Module:
    """torchvision's SqueezeExcitation (in MBConv blocks) and the SENet form, before a global pool."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, 2, 1),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        MBConv(8, 16),
        SE_FORMS["selayer"](8),
        _constant_channel(nn.Conv2d(8, 6, 1)),
        nn.ReLU(),
    )
    return nn.Sequential(OrderedDict([("features", trunk), ("pool", GlobalPool(pool)), ("fc", nn.Linear(6, 3))]))


def _fused_last(sft: SFT, pool: str) -> None:
    """The step ran with the pool folded into the last segment, a multi-pass one, over several tiles."""
    compiled = next(iter(sft._cache.values()))
    last_plan, last_seg = compiled.plan.segments[-1], compiled.segments[-1]
    assert last_plan.mode == "tiled" and last_plan.fused_pool == KIND[pool], f"not fused:\n{compiled.plan}"
    assert last_seg in multipass_segments(sft) and last_seg.fusion is not None
    assert last_plan.n_tiles > 1, "the test must really tile"


@pytest.mark.parametrize("tile", [16, 24])
@pytest.mark.parametrize("pool", ["avg", "mean", "max", "amax"])
def test_train_bn_segment_folds_the_pool(pool: str, tile: int) -> None:
    sft = check(lambda: resnet_like(pool), SHAPE, seed=11, tile_size=tile, memory_budget="4GiB", checkpoints=[])
    _fused_last(sft, pool)


def test_train_bn_fused_after_a_checkpoint() -> None:
    """The multi-pass segment that folds the pool starts at a checkpoint (not the image)."""
    sft = check(
        lambda: resnet_like("avg"), SHAPE, seed=12, tile_size=16, memory_budget="4GiB", checkpoints=["features.3.relu"]
    )
    _fused_last(sft, "avg")
    assert len(next(iter(sft._cache.values())).plan.segments) == 2


@pytest.mark.parametrize(("pool", "train"), [("avg", True), ("amax", False), ("max", True)])
def test_squeeze_excitation_segment_folds_the_pool(pool: str, train: bool) -> None:
    sft = check(lambda: se_like(pool), SHAPE, seed=13, train=train, tile_size=16, memory_budget="4GiB", checkpoints=[])
    _fused_last(sft, pool)
    kinds = [b.kind for b in multipass_segments(sft)[-1].barriers]
    assert kinds.count(SQUEEZE) == 2, kinds


@pytest.mark.parametrize(("make", "pool"), [(se_like, "amax"), (resnet_like, "max")])
def test_fused_bf16_autocast_as_accurate_as_plain(make, pool: str) -> None:
    """Under bf16 autocast the folded pool loses no more than plain autograd does against float64 (amax's tie
    mask and max's index come from the recomputed tiles, which must match the forward's values)."""
    torch.manual_seed(15)
    model = make(pool).train()
    twin, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(*SHAPE)
    ref(x.double()).square().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().square().sum().backward()
        sft = SFT(twin, tile_size=16, memory_budget="4GiB", checkpoints=[])
        sft(x).float().square().sum().backward()
    _fused_last(sft, pool)
    assert_bf16_no_worse(ref, model, twin)


def test_fusion_lowers_the_planned_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same segments and tiles, with and without the fold: the last map and its gradient leave the plan."""
    model = resnet_like("avg").double().train()
    sft = SFT(model, tile_size=16, memory_budget="4GiB", checkpoints=[])
    fused = sft.plan_for(SHAPE, input_dtype=torch.float64)
    monkeypatch.setattr(options, "fuses_pool", lambda sess, start, end: False)  # the planner before this change
    joined = SFT(model, tile_size=16, memory_budget="4GiB", checkpoints=[]).plan_for(SHAPE, input_dtype=torch.float64)
    assert fused.segments[-1].fused_pool == "avg" and joined.segments[-1].fused_pool is None
    last_map = 2 * 6 * 23 * 31 * 8  # (B, C, H, W) float64 after the stride-2 block
    assert joined.breakdown["head"] >= last_map > fused.breakdown["head"]
    assert fused.estimated_peak_bytes <= joined.estimated_peak_bytes - last_map


@pytest.mark.heavy  # ResNet-50 planned at slide size: 11 s (measured); CI runs it (`make test-heavy`)
def test_resnet50_train_bn_at_slide_size_has_no_full_size_head() -> None:
    """ResNet-50 with train-mode BatchNorm at 100,000 px: before, the head was 149 GiB and its gradient 74.5 GiB."""
    with torch.device("meta"):
        model = build("resnet50", 2, freeze_bn=False).train()
    p = plan(model, (1, 3, 100_000, 100_000), "11GiB", device="cuda")
    assert p.segments[-1].mode == "tiled" and p.segments[-1].fused_pool == "avg", p
    assert p.breakdown["head"] < 2**20 and p.breakdown["gradient_buffers"] < 2**30, p.breakdown


@pytest.mark.parametrize("form", sorted(SE_FORMS))
def test_hand_written_squeeze_excitation_tiles(form: str) -> None:
    """view / flatten / [:, :, None, None] / unsqueeze / expand_as around 2-D Linear layers: squeeze-excitation
    barriers inside a tiled segment (the trunk runs to the last conv), exact."""
    facts = annotate(ModelGraph(se_form_net(form)), SHAPE, torch.float32, torch.float32)
    assert facts.name(facts.trunk_end) == "features.6", "the squeeze-excitation pools must not end the trunk"
    barriers = [f.name for f in facts.nodes if f.spec.extra and f.spec.extra.get("barrier") == SQUEEZE]
    assert len(barriers) == 2, barriers
    for tile in (16, 24):
        sft = check(lambda: se_form_net(form), SHAPE, seed=14, train=False, tile_size=tile, memory_budget="4GiB",
                    checkpoints=[])
        (seg,) = multipass_segments(sft)
        assert [b.kind for b in seg.barriers] == [SQUEEZE, SQUEEZE] and seg.regions.grid[0] * seg.regions.grid[1] > 1


def test_pooled_value_added_back_is_not_squeeze_excitation() -> None:
    """A pooled (B, C) that returns by an add is no barrier: its pool still ends the tiled trunk."""
    trunk = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), AddGate(6), nn.Conv2d(6, 6, 3, padding=1))
    model = nn.Sequential(OrderedDict([("features", trunk), *head(6)]))
    facts = annotate(ModelGraph(model), SHAPE, torch.float32, torch.float32)
    assert not any(f.spec.extra and f.spec.extra.get("barrier") for f in facts.nodes)
    assert facts.name(facts.trunk_end) == "features.1"
