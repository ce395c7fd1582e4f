"""Per-tile timings (and, when asked for, per-tile peak memory) of the last step: ``SFT.last_stats``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

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


class TimingEvent(Protocol):
    """A CUDA event with timing (``torch.cuda.Event(enable_timing=True)``), injectable for tests."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...


@dataclass(frozen=True)
class _Pending:
    """A tile timed by a start/end event pair on the compute stream, read when the step's stats are."""

    segment: int
    row: int
    col: int
    phase: str
    start: TimingEvent
    end: TimingEvent


@dataclass
class StepStats:
    """One step's tiles. On CUDA tiles are timed by events and resolved when first read (after the step)."""

    recomputed_tiles: int = 0
    # background tiles whose cached work was added instead of computing them (execution/reuse.py)
    reused_forward: int = 0
    reused_backward: int = 0
    skipped_backward: int = 0  # tiles whose output gradient is zero (max pooling's losers): no recompute
    # one-pass segments whose pooled gradient came off the head's direction: they recomputed after their one pass
    one_pass_fallbacks: int = 0
    _done: list[TileStat] = field(default_factory=list, repr=False)
    _pending: list[_Pending] = field(default_factory=list, repr=False)

    @property
    def tiles(self) -> list[TileStat]:
        """Every tile so far; pending CUDA timings are read here: one wait on the last tile's end event."""
        if self._pending:
            pending, self._pending = self._pending, []
            pending[-1].end.synchronize()  # events of one compute stream complete in order
            for p in pending:
                p.end.synchronize()  # already complete (a no-op) unless a tile ran on another stream
                ms = float(p.start.elapsed_time(p.end))
                self._done.append(TileStat(p.segment, p.row, p.col, p.phase, ms, None))
        return self._done

    @property
    def tile_count(self) -> int:
        """Tiles so far without reading their timings (safe while the step runs, e.g. from a progress bar)."""
        return len(self._done) + len(self._pending)

    @property
    def forward_ms(self) -> float:
        return sum(t.ms for t in self.tiles if t.phase == "forward")

    @property
    def backward_ms(self) -> float:
        return sum(t.ms for t in self.tiles if t.phase == "backward")

    def summary(self) -> dict[str, Any]:
        """Counts and totals per phase, for logs that do not want every tile."""
        tiles = self.tiles
        out: dict[str, Any] = {
            "tiles_forward": sum(1 for t in tiles if t.phase == "forward"),
            "tiles_backward": sum(1 for t in tiles if t.phase == "backward"),
            "recomputed_tiles": self.recomputed_tiles,
            "tiles_reused_forward": self.reused_forward,
            "tiles_reused_backward": self.reused_backward,
            "tiles_skipped_backward": self.skipped_backward,
            "forward_ms": round(self.forward_ms, 3),
            "backward_ms": round(self.backward_ms, 3),
        }
        for phase in ("forward", "backward"):
            ms = [t.ms for t in tiles if t.phase == phase]
            if ms:
                out[f"{phase}_tile_ms_mean"] = round(sum(ms) / len(ms), 3)
                out[f"{phase}_tile_ms_max"] = round(max(ms), 3)
            peaks = [t.peak_bytes for t in tiles if t.phase == phase and t.peak_bytes is not None]
            if peaks:
                out[f"{phase}_tile_peak_bytes_max"] = max(peaks)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = self.summary()
        d["tiles"] = [asdict(t) for t in self.tiles]
        return d


def _cuda_event() -> TimingEvent:
    return torch.cuda.Event(enable_timing=True)


class StatsRecorder:
    """Times each tile; with ``meter`` also reads that tile's peak memory.

    CUDA without per-tile peaks: a start and an end event per tile, recorded on the compute stream, read once
    when the step's stats are (``StepStats.tiles``): no device synchronization per tile, so copies on the side
    streams keep overlapping compute (two full synchronizations per tile would serialize them and hide
    cross-tile races). Per-tile peaks need the meter's counter restarted before each tile and read after it,
    which needs the device idle at both ends: only then (``SFT(tile_peaks=True)``) is each tile synchronized
    and timed on the host clock. A caller measuring a whole step reads its own meter, which this restarts,
    only between steps. ``new_event`` is injectable for tests.
    """

    def __init__(
        self,
        device: torch.device,
        stats: StepStats,
        meter: PeakMeter | None = None,
        new_event: Callable[[], TimingEvent] = _cuda_event,
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.events = self.cuda and meter is None
        self.stats = stats
        self.meter = meter
        self._new_event = new_event
        self._start: TimingEvent | None = None

    def tick(self) -> float:
        if self.events:
            self._start = self._new_event()
            self._start.record(torch.cuda.current_stream(self.device))
            return 0.0
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.meter is not None:
            self.meter.start()
        return time.perf_counter()

    def tock(self, t0: float, segment: int, row: int, col: int, phase: str) -> None:
        if self.events:
            assert self._start is not None, "tock without tick"
            end = self._new_event()
            end.record(torch.cuda.current_stream(self.device))
            self.stats._pending.append(_Pending(segment, row, col, phase, self._start, end))
            self._start = None
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        ms = (time.perf_counter() - t0) * 1000.0
        peak = self.meter.peak() if self.meter is not None else None
        self.stats._done.append(TileStat(segment, row, col, phase, ms, peak))
