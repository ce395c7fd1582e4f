"""A slide read tile by tile: the first tiled segment's input regions decoded from the slide when it asks for them.

``SlideTileSource`` is a ``wsitrain.sft.source.RegionSource``: it stands in for the (1, 3, H, W) uint8 image that
``read_slide_region`` followed by ``augment_from_config`` would build, and gives bitwise the same pixels for any
region of it, without that image ever existing. A region in the augmented frame maps back to one box of the read
(flips and quarter turns are index maps: the box's corners move, the pixels are the box's, turned); the box is
decoded from the slide (``pixels.fill_box_masked``: the same chunks and arithmetic as the whole read, the background
mask applied by absolute coordinates), turned, then colour-jittered per pixel with the slide's drawn parameters.

Read-ahead: the executor says in which order it will ask for regions (``expect``, the plan's tile order); while
tile t computes, a reader thread decodes the next ``ahead`` regions (each on the read's decoder threads). The
backward recompute asks again in the same order and the regions are decoded again: host memory holds
``ahead`` + 1 regions, never the image.

Cache (``data.stream_cache``, off by default): up to ``cache_bytes`` of decoded regions are kept for the source's
life (one slide's step), the first ones asked for, and the recompute takes those from memory instead of decoding
them again. First ones, not the most recent: the recompute visits the tiles in the forward's order, so a
least-recently-used cache would have dropped each region just before it is asked for again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsitrain.errors import WsiTrainError
from wsitrain.sft.source import Interval
from wsitrain.slides.augment import (
    AugmentConfig,
    ColorJitterParams,
    Geometry,
    apply_color_jitter,
    apply_drawn,
    draw_augmentation,
)
from wsitrain.slides.pixels import ReadThreads, fill_box_masked, fill_region_masked
from wsitrain.slides.readers import Background, SlideReader, open_slide
from wsitrain.slides.stream import ReadLayout, ReadResult, _check_read_args, layout_read, read_slide_region

# Regions decoded ahead of the one being computed. Two: the stager itself asks for tile t + 1 as soon as tile t is
# handed out (its own upload prefetch), so a second keeps a decode running while tile t computes.
READ_AHEAD = 2


def pre_box(geo: Geometry, shape: tuple[int, int], rows: Interval, cols: Interval) -> tuple[Interval, Interval]:
    """The box (rows, cols) of the read (before augmentation, ``shape`` (h, w)) whose pixels, flipped and turned
    by ``geo``, are the augmented image's region ``rows`` x ``cols``."""
    h, w = shape
    (r0, r1), (c0, c1) = rows, cols
    k = geo.k % 4
    # undo the turn: the region of the flipped image J (h, w) that torch.rot90(J, k) puts at rows x cols
    if k == 0:
        jr, jc = (r0, r1), (c0, c1)
    elif k == 1:  # A[i, j] = J[j, w - 1 - i]
        jr, jc = (c0, c1), (w - r1, w - r0)
    elif k == 2:  # A[i, j] = J[h - 1 - i, w - 1 - j]
        jr, jc = (h - r1, h - r0), (w - c1, w - c0)
    else:  # A[i, j] = J[h - 1 - j, i]
        jr, jc = (h - c1, h - c0), (r0, r1)
    if geo.vflip:
        jr = (h - jr[1], h - jr[0])
    if geo.hflip:
        jc = (w - jc[1], w - jc[0])
    return jr, jc


