"""Per-tile timings and peak memory of the last step (``SFT.last_stats``)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from wsitrain.memory import peak_rss_bytes


@dataclass(frozen=True)
class TileStat:
    segment: int
    row: int
    col: int
    phase: str  # "forward" | "backward" (recompute + backward)
    ms: float
    peak_bytes: int  # CUDA: max allocated during the tile; CPU: process peak RSS so far


@dataclass
class StepStats:
    tiles: list[TileStat] = field(default_factory=list)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    peak_bytes: int = 0
    recomputed_tiles: int = 0

    def summary(self) -> dict[str, Any]:
        """Counts and totals per phase, for logs that do not want every tile."""
        out: dict[str, Any] = {
            "tiles_forward": sum(1 for t in self.tiles if t.phase == "forward"),
            "tiles_backward": sum(1 for t in self.tiles if t.phase == "backward"),
            "recomputed_tiles": self.recomputed_tiles,
            "forward_ms": round(self.forward_ms, 3),
            "backward_ms": round(self.backward_ms, 3),
            "peak_bytes": self.peak_bytes,
        }
        for phase in ("forward", "backward"):
            ms = [t.ms for t in self.tiles if t.phase == phase]
            if ms:
                out[f"{phase}_tile_ms_mean"] = round(sum(ms) / len(ms), 3)
                out[f"{phase}_tile_ms_max"] = round(max(ms), 3)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = self.summary()
        d["tiles"] = [asdict(t) for t in self.tiles]
        return d


class StatsRecorder:
    """Times tiles and reads peak memory around each (CUDA: max_memory_allocated, CPU: peak RSS).

    On CUDA the allocator's peak counter is reset before each tile to read that tile's peak; the
    step's overall peak is folded into ``StepStats.peak_bytes`` first, so read it there.
    """

    def __init__(self, device: torch.device, stats: StepStats) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stats = stats

    @property
    def recomputed_tiles(self) -> int:
        return self.stats.recomputed_tiles

    @recomputed_tiles.setter
    def recomputed_tiles(self, v: int) -> None:
        self.stats.recomputed_tiles = v

    def peak_now(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return peak_rss_bytes()

    def tick(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.peak_now())
            torch.cuda.reset_peak_memory_stats(self.device)
        return time.perf_counter()

    def tock(self, t0: float, segment: int, row: int, col: int, phase: str) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - t0) * 1000.0
        peak = self.peak_now()
        self.stats.peak_bytes = max(self.stats.peak_bytes, peak)
        self.stats.tiles.append(TileStat(segment, row, col, phase, ms, peak))
        if phase == "forward":
            self.stats.forward_ms += ms
        else:
            self.stats.backward_ms += ms
