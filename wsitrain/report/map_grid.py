"""Where a slide map's cells lie on the slide, in level-0 pixels: what viewer files (GeoJSON, TIFF) are drawn on.

A map of (h, w) cells computed on an image read at ``downsample`` level-0 px per image px, with ``stride`` image px
per cell, puts cell (i, j) on the level-0 square [x0 + j*c, x0 + (j+1)*c) x [y0 + i*c, y0 + (i+1)*c), c = stride *
downsample, (x0, y0) the read box's corner. Viewers (QuPath, ASAP) address the slide in level-0 pixels, so every
file a viewer opens is written in them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class MapGrid:
    """Cell (0, 0)'s top-left corner ``origin`` (level-0 x, y), cell edge ``cell`` in level-0 px, map ``shape``
    (h, w), the slide's level-0 ``slide_wh`` and level-0 ``mpp`` (microns per pixel; None when unknown)."""

    origin: tuple[float, float]
    cell: float
    shape: tuple[int, int]
    slide_wh: tuple[int, int]
    mpp: float | None = None

    @classmethod
    def of_read(
        cls, box: tuple[float, ...], downsample: float, stride: float, shape: tuple[int, int],
        slide_wh: tuple[int, int], mpp: float | None = None,
    ) -> MapGrid:
        """The grid of a map computed on a read (``ReadResult.box`` / ``.downsample``) with ``stride``."""
        return cls((float(box[0]), float(box[1])), float(stride) * float(downsample),
                   (int(shape[0]), int(shape[1])), (int(slide_wh[0]), int(slide_wh[1])), mpp)

    def x_edges(self) -> np.ndarray:
        """Level-0 x of the w + 1 column edges."""
        return self.origin[0] + np.arange(self.shape[1] + 1) * self.cell

    def y_edges(self) -> np.ndarray:
        return self.origin[1] + np.arange(self.shape[0] + 1) * self.cell

    def coarsen(self, k: int) -> MapGrid:
        """The grid of k x k cell aggregates (the last row/column of aggregates may be partial)."""
        h, w = self.shape
        return replace(self, cell=self.cell * k, shape=(-(-h // k), -(-w // k)))

    def on_slide(self) -> np.ndarray:
        """(h, w) bool: cells whose square overlaps the slide (padding past the slide's edge is not slide)."""
        xe, ye = self.x_edges(), self.y_edges()
        cols = (xe[1:] > 0) & (xe[:-1] < self.slide_wh[0])
        rows = (ye[1:] > 0) & (ye[:-1] < self.slide_wh[1])
        return rows[:, None] & cols[None, :]

    def sample(self, mask: np.ndarray, extent: tuple[float, float, float, float]) -> np.ndarray:
        """(h, w) bool: ``mask`` (a picture covering level-0 ``extent`` = (x0, x1, y1, y0), matplotlib's order)
        looked up at every cell's centre; centres off the picture are False."""
        x0, x1, y1, y0 = extent
        mh, mw = mask.shape
        xc = (self.x_edges()[:-1] + self.cell / 2 - x0) * mw / (x1 - x0)
        yc = (self.y_edges()[:-1] + self.cell / 2 - y0) * mh / (y1 - y0)
        ci, ri = np.floor(xc).astype(np.int64), np.floor(yc).astype(np.int64)
        cok, rok = (ci >= 0) & (ci < mw), (ri >= 0) & (ri < mh)
        out = mask[np.clip(ri, 0, mh - 1)[:, None], np.clip(ci, 0, mw - 1)[None, :]].astype(bool)
        return out & rok[:, None] & cok[None, :]


def block_mean(values: np.ndarray, k: int) -> np.ndarray:
    """(h, w) -> (ceil(h/k), ceil(w/k)): the mean of each k x k block of cells, NaN cells left out (a block with no
    value is NaN); partial blocks at the far edges average the cells they have."""
    if k == 1:
        return values.astype(np.float64)
    h, w = values.shape
    hh, ww = -(-h // k) * k, -(-w // k) * k
    padded = np.full((hh, ww), np.nan)
    padded[:h, :w] = values
    blocks = padded.reshape(hh // k, k, ww // k, k)
    have = ~np.isnan(blocks)
    n = have.sum(axis=(1, 3))
    total = np.where(have, blocks, 0.0).sum(axis=(1, 3))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, total / np.maximum(n, 1), np.nan)


def block_any(mask: np.ndarray, k: int) -> np.ndarray:
    """(h, w) bool -> (ceil(h/k), ceil(w/k)): whether any cell of each k x k block is set."""
    if k == 1:
        return mask.astype(bool)
    h, w = mask.shape
    hh, ww = -(-h // k) * k, -(-w // k) * k
    padded = np.zeros((hh, ww), dtype=bool)
    padded[:h, :w] = mask
    return padded.reshape(hh // k, k, ww // k, k).any(axis=(1, 3))
