"""What tissue detection takes (``TissueSettings``) and gives (``TissueResult``: the mask, the box, every piece)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wsitrain.slides.tissue.pieces import Piece

# data.tissue.min_fragment_mm2's default: 0.001 mm² is a piece about 32 um across, room for roughly ten cells. It
# keeps the 0.005 mm² fragment that carried a lesion in issue 35 (160 px at 0.5 um/px) with a factor of five to
# spare, and drops specks of stain or debris smaller than a few cells, which carry nothing to learn from.
DEFAULT_MIN_FRAGMENT_MM2 = 0.001
# When a slide states no mpp and data.fallback_mpp is unset, areas are computed at this many um per level-0 pixel.
# 1.0 (a 10x scan) is coarser than nearly every scan, so a piece's area is overestimated rather than under: no piece
# at or above the threshold is dropped for the unknown scale (a few more specks may be kept).
UNKNOWN_MPP = 1.0


@dataclass(frozen=True)
class TissueSettings:
    """How pieces are judged: ``min_fragment_mm2``, and the mpp assumed for slides that state none."""

    min_fragment_mm2: float = DEFAULT_MIN_FRAGMENT_MM2
    fallback_mpp: float | None = None


@dataclass(frozen=True)
class TissueResult:
    """``mask`` (thumbnail pixels, the kept pieces); ``downsample`` maps thumbnail px to level-0 px; ``box`` (x, y, w,
    h) level 0, covering every kept piece; ``pieces`` every candidate piece, kept or dropped with its reason."""

    mask: np.ndarray
    downsample: float
    box: tuple[int, int, int, int] | None
    threshold: int
    pieces: tuple[Piece, ...] = ()
    mpp: float | None = None  # um per level-0 pixel the areas were computed at
    mpp_assumed: bool = False  # the slide states no mpp: ``mpp`` is data.fallback_mpp or UNKNOWN_MPP
    min_fragment_mm2: float = DEFAULT_MIN_FRAGMENT_MM2

    @property
    def found(self) -> bool:
        return self.box is not None

    @property
    def fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0

    @property
    def kept(self) -> list[Piece]:
        return [p for p in self.pieces if p.kept]

    @property
    def dropped(self) -> list[Piece]:
        return [p for p in self.pieces if not p.kept]
