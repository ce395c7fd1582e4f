"""timm's BatchNormAct2d (BatchNorm, then its drop and activation) in training mode inside tiles equals plain
autograd (float64): outputs, every parameter gradient, the input gradient and the running statistics after the
step; variants the engine cannot tile are refused by name (``wsitrain.sft.ops.norm_act``).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from test_sft_multipass import _head, check, multipass_segments
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.sft import SFT

norm_act = pytest.importorskip("timm.layers.norm_act", reason="timm is an optional extra; the `test` extra installs it")
BatchNormAct2d = norm_act.BatchNormAct2d


class Centered(nn.Module):
    """An activation that is not elementwise in the engine's sense (it reads a whole-map statistic)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean()


def bnact_net() -> nn.Module:
    """conv + BatchNormAct2d blocks: SiLU with cumulative averaging (momentum=None), in-place ReLU behind a stride-2
    conv, a depthwise conv with no activation (apply_act=False), PReLU (a parameter), Hardswish with an inactive
    Dropout (rate 0), and one without running statistics (batch statistics, nothing updated)."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        BatchNormAct2d(6, momentum=None, act_layer=nn.SiLU),
        nn.Conv2d(6, 8, 3, stride=2, padding=1),
        BatchNormAct2d(8, momentum=0.3, act_layer=nn.ReLU, inplace=True),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
        BatchNormAct2d(8, apply_act=False),
        nn.Conv2d(8, 8, 1),
        BatchNormAct2d(8, act_layer=nn.PReLU, inplace=False),
        nn.Conv2d(8, 8, 3, padding=1),
        BatchNormAct2d(8, act_layer=nn.Hardswish, drop_layer=lambda: nn.Dropout(0.0)),
        nn.Conv2d(8, 8, 3, padding=1),
        BatchNormAct2d(8, track_running_stats=False, act_layer="gelu"),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *_head(8)]))


N_BN = 6


@pytest.mark.parametrize(("tile", "shape"), [(16, (2, 3, 45, 62)), (24, (2, 3, 53, 38))])
def test_bnact_net_forced_tiles(tile: int, shape: tuple[int, ...]) -> None:
    sft = check(bnact_net, shape, seed=11, tile_size=tile, memory_budget="4GiB")
    segs = multipass_segments(sft)
    assert segs and all(s.regions.grid[0] * s.regions.grid[1] > 1 for s in segs), "must really tile"
    acts = [a for s in segs for a in s.act.values() if not isinstance(a, nn.Identity)]
    assert len(acts) == N_BN - 1, "every BatchNormAct2d but apply_act=False runs its activation"


@pytest.mark.parametrize("checkpoints", [[], ["features.3", "features.7"]])
def test_bnact_net_segmentations(checkpoints: list[str]) -> None:
    """The whole trunk as one tiled segment (six levels of sweeps), and cut in three."""
    sft = check(bnact_net, (2, 3, 45, 62), seed=12, tile_size=16, memory_budget="4GiB", checkpoints=checkpoints)
    held = [b.kind for s in multipass_segments(sft) for b in s.barriers]
    assert held.count("batchnorm") == N_BN, held
    if not checkpoints:
        (seg,) = multipass_segments(sft)
        assert seg.levels == list(range(1, N_BN + 1)), seg.levels


def test_bnact_net_eval_tiles() -> None:
    """Eval mode: running statistics (pointwise), except the layer without them (batch statistics, a barrier)."""
    sft = check(bnact_net, (2, 3, 45, 62), seed=13, train=False, tile_size=16, memory_budget="4GiB")
    held = [b.kind for s in multipass_segments(sft) for b in s.barriers]
    assert held == ["batchnorm"], held


def test_activation_really_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the activation after the normalization the comparison fails: the tests above can fail."""
    import wsitrain.sft.execution.multipass_tile as mp

    monkeypatch.setattr(mp, "act_after_norm", lambda m: None)
    with pytest.raises(AssertionError):
        check(bnact_net, (2, 3, 45, 62), seed=11, tile_size=16, memory_budget="4GiB")


def _one(norm: nn.Module) -> nn.Module:
    trunk = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), norm, nn.Conv2d(6, 6, 3, padding=1))
    return nn.Sequential(OrderedDict([("features", trunk), *_head(6)]))


class OwnForward(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def _sync_act() -> nn.Module:
    return norm_act.convert_sync_batchnorm(BatchNormAct2d(6, act_layer=nn.SiLU))


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: BatchNormAct2d(6, drop_layer=lambda: nn.Dropout(0.2)), "drop layer Dropout is active in training"),
        (lambda: BatchNormAct2d(6, act_layer=Centered), "BatchNormAct2d's activation Centered is not an elementwise"),
        (_sync_act, "SyncBatchNormAct with batch statistics"),
        (lambda: nn.SyncBatchNorm(6), "SyncBatchNorm with batch statistics"),
        (lambda: OwnForward(6), "OwnForward overrides BatchNorm2d's forward"),
    ],
)
def test_refused_by_name(make, says: str) -> None:
    model = _one(make()).double().train()
    with pytest.raises(PlanError, match=says):
        SFT(model, tile_size=16, memory_budget="4GiB")(torch.randn(2, 3, 37, 41, dtype=torch.float64))


@pytest.mark.parametrize(
    "make", [_sync_act, lambda: nn.SyncBatchNorm(6), lambda: norm_act.FrozenBatchNormAct2d(6, act_layer=nn.SiLU)]
)
def test_running_statistics_variants_exact(make) -> None:
    """SyncBatchNorm(Act) in eval mode and timm's FrozenBatchNormAct2d (a plain module, traced through) tile as
    the pointwise layers they are."""

    def build() -> nn.Module:
        model = _one(make())
        norm = model.features[1]
        with torch.no_grad():  # non-trivial statistics, so a wrong normalization shows
            norm.running_mean.uniform_(-0.2, 0.2)
            norm.running_var.uniform_(0.5, 1.5)
        return model

    sft = check(build, (2, 3, 37, 41), seed=14, train=False, tile_size=16, memory_budget="4GiB")
    plan = next(iter(sft._cache.values())).plan
    assert any(s.mode == "tiled" and s.n_tiles > 1 for s in plan.segments), f"must really tile:\n{plan}"
