"""What tissue detection kept and dropped on one slide, as the preflight table, data.json and the report show it.

A dropped piece is worth a look (``doubts``) when it might be tissue after all: a piece dropped as too small that is
larger than a tenth of the threshold, or darker than the slide's kept tissue (a small dense cluster of nuclei is
dark); or a colourless piece dropped as dust that is larger than that tenth. Pen strokes and labels are dropped on
positive evidence of colour and shape together, so they are listed but raise no doubt.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from wsitrain.slides.tissue.pieces import DROP_REASONS, Piece
from wsitrain.slides.tissue.result import TissueResult

# A dropped piece is darker than tissue when its mean luminance (0-255) is this much below the kept tissue's mean:
# more than the spread of pale tissue pieces on one slide (the synthetic fragments' means: 177-181), far less than a
# nuclei-packed fragment against eosin (the synthetic lesion fragment: 91 against 178, *measured* on its thumbnail).
DARKER_BY = 10.0
# The reason a doubt gives for a dark piece, as data.json records it (slides.tissue.cohort reads it back).
DARKER_WHY = "darker than the kept tissue"
# Pieces listed by name in a record: the largest dropped ones, so a slide with a thousand specks stays readable.
LISTED = 5


def _darker(p: Piece, tissue_grey: float | None) -> bool:
    return tissue_grey is not None and p.grey < tissue_grey - DARKER_BY


def kept_grey(result: TissueResult) -> float | None:
    """Mean luminance of the kept tissue, weighted by area (None: nothing kept)."""
    kept = result.kept
    n = sum(p.area_px for p in kept)
    return sum(p.grey * p.area_px for p in kept) / n if n else None


def doubts(result: TissueResult) -> list[tuple[Piece, str]]:
    """Dropped pieces that may be tissue, each with why, largest first."""
    tenth = result.min_fragment_mm2 / 10
    grey = kept_grey(result)
    out: list[tuple[Piece, str]] = []
    for p in sorted(result.dropped, key=lambda q: -q.area_px):
        why = []
        if p.kind in ("small", "dust") and p.area_mm2 > tenth:
            why.append(f"{p.area_mm2:.4f} mm² is more than a tenth of the threshold")
        if p.kind == "small" and _darker(p, grey):
            why.append(DARKER_WHY)
        if why:
            out.append((p, " and ".join(why)))
    return out


def _round(x: float) -> float:
    return float(f"{x:.6g}") if np.isfinite(x) else x


def tissue_record(result: TissueResult) -> dict[str, Any]:
    """The per-slide record: kept and dropped counts and areas (mm²), drops by reason, the largest dropped piece
    (and up to LISTED dropped pieces, level-0 boxes), the doubts, and the scale the areas were computed at."""
    ds = result.downsample

    def box(p: Piece) -> list[int]:
        r0, c0, r1, c1 = p.bbox
        return [int(c0 * ds), int(r0 * ds), int(np.ceil((c1 - c0) * ds)), int(np.ceil((r1 - r0) * ds))]

    def piece(p: Piece) -> dict[str, Any]:
        return {"kind": p.kind, "area_mm2": _round(p.area_mm2), "box": box(p)}

    kept, dropped = result.kept, sorted(result.dropped, key=lambda q: -q.area_px)
    return {
        "kept": {"count": len(kept), "area_mm2": _round(sum(p.area_mm2 for p in kept))},
        "dropped": {
            "count": len(dropped), "area_mm2": _round(sum(p.area_mm2 for p in dropped)),
            "by_reason": {r: sum(p.kind == r for p in dropped) for r in DROP_REASONS},
            "largest": piece(dropped[0]) if dropped else None,
            "pieces": [piece(p) for p in dropped[:LISTED]],
        },
        "doubts": [{**piece(p), "why": why} for p, why in doubts(result)],
        "min_fragment_mm2": result.min_fragment_mm2,
        "mpp": result.mpp,
        "mpp_assumed": result.mpp_assumed,
    }  # fmt: skip


def describe_dropped(record: dict[str, Any]) -> str:
    """'3 (0.0012 mm²; 2 small, 1 pen)' for a record's dropped pieces."""
    d = record["dropped"]
    if not d["count"]:
        return "0"
    reasons = ", ".join(f"{n} {r}" for r, n in d["by_reason"].items() if n)
    return f"{d['count']} ({d['area_mm2']:.4g} mm²; {reasons})"
