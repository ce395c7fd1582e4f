"""Pieces of a thumbnail's candidate mask, each kept as tissue or dropped with its reason.

Connected pieces (8-connected, scikit-image's ``label``) of the not-glass pixels (``colour.PixelClasses``) are judged
one by one, artefacts first, so a piece is dropped by size only when nothing else explains it:

1. ``pen``: mostly pen-coloured or dark colourless pixels, *and* thin and long (a straight stroke, or a curved line
   or ring such as a circle drawn round a lesion). Colour alone never drops a piece (haematoxylin is blue too), and
   shape alone never does (needle biopsies are thin strips).
2. ``dust``: mostly dark colourless pixels (dust, dirt, a label's print). Stained tissue is coloured, however
   dense: a dark, nuclei-rich piece is purple, so it is never dropped here.
3. ``label``: a flat, near-perfect rectangle (the slide's label or a sticker), never the largest piece.
4. ``small``: below ``min_fragment_mm2`` of physical area at the slide's mpp.

Everything else is ``tissue`` and kept, however far from the main piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from skimage.measure import label, regionprops
from skimage.morphology import erosion

from wsitrain.slides.tissue.colour import PixelClasses

TISSUE = "tissue"
# Why a piece was dropped: the one vocabulary the preflight, data.json and the report use.
DROP_REASONS = ("small", "pen", "dust", "label")

# A piece is pen or dust when at least this share of its pixels is pen-coloured or dark colourless.
ARTEFACT_SHARE = 0.5
# Thin and long: a straight piece whose major axis is this many times its minor axis (the synthetic pen line: 43; the
# real test slides' pieces of 64 thumbnail px or more: 1.5-3.1, *measured* on their 512 px thumbnails) ...
PEN_ELONGATION = 5.0
# ... or a curved line: perimeter^2 / (4 pi area) at least this (1 for a disc; a 4 px wide ring of radius 100 px is
# about 50) with solidity below PEN_SOLIDITY (a ring's convex hull is mostly empty). Lacy real tissue passes this
# test too (CMU-1's main piece: 333 and 0.50), which is why a pen piece must also be mostly pen-coloured.
PEN_CURVE = 4.0
PEN_SOLIDITY = 0.5
# Shapes of fewer thumbnail pixels say nothing reliable (a 2 x 3 px speck has any elongation).
SHAPE_MIN_PX = 6
# Label: at least this many thumbnail pixels, filling at least LABEL_EXTENT of its bounding box (a pixelated disc fills
# 0.76-0.90 of its own), with interior luminance varying by at most LABEL_FLAT_STD (0-255). The real test slides'
# pieces of 64 px or more fill at most 0.62 of their box and vary by 16-36; the synthetic label fills 1.0 and varies
# by 0.1 (flat synthetic tissue: 2-8), *measured* on 512 px thumbnails.
LABEL_MIN_PX = 64
LABEL_EXTENT = 0.95
LABEL_FLAT_STD = 6.0


@dataclass(frozen=True)
class Piece:
    """One connected piece: its area, where it lies (thumbnail rows/cols, end exclusive), and what was decided."""

    kind: str  # TISSUE or one of DROP_REASONS
    area_px: int
    area_mm2: float
    bbox: tuple[int, int, int, int]  # (row0, col0, row1, col1) thumbnail px
    grey: float  # mean luminance 0-255 on the thumbnail

    @property
    def kept(self) -> bool:
        return self.kind == TISSUE

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "area_px": self.area_px, "area_mm2": self.area_mm2, "bbox": list(self.bbox),
                "grey": self.grey}  # fmt: skip


def _thin_and_long(p: object) -> bool:
    if p.area < SHAPE_MIN_PX:  # type: ignore[attr-defined]
        return False
    minor = max(float(p.axis_minor_length), 1.0)  # type: ignore[attr-defined]
    if float(p.axis_major_length) / minor >= PEN_ELONGATION:  # type: ignore[attr-defined]
        return True
    curve = float(p.perimeter) ** 2 / (4 * np.pi * float(p.area))  # type: ignore[attr-defined]
    return curve >= PEN_CURVE and float(p.solidity) < PEN_SOLIDITY  # type: ignore[attr-defined]


def _label_like(p: object, grey: np.ndarray) -> bool:
    if p.area < LABEL_MIN_PX or float(p.extent) < LABEL_EXTENT:  # type: ignore[attr-defined]
        return False
    r0, c0, r1, c1 = p.bbox  # type: ignore[attr-defined]
    inside = erosion(p.image, np.ones((3, 3), dtype=bool))  # type: ignore[attr-defined]  # edges blend with glass
    region = p.image if not inside.any() else inside  # type: ignore[attr-defined]
    return float(grey[r0:r1, c0:c1][region].std()) <= LABEL_FLAT_STD


def classify_pieces(
    px: PixelClasses, px_mm2: float | None, min_fragment_mm2: float
) -> tuple[np.ndarray, list[Piece]]:
    """Label the candidate pixels and judge every piece; returns (labels (h, w) int, pieces in label order 1..n).

    ``px_mm2``: one thumbnail pixel's area in mm² (None: no size test, as for a thumbnail of unknown scale)."""
    labels = label(px.candidate, connectivity=2)  # (h, w) int
    n = int(labels.max())
    if n == 0:
        return labels, []
    flat = labels.ravel()
    counts = np.bincount(flat, minlength=n + 1)[1:].astype(np.int64)
    dark = np.bincount(flat[px.dark.ravel()], minlength=n + 1)[1:]
    pen_or_dark = np.bincount(flat[(px.pen | px.dark).ravel()], minlength=n + 1)[1:]
    grey = np.bincount(flat, weights=px.grey.ravel(), minlength=n + 1)[1:] / np.maximum(counts, 1)
    largest = int(np.argmax(counts)) + 1
    pieces: list[Piece] = []
    for p in regionprops(labels):  # label order; shape measures are computed only when asked for
        i = p.label - 1
        area = int(counts[i])
        mm2 = area * px_mm2 if px_mm2 is not None else float("nan")
        if pen_or_dark[i] >= ARTEFACT_SHARE * area and _thin_and_long(p):
            kind = "pen"
        elif dark[i] >= ARTEFACT_SHARE * area:
            kind = "dust"
        elif p.label != largest and _label_like(p, px.grey):
            kind = "label"
        elif px_mm2 is not None and mm2 < min_fragment_mm2:
            kind = "small"
        else:
            kind = TISSUE
        r0, c0, r1, c1 = (int(v) for v in p.bbox)
        pieces.append(Piece(kind, area, float(mm2), (r0, c0, r1, c1), float(grey[i])))
    return labels, pieces


def kept_mask(labels: np.ndarray, pieces: list[Piece]) -> np.ndarray:
    """(h, w) bool: the pixels of the kept pieces."""
    keep = np.zeros(len(pieces) + 1, dtype=bool)
    keep[1:] = [p.kept for p in pieces]
    return keep[labels]