class SlideTileSource:
    """One slide's augmented read, region by region (see the module doc). Holds the slide open until ``close``."""

    requires_grad = False
    _version = 0  # never changes in place: a region the stager prefetched stays valid
    dtype = torch.uint8
    device = torch.device("cpu")

    def __init__(
        self,
        reader: SlideReader,
        layout: ReadLayout,
        geometry: Geometry = Geometry(),
        jitter: ColorJitterParams | None = None,
        read_threads: ReadThreads | None = 1,
        chunk: int = 4096,
        ahead: int = READ_AHEAD,
        own_reader: bool = True,
        cache_bytes: int = 0,
    ) -> None:
        self.reader = reader
        self.layout = layout
        self.geometry = geometry
        self.jitter = jitter
        self.read_threads = read_threads
        self.chunk = chunk
        self.ahead = ahead
        self._own = own_reader
        h, w = layout.shape
        self.shape = torch.Size((1, 3, *((w, h) if geometry.k % 2 else (h, w))))
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._order: list[tuple[Interval, Interval]] = []
        self._index: dict[tuple[Interval, Interval], int] = {}
        self._pending: dict[tuple[Interval, Interval], Future[torch.Tensor]] = {}
        self.regions_read = 0  # regions decoded (read-ahead included): the re-reads of the backward recompute count
        self.bytes_read = 0  # their bytes (uint8)
        self.cache_bytes = cache_bytes  # the bound on the cache of decoded regions
        self._cache: dict[tuple[Interval, Interval], torch.Tensor] = {}
        self.cached_bytes = 0  # held in the cache now (never above cache_bytes)
        self.regions_from_cache = 0  # regions given from the cache instead of decoded again

    def __deepcopy__(self, memo: dict[int, object]) -> SlideTileSource:
        # The image never changes, so a copy is this source: a model deep-copied while its pool holds the slide's
        # tissue mask (a ReadResult method, hence this source) shares it rather than copying an open slide.
        return self

    # ---- the tensor it stands in for -------------------------------------------------------------
    def dim(self) -> int:
        return 4

    def size(self, d: int | None = None) -> torch.Size | int:
        return self.shape if d is None else self.shape[d]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        if not (isinstance(index, tuple) and len(index) == 4 and all(isinstance(s, slice) for s in index)):
            raise TypeError(f"a slide tile source is cut as [:, :, r0:r1, c0:c1], not {index!r}")
        _, H, W = self.shape[1:]
        r = index[2].indices(H)
        c = index[3].indices(W)
        if r[2] != 1 or c[2] != 1 or index[0] != slice(None) or index[1] != slice(None):
            raise TypeError(f"a slide tile source is cut as [:, :, r0:r1, c0:c1], not {index!r}")
        key = ((r[0], max(r[0], r[1])), (c[0], max(c[0], c[1])))
        with self._lock:
            region = self._cache.get(key)
            fut = self._pending.pop(key, None) if region is None else None
            if region is not None:
                self.regions_from_cache += 1
        if region is None:
            region = fut.result() if fut is not None else self.read(*key)
            self._keep(key, region)
        self._read_ahead(key)
        return region  # callers copy it (the stager packs it into its buffers) and never write to it

    def _keep(self, key: tuple[Interval, Interval], region: torch.Tensor) -> None:
        """Cache ``region`` while the bound allows (the first regions asked for stay; see the module doc)."""
        n = region.numel() * region.element_size()
        with self._lock:
            if key not in self._cache and self.cached_bytes + n <= self.cache_bytes:
                self._cache[key] = region
                self.cached_bytes += n

    def materialize(self) -> torch.Tensor:
        """The whole augmented image (1, 3, H, W): exactly the whole-image read and augmentation."""
        lay = self.layout
        out = torch.empty((3, *lay.shape), dtype=torch.uint8)
        fill_region_masked(self.reader, out, lay.res.level, lay.res.scale, lay.origin, lay.mask, self.chunk,
                           self.read_threads)  # fmt: skip
        return apply_drawn(out, self.geometry, self.jitter)[None]

    # ---- one region ------------------------------------------------------------------------------
    def read(self, rows: Interval, cols: Interval) -> torch.Tensor:
        """The augmented image's region rows x cols, (1, 3, h, w) uint8, decoded from the slide now."""
        lay = self.layout
        (y0, y1), (x0, x1) = pre_box(self.geometry, lay.shape, rows, cols)
        box = torch.empty((3, y1 - y0, x1 - x0), dtype=torch.uint8)  # (3, h, w) before the turn
        if box.numel():
            fill_box_masked(self.reader, box, lay.res.level, lay.res.scale, lay.origin, lay.mask, lay.shape, y0, x0,
                            self.chunk, self.read_threads)  # fmt: skip
        g = self.geometry
        turned = g.apply(box).contiguous()  # index maps: the box's pixels flipped and turned
        if self.jitter is not None:
            turned = apply_color_jitter(turned, self.jitter)  # per pixel, as on the whole image
        with self._lock:
            self.regions_read += 1
            self.bytes_read += turned.numel()
        return turned[None]

    # ---- read-ahead ------------------------------------------------------------------------------
    def expect(self, order: list[tuple[Interval, Interval]]) -> None:
        if order is self._order:
            return
        with self._lock:
            self._order = order
            self._index = {k: i for i, k in enumerate(order)}
            stale, self._pending = self._pending, {}
        for f in stale.values():
            f.cancel()

    def _read_ahead(self, key: tuple[Interval, Interval]) -> None:
        i = self._index.get(key)
        if i is None or self.ahead <= 0:
            return
        want = [self._order[j] for j in range(i + 1, min(len(self._order), i + 1 + self.ahead))]
        with self._lock:
            for k in [k for k in self._pending if k not in want]:  # skipped tiles (zero gradient) or a new sweep
                self._pending.pop(k).cancel()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wsitrain-tiles")
            for k in want:
                if k not in self._pending and k not in self._cache:
                    self._pending[k] = self._pool.submit(self.read, *k)

    def close(self) -> None:
        """Stop reading ahead and close the slide (when this source opened it)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._cache.clear()
            self.cached_bytes = 0
        for f in pending.values():
            f.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._own:
            self.reader.close()
            self._own = False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to close cleanly
            pass


def open_tile_source(
    path: str | Path,
    *,
    augment: AugmentConfig | None = None,
    rng: np.random.Generator | int | None = None,
    background: Background = (255, 255, 255),
    chunk: int = 4096,
    read_threads: ReadThreads | None = "auto",
    mask_background: bool = False,
    pin_memory: bool = False,
    cache_bytes: int = 0,
    **layout: object,
) -> ReadResult:
    """``read_slide_region`` (then ``augment_from_config`` with ``rng`` when ``augment``), as a ``ReadResult`` whose
    ``image`` is a ``SlideTileSource``: nothing is decoded yet. ``layout``: the read's level/mpp/region/size/pad;
    ``cache_bytes``: the bound on its cache of decoded regions (0: none, the recompute decodes again)."""
    del pin_memory  # regions reach the device through the stager's own page-locked buffers
    t0 = time.perf_counter()
    _check_read_args(read_threads, mask_background)
    reader = open_slide(path, background)
    try:
        lay = layout_read(reader, mask_background=mask_background, **layout)  # type: ignore[arg-type]
        geo, params = draw_augmentation(rng, augment) if augment is not None else (Geometry(), None)
    except WsiTrainError:
        reader.close()
        raise
    src = SlideTileSource(reader, lay, geo, params, read_threads, chunk, cache_bytes=cache_bytes)
    res = lay.result(src, reader, time.perf_counter() - t0)  # type: ignore[arg-type]  # the open; decoding comes later
    res.geometry = geo
    return res


@contextlib.contextmanager
def slide_read(path: str | Path, stream: bool, **read: Any) -> Iterator[ReadResult]:
    """One slide read for inference (predict, heatmaps, run maps): whole (``read_slide_region``), or with ``stream``
    (``data.stream_tiles``) a ``SlideTileSource`` read region by region when the engine asks; closed on exit."""
    res = open_tile_source(path, **read) if stream else read_slide_region(path, **read)
    try:
        yield res
    finally:
        if isinstance(res.image, SlideTileSource):
            res.image.close()
