"""Tissue detection on a low-resolution view: Otsu on saturation, opening, small-object removal, bounding box.

Works on a thumbnail of at most ``max_side`` pixels read through the same streaming path as training reads,
so transparent areas are already composited onto the background colour (white background has saturation 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from wsitrain.slides.pixels import RegionMask, read_thumbnail
from wsitrain.slides.readers import SlideReader

# Below this saturation (0-255) nothing counts as tissue, even when Otsu splits pure-background noise.
MIN_SATURATION = 15
# Background masking grows the tissue mask by this many thumbnail pixels on every side (8-connected) before use.
# One thumbnail pixel is hundreds of level-0 pixels (a 100,000 px slide's 512 px thumbnail: ~200 px, ~50 µm at
# 0.25 µm/px), so the mask's blocky outline, and a tissue edge too faint to pass the threshold, are never cut.
MASK_DILATION_PX = 1


@dataclass(frozen=True)
class TissueResult:
    """``mask`` (thumbnail pixels); ``downsample`` maps thumbnail px to level-0 px; ``box`` (x, y, w, h) level 0."""

    mask: np.ndarray
    downsample: float
    box: tuple[int, int, int, int] | None
    threshold: int

    @property
    def found(self) -> bool:
        return self.box is not None

    @property
    def fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0


def saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation of an (h, w, 3) uint8 image, scaled to 0-255 (uint8)."""
    mx = rgb.max(axis=-1).astype(np.int32)
    mn = rgb.min(axis=-1).astype(np.int32)
    sat = np.zeros(mx.shape, dtype=np.int32)
    nz = mx > 0
    sat[nz] = (mx[nz] - mn[nz]) * 255 // mx[nz]
    return sat.astype(np.uint8)


