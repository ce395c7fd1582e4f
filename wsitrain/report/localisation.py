"""Localisation scores of a slide map (attention or CAM) against known lesion boxes (``lesions.json``).

- **pointing game**: the map's highest cell lies inside a lesion box (one yes/no per positive slide);
- **mass on lesions**: the share of the map's total (attention weights sum to 1) in cells inside lesion boxes.

A cell is inside a box when its centre is. Cell (i, j) of a map with ``stride`` over an image placed at level-0
``box`` (x, y, w, h) with ``downsample`` level-0 px per image px has its centre at level-0
(x + (j + 0.5) * stride * downsample, y + (i + 0.5) * stride * downsample): the same placement ``predict
--heatmaps`` records per slide in heatmaps.json.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LESION = "lesion"  # lesions.json's kind of a true lesion (distractors are the look-alikes)
DECISIVE = "decisive"  # score_heatmaps' key for max pooling's deciding cell (heatmaps.json's per-class (row, col))


@dataclass(frozen=True)
class Localisation:
    """One slide's scores: whether the map's peak is in a lesion, and the share of its mass there."""

    pointing: bool
    mass: float


def inside_mask(shape: tuple[int, int], stride: float, origin: tuple[float, float], downsample: float,
                boxes: Sequence[dict[str, Any]]) -> np.ndarray:  # fmt: skip
    """(h, w) bool: the cells whose centre lies inside any box (``x0, y0, x1, y1`` in level-0 px)."""
    h, w = shape
    step = stride * downsample
    cy = origin[1] + (np.arange(h) + 0.5) * step  # (h,)
    cx = origin[0] + (np.arange(w) + 0.5) * step  # (w,)
    mask = np.zeros((h, w), dtype=bool)
    for b in boxes:
        rows = (cy >= b["y0"]) & (cy < b["y1"])
        cols = (cx >= b["x0"]) & (cx < b["x1"])
        mask |= rows[:, None] & cols[None, :]
    return mask


def score_map(values: np.ndarray, inside: np.ndarray) -> Localisation:
    """Pointing game and mass share of one (h, w) map; a negative map (a CAM) is shifted to start at 0 for the mass."""
    v = np.asarray(values, dtype=np.float64)
    peak = np.unravel_index(int(np.argmax(v)), v.shape)
    shifted = v - min(0.0, float(v.min()))
    total = float(shifted.sum())
    return Localisation(bool(inside[peak]), float(shifted[inside].sum() / total) if total > 0 else 0.0)


def score_heatmaps(heatmaps_dir: Path, lesions_json: Path, key: str = "attention") -> dict[str, float]:
    """Mean pointing game and mass over the positive slides of a ``predict --heatmaps`` folder that lesions.json knows.

    ``key``: "attention" (branch 0, or the positive class's branch), "cam" (the positive class's map) or "decisive"
    (max pooling: the positive class's deciding cell, the one whose channels' maxima gave the largest part of its
    pooled logit, ``decisive`` in heatmaps.json; the CAM's peak need not be any channel's maximum, so this is where a
    max-pooled score was really decided; its mass is the CAM's). Also the
    pointing game apart on the positive slides that carry a look-alike as well (``pointing_game_with_lookalike``,
    ``n_with_lookalike``) and on those that do not (``pointing_game_without_lookalike``): a map that finds
    "a structure" rather than the lesion fails only on the first (docs/research/plateau.md section 8)."""
    index = json.loads((heatmaps_dir / "heatmaps.json").read_text())
    truth = json.loads(Path(lesions_json).read_text())["slides"]
    positive = index["classes"].index("positive") if "positive" in index["classes"] else len(index["classes"]) - 1
    scores, lookalike = [], []
    decisive = key == DECISIVE
    for rec in index["slides"]:
        t = truth.get(rec["slide"])
        if t is None or t["label"] != "positive" or rec.get(key) is None:
            continue
        maps = np.load(heatmaps_dir / rec["cam" if decisive else key])  # (branches or classes, h, w)
        m = maps[positive] if len(maps) > 1 else maps[0]
        boxes = [b for b in t["boxes"] if b["kind"] == LESION]
        inside = inside_mask(m.shape, rec["stride"], (rec["box"][0], rec["box"][1]), rec["downsample"], boxes)
        s = score_map(m, inside)
        if decisive:
            r, c = rec[key][positive]  # (row, col) of the class's deciding cell
            s = Localisation(bool(inside[int(r), int(c)]), s.mass)
        scores.append(s)
        lookalike.append(any(b["kind"] != LESION for b in t["boxes"]))
    if not scores:
        return {"pointing_game": float("nan"), "lesion_mass": float("nan"), "n_positive": 0}

    def pointing(with_lookalike: bool) -> float:
        hits = [s.pointing for s, w in zip(scores, lookalike, strict=True) if w == with_lookalike]
        return float(np.mean(hits)) if hits else float("nan")

    return {"pointing_game": float(np.mean([s.pointing for s in scores])),
            "lesion_mass": float(np.mean([s.mass for s in scores])), "n_positive": len(scores),
            "pointing_game_with_lookalike": pointing(True), "pointing_game_without_lookalike": pointing(False),
            "n_with_lookalike": int(sum(lookalike))}  # fmt: skip
