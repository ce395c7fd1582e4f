"""Tile timings on CUDA come from events read once per step: no device synchronization per tile (checked on CPU
by making the stats recorder believe it runs on CUDA, with fake timing events)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import wsitrain.sft.api as api
from wsitrain.sft import SFT
from wsitrain.sft.execution.stats import StatsRecorder, StepStats

_clock = itertools.count()


class FakeEvent:
    """Records a tick of a global clock; elapsed_time is the ticks between two events (ms)."""

    syncs = 0

    def __init__(self) -> None:
        self.t: int | None = None

    def record(self, stream: object = None) -> None:
        assert stream == "compute"  # tiles are timed on the compute stream
        self.t = next(_clock)

    def synchronize(self) -> None:
        FakeEvent.syncs += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.t is not None and end.t is not None
        return float(end.t - self.t)


def _model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).double()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")

    def recorder(device: torch.device, stats: StepStats, meter: object = None) -> StatsRecorder:
        return StatsRecorder(torch.device("cuda"), stats, meter, new_event=FakeEvent)  # type: ignore[arg-type]

    monkeypatch.setattr(api, "StatsRecorder", recorder)
    FakeEvent.syncs = 0
    return calls


def test_no_device_synchronization_per_tile(fake_cuda: list[str]) -> None:
    m = SFT(_model(), tile_size=8, memory_budget="1GiB")
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    m(x).sum().backward()
    assert fake_cuda == [] and FakeEvent.syncs == 0  # the step ran without waiting on the device
    stats = m.last_stats
    n = stats.tile_count
    per_phase = sum(s.n_tiles for s in m.plan_for(tuple(x.shape)).tiled_segments)
    assert n == 2 * per_phase and per_phase >= 16  # 4 x 4 tiles per segment, forward and backward
    tiles = stats.tiles  # read after the step: the events are waited on here, once per event at most
    assert len(tiles) == n and FakeEvent.syncs == n + 1
    assert all(t.ms == 1.0 and t.peak_bytes is None for t in tiles)  # start and end recorded around each tile
    assert stats.forward_ms == per_phase and stats.summary()["tiles_backward"] == per_phase
    assert stats.tiles is tiles and FakeEvent.syncs == n + 1  # read once


def test_tile_peaks_synchronize_each_tile(fake_cuda: list[str]) -> None:
    m = SFT(_model(), tile_size=8, memory_budget="1GiB", tile_peaks=True)
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    m(x).sum().backward()
    # per-tile peaks need the device idle before and after each tile: asked for, they cost two synchronizations
    tiles = 2 * sum(s.n_tiles for s in m.plan_for(tuple(x.shape)).tiled_segments)
    assert fake_cuda.count("synchronize") == 2 * tiles and FakeEvent.syncs == 0
    assert all(t.peak_bytes is not None for t in m.last_stats.tiles)
