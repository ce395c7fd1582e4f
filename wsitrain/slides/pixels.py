"""Pixels out of a slide: fill a preallocated (3, H, W) uint8 tensor from one pyramid level, resized on the fly.

The low layer under streaming (``stream``) and tissue detection (``tissue``), so neither needs the other.
Chunks are read (and, off a pyramid level, resized with PIL's antialiased bilinear filter using absolute source
coordinates, so chunks join without seams) and copied into place: no full-size intermediate ever exists.

Chunks may be decoded on several threads (``threads``): each chunk writes only its own disjoint part of the
preallocated output, and its pixels depend only on its own coordinates, so the result is byte-identical to a
one-thread read whatever the order. Decoding (OpenSlide's C library through ctypes, tifffile's imagecodecs, PIL's
resize, numpy and torch copies) releases the GIL, so threads, not processes, are enough.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
    _, H, W = out.shape
    if chunk < 64:
        raise SlideError(f"chunk {chunk} is too small", hint="use data.chunk of at least 64 (default 4096)")
    jobs: list[Callable[[], None]] = []
    if scale >= 1.0:
        ox, oy = int(round(origin[0])), int(round(origin[1]))

        def read_chunk(x: int, y: int, h: int, w: int) -> None:
            reader.read_into(level, ox + x, oy + y, out[:, y : y + h, x : x + w])

        for y in range(0, H, chunk):
            for x in range(0, W, chunk):
                h, w = min(chunk, H - y), min(chunk, W - x)
                jobs.append(partial(read_chunk, x, y, h, w))
        return run_chunks(jobs, threads)
    # Resize path: keep each chunk's *source* read about chunk x chunk, however strong the downscale.
    step = max(64, int(chunk * scale))
    margin = int(math.ceil(1.0 / scale)) + 2  # bilinear support is 1/scale source px on each side

    def resize_chunk(x: int, y: int, h: int, w: int) -> None:
        bx0, by0 = origin[0] + x / scale, origin[1] + y / scale
        bx1, by1 = origin[0] + (x + w) / scale, origin[1] + (y + h) / scale
        sx0, sy0 = int(math.floor(bx0)) - margin, int(math.floor(by0)) - margin
        sx1, sy1 = int(math.ceil(bx1)) + margin, int(math.ceil(by1)) + margin
        src = reader.read_region(level, sx0, sy0, sx1 - sx0, sy1 - sy0)
        img = Image.fromarray(src).resize(
            (w, h), Image.Resampling.BILINEAR, box=(bx0 - sx0, by0 - sy0, bx1 - sx0, by1 - sy0)
        )
        out[:, y : y + h, x : x + w].copy_(torch.from_numpy(np.array(img)).permute(2, 0, 1))

    for y in range(0, H, step):
        for x in range(0, W, step):
            h, w = min(step, H - y), min(step, W - x)
            jobs.append(partial(resize_chunk, x, y, h, w))
    return run_chunks(jobs, threads)


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