def otsu_threshold(values: np.ndarray) -> int:
    """Otsu's threshold of uint8 ``values``: the split maximising between-class variance (pixels > t are fg)."""
    hist = np.bincount(values.ravel(), minlength=256).astype(np.float64)
    total = hist.sum()
    if total == 0:
        return 0
    levels = np.arange(256, dtype=np.float64)
    w0 = np.cumsum(hist)
    m0 = np.cumsum(hist * levels)
    w1 = total - w0
    mean_all = m0[-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        between = (mean_all * w0 / total - m0) ** 2 / (w0 * w1 / total)
    between = np.nan_to_num(between, nan=-1.0, posinf=-1.0)
    return int(np.argmax(between))


def _erode(x: torch.Tensor, k: int) -> torch.Tensor:
    return -F.max_pool2d(-x, k, stride=1, padding=k // 2)


def _dilate(x: torch.Tensor, k: int) -> torch.Tensor:
    return F.max_pool2d(x, k, stride=1, padding=k // 2)


def _runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Horizontal runs of True: (row, start, end) arrays, end exclusive, in row-major order."""
    h, w = mask.shape
    padded = np.zeros((h, w + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    d = np.diff(padded, axis=1)
    rows, starts = np.nonzero(d == 1)
    _rows2, ends = np.nonzero(d == -1)
    return rows, starts, ends


def label_components(mask: np.ndarray) -> np.ndarray:
    """8-connected component labels (0 = background, 1..n) by union-find over horizontal runs.

    Works run by run, not pixel by pixel, so a 512 px thumbnail takes milliseconds in plain Python.
    """
    rows, starts, ends = _runs(mask)
    n = len(rows)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    row_begin = np.searchsorted(rows, np.arange(mask.shape[0] + 1))
    for r in range(1, mask.shape[0]):
        i, i_end = int(row_begin[r - 1]), int(row_begin[r])  # runs of the row above
        j, j_end = int(row_begin[r]), int(row_begin[r + 1])
        while i < i_end and j < j_end:
            # 8-connected: runs touch when they overlap or meet diagonally.
            if starts[j] <= ends[i] and starts[i] <= ends[j]:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
            if ends[i] < ends[j]:
                i += 1
            else:
                j += 1
    labels = np.zeros(mask.shape, dtype=np.int64)
    ids: dict[int, int] = {}
    for k in range(n):
        root = find(k)
        labels[rows[k], starts[k] : ends[k]] = ids.setdefault(root, len(ids) + 1)
    return labels


def remove_small_objects(mask: np.ndarray, min_pixels: int, min_fraction_of_largest: float = 0.02) -> np.ndarray:
    """Drop components smaller than ``min_pixels`` or than a fraction of the largest one (dust, pen specks)."""
    if not mask.any():
        return mask
    labels = label_components(mask)
    ids, counts = np.unique(labels[labels > 0], return_counts=True)
    keep_min = max(min_pixels, int(counts.max() * min_fraction_of_largest))
    keep = ids[counts >= keep_min]
    return np.isin(labels, keep)


def tissue_mask(rgb: np.ndarray, min_object_fraction: float = 0.0005) -> tuple[np.ndarray, int]:
    """Boolean tissue mask of a thumbnail and the saturation threshold used."""
    sat = saturation(rgb)
    thr = max(otsu_threshold(sat), MIN_SATURATION)
    mask = sat > thr
    # Opening removes single-pixel noise and thin pen lines before component counting.
    t = torch.from_numpy(mask.astype(np.float32))[None, None]
    t = _dilate(_erode(t, 3), 3)
    mask = t[0, 0].numpy() > 0.5
    mask = remove_small_objects(mask, max(4, int(mask.size * min_object_fraction)))
    return mask, thr


def mask_box(
    mask: np.ndarray, downsample: float, dims: tuple[int, int], margin_px: int = 2
) -> tuple[int, int, int, int] | None:
    """Level-0 (x, y, w, h) of the mask's bounding box plus a margin, clipped to the slide ``dims`` (w, h)."""
    rows, cols = np.nonzero(mask.any(axis=1))[0], np.nonzero(mask.any(axis=0))[0]
    if rows.size == 0:
        return None
    x0 = max(0, int(np.floor((cols[0] - margin_px) * downsample)))
    y0 = max(0, int(np.floor((rows[0] - margin_px) * downsample)))
    x1 = min(dims[0], int(np.ceil((cols[-1] + 1 + margin_px) * downsample)))
    y1 = min(dims[1], int(np.ceil((rows[-1] + 1 + margin_px) * downsample)))
    return x0, y0, x1 - x0, y1 - y0


def detect_tissue(reader: SlideReader, max_side: int = 512) -> TissueResult:
    """Read a thumbnail of ``reader`` and find its tissue."""
    thumb, ds = read_thumbnail(reader, max_side)
    mask, thr = tissue_mask(thumb)
    box = mask_box(mask, ds, reader.info.dimensions)
    return TissueResult(mask=mask, downsample=ds, box=box, threshold=thr)


def dilate_mask(mask: np.ndarray, px: int = MASK_DILATION_PX) -> np.ndarray:
    """``mask`` grown by ``px`` pixels on every side (a (2 px + 1) square); nothing grows in from beyond its edge."""
    if px <= 0 or not mask.any():
        return mask.copy()
    t = torch.from_numpy(mask.astype(np.float32))[None, None]
    return _dilate(t, 2 * px + 1)[0, 0].numpy() > 0.5


def _grid_index(start: float, n: int, step: float, cell: float, extent: int, cells: int) -> np.ndarray:
    """Grid cell of each of ``n`` output pixels along one axis (-1: the pixel centre lies outside the slide).

    Output pixel k covers level-0 [start + k * step, start + (k + 1) * step); its centre picks the cell. Centres
    inside the slide are clamped to the grid, so the thumbnail's rounded size never drops the slide's last pixels.
    """
    centre = start + (np.arange(n, dtype=np.float64) + 0.5) * step
    idx = np.clip(np.floor(centre / cell).astype(np.int64), 0, cells - 1)
    idx[(centre < 0) | (centre >= extent)] = -1
    return idx


def region_mask(
    tissue: TissueResult,
    dims: tuple[int, int],
    origin: tuple[float, float],
    downsample: float,
    shape: tuple[int, int],
    background: tuple[int, int, int],
    dilation_px: int = MASK_DILATION_PX,
) -> RegionMask | None:
    """The ``RegionMask`` of a (H, W) = ``shape`` read whose output px (0, 0) starts at level-0 ``origin`` (x, y)
    and covers ``downsample`` level-0 px: the tissue mask, dilated by ``dilation_px`` thumbnail px. None when no
    tissue was found (then nothing is masked). Pixels whose centre lies outside the slide (``dims`` = (w, h) level
    0), where a read gives the background colour anyway, count as outside."""
    if not tissue.found:
        return None
    mask = dilate_mask(tissue.mask, dilation_px)
    gh, gw = mask.shape
    grid = np.zeros((gh + 1, gw + 1), dtype=bool)
    grid[:gh, :gw] = mask
    rows = _grid_index(origin[1], shape[0], downsample, tissue.downsample, dims[1], gh)
    cols = _grid_index(origin[0], shape[1], downsample, tissue.downsample, dims[0], gw)
    bg = (int(background[0]), int(background[1]), int(background[2]))
    return RegionMask(grid=grid, rows=rows, cols=cols, background=bg)
