"""Predicted step cost per slide (what distributed.balance: time sorts by), from the preflight's shapes and plans."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from wsitrain.config import WsiTrainConfig
from wsitrain.models import build
from wsitrain.preflight import SlideShape, run_preflight
from wsitrain.sft import SFT
from wsitrain.sft.planning.tissue_share import tissue_tile_share
from wsitrain.slides.dataset import load_labels
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.train.balance.cost import predicted_cost, slide_costs, tile_share

H = W = 512
BACKGROUND = 240


@pytest.fixture(scope="module")
def plan():  # the tiny model tiled 8 x 8 (64 px tiles) with background reuse: most of its time is tiled
    p = SFT(build("tiny", 2), memory_budget="1GiB", tile_size=64).plan_for((1, 3, H, W), input_dtype=torch.uint8)
    assert p.reuse_tiles and p.tiled_segments[0].start == 0 and p.time_tiles > 0.5 * p.time_sft
    return p


def _cells(image: torch.Tensor, n: int) -> np.ndarray:
    """Which of n x n cells of ``image`` hold a pixel that is not the background (the preflight's grid)."""
    tissue = image[0] != BACKGROUND
    return tissue.reshape(n, H // n, n, W // n).any(3).any(1).numpy()


@pytest.mark.parametrize("n", [16, 32, 64])
def test_tiles_counted_on_the_grid_are_the_executors(plan, n: int) -> None:
    """The share counted on a coarse tissue grid equals what the executor's rule counts on the pixels."""
    image = torch.full((3, H, W), BACKGROUND, dtype=torch.uint8)
    image[:, 100:220, 260:330] = 120
    exact = tissue_tile_share(image, plan)
    assert exact is not None and 0.4 < exact < 0.7
    assert tile_share(_cells(image, n), plan) == exact


def test_no_tissue_leaves_the_border_tiles_and_no_grid_or_reuse_counts_nothing(plan) -> None:
    assert tile_share(np.ones((64, 64), bool), plan) == 1.0
    assert tile_share(np.zeros((64, 64), bool), plan) == (64 - 36) / 64  # the 8 x 8 grid's border
    assert tile_share(None, plan) is None
    assert tile_share(np.ones((64, 64), bool), replace(plan, reuse_tiles=False)) is None


def test_cost_grows_with_tissue_and_with_area_within_a_bucket(plan) -> None:
    full = SlideShape("a", Path("a"), 0, 0.5, (H, W), (H, W), np.ones((64, 64), bool))
    some = replace(full, tissue_cells=np.eye(64, dtype=bool))
    none = replace(full, tissue_cells=None)  # masking off: every tile computes
    smaller = replace(full, shape=(H // 2, W))  # half the bucket's area, planned with the bucket
    assert predicted_cost(some, plan) < predicted_cost(full, plan) == predicted_cost(none, plan) == plan.time_sft
    assert predicted_cost(smaller, plan) == pytest.approx(plan.time_sft / 2)


def test_costs_from_the_preflight_follow_the_slides_areas(tmp_path: Path) -> None:
    sides = {"small.svs": 256, "large.svs": 640, "mid.svs": 448}
    for i, (name, side) in enumerate(sides.items()):
        write_synthetic_slide(tmp_path / name, size=side, positive=bool(i % 2), seed=i)
    (tmp_path / "labels.csv").write_text("slide,label\n" + "".join(f"{n},{'ab'[i % 2]}\n" for i, n in
                                                                   enumerate(sides)))  # fmt: skip
    cfg = WsiTrainConfig.model_validate({
        "data": {"labels": str(tmp_path / "labels.csv"), "region": "whole"},  # mask_background: on by default
        "model": {"name": "tiny"}, "engine": {"memory_budget": "1GiB", "device": "cpu"},
    })  # fmt: skip
    report = run_preflight(cfg, 2**30, "cpu")
    assert all(s.tissue_cells is not None and s.tissue_cells.any() for s in report.slides)
    records, _ = load_labels(tmp_path / "labels.csv")
    costs, buckets = slide_costs(report, records)
    by_name = dict(zip([r.path.name for r in records], costs, strict=True))
    assert by_name["small.svs"] < by_name["mid.svs"] < by_name["large.svs"]
    assert buckets == [next(s.bucket for s in report.slides if s.path.name == r.path.name) for r in records]
    # shapes only (no tissue detection): no grid, the same order by area
    shapes_only = run_preflight(cfg, 2**30, "cpu", shapes_only=True)
    assert all(s.tissue_cells is None for s in shapes_only.slides)
    assert np.argsort(slide_costs(shapes_only, records)[0]).tolist() == np.argsort(costs).tolist()
