"""Per-tile timings (and, when asked for, per-tile peak memory) of the last step: ``SFT.last_stats``."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from wsitrain.memory import PeakMeter


@dataclass(frozen=True)
class TileStat:
    segment: int
    row: int
    col: int
    phase: str  # "forward" | "backward" (recompute + backward)
    ms: float
    peak_bytes: int | None  # peak during the tile, only with SFT(tile_peaks=True)


@dataclass
class StepStats:
    tiles: list[TileStat] = field(default_factory=list)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    recomputed_tiles: int = 0

    def summary(self) -> dict[str, Any]:
        """Counts and totals per phase, for logs that do not want every tile."""
        out: dict[str, Any] = {
            "tiles_forward": sum(1 for t in self.tiles if t.phase == "forward"),
            "tiles_backward": sum(1 for t in self.tiles if t.phase == "backward"),
            "recomputed_tiles": self.recomputed_tiles,
            "forward_ms": round(self.forward_ms, 3),
            "backward_ms": round(self.backward_ms, 3),
        }
        for phase in ("forward", "backward"):
            ms = [t.ms for t in self.tiles if t.phase == phase]
            if ms:
                out[f"{phase}_tile_ms_mean"] = round(sum(ms) / len(ms), 3)
                out[f"{phase}_tile_ms_max"] = round(max(ms), 3)
            peaks = [t.peak_bytes for t in self.tiles if t.phase == phase and t.peak_bytes is not None]
            if peaks:
                out[f"{phase}_tile_peak_bytes_max"] = max(peaks)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = self.summary()
        d["tiles"] = [asdict(t) for t in self.tiles]
        return d


class StatsRecorder:
    """Times each tile; with ``meter`` also reads that tile's peak memory.

    Per-tile peaks need the meter's counter restarted before each tile (on CUDA the device's peak
    counter), so they are taken only when the caller asked for them (``SFT(tile_peaks=True)``); a
    caller measuring a whole step then reads its own meter, which this restarts, only between steps.
    """

    def __init__(self, device: torch.device, stats: StepStats, meter: PeakMeter | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stats = stats
        self.meter = meter

    def tick(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.meter is not None:
            self.meter.start()
        return time.perf_counter()

    def tock(self, t0: float, segment: int, row: int, col: int, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - t0) * 1000.0
        peak = self.meter.peak() if self.meter is not None else None
        self.stats.tiles.append(TileStat(segment, row, col, phase, ms, peak))
        if phase == "forward":
            self.stats.forward_ms += ms
        else:
            self.stats.backward_ms += ms
