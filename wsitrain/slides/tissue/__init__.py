"""Tissue detection on a slide's thumbnail, on scikit-image: pixel classes (``colour``), pieces kept or dropped with
their reason (``pieces``), the detector (``detect``), its settings and result (``result``), the box and the mask a
region read keeps (``region``), and what was kept and dropped (``summary``)."""

from wsitrain.slides.tissue.colour import MIN_SATURATION, saturation
from wsitrain.slides.tissue.detect import detect_tissue, level0_mpp, tissue_mask
from wsitrain.slides.tissue.pieces import DROP_REASONS, TISSUE, Piece
from wsitrain.slides.tissue.region import MASK_DILATION_PX, dilate_mask, mask_box, region_mask
from wsitrain.slides.tissue.result import DEFAULT_MIN_FRAGMENT_MM2, UNKNOWN_MPP, TissueResult, TissueSettings

__all__ = [
    "DEFAULT_MIN_FRAGMENT_MM2",
    "DROP_REASONS",
    "MASK_DILATION_PX",
    "MIN_SATURATION",
    "TISSUE",
    "UNKNOWN_MPP",
    "Piece",
    "TissueResult",
    "TissueSettings",
    "detect_tissue",
    "dilate_mask",
    "level0_mpp",
    "mask_box",
    "region_mask",
    "saturation",
    "tissue_mask",
]
