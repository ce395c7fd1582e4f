"""Synthetic slides with a tissue detector's ground truth: fragments of known sizes, one carrying a lesion, beside
the artefacts a detector must drop (dust, a pen line, a label).

One scene is a 2048 px slide at 0.5 um/px (1 mm a side, like issue 35's small-lesion cohort), painted whole in
memory (12 MB) and handed to ``write_synthetic_slide`` band by band:

- a main piece of pink tissue (an ellipse) with sparse pale nuclei, as every synthetic scene has;
- fragments of ``FRAGMENT_MM2`` (discs with nuclei), far from the main piece; the ``LESION_MM2`` one (160 px across
  at 0.5 um/px, the size of the fragment issue 35's lesion sat on) is packed with large dark nuclei: dense, dark and
  nuclei-rich, which must never be taken for an artefact;
- a ``SPECK_MM2`` fragment of stained tissue, below the default threshold (dropped as small, and flagged);
- dust: dark grey specks, and one clump larger than the threshold (dropped by colour, not size);
- a blue pen line, thin and long, and a flat pale-yellow rectangle at the slide's top-left corner (a label).

Positions jitter with the seed. ``truth`` lists every object with its kind, level-0 box and centre, and its area.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAGMENT_MPP = 0.5
FRAGMENT_SIZE = 2048
FRAGMENT_MM2 = (0.0012, 0.002, 0.01, 0.03)  # tissue fragments at or above the default 0.001 mm²
LESION_MM2 = 0.005  # the lesion-carrying fragment
SPECK_MM2 = 0.0004  # stained, below the default threshold
DUST_CLUMP_MM2 = 0.003  # colourless, above the threshold: dropped as dust
_TISSUE = np.array([232, 150, 196])
_NUCLEUS = np.array([175, 125, 190])
_LESION_NUCLEUS = np.array([75, 35, 125])
_DUST = np.array([70, 70, 72])
_PEN = np.array([40, 75, 175])
_LABEL = np.array([236, 222, 150])


@dataclass(frozen=True)
class Truth:
    """One painted object: ``kind`` in fragment, lesion, speck, dust, pen, label, main; level-0 box and centre."""

    kind: str
    box: tuple[int, int, int, int]  # (x0, y0, x1, y1) level 0, end exclusive
    centre: tuple[float, float]  # (x, y) level 0
    area_mm2: float


class FragmentScene:
    """A scene ``write_synthetic_slide(scene=...)`` writes: ``background``, ``band(y0, y1)``, plus ``truth``."""

    def __init__(self, seed: int = 0, size: int = FRAGMENT_SIZE, mpp: float = FRAGMENT_MPP) -> None:
        rng = np.random.default_rng(seed)
        self.w = self.h = size
        self.mpp = mpp
        self.background = np.array([243, 242, 244]) + rng.integers(-2, 3, size=3)
        s = size / FRAGMENT_SIZE  # the layout below is drawn for 2048 px and scaled
        self.tissue = np.zeros((size, size), dtype=bool)
        img = np.empty((size, size, 3), dtype=np.int16)
        img[:] = self.background
        self.truth: list[Truth] = []

        def jitter() -> float:
            return float(rng.uniform(-25, 25) * s)

        # main piece
        cx, cy, rx, ry = 1300 * s + jitter(), 1000 * s + jitter(), 520 * s, 400 * s
        at, (yy, xx) = self._window(cx - rx, cy - ry, cx + rx, cy + ry)
        self._put(img, at, ((xx - cx) / rx) ** 2 + ((yy - cy) / ry) ** 2 <= 1, _TISSUE, "main")
        # fragments, the lesion one, and the speck: discs of a known area
        spots = [(250, 620), (450, 1300), (1300, 1760), (600, 1760)]
        discs = [(a, "fragment", xy) for a, xy in zip(FRAGMENT_MM2, spots, strict=True)]
        discs += [(LESION_MM2, "lesion", (300, 1000)), (SPECK_MM2, "speck", (190, 1480))]
        for area, kind, (x, y) in discs:
            self._disc_object(img, x * s + jitter(), y * s + jitter(), self._radius(area), _TISSUE, kind)
        self._nuclei(rng, img)
        self._lesion_nuclei(rng, img, self.of("lesion")[0])
        # dust: specks of 3-6 px radius, and a clump above the threshold
        for x, y, r in [(1900, 180, 4), (1960, 1920, 6), (90, 1960, 5), (1080, 1500, 3)]:
            self._disc_object(img, x * s, y * s, r * s, _DUST, "dust")
        self._disc_object(img, 1860 * s, 1560 * s, self._radius(DUST_CLUMP_MM2), _DUST, "dust")
        # a pen line, 24 px wide, about 1100 px long, across the top
        x0, y0, x1, y1, half = 600 * s, 190 * s + jitter(), 1700 * s, 370 * s + jitter(), 12 * s
        at, (yy, xx) = self._window(x0 - half, y0 - half, x1 + half, y1 + half)
        t = np.clip(((xx - x0) * (x1 - x0) + (yy - y0) * (y1 - y0)) / ((x1 - x0) ** 2 + (y1 - y0) ** 2), 0, 1)
        self._put(img, at, (xx - x0 - t * (x1 - x0)) ** 2 + (yy - y0 - t * (y1 - y0)) ** 2 <= half**2, _PEN, "pen")
        # a label in the top-left corner: flat, rectangular, touching two edges
        at, (yy, _xx) = self._window(0, 0, 360 * s - 1, 260 * s - 1)
        self._put(img, at, np.ones(yy.shape, dtype=bool), _LABEL, "label")
        noise = rng.integers(-6, 7, size=img.shape).astype(np.int16)
        flat = ~self.tissue[..., None]  # glass, pen and label carry little noise; tissue its texture
        self.image = np.clip(img + np.where(flat, noise // 3, noise), 0, 255).astype(np.uint8)

    def _radius(self, area_mm2: float) -> float:
        return float(np.sqrt(area_mm2 / (self.mpp * 1e-3) ** 2 / np.pi))

    def _window(
        self, x0: float, y0: float, x1: float, y1: float
    ) -> tuple[tuple[slice, slice], tuple[np.ndarray, np.ndarray]]:
        """The level-0 window covering [x0, x1] x [y0, y1] (clipped), and its pixel centres' (y, x) grids."""
        ya, yb = max(0, int(y0) - 1), min(self.h, int(y1) + 2)
        xa, xb = max(0, int(x0) - 1), min(self.w, int(x1) + 2)
        yy, xx = np.mgrid[ya:yb, xa:xb].astype(np.float32) + 0.5
        return (slice(ya, yb), slice(xa, xb)), (yy, xx)

    def _disc_object(self, img: np.ndarray, x: float, y: float, r: float, colour: np.ndarray, kind: str) -> None:
        at, (yy, xx) = self._window(x - r, y - r, x + r, y + r)
        self._put(img, at, (xx - x) ** 2 + (yy - y) ** 2 <= r * r, colour, kind)

    def _put(self, img: np.ndarray, at: tuple[slice, slice], mask: np.ndarray, colour: np.ndarray, kind: str) -> None:
        """Paint ``mask`` (the window ``at``) in ``colour``; tissue kinds become tissue, others cover it."""
        img[at][mask] = colour
        if kind in ("main", "fragment", "lesion", "speck"):
            self.tissue[at] |= mask
        else:
            self.tissue[at] &= ~mask
        ys, xs = np.nonzero(mask)
        ys, xs = ys + at[0].start, xs + at[1].start
        box = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
        area = float(mask.sum()) * (self.mpp * 1e-3) ** 2
        self.truth.append(Truth(kind, box, (float(xs.mean()) + 0.5, float(ys.mean()) + 0.5), area))

    def _disc(self, img: np.ndarray, x: float, y: float, r: float, colour: np.ndarray) -> None:
        """A nucleus: a disc painted over tissue only."""
        at, (yy, xx) = self._window(x - r, y - r, x + r, y + r)
        m = ((xx - x) ** 2 + (yy - y) ** 2 <= r * r) & self.tissue[at]
        img[at][m] = colour

    def _nuclei(self, rng: np.random.Generator, img: np.ndarray) -> None:
        """Pale nuclei (8 um) every ~30 um over all tissue, so every fragment carries some."""
        n = int(self.tissue.sum() / (30 / self.mpp) ** 2)
        ys, xs = np.nonzero(self.tissue)
        for i in rng.choice(len(ys), size=n, replace=False):
            self._disc(img, xs[i] + 0.5, ys[i] + 0.5, 4 / self.mpp * rng.uniform(0.8, 1.2), _NUCLEUS)

    def _lesion_nuclei(self, rng: np.random.Generator, img: np.ndarray, lesion: Truth) -> None:
        """Large dark nuclei (12-16 um) packed over the lesion fragment: dense, dark and nuclei-rich."""
        x0, y0, x1, y1 = lesion.box
        step = 14 / self.mpp
        for y in np.arange(y0 + step / 2, y1, step):
            for x in np.arange(x0 + step / 2, x1, step):
                r = rng.uniform(6, 8) / self.mpp
                col = _LESION_NUCLEUS + rng.integers(-12, 12, size=3)
                self._disc(img, x + rng.normal(0, 2), y + rng.normal(0, 2), r, col)

    def band(self, y0: int, y1: int) -> np.ndarray:
        """Level-0 rows [y0, y1) as (y1 - y0, w, 3) uint8."""
        return self.image[y0:y1]

    def of(self, kind: str) -> list[Truth]:
        return [t for t in self.truth if t.kind == kind]
