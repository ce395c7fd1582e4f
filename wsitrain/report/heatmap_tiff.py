"""A slide map as a tiled pyramidal TIFF the size of the slide: ``NAME.heatmap.tif``, for viewers to overlay.

Geometry: level 0 of the TIFF has the slide's level-0 width and height, so pixel (x, y) of the heatmap is pixel
(x, y) of the slide and no viewer needs to be told an offset or a scale. This is the choice the viewers leave:
ASAP's overlay ("Open result image", VisualizationWorkstationExtensionPlugin) scales the overlay by the integer
ratio of the two images' level-0 widths and has no offset, so a map-resolution TIFF of a region read from a box
that does not start at (0, 0), or whose size is not an integer fraction of the slide's, would sit in the wrong
place; QuPath overlays a second image through Interactive image alignment / Warpy's image combiner, for which an
image with the slide's size and pixel size lines up with the identity transform. Most of the file is cheap anyway:
a 256 px tile of one colour (background, or a map cell larger than a tile) is compressed once and its bytes reused.

Layout: OME-TIFF (OME-XML in ImageDescription with PhysicalSizeX/Y in microns, what Bio-Formats and so QuPath read
the pixel size from), RGB uint8, 256 x 256 tiles, Deflate, sub-resolutions halving down to one tile stored as
SubIFDs of level 0 (the Bio-Formats 6 pyramid layout, tifffile's own pyramid example); every level carries its
pixel size in XResolution/YResolution (pixels per centimetre). Readers that ignore SubIFDs (ASAP, OpenSlide) see
level 0 only, which is still right, just slower to zoom out.

Content: one map (predict writes the predicted class's CAM) colour-mapped like the PNG (RdBu_r, symmetric about
0); pixels outside the map or off the slide are white, the slide's background.

Cost, measured on a 100,000 x 100,000 px slide geometry (0.25 um/px; 2 shared CPU cores; a random-walk map, every
cell its own colour, so almost no tile is one colour: the worst case): a stride-32 map read at downsample 4 (781 x
781 cells of 128 px) writes in 53 s, 369 MB, 10 levels. Read at level 0 (3125 x 3125 cells of 32 px): 153 s,
777 MB (measured while another job shared the cores). The time is the Deflate encoding of 152,000 level-0 tiles
(zlib releases the GIL, so more cores help); a map with large uniform areas (background, cells >= 256 px) costs
far less, its tiles being encoded once per colour.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wsitrain.report.map_grid import MapGrid
from wsitrain.write_errors import named_write_errors

TILE = 256
OUTSIDE = 256  # colour index of pixels off the map: the LUT's extra, white entry
WHITE = (255, 255, 255)
_BATCH = 64  # tiles encoded at once (64 x 192 KB of pixels held)
ZLIB_LEVEL = 1  # blocky maps compress almost as well at level 1 as at 6, several times faster


@dataclass(frozen=True)
class TiffInfo:
    path: Path
    levels: list[tuple[int, int]]  # (width, height) per level, level 0 first
    vmin: float
    vmax: float
    bytes: int


def colour_lut(cmap: str = "RdBu_r") -> np.ndarray:
    """(257, 3) uint8: 256 colours of ``cmap`` and white for OUTSIDE."""
    from matplotlib import colormaps

    lut = np.empty((OUTSIDE + 1, 3), dtype=np.uint8)
    lut[:OUTSIDE] = np.round(colormaps[cmap](np.linspace(0.0, 1.0, OUTSIDE))[:, :3] * 255).astype(np.uint8)
    lut[OUTSIDE] = WHITE
    return lut


def colour_index(values: np.ndarray, vmin: float, vmax: float) -> np.ndarray:
    """(h, w) float -> (h, w) uint16 index into ``colour_lut``: 0..255 over [vmin, vmax]; NaN -> OUTSIDE."""
    v = np.asarray(values, dtype=np.float64)
    span = (vmax - vmin) or 1.0
    idx = np.clip(np.floor((v - vmin) / span * OUTSIDE), 0, OUTSIDE - 1)
    return np.where(np.isnan(v), OUTSIDE, idx).astype(np.uint16)


def pyramid_sizes(width: int, height: int, tile: int = TILE) -> list[tuple[int, int]]:
    """Level sizes, each half the previous (rounded up), until the level fits in one tile."""
    sizes = [(int(width), int(height))]
    while max(sizes[-1]) > tile:
        w, h = sizes[-1]
        sizes.append((-(-w // 2), -(-h // 2)))
    return sizes


def _cell_lookup(n_px: int, n_pad: int, level_ds: float, origin: float, cell: float, n_cells: int) -> np.ndarray:
    """Map cell index of every level pixel (padded to ``n_pad``), sampled at the pixel's level-0 centre;
    ``n_cells`` (the extra OUTSIDE row/column) where the pixel is off the map or past the level's edge."""
    centre = (np.arange(n_pad) + 0.5) * level_ds
    j = np.floor((centre - origin) / cell).astype(np.int64)
    bad = (j < 0) | (j >= n_cells) | (np.arange(n_pad) >= n_px)
    return np.where(bad, n_cells, j)


