"""Where the tissue is, in level-0 pixels: its bounding box, and the mask a region read keeps (``RegionMask``).
"""

from __future__ import annotations

import numpy as np
from skimage.morphology import dilation

from wsitrain.slides.pixels import RegionMask
from wsitrain.slides.tissue.result import TissueResult

# Background masking grows the tissue mask by this many thumbnail pixels on every side (8-connected) before use.
# One thumbnail pixel is hundreds of level-0 pixels (a 100,000 px slide's 512 px thumbnail: ~200 px, ~50 µm at
# 0.25 µm/px), so the mask's blocky outline, and a tissue edge too faint to pass the threshold, are never cut.
MASK_DILATION_PX = 1


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


def dilate_mask(mask: np.ndarray, px: int = MASK_DILATION_PX) -> np.ndarray:
    """``mask`` grown by ``px`` pixels on every side (a (2 px + 1) square); nothing grows in from beyond its edge."""
    if px <= 0 or not mask.any():
        return mask.copy()
    # grey dilation of a bool image pads with its lowest value (False): nothing grows in from beyond the edge
    return dilation(mask, np.ones((2 * px + 1, 2 * px + 1), dtype=bool)).astype(bool)


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
