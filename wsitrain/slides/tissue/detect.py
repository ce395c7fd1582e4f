"""Tissue detection on a low-resolution view: pixel classes, pieces judged one by one, the box of all kept pieces.

Works on a thumbnail of at most ``max_side`` pixels read through the same streaming path as training reads,
so transparent areas are already composited onto the background colour (white background has saturation 0).
Every kept piece counts, however small or far from the others: the tissue box grows to cover them all (one box, not
pieces packed together, so level-0 coordinates stay what they are everywhere downstream).
"""

from __future__ import annotations

import numpy as np

from wsitrain.slides.pixels import read_thumbnail
from wsitrain.slides.readers import SlideReader
from wsitrain.slides.tissue.colour import classify_pixels
from wsitrain.slides.tissue.pieces import Piece, classify_pieces, kept_mask
from wsitrain.slides.tissue.region import mask_box
from wsitrain.slides.tissue.result import DEFAULT_MIN_FRAGMENT_MM2, UNKNOWN_MPP, TissueResult, TissueSettings


def tissue_mask(
    rgb: np.ndarray, px_mm2: float | None = None, min_fragment_mm2: float = DEFAULT_MIN_FRAGMENT_MM2
) -> tuple[np.ndarray, int]:
    """Boolean tissue mask (the kept pieces) of a thumbnail and the saturation threshold used. ``px_mm2``: one
    thumbnail pixel's area in mm²; None keeps pieces of any size (pen, dust and labels still go)."""
    mask, thr, _ = _detect(rgb, px_mm2, min_fragment_mm2)
    return mask, thr


def _detect(rgb: np.ndarray, px_mm2: float | None, min_fragment_mm2: float) -> tuple[np.ndarray, int, list[Piece]]:
    px = classify_pixels(rgb)
    labels, pieces = classify_pieces(px, px_mm2, min_fragment_mm2)
    return kept_mask(labels, pieces), px.threshold, pieces


def level0_mpp(reader: SlideReader, fallback_mpp: float | None) -> tuple[float, bool]:
    """(um per level-0 pixel, assumed?): the slide's own mpp (mean of x and y), else the fallback, else UNKNOWN_MPP."""
    mpp = reader.info.mpp
    if mpp is not None:
        return (float(mpp[0]) + float(mpp[1])) / 2, False
    return (float(fallback_mpp) if fallback_mpp is not None else UNKNOWN_MPP), True


def detect_tissue(reader: SlideReader, max_side: int = 512, settings: TissueSettings | None = None) -> TissueResult:
    """Read a thumbnail of ``reader`` and find its tissue: every piece of at least ``min_fragment_mm2``."""
    s = settings if settings is not None else TissueSettings()
    thumb, ds = read_thumbnail(reader, max_side)  # (h, w, 3) uint8
    mpp, assumed = level0_mpp(reader, s.fallback_mpp)
    px_mm2 = (ds * mpp * 1e-3) ** 2  # one thumbnail pixel, in mm²
    mask, thr, pieces = _detect(thumb, px_mm2, s.min_fragment_mm2)
    box = mask_box(mask, ds, reader.info.dimensions)
    return TissueResult(mask=mask, downsample=ds, box=box, threshold=thr, pieces=tuple(pieces), mpp=mpp,
                        mpp_assumed=assumed, min_fragment_mm2=s.min_fragment_mm2)  # fmt: skip


def block_tissue(rgb: np.ndarray, block: int) -> np.ndarray:
    """(H // block, W // block) bool: ``tissue_mask`` of an (H, W, 3) uint8 image's ``block`` x ``block`` means, one
    per map cell of a trunk with that stride (the ragged edge left out)."""
    h, w = rgb.shape[0] // block, rgb.shape[1] // block
    means = rgb[: h * block, : w * block].astype(np.float32).reshape(h, block, w, block, 3).mean((1, 3))
    mask, _ = tissue_mask(means.round().astype(np.uint8))
    return mask