def _runs(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start positions and lengths of the runs of equal values in ``index``."""
    starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]])
    return starts, np.diff(np.r_[starts, index.size])


def _tile_pixels(idx: np.ndarray, lut: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """(tile, tile, 3) uint8: one pixel row per run of equal map rows, repeated (a map cell spans many pixels, so
    this gathers a few rows instead of every pixel: 15x faster than ``lut[idx[rows][:, cols]]``)."""
    starts, counts = _runs(rows)
    return np.repeat(lut[idx[rows[starts]][:, cols]], counts, axis=0)


def _encode(pixels: np.ndarray) -> bytes:
    return zlib.compress(pixels.tobytes(), ZLIB_LEVEL)


def _tiles(idx: np.ndarray, lut: np.ndarray, grid: MapGrid, size: tuple[int, int], level_ds: float,
           tile: int, cache: dict[int, bytes], pool: ThreadPoolExecutor) -> Iterator[bytes]:
    """The level's tiles, Deflate-encoded, row by row. One-colour tiles (background, or inside one cell larger
    than a tile) are encoded once per colour; the others on ``pool`` (zlib releases the GIL), a batch at a time."""
    w, h = size
    ntx, nty = -(-w // tile), -(-h // tile)
    ci = _cell_lookup(w, ntx * tile, level_ds, grid.origin[0], grid.cell, grid.shape[1])
    ri = _cell_lookup(h, nty * tile, level_ds, grid.origin[1], grid.cell, grid.shape[0])
    for ty in range(nty):
        rows = ri[ty * tile : (ty + 1) * tile]
        band = idx[np.unique(rows)]  # the map rows this row of tiles touches
        out: list[bytes | None] = []
        work: list[tuple[int, np.ndarray]] = []
        for tx in range(ntx):
            cols = ci[tx * tile : (tx + 1) * tile]
            sub = band[:, np.unique(cols)]
            lo = int(sub.min())
            if lo == int(sub.max()):
                if lo not in cache:
                    cache[lo] = _encode(np.broadcast_to(lut[lo], (tile, tile, 3)))
                out.append(cache[lo])
            else:
                out.append(None)
                work.append((tx, _tile_pixels(idx, lut, rows, cols)))
            if len(work) >= _BATCH or tx == ntx - 1:
                for (i, _), data in zip(work, pool.map(_encode, [p for _, p in work]), strict=True):
                    out[i] = data
                work = []
        yield from out  # type: ignore[misc]


def write_heatmap_tiff(
    path: Path,
    values: np.ndarray,
    grid: MapGrid,
    *,
    vmin: float | None = None,
    vmax: float | None = None,
    cmap: str = "RdBu_r",
    tile: int = TILE,
) -> TiffInfo:
    """Write ``values`` ((h, w) on ``grid``; NaN: no value) colour-mapped over [vmin, vmax] (default: symmetric
    about 0 at the largest magnitude, as the PNG) as a pyramidal OME-TIFF of the slide's level-0 size."""
    import tifffile

    values = np.asarray(values, dtype=np.float64)
    if values.shape != grid.shape:
        raise ValueError(f"values have shape {values.shape}; the grid is {grid.shape}")
    if vmin is None or vmax is None:
        finite = values[np.isfinite(values)]
        lim = float(np.abs(finite).max()) if finite.size else 1.0
        lim = lim or 1.0
        vmin = -lim if vmin is None else vmin
        vmax = lim if vmax is None else vmax
    lut = colour_lut(cmap)
    idx = np.full((grid.shape[0] + 1, grid.shape[1] + 1), OUTSIDE, dtype=np.uint16)
    idx[:-1, :-1] = colour_index(values, vmin, vmax)
    sizes = pyramid_sizes(*grid.slide_wh, tile=tile)
    w0, h0 = sizes[0]
    mpp = grid.mpp
    cache: dict[int, bytes] = {}
    options = {"dtype": np.uint8, "tile": (tile, tile), "photometric": "rgb", "planarconfig": "contig",
               "compression": "zlib"}
    workers = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    with (
        named_write_errors(path, "the pyramidal heatmap"),
        tifffile.TiffWriter(path, bigtiff=True, ome=True) as tif,
        ThreadPoolExecutor(workers) as pool,
    ):
        for level, (w, h) in enumerate(sizes):
            ds = ((w0 / w) + (h0 / h)) / 2  # level-0 px per level px (2^level, up to the rounding of odd sizes)
            extra: dict[str, object] = {}
            if mpp is not None:
                px_per_cm = 1e4 / (mpp * ds)
                extra.update(resolution=(px_per_cm, px_per_cm), resolutionunit="CENTIMETER")
            if level == 0:
                extra["subifds"] = len(sizes) - 1
                meta: dict[str, object] = {"axes": "YXS", "Name": Path(path).name}
                if mpp is not None:
                    meta.update(PhysicalSizeX=mpp, PhysicalSizeXUnit="µm", PhysicalSizeY=mpp,
                                PhysicalSizeYUnit="µm")
                extra["metadata"] = meta
            else:
                extra.update(subfiletype=1, metadata=None)
            tif.write(_tiles(idx, lut, grid, (w, h), ds, tile, cache, pool), shape=(h, w, 3), **options, **extra)
    return TiffInfo(Path(path), sizes, float(vmin), float(vmax), Path(path).stat().st_size)
