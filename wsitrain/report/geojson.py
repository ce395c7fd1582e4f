"""Slide maps as QuPath detections: ``NAME.geojson``, one square detection per (aggregated) map cell, in level-0
slide pixels, carrying each map's value at that cell as a named measurement.

Format followed: QuPath 0.4+ (also what 0.5 reads and writes). A FeatureCollection; each Feature has a Polygon
geometry (closed ring, in QuPath's own vertex order: top-left, top-right, bottom-right, bottom-left, top-left, y
down) and ``properties = {"objectType": "detection", "measurements": {name: value, ...}}``. Sources: QuPath pull
request #698 (0.3: ``objectType`` in properties picks annotation/detection/cell), pull request #1099 (0.4.0: the
measurements are stored as a JSON object name -> value, no longer a list of {name, value}; 0.4 still reads the
old list), and wsinfer issue #178 quoting a QuPath-exported feature of that form. Drag the file onto the open slide
in QuPath (or File > Import objects); colour the detections by a measurement with Measure > Show measurement maps.
No ``id``/``classification`` is written: QuPath makes ids on import and these cells have no class.

Size: a feature with two measurements is about 235 bytes (coordinates as integers, values to 4 significant
digits). A 100,000 x 100,000 px slide read at level 0 with a stride-32 model has 3125 x 3125 = 9.8 M cells: about
2 GB, far more than QuPath is pleasant with. So cells are aggregated k x k (their mean) with k chosen, unless given,
as the smallest that leaves at most ``MAX_CELLS`` = 150,000 cells (k = 9 there: 288 px squares, 348 x 348 cells,
about 29 MB with two classes; each further map adds about 20 bytes a cell). Cells off the slide (padding) are
skipped, and cells off the tissue when a tissue mask is given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wsitrain.report.map_grid import MapGrid, block_any, block_mean
from wsitrain.write_errors import named_write_errors

# At most this many detections unless a cell size is given: keeps a whole-slide file under ~50 MB (see above).
MAX_CELLS = 150_000
DIGITS = 4  # significant digits of the measurements: maps are model outputs, not exact to more than this


@dataclass(frozen=True)
class GeoJsonInfo:
    path: Path
    k: int  # map cells per detection side
    cell_px: float  # detection edge in level-0 px
    features: int
    bytes: int


def auto_k(shape: tuple[int, int], max_cells: int = MAX_CELLS) -> int:
    """Smallest k whose k x k aggregates of a ``shape`` map number at most ``max_cells``."""
    h, w = shape
    k = max(1, math.floor(math.sqrt(h * w / max_cells)))
    while -(-h // k) * -(-w // k) > max_cells:
        k += 1
    return k


def _num(v: float) -> str:
    """A coordinate: an integer when it is one (level-0 corners usually are), else two decimals."""
    r = round(float(v), 2)
    return str(int(r)) if r == int(r) else f"{r:.2f}".rstrip("0")


def write_geojson(
    path: Path,
    maps: Mapping[str, np.ndarray],
    grid: MapGrid,
    *,
    k: int | None = None,
    keep: np.ndarray | None = None,
) -> GeoJsonInfo:
    """Write ``maps`` (name -> (h, w) array on ``grid``; e.g. ``{"cam tumour": ..., "attention": ...}``) as one
    detection per k x k block of cells (None: ``auto_k``), each carrying every map's block mean as a measurement
    of that name. ``keep``: (h, w) bool, cells to write (e.g. on tissue); a block is written when any of its cells
    is kept and on the slide. NaN values are left out of the measurements; a block with none is not written."""
    if not maps:
        raise ValueError("write_geojson needs at least one map")
    for name, m in maps.items():
        if tuple(m.shape) != grid.shape:
            raise ValueError(f"map {name!r} has shape {tuple(m.shape)}; the grid is {grid.shape}")
    if keep is not None and tuple(keep.shape) != grid.shape:
        raise ValueError(f"keep has shape {tuple(keep.shape)}; the grid is {grid.shape}")
    k = auto_k(grid.shape) if k is None else int(k)
    if k < 1:
        raise ValueError(f"cell size k must be >= 1, got {k}")
    coarse = grid.coarsen(k)
    on = grid.on_slide() if keep is None else grid.on_slide() & keep.astype(bool)
    write = block_any(on, k)
    means = {name: block_mean(np.where(on, np.asarray(m, dtype=np.float64), np.nan), k) for name, m in maps.items()}
    any_value = np.zeros(coarse.shape, dtype=bool)
    for v in means.values():
        any_value |= ~np.isnan(v)
    write &= any_value
    # Edges clipped to the slide: a detection covers only slide pixels (the read box may run past the edge).
    w0, h0 = grid.slide_wh
    xs = [_num(v) for v in np.clip(coarse.x_edges(), 0, w0)]
    ys = [_num(v) for v in np.clip(coarse.y_edges(), 0, h0)]
    keys = [json.dumps(str(name)) for name in maps]
    values = list(means.values())
    n = 0
    with named_write_errors(path, "the GeoJSON heatmap"), open(path, "w") as f:
        f.write('{"type":"FeatureCollection","features":[')
        for i, j in zip(*np.nonzero(write), strict=True):
            x0, x1, y0, y1 = xs[j], xs[j + 1], ys[i], ys[i + 1]
            ring = f"[[{x0},{y0}],[{x1},{y0}],[{x1},{y1}],[{x0},{y1}],[{x0},{y0}]]"
            meas = ",".join(f"{key}:{v[i, j]:.{DIGITS}g}" for key, v in zip(keys, values, strict=True)
                            if not np.isnan(v[i, j]))
            f.write(("," if n else "") + '{"type":"Feature","geometry":{"type":"Polygon","coordinates":[' + ring
                    + ']},"properties":{"objectType":"detection","measurements":{' + meas + "}}}")
            n += 1
        f.write("]}\n")
    return GeoJsonInfo(Path(path), k, coarse.cell, n, Path(path).stat().st_size)
