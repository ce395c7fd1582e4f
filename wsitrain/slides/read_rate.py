"""The read throughput a slide read tile by tile (data.stream_tiles) needs, and what the reader gives.

Streamed, the first tiled segment decodes its input regions (halo in) from the slide as it visits them: once in
the forward, and once more in the backward recompute when that segment has parameters to train, less what
``data.stream_cache`` keeps. ``stream_read_bytes`` counts those decoded bytes per step from the plan's regions;
``measure_read_rate`` decodes a few regions of the first segment's tile shape from a slide with the run's read
settings and times them; ``StreamRead.text`` sets them side by side: the seconds of decoding per step at the
measured rate (a step that computes faster waits on the reader; the read-ahead thread overlaps the rest), and at a
planned step time the rate the stream needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from wsitrain.sft.plan_types import Plan, SegmentPlan
from wsitrain.units import format_bytes

# Regions decoded to measure the reader: enough to cover a few chunks per region at the read's chunk size, few
# enough that the preflight stays short (4 regions of 1,694 px, tiny's tile at 16,384 px: 34 MB, under 2 s at the
# 20 MB/s measured on this project's shared CPU with 2 threads, docs/benchmarks/read_throughput.md).
MEASURE_REGIONS = 4


def segment_trains(model: nn.Module, seg: SegmentPlan) -> bool:
    """Does ``seg`` hold a parameter that trains (then its backward recomputes it, reading its input again)?"""
    for name in seg.layers:
        try:
            mod = model.get_submodule(name)
        except AttributeError:
            continue
        if any(p.requires_grad for p in mod.parameters()):
            return True
    return False


def first_regions(plan: Plan, sweep: bool = False) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The first tiled segment's input regions (rows, cols), halo in, in visit order; [] when it is not tiled.
    The recompute's, or with ``sweep`` the forward sweep's (its own, larger tiles where the plan gives it some)."""
    first = plan.segments[0] if plan.segments else None
    if first is None or first.mode != "tiled":
        return []
    reg = first.sweep_regions if sweep else first.regions
    if reg is None:  # a plan without its regions: the largest tile, n times
        th, tw = first.sweep_tile_shape if sweep else first.tile_shape
        return [((0, th), (0, tw))] * (first.n_forward_tiles if sweep else first.n_tiles)
    return [(rt.need[first.start], ct.need[first.start]) for rt in reg.rows for ct in reg.cols]


def stream_read_bytes(plan: Plan, passes: int, cache_bytes: int = 0) -> int:
    """uint8 bytes decoded per step when the slide is read tile by tile into ``plan``: the first segment's forward
    regions once, and with ``passes`` 2 (a first segment with parameters) its recompute's regions again, less what
    ``cache_bytes`` keeps of them (only when the two sweeps read the same regions: the cache is keyed by region);
    0 when it is not tiled."""

    def once(sweep: bool) -> int:
        return sum(3 * (r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in first_regions(plan, sweep))

    forward, recompute = once(True), once(False)
    same = not plan.segments[0].forward_grid if plan.segments else True
    kept = min(cache_bytes, recompute) if same else 0
    return forward + (recompute - kept) * max(0, passes - 1)


@dataclass(frozen=True)
class ReadRate:
    """The reader's measured decode rate on one slide."""

    bytes_per_s: float
    threads: int | str
    slide: str


def measure_read_rate(path: str | Path, plan: Plan, read: dict[str, Any], n: int = MEASURE_REGIONS) -> ReadRate | None:
    """Decode up to ``n`` of ``plan``'s first-segment regions of ``path`` (spread over the image, read as fit reads
    them: ``read`` are fit's read arguments) and time them; None when the first segment is not tiled."""
    from wsitrain.slides.tile_source import SlideTileSource, open_tile_source

    regions = first_regions(plan)
    if not regions:
        return None
    src = open_tile_source(path, **read).image
    assert isinstance(src, SlideTileSource)
    try:
        # the plan is the bucket's (padded, maybe turned): its regions cut to this slide's read, the empty ones gone
        h, w = src.shape[-2:]
        inside = [((r0, min(r1, h)), (c0, min(c1, w))) for (r0, r1), (c0, c1) in regions if r0 < h and c0 < w]
        picks = [inside[(2 * i + 1) * len(inside) // (2 * n)] for i in range(min(n, len(inside)))]
        if not picks:
            return None
        t0 = time.perf_counter()
        got = sum(src.read(rows, cols).numel() for rows, cols in picks)
        secs = max(time.perf_counter() - t0, 1e-9)
    finally:
        src.close()
    return ReadRate(got / secs, read.get("read_threads", "auto"), Path(path).name)


@dataclass(frozen=True)
class StreamRead:
    """What a streamed step reads, against the measured reader and (where known) a planned step time."""

    bytes_per_step: int
    passes: int
    rate: ReadRate | None = None
    step_s: float | None = None  # the planned step time, where the plan gives one in seconds
    step_kind: str = "planned"  # how step_s was found: planned (the time model at a preset's rate) or simulated

    @property
    def needed_bytes_per_s(self) -> float | None:
        return self.bytes_per_step / self.step_s if self.step_s else None

    def text(self) -> str:
        what = "forward and recompute" if self.passes > 1 else "forward"
        out = f"streamed read (data.stream_tiles): {format_bytes(self.bytes_per_step)} of decoded tiles a step ({what})"
        if self.needed_bytes_per_s is not None:
            out += (f"; at the {self.step_kind} {self.step_s:.2f} s a step it needs "
                    f"{self.needed_bytes_per_s / 1e6:.0f} MB/s ({self.step_kind})")  # fmt: skip
        if self.rate is not None:
            secs = self.bytes_per_step / self.rate.bytes_per_s
            out += (f"; the reader gives {self.rate.bytes_per_s / 1e6:.0f} MB/s on {self.rate.slide} "
                    f"({self.rate.threads} read threads, measured): {secs:.1f} s of decoding per step, overlapped "
                    "with compute by the read-ahead (a step computed faster waits on the reader)")  # fmt: skip
        return out
