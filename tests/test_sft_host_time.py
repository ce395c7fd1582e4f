"""The host's share of a step (sft/simulate/host_time.py): launches, copies and synchronizations counted on the meta
device with the real plan's grid; ``plan --simulate`` and ``bench`` report them."""

from __future__ import annotations

import pytest
import torch

from wsitrain.gpus import resolve_budget
from wsitrain.models import build
from wsitrain.sft.simulate.host_time import HostTime, measure_host_time


def _measure(model: str, size: int, memory: str, tile: int | None = None, classes: int = 2) -> HostTime:
    b = resolve_budget("h100", memory)
    with torch.device("meta"):
        net = build(model, classes)
    return measure_host_time(net, (1, 3, size, size), b.bytes, dtype=torch.bfloat16, target=b.target, tile_size=tile)


def test_counts_scale_with_the_grid_and_name_the_copies() -> None:
    """Twice the tiles, more launches per step; the image's tiles go up as copies; every visit is one tile. Three
    classes: the last segment recomputes (no one pass), so tiles are visited in forward and in backward."""
    coarse = _measure("tiny", 1024, "1GiB", tile=512, classes=3)
    fine = _measure("tiny", 1024, "1GiB", tile=256, classes=3)
    tiled = [s for s in fine.plan.segments if s.mode == "tiled"]
    assert tiled and coarse.plan.segments[0].mode == "tiled"
    # forward and recompute of every tile (the image's normalization alone has no parameters: no recompute)
    assert sum(s.n_tiles for s in tiled) < fine.tile_visits <= 2 * sum(s.n_tiles for s in tiled)
    assert fine.tile_visits > coarse.tile_visits
    assert fine.launches > coarse.launches > 0
    assert fine.by_op["convolution.default"] == 4 * coarse.by_op["convolution.default"] > 0  # 16 tiles, 4
    # the image streams from the host: one upload per tile of the first segment (forward only: no parameters)
    assert fine.copies == fine.plan.segments[0].n_tiles and coarse.copies == 4
    assert fine.host_bytes > 0 and fine.seconds > 0 and fine.optimizer_launches > 0
    # a tile's parameter gradients are summed by one multi-tensor add, not one add per parameter
    assert 0 < fine.by_op["_foreach_add_.List"] < fine.tile_visits
    d = fine.to_dict()
    assert d["launches_per_step"] == fine.launches and "measured" in d["how"]
    assert "launches" in fine.text()


def test_content_checks_count_as_synchronizations() -> None:
    """A background-reuse check reads device content (torch.equal, bool(tensor)): each is a synchronization on a
    GPU; tiles with a reuse key check, so a grid with interior tiles synchronizes."""
    h = _measure("tiny", 2048, "1GiB", tile=256)
    assert h.plan.reuse_tiles
    assert h.syncs > 0


def test_host_time_refuses_an_image_larger_than_half_the_free_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan --simulate at 100,000 px allocated a real 28 GiB host image to time its staging; it now says why not."""
    from wsitrain.sft.simulate import host_time

    monkeypatch.setattr(host_time, "available_host_bytes", lambda: 2 * 2**30)
    assert host_time.host_image_refusal((1, 3, 512, 512)) is None
    reason = host_time.host_image_refusal((1, 3, 100_000, 100_000))
    assert reason is not None and "27.94 GiB image" in reason and "2.00 GiB available" in reason
    assert host_time.host_image_refusal((1, 3, 1024, 1024), torch.float32) is None
    assert host_time.host_image_refusal((1, 3, 20_000, 20_000), torch.float32) is not None
