"""Pixels out of a slide: fill a preallocated (3, H, W) uint8 tensor from one pyramid level, resized on the fly.

The low layer under streaming (``stream``) and tissue detection (``tissue``), so neither needs the other.
Chunks are read (and, off a pyramid level, resized with PIL's antialiased bilinear filter using absolute source
coordinates, so chunks join without seams) and copied into place: no full-size intermediate ever exists.

Chunks may be decoded on several threads (``threads``): each chunk writes only its own disjoint part of the
preallocated output, and its pixels depend only on its own coordinates, so the result is byte-identical to a
one-thread read whatever the order. Decoding (OpenSlide's C library through ctypes, tifffile's imagecodecs, PIL's
resize, numpy and torch copies) releases the GIL, so threads, not processes, are enough.

A ``RegionMask`` (``fill_region_masked``) says which output pixels keep their slide pixels: the others are set to
the background colour, and a chunk with no kept pixel is filled with that colour without being decoded at all.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from PIL import Image

from wsitrain.errors import SlideError
from wsitrain.slides.readers import SlideReader

# "auto" uses the cores this process may run on, but no more than this: past a handful of decoder threads a
# slide's read is bound by the disk and the memory bus, and more threads only take cores from training.
MAX_AUTO_READ_THREADS = 8

ReadThreads = int | str  # a positive int or "auto"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and ``taskset`` restrict), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return max(1, os.cpu_count() or 1)


def resolve_read_threads(threads: ReadThreads | None) -> int:
    """The number of decoder threads that ``threads`` ("auto", None or a positive int) asks for."""
    if threads is None or threads == "auto":
        return min(MAX_AUTO_READ_THREADS, available_cores())
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SlideError(
            f"read_threads {threads!r} is not a positive integer or 'auto'",
            hint="set data.read_threads: auto or e.g. 2",
        )
    return threads


def run_chunks(jobs: list[Callable[[], None]], threads: ReadThreads | None) -> int:
    """Run ``jobs`` (each fills its own part of one output) on up to ``threads`` threads; the threads used.

    The pool lives for this one read, so no thread outlives it and nothing global is kept. The first failing job
    in chunk order raises its own error (as a one-thread read would); jobs not yet started are cancelled.
    """
    n = min(resolve_read_threads(threads), len(jobs))
    if n <= 1:
        for job in jobs:
            job()
        return 1
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="wsitrain-read") as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return n


# What ``RegionMask.chunk`` says of a chunk: every pixel kept, none kept (never decoded), or some kept.
INSIDE, OUTSIDE, PARTIAL = "inside", "outside", "partial"


@dataclass(frozen=True)
class RegionMask:
    """Which pixels of a (3, H, W) read keep their slide pixels; the others are set to ``background``.

    ``grid`` is a coarse boolean mask (a tissue mask on a thumbnail) with one extra all-False last row and last
    column; output row i looks up grid row ``rows[i]`` and output column j grid column ``cols[j]``, so -1 (the
    extra row or column) marks output pixels outside the grid, which are never kept. The output pixel's mask value
    is ``grid[rows[i], cols[j]]``: a separable lookup, so no (H, W) mask ever exists (a chunk's is made when needed).
    """

    grid: np.ndarray  # (gh + 1, gw + 1) bool, last row and column False
    rows: np.ndarray  # (H,) int64 in [-1, gh)
    cols: np.ndarray  # (W,) int64 in [-1, gw)
    background: tuple[int, int, int]

    def chunk(self, y: int, x: int, h: int, w: int) -> str:
        """INSIDE, OUTSIDE or PARTIAL for output rows [y, y + h) and columns [x, x + w)."""
        r, c = np.unique(self.rows[y : y + h]), np.unique(self.cols[x : x + w])
        cells = self.grid[np.ix_(r, c)]  # every grid cell a pixel of the chunk looks up, each once
        if not cells.any():
            return OUTSIDE
        return INSIDE if cells.all() else PARTIAL

    def keep(self, y: int, x: int, h: int, w: int) -> np.ndarray:
        """(h, w) bool: the chunk's pixels that keep their slide pixels."""
        # np.take keeps the result C-ordered (``[rows][:, cols]`` gives a Fortran-ordered array, which made the
        # background writes of a 4096 px chunk 20x slower).
        return np.take(self.grid[self.rows[y : y + h]], self.cols[x : x + w], axis=1)

    def fraction(self) -> float:
        """Share of the output's H * W pixels that are kept (exact: counted per grid cell, not sampled)."""
        gh, gw = self.grid.shape
        per_row = np.bincount(self.rows % gh, minlength=gh).astype(np.float64)
        per_col = np.bincount(self.cols % gw, minlength=gw).astype(np.float64)
        kept = per_row @ self.grid.astype(np.float64) @ per_col
        return float(kept / (len(self.rows) * len(self.cols)))

    def cells(self, h: int, w: int) -> np.ndarray:
        """(h, w) bool: the output split into h x w cells (cell i holds rows ``y`` with ``y * h // H == i``), each
        True when any of its pixels is kept. Made from the grid lookups, never from an (H, W) mask."""
        gh, gw = self.grid.shape

        def member(index: np.ndarray, n: int, g: int) -> np.ndarray:  # (n, g) int: cell i looks up grid entry j
            m = np.zeros((n, g), dtype=np.int64)
            m[np.arange(len(index)) * n // len(index), index] = 1
            return m

        hits = member(self.rows, h, gh) @ self.grid.astype(np.int64) @ member(self.cols, w, gw).T
        return hits > 0

    # numpy, not torch, writes the colour: on a strided chunk view of the output, torch's fill_ and masked_fill_
    # took 24 and 35 ms for a 1024 px chunk, numpy's fill and copyto 0.06 and 2.3 ms (measured on 2 cores).
    def fill(self, view: torch.Tensor) -> None:
        """Set every pixel of ``view`` (3, h, w, a CPU uint8 view of the output) to the background colour."""
        a = view.numpy()
        for c, value in enumerate(self.background):
            a[c].fill(value)

    def apply(self, view: torch.Tensor, y: int, x: int) -> None:
        """Set the pixels of ``view`` (output rows from y, columns from x) outside the mask to the background."""
        a = view.numpy()
        drop = ~self.keep(y, x, a.shape[1], a.shape[2])
        for c, value in enumerate(self.background):
            np.copyto(a[c], np.uint8(value), where=drop)


@dataclass(frozen=True)
class FillStats:
    """How a ``fill_region_masked`` call went: threads used, chunks decoded, chunks skipped (never decoded)."""

    threads: int
    decoded: int
    skipped: int


def fill_region(
    reader: SlideReader,
    out: torch.Tensor,
    level: int,
    scale: float,
    origin: tuple[float, float],
    chunk: int = 4096,
    threads: ReadThreads | None = 1,
) -> int:
    """Fill ``out`` (3, H, W) with level ``level`` pixels starting at ``origin`` (level px), resized by ``scale``.

    Output pixel (i, j) covers level pixels [origin + j / scale, origin + (j + 1) / scale). Chunks are decoded on
    up to ``threads`` threads (a positive int or "auto"); returns the number of threads used.
    """
    return fill_region_masked(reader, out, level, scale, origin, None, chunk, threads).threads


def fill_region_masked(
    reader: SlideReader,
    out: torch.Tensor,
    level: int,
    scale: float,
    origin: tuple[float, float],
    mask: RegionMask | None,
    chunk: int = 4096,
    threads: ReadThreads | None = 1,
) -> FillStats:
    """``fill_region``, then the pixels outside ``mask`` (None: no mask) set to its background colour.

    A chunk wholly outside the mask is filled with the background colour and never read from the slide; a chunk
    partly inside is decoded, then its outside pixels are overwritten; pixels inside are exactly what an unmasked
    read gives (the decode does not change: a resized chunk still reads its own source margin).
    """
    _, H, W = out.shape
    if chunk < 64:
        raise SlideError(f"chunk {chunk} is too small", hint="use data.chunk of at least 64 (default 4096)")
    if mask is not None and (len(mask.rows), len(mask.cols)) != (H, W):
        raise ValueError(f"mask is for {len(mask.rows)}x{len(mask.cols)} px, the output is {H}x{W}")
    jobs: list[Callable[[], None]] = []
    counts = {INSIDE: 0, OUTSIDE: 0, PARTIAL: 0}

    def add(decode: Callable[[int, int, int, int], None], x: int, y: int, h: int, w: int) -> None:
        # Chunks are classified here, cheaply (a few grid cells); a partial chunk's pixel mask is made in its job.
        state = INSIDE if mask is None else mask.chunk(y, x, h, w)
        counts[state] += 1
        jobs.append(partial(masked_chunk, decode, state, x, y, h, w))

    def masked_chunk(decode: Callable[[int, int, int, int], None], state: str, x: int, y: int, h: int, w: int) -> None:
        if state == OUTSIDE:
            assert mask is not None
            mask.fill(out[:, y : y + h, x : x + w])
            return
        decode(x, y, h, w)
        if state == PARTIAL:
            assert mask is not None
            mask.apply(out[:, y : y + h, x : x + w], y, x)

    def stats(used: int) -> FillStats:
        return FillStats(used, counts[INSIDE] + counts[PARTIAL], counts[OUTSIDE])

    if scale >= 1.0:
        ox, oy = int(round(origin[0])), int(round(origin[1]))

        def read_chunk(x: int, y: int, h: int, w: int) -> None:
            reader.read_into(level, ox + x, oy + y, out[:, y : y + h, x : x + w])

        for y in range(0, H, chunk):
            for x in range(0, W, chunk):
                h, w = min(chunk, H - y), min(chunk, W - x)
                add(read_chunk, x, y, h, w)
        return stats(run_chunks(jobs, threads))
    # Resize path: keep each chunk's *source* read about chunk x chunk, however strong the downscale.
    step = resize_step(chunk, scale)

    def resize_chunk(x: int, y: int, h: int, w: int) -> None:
        resize_into(reader, out[:, y : y + h, x : x + w], level, scale, origin, x, y)

    for y in range(0, H, step):
        for x in range(0, W, step):
            h, w = min(step, H - y), min(step, W - x)
            add(resize_chunk, x, y, h, w)
    return stats(run_chunks(jobs, threads))


def resize_step(chunk: int, scale: float) -> int:
    """The resized read's chunk edge (output px): each chunk's *source* read stays about chunk x chunk."""
    return max(64, int(chunk * scale))


def resize_into(
    reader: SlideReader, view: torch.Tensor, level: int, scale: float, origin: tuple[float, float], x: int, y: int
) -> None:
    """Output pixels [y, y + h) x [x, x + w) of a resized read (``view`` (3, h, w)) from their own source margin.

    The one place a resized chunk is computed: a region read (``fill_box_masked``) gives bitwise the pixels of the
    whole read only when it resizes the very same chunks with the very same arithmetic (PIL's filter weights
    depend on the box, so a sub-box of a chunk is not the same as a chunk of its own).
    """
    _, h, w = view.shape
    margin = int(math.ceil(1.0 / scale)) + 2  # bilinear support is 1/scale source px on each side
    bx0, by0 = origin[0] + x / scale, origin[1] + y / scale
    bx1, by1 = origin[0] + (x + w) / scale, origin[1] + (y + h) / scale
    sx0, sy0 = int(math.floor(bx0)) - margin, int(math.floor(by0)) - margin
    sx1, sy1 = int(math.ceil(bx1)) + margin, int(math.ceil(by1)) + margin
    src = reader.read_region(level, sx0, sy0, sx1 - sx0, sy1 - sy0)
    img = Image.fromarray(src).resize(
        (w, h), Image.Resampling.BILINEAR, box=(bx0 - sx0, by0 - sy0, bx1 - sx0, by1 - sy0)
    )
    view.copy_(torch.from_numpy(np.array(img)).permute(2, 0, 1))


def fill_box_masked(
    reader: SlideReader,
    out: torch.Tensor,
    level: int,
    scale: float,
    origin: tuple[float, float],
    mask: RegionMask | None,
    whole: tuple[int, int],
    y0: int,
    x0: int,
    chunk: int = 4096,
    threads: ReadThreads | None = 1,
) -> FillStats:
    """Rows [y0, y0 + h) and columns [x0, x0 + w) of the image ``fill_region_masked`` gives with these arguments
    into an output of ``whole`` (H, W) px, into ``out`` (3, h, w): bitwise the same pixels, without the rest of the
    image.

    Unresized, a pixel depends only on its own coordinates, so the box is read as it is (in ``chunk`` pieces on
    ``threads`` threads). Resized, the whole read's chunks that the box overlaps are resized as the whole read
    resizes them (``resize_into``) and cropped.
    """
    _, h, w = out.shape
    if scale >= 1.0:
        sub = None if mask is None else RegionMask(mask.grid, mask.rows[y0 : y0 + h], mask.cols[x0 : x0 + w],
                                                   mask.background)  # fmt: skip
        ox, oy = int(round(origin[0])), int(round(origin[1]))
        return fill_region_masked(reader, out, level, scale, (ox + x0, oy + y0), sub, chunk, threads)
    step = resize_step(chunk, scale)
    H, W = whole
    jobs: list[Callable[[], None]] = []
    decoded = skipped = 0

    def one(cy: int, cx: int, ch: int, cw: int, state: str) -> None:
        part = torch.empty((3, ch, cw), dtype=torch.uint8)
        if state == OUTSIDE:
            assert mask is not None
            mask.fill(part)
        else:
            resize_into(reader, part, level, scale, origin, cx, cy)
            if state == PARTIAL:
                assert mask is not None
                mask.apply(part, cy, cx)
        ya, yb, xa, xb = max(cy, y0), min(cy + ch, y0 + h), max(cx, x0), min(cx + cw, x0 + w)
        out[:, ya - y0 : yb - y0, xa - x0 : xb - x0].copy_(part[:, ya - cy : yb - cy, xa - cx : xb - cx])

    for cy in range((y0 // step) * step, y0 + h, step):
        for cx in range((x0 // step) * step, x0 + w, step):
            # the whole read's chunk, clipped at the whole image's edge exactly as that read clips it
            ch, cw = min(step, H - cy), min(step, W - cx)
            state = INSIDE if mask is None else mask.chunk(cy, cx, ch, cw)
            skipped += state == OUTSIDE
            decoded += state != OUTSIDE
            jobs.append(partial(one, cy, cx, ch, cw, state))
    return FillStats(run_chunks(jobs, threads), decoded, skipped)


def read_thumbnail(reader: SlideReader, max_side: int = 512) -> tuple[np.ndarray, float]:
    """(h, w, 3) uint8 view of the whole slide with its longer side <= ``max_side``; and its level-0 downsample."""
    info = reader.info
    w0, h0 = info.dimensions
    want = max(w0, h0) / max_side if max(w0, h0) > max_side else 1.0
    level = 0
    for i, ds in enumerate(info.level_downsamples):
        if ds <= want and ds >= info.level_downsamples[level]:
            level = i
    ds_l = info.level_downsamples[level]
    scale = min(1.0, ds_l / want)
    lw, lh = info.level_dimensions[level]
    tw, th = max(1, int(round(lw * scale))), max(1, int(round(lh * scale)))
    out = torch.empty((3, th, tw), dtype=torch.uint8)
    fill_region(reader, out, level, scale, (0.0, 0.0))
    return out.permute(1, 2, 0).numpy(), (w0 / tw + h0 / th) / 2
