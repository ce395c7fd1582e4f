"""Synthetic slides where only full resolution tells the classes apart: small lesions and look-alike distractors.

``wsitrain synth --lesions small``. Every slide is one large piece of pink tissue (55-80% of the field) with sparse
small pale nuclei, and one to three round *structures* of a fixed physical size (``LESION_UM`` across):

- a **lesion** (positive slides only, one to three of them): a cluster of atypical nuclei, larger than the normal
  ones, pale with a dark irregular rim, a dark nucleolus and chromatin speckles;
- a **distractor** (negatives, and positives with fewer lesions than structures): a dense cluster of small dark
  nuclei that is, at thumbnail scale, *the same image* as a lesion.

How the thumbnail shortcut is closed: a distractor is drawn from an unseen lesion of the same generator. For every
``BLOCK`` x ``BLOCK`` block of level 0 (one pixel of the 512 px thumbnail of a 2048 px slide, i.e. pyramid level 2)
the distractor puts the lesion block's total colour offset from the tissue into a few dark pixels. Block sums are
equal, so every thumbnail pixel of a distractor is distributed exactly as a lesion's: same mean colour, same
mottling, same outline. Structures start on the block grid, and the number of structures per slide has the same
distribution in both classes, so the thumbnail carries no label signal; only the nuclei's shapes and texture at
level 0 do. Lesions cover well under 1% of the tissue (three lesions of 200 um at 2.5 um/px: 15,000 of 2.3 million
tissue pixels or more on a 2048 px slide).

Deterministic from the seed. ``LesionScene.boxes`` lists every structure's box in level-0 pixels; the dataset
writer puts them in ``lesions.json`` beside ``labels.csv``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from wsitrain.errors import WsiTrainError
from wsitrain.slides.synth.fields import add_lobe, coarse_grid, smooth_noise, upsample

# none: the default scenes; small: lesions on positives, look-alikes where a slide has fewer lesions than structures
# (every negative, about 2 in 5 positives); paired: as small, but every slide of either class carries a look-alike,
# so a look-alike's presence says nothing of the label and only the lesion's own nuclei do.
LESION_MODES = ("none", "small", "paired")
LESION_MPP = 2.5  # um per level-0 pixel (a 4x scan): a 2048 px slide is 5 mm of tissue, nuclei are 3-8 px
LESION_APP_MAG = 4.0
LESION_UM = 200.0  # lesion (and distractor) diameter
BLOCK = 4  # structures are matched in blocks of this many level-0 px: the 4x-down thumbnail (pyramid level 2)
SIDECAR = "lesions.json"
MIN_SIZE = 512  # below this a 200 um structure (80 px) no longer fits inside the tissue three times

# Colours (RGB) of the parts of a nucleus, before per-nucleus jitter.
_NORMAL = np.array([175, 125, 190])
_ATYPICAL = np.array([185, 145, 212])  # pale nucleoplasm
_RIM = np.array([105, 60, 150])
_NUCLEOLUS = np.array([60, 25, 110])


class LesionScene:
    """One slide's scene; ``band(y0, y1)`` renders level-0 rows, as ``synth._Scene`` does for the default mode."""

    def __init__(
        self, width: int, height: int, positive: bool, seed: int, mpp: float = LESION_MPP, paired: bool = False
    ) -> None:
        check_size(width, height, mpp)
        rng = np.random.default_rng(seed)
        self.w, self.h, self.positive, self.mpp = width, height, positive, mpp
        self.background = rng.integers(238, 248) + rng.integers(-3, 4, size=3)
        self._tissue_fields(rng)
        self.noise = rng.integers(-7, 8, size=(512, 512, 3)).astype(np.int16)
        # Stamps: (y0, x0, rgb (h, w, 3) int16, mask (h, w) bool) pasted over the tissue colour before the noise.
        self._stamps: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self.boxes: list[dict[str, Any]] = []
        # Same number of structures in both classes: the count says nothing about the label. Paired: two or three,
        # at least one of them a look-alike on a positive slide too.
        n_struct = int(rng.integers(2, 4)) if paired else int(rng.integers(1, 4))
        n_lesions = int(rng.integers(1, n_struct + 1 - paired)) if positive else 0
        kinds = ["lesion"] * n_lesions + ["distractor"] * (n_struct - n_lesions)
        rng.shuffle(kinds)
        radius = LESION_UM / 2 / mpp
        for kind, (x0, y0) in zip(kinds, self._place(rng, radius, len(kinds)), strict=True):
            self._add_structure(rng, kind, x0, y0, radius)
        self._add_normal_nuclei(rng)
        ys0 = np.array([s[0] for s in self._stamps])
        self._ys0, self._ys1 = ys0, ys0 + np.array([s[2].shape[0] for s in self._stamps])

    # ---- tissue
    def _tissue_fields(self, rng: np.random.Generator) -> None:
        """One large tissue piece (55-80% of the field) with a smooth colour drift, on a coarse grid."""
        self.f = max(1, int(np.ceil(max(self.w, self.h) / 2048)))
        lw, lh = -(-self.w // self.f), -(-self.h // self.f)
        gw, gh, u, v = coarse_grid(lw, lh)
        field = np.zeros((gh, gw), dtype=np.float32)
        wobble = 0.1 * smooth_noise(rng, (gh, gw), 6)
        for _ in range(12):  # add lobes until the tissue covers enough of the field
            field = add_lobe(field, rng, u, v, centre=(0.35, 0.65), radii=(0.25, 0.45))
            if ((field - wobble) > 0.35).mean() >= 0.6:
                break
        drift = smooth_noise(rng, (gh, gw), 5)
        field, drift = upsample(field - wobble, (lh, lw)), upsample(drift, (lh, lw))
        self.tissue = field > 0.35
        base = np.array([232, 150, 196], dtype=np.float32) + rng.uniform(-8, 8, size=3)
        colour = base + drift[..., None] * np.array([8, 18, 12], dtype=np.float32)
        colour = np.where(self.tissue[..., None], colour, self.background.astype(np.float32))
        self.colour = np.clip(colour, 0, 255).astype(np.int16)

    @property
    def tissue_px(self) -> int:
        """Tissue area in level-0 pixels."""
        rows = np.arange(self.h) // self.f
        cols = np.arange(self.w) // self.f
        return int(self.tissue[rows][:, cols].sum())

    def _base(self, y0: int, x0: int, h: int, w: int) -> np.ndarray:
        """Tissue colour (no noise) of level-0 rows y0..y0+h, columns x0..x0+w, as int16 (h, w, 3)."""
        rows = np.clip(np.arange(y0, y0 + h), 0, self.h - 1) // self.f
        cols = np.clip(np.arange(x0, x0 + w), 0, self.w - 1) // self.f
        return self.colour[rows][:, cols]

    def _is_tissue(self, x: float, y: float) -> bool:
        i, j = int(y) // self.f, int(x) // self.f
        return 0 <= i < self.tissue.shape[0] and 0 <= j < self.tissue.shape[1] and bool(self.tissue[i, j])

    # ---- structures
    def _place(self, rng: np.random.Generator, radius: float, n: int) -> list[tuple[int, int]]:
        """Top-left corners (on the block grid) of ``n`` non-overlapping structures lying wholly inside tissue."""
        side = _patch_side(radius)
        ring = np.linspace(0, 2 * np.pi, 16, endpoint=False)
        spots: list[tuple[int, int]] = []
        for _ in range(4000):
            x0 = int(rng.integers(0, max(1, (self.w - side) // BLOCK))) * BLOCK
            y0 = int(rng.integers(0, max(1, (self.h - side) // BLOCK))) * BLOCK
            cx, cy = x0 + side / 2, y0 + side / 2
            pts = [(cx + k * radius * np.cos(t), cy + k * radius * np.sin(t)) for k in (0.5, 1.3) for t in ring]
            inside = all(self._is_tissue(x, y) for x, y in pts)
            apart = all(np.hypot(cx - sx - side / 2, cy - sy - side / 2) > 2.6 * radius for sx, sy in spots)
            if inside and apart:
                spots.append((x0, y0))
                if len(spots) == n:
                    return spots
        raise WsiTrainError(  # pragma: no cover - the tissue covers >= 55% of a field of >= 512 px
            f"synth --lesions small: no room for {n} structures of {LESION_UM:g} um in a {self.w}x{self.h} px slide",
            hint="use a larger --size",
        )

    def _add_structure(self, rng: np.random.Generator, kind: str, x0: int, y0: int, radius: float) -> None:
        side = _patch_side(radius)
        base = self._base(y0, x0, side, side)
        rgb, mask = _lesion_patch(rng, base, radius, self.mpp)
        if kind == "distractor":
            rgb, mask = _distractor_from(rng, base, rgb, mask)
        self._stamps.append((y0, x0, rgb, mask))
        self.boxes.append({
            "kind": kind, "x0": x0, "y0": y0, "x1": x0 + side, "y1": y0 + side,
            "area_px": float(np.pi * radius * radius), "diameter_um": LESION_UM,
        })  # fmt: skip

    def _add_normal_nuclei(self, rng: np.random.Generator) -> None:
        """Sparse small pale nuclei over the tissue (both classes alike), none inside a structure's box."""
        r0 = 4.0 / self.mpp  # 8 um nuclei
        spacing = 40.0 / self.mpp
        n = int(self.w * self.h / spacing**2)
        xs, ys = rng.uniform(0, self.w, n), rng.uniform(0, self.h, n)
        rs = r0 * rng.uniform(0.8, 1.15, n)
        jit = rng.integers(-10, 10, size=(n, 3))
        keep = self.tissue[(ys // self.f).astype(int), (xs // self.f).astype(int)]
        for b in self.boxes:
            keep &= ~((xs >= b["x0"] - r0) & (xs < b["x1"] + r0) & (ys >= b["y0"] - r0) & (ys < b["y1"] + r0))
        s = int(2 * r0 * 1.15) + 2
        yy, xx = np.mgrid[0:s, 0:s] + 0.5
        for x, y, r, j in zip(xs[keep], ys[keep], rs[keep], jit[keep], strict=True):
            ya, xa = int(y - r), int(x - r)
            mask = (xx + xa - x) ** 2 + (yy + ya - y) ** 2 <= r * r
            rgb = (self._base(ya, xa, s, s) * 3 + (_NORMAL + j) * 7) // 10
            self._stamps.append((ya, xa, rgb.astype(np.int16), mask))

    # ---- rendering
    def band(self, y0: int, y1: int) -> np.ndarray:
        """Level-0 rows [y0, y1) as (y1 - y0, w, 3) uint8."""
        img = self._base(y0, 0, y1 - y0, self.w).copy()
        for i in np.nonzero((self._ys1 > y0) & (self._ys0 < y1))[0]:
            sy, sx, rgb, mask = self._stamps[i]
            ya, yb = max(y0, sy), min(y1, sy + rgb.shape[0])
            xa, xb = max(0, sx), min(self.w, sx + rgb.shape[1])
            if xa >= xb:
                continue
            m = mask[ya - sy : yb - sy, xa - sx : xb - sx]
            dst = img[ya - y0 : yb - y0, xa:xb]
            dst[m] = rgb[ya - sy : yb - sy, xa - sx : xb - sx][m]
        tissue = self.tissue[np.arange(y0, y1) // self.f][:, np.arange(self.w) // self.f]
        noise = self.noise[np.arange(y0, y1) % 512][:, np.arange(self.w) % 512]
        img = img + np.where(tissue[..., None], noise, noise // 3)
        return np.clip(img, 0, 255).astype(np.uint8)


def check_size(width: int, height: int, mpp: float) -> None:
    """Bad input (exit 2) when three structures of LESION_UM cannot fit in a slide of this size."""
    if min(width, height) < MIN_SIZE * LESION_MPP / mpp:
        raise WsiTrainError(
            f"synth --lesions small: slides of {width}x{height} px are too small for {LESION_UM:g} um lesions "
            f"at {mpp:g} um/px",
            hint=f"use --size {MIN_SIZE} or more (2048 gives lesions under 1% of the tissue)",
        )


def _patch_side(radius: float) -> int:
    """Edge of a structure's square box: the disc plus a margin for nuclei on its edge, a multiple of BLOCK."""
    return int(np.ceil((2 * radius + 8) / BLOCK)) * BLOCK


def _lesion_patch(
    rng: np.random.Generator, base: np.ndarray, radius: float, mpp: float
) -> tuple[np.ndarray, np.ndarray]:
    """A cluster of atypical nuclei inside a disc of ``radius`` px centred in a box of ``base``'s shape.

    Nuclei are 12-20 um across (normal ones: 8 um), on a jittered grid 22 um apart, with irregular outlines (two
    random harmonics of the radius), a dark rim, one dark nucleolus and darker chromatin speckles.
    Returns (rgb int16, mask bool): the pixels that replace the tissue colour."""
    side = base.shape[0]
    rgb = base.copy()
    mask = np.zeros((side, side), dtype=bool)
    c = side / 2
    step = 22.0 / mpp
    grid = np.arange(c - radius, c + radius + step, step)
    yy, xx = np.mgrid[0:side, 0:side]
    for gy in grid:
        for gx in grid:
            x, y = gx + rng.normal(0, step / 6), gy + rng.normal(0, step / 6)
            r0 = rng.uniform(6.0, 10.0) / mpp
            if np.hypot(x - c, y - c) > radius - r0 * 0.5 or rng.random() < 0.1:
                continue
            dx, dy = xx + 0.5 - x, yy + 0.5 - y
            th = np.arctan2(dy, dx)
            a1, a2, p1, p2 = rng.uniform(0.05, 0.18), rng.uniform(0.03, 0.12), *rng.uniform(0, 2 * np.pi, 2)
            rr = r0 * (1 + a1 * np.cos(2 * th + p1) + a2 * np.cos(3 * th + p2))
            d = np.hypot(dx, dy)
            inside = d <= rr
            if not inside.any():
                continue
            jit = rng.integers(-12, 12, size=3)
            col = np.where((rr - d)[..., None] < 1.2, _RIM + jit // 2, _ATYPICAL + jit)
            speck = rng.random((side, side)) < 0.15
            col = np.where(speck[..., None], col - 30, col)
            nx, ny = x + rng.uniform(-0.3, 0.3) * r0, y + rng.uniform(-0.3, 0.3) * r0
            nucleolus = np.hypot(xx + 0.5 - nx, yy + 0.5 - ny) <= max(0.8, 1.8 / mpp)
            col = np.where((nucleolus & inside)[..., None], _NUCLEOLUS, col)
            rgb[inside] = col[inside]
            mask |= inside
    return rgb.astype(np.int16), mask


def _distractor_from(
    rng: np.random.Generator, base: np.ndarray, lesion_rgb: np.ndarray, lesion_mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Small dark nuclei whose every BLOCK x BLOCK block sum equals the given (unseen) lesion's.

    Each block's colour offset from the tissue (summed over the block's nucleus pixels) goes into a compact dot of
    about 40% as many pixels, around a random point of the block: darker and smaller nuclei, same block mean."""
    side = base.shape[0]
    rgb = base.copy()
    mask = np.zeros((side, side), dtype=bool)
    offset = (lesion_rgb.astype(np.int32) - base) * lesion_mask[..., None]
    by, bx = np.mgrid[0:BLOCK, 0:BLOCK]
    for y in range(0, side, BLOCK):
        for x in range(0, side, BLOCK):
            n = int(lesion_mask[y : y + BLOCK, x : x + BLOCK].sum())
            if n == 0:
                continue
            total = offset[y : y + BLOCK, x : x + BLOCK].sum(axis=(0, 1)).astype(np.float64)
            cy, cx = rng.uniform(0.5, BLOCK - 0.5, 2)
            order = np.argsort(((by + 0.5 - cy) ** 2 + (bx + 0.5 - cx) ** 2 + rng.uniform(0, 0.1, by.shape)).ravel())
            t = base[y : y + BLOCK, x : x + BLOCK].reshape(-1, 3).astype(np.float64)
            k = max(1, round(0.4 * n))
            while True:  # grow the dot until its colour is a valid one (never needed beyond n pixels)
                pick = order[:k]
                col = t[pick] + total / k
                if k >= n or (col.min() >= 12 and col.max() <= 250):
                    break
                k += 1
            sub_rgb = rgb[y : y + BLOCK, x : x + BLOCK].reshape(-1, 3)
            sub_rgb[pick] = np.rint(np.clip(col, 0, 255)).astype(np.int16)
            rgb[y : y + BLOCK, x : x + BLOCK] = sub_rgb.reshape(BLOCK, BLOCK, 3)
            sub_mask = mask[y : y + BLOCK, x : x + BLOCK].reshape(-1)
            sub_mask[pick] = True
            mask[y : y + BLOCK, x : x + BLOCK] = sub_mask.reshape(BLOCK, BLOCK)
    return rgb.astype(np.int16), mask


def render_lesion_slide(size: int | tuple[int, int], positive: bool, seed: int) -> tuple[np.ndarray, LesionScene]:
    """The full level-0 image the dataset writer writes for one slide, and its scene (boxes, tissue area)."""
    w, h = (size, size) if isinstance(size, int) else (size[1], size[0])
    scene = LesionScene(w, h, positive, seed)
    img = np.concatenate([scene.band(y, min(h, y + 256)) for y in range(0, h, 256)], axis=0)
    return img, scene


def write_sidecar(out: Path, slides: dict[str, dict[str, Any]]) -> Path:
    """``lesions.json``: per slide its label, tissue area and structure boxes (level-0 px), plus the units."""
    path = out / SIDECAR
    doc = {"mpp": LESION_MPP, "lesion_um": LESION_UM, "block": BLOCK, "slides": slides}
    path.write_text(json.dumps(doc, indent=1))
    return path


def read_sidecar(out: str | Path) -> dict[str, Any]:
    """The ``lesions.json`` a ``--lesions small`` dataset wrote."""
    return dict(json.loads((Path(out) / SIDECAR).read_text()))
