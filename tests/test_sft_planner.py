"""Planner: figures against the paper and measurements, plans on shapes only, and clear errors."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from sft_models import MODELS, head
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.models import build
from wsitrain.sft import SFT, max_square_size, plan

GiB = 1024**3


def meta_model(name: str) -> nn.Module:
    with torch.device("meta"):
        return build(name, 2)


@pytest.mark.parametrize(("name", "paper_gib"), [("vgg16", 118), ("vgg19", 129)])
def test_feature_maps_match_paper(name: str, paper_gib: float) -> None:
    """The paper's figure counts every feature map once; ours must agree within 15%."""
    p = plan(meta_model(name), (1, 3, 10240, 10240), "2TiB", device="cpu")
    assert abs(p.feature_map_bytes / GiB - paper_gib) / paper_gib < 0.15
    # what PyTorch really keeps is more: int64 max-pool indices and backward's gradient buffers
    assert p.baseline_peak_bytes > p.feature_map_bytes


def test_darknet_plain_peak_matches_measurement() -> None:
    """Plain DarkNet-19 training measures about 108 GiB at 10240 px (peak RSS growth at 1024 px, x100)."""
    p = plan(meta_model("darknet19"), (1, 3, 10240, 10240), "2TiB", device="cpu")
    assert abs(p.baseline_peak_bytes / GiB - 108) / 108 < 0.15


def test_vgg16_20480_fits_2080ti() -> None:
    p = plan(meta_model("vgg16"), (1, 3, 20480, 20480), "11GiB", device="cuda")
    assert p.fits
    assert p.estimated_peak_bytes <= 11 * GiB < p.checkpoint_peak_bytes < p.baseline_peak_bytes
    tiled = [s for s in p.segments if s.mode == "tiled"]
    assert tiled and tiled[0].checkpoint_location == "host"  # the image streams from host memory
    assert tiled[0].n_tiles > 1
    assert 0 < p.overhead < 1.0
    d = p.to_dict()
    json.dumps(d)
    assert d["fits"] is True and d["segments"][0]["layers"] == list(p.segments[0].layers)
    text = str(p)
    assert "fits" in text and "segment 0" in text


def test_plan_spends_tiles_where_memory_is() -> None:
    """VGG-16 at 1024 px with 35% of plain's memory: tile the full-resolution blocks, run the rest plain."""
    m = meta_model("vgg16")
    base = plan(m, (1, 3, 1024, 1024), "100GiB", device="cpu")
    assert all(s.mode == "plain" for s in base.segments) and base.recomputed_tiles == 0
    p = plan(m, (1, 3, 1024, 1024), int(0.35 * base.baseline_peak_bytes), device="cpu")
    assert p.fits
    modes = [s.mode for s in p.segments]
    assert "tiled" in modes and modes[-1] == "plain"
    first_tiled = next(s for s in p.segments if s.mode == "tiled")
    assert "features.0" in first_tiled.layers
    assert p.overhead < 0.35  # a full recompute alone would be +33%


def test_plan_on_huge_shapes_is_shape_only() -> None:
    p = plan(meta_model("vgg16"), (1, 3, 100000, 100000), "80GiB", device="cuda")
    assert p.budget_bytes == 80 * GiB
    assert p.estimated_peak_bytes > 0


def test_max_square_size() -> None:
    m = meta_model("tiny")
    edge = max_square_size(m, "64MiB", device="cpu")
    assert edge > 0 and edge % m.stride == 0
    assert plan(m, (1, 3, edge, edge), "64MiB", device="cpu").fits
    assert not plan(m, (1, 3, edge * 2, edge * 2), "64MiB", device="cpu").fits


def test_impossible_budget() -> None:
    p = plan(meta_model("vgg16"), (1, 3, 4096, 4096), "20MiB", device="cpu")
    assert not p.fits
    assert any("needs at least" in n for n in p.notes)
    with pytest.raises(PlanError, match="does not fit"):
        SFT(MODELS["vgg_chain"](), memory_budget="1KiB")(torch.randn(1, 3, 64, 64))


def squeeze(p, frac: float) -> int:
    """A budget that leaves ``frac`` of plain's activation memory (weights and runtime stay whole)."""
    fixed = p.breakdown["parameters"] + p.breakdown["runtime"]
    return int(fixed + frac * (p.baseline_peak_bytes - fixed))


def _with(layer: nn.Module) -> nn.Sequential:
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        layer,
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(4),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(8)]))


@pytest.mark.parametrize(
    ("layer", "words"),
    [
        (nn.Dropout(0.5), ["features.1", "Dropout", "position-dependent"]),
        (nn.GroupNorm(2, 8), ["features.1", "GroupNorm", "not an operator the SFT engine knows"]),
    ],
)
def test_untileable_layer_where_tiling_is_needed(layer: nn.Module, words: list[str]) -> None:
    model = _with(layer).train()
    x = torch.randn(1, 3, 256, 256)
    plain = plan(model, tuple(x.shape), "10GiB", device="cpu")
    assert plain.fits  # untiled, any layer runs
    with pytest.raises(PlanError) as err:
        SFT(model, memory_budget=squeeze(plain, 0.4))(x)
    msg = str(err.value)
    for w in words:
        assert w in msg


def test_frozen_batchnorm_tiles() -> None:
    model = _with(nn.BatchNorm2d(8)).eval()
    x = torch.randn(1, 3, 256, 256)
    plain = plan(model, tuple(x.shape), "10GiB", device="cpu")
    out = SFT(model, memory_budget=squeeze(plain, 0.4))(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


def test_bad_checkpoint_name_lists_valid_ones() -> None:
    with pytest.raises(PlanError, match="valid:"):
        SFT(MODELS["vgg_chain"](), checkpoints=["nope"], memory_budget="1GiB")(torch.randn(1, 3, 32, 32))


def test_bad_budget_string() -> None:
    from wsitrain.errors import WsiTrainError

    with pytest.raises(WsiTrainError, match="cannot read"):
        plan(MODELS["vgg_chain"](), (1, 3, 32, 32), "eleven gigs", device="cpu")


def test_sft_plans_a_model_built_on_the_meta_device() -> None:
    """Planning needs shapes only: an SFT around a meta model plans (it used to fail asking autocast about the
    meta device) as ``plan`` does for that device."""
    with torch.device("meta"):
        model = build("vgg16", 2)
    shape = (1, 3, 2048, 2048)
    got = SFT(model, memory_budget="2GiB").plan_for(shape)
    want = plan(model, shape, "2GiB", device="meta", input_on_host=False)
    assert got.fits == want.fits
    assert got.estimated_peak_bytes == want.estimated_peak_bytes
    assert [s.mode for s in got.segments] == [s.mode for s in want.segments]
