"""What each thumbnail pixel looks like: stained (tissue-coloured), pen-coloured, dark and colourless, or glass.

Stained tissue is coloured (eosin pink, haematoxylin purple), glass is white or grey: so tissue is found by HSV
saturation above Otsu's threshold (scikit-image), never below ``MIN_SATURATION``. Two more pixel classes are kept
as candidates so the piece classifier (``pieces``) can see them and say why they were dropped:

- *dark and colourless*: grey or black (dust, dirt, black pen, a label's print): value below ``DARK_VALUE`` and
  saturation at most the threshold;
- *pen-coloured*: the blue-green inks of marker pens, hue ``PEN_HUE_DEG`` and saturation of ``PEN_SATURATION`` or
  more. Haematoxylin reaches into that range too (CMU-1's dark nuclei at hue 240-270 degrees, the kidney slide's
  grey-blue fragment at 210-270, *measured* on their 512 px thumbnails), so colour alone never drops a piece: a pen
  stroke must also be thin and long (``pieces``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from skimage.color import rgb2hsv
from skimage.filters import threshold_otsu

# Below this saturation (0-255) nothing counts as tissue, even when Otsu splits pure-background noise.
MIN_SATURATION = 15
# Value (the brightest channel, 0-255) below which a colourless pixel is dark: glass is above 200, the palest
# stained tissue of the real test slides above 150; dust and black ink are below 100.
DARK_VALUE = 110
# Marker inks: green (about 120-160 degrees) through blue (200-235). CMU-1's teal tissue-marking dye is 180-210.
PEN_HUE_DEG = (80.0, 235.0)
PEN_SATURATION = 64  # 0-255: pen ink is strongly coloured; pale blue-grey tissue stays below it


@dataclass(frozen=True)
class PixelClasses:
    """Per-pixel classes of an (h, w, 3) uint8 thumbnail; every array (h, w)."""

    stained: np.ndarray  # bool: saturation above the threshold
    dark: np.ndarray  # bool: colourless and dark (not stained)
    pen: np.ndarray  # bool: pen-coloured (a subset of stained)
    grey: np.ndarray  # float32 luminance 0-255 (how dark a piece is)
    threshold: int  # the saturation threshold used

    @property
    def candidate(self) -> np.ndarray:
        """Pixels that are not glass: every piece the classifier looks at is made of them."""
        return self.stained | self.dark


def saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation of an (h, w, 3) uint8 image, scaled to 0-255 (uint8)."""
    mx = rgb.max(axis=-1).astype(np.int32)
    mn = rgb.min(axis=-1).astype(np.int32)
    sat = np.zeros(mx.shape, dtype=np.int32)
    nz = mx > 0
    sat[nz] = (mx[nz] - mn[nz]) * 255 // mx[nz]
    return sat.astype(np.uint8)


def saturation_threshold(sat: np.ndarray) -> int:
    """Otsu's split of the saturation histogram (pixels above it are stained), at least ``MIN_SATURATION``."""
    if sat.size == 0 or int(sat.min()) == int(sat.max()):  # one value: nothing to split
        return max(int(sat.max()) if sat.size else 0, MIN_SATURATION)
    return max(int(threshold_otsu(sat)), MIN_SATURATION)


def classify_pixels(rgb: np.ndarray) -> PixelClasses:
    """The pixel classes of an (h, w, 3) uint8 thumbnail."""
    sat = saturation(rgb)
    thr = saturation_threshold(sat)
    stained = sat > thr
    value = rgb.max(axis=-1)
    dark = ~stained & (value < DARK_VALUE)
    hue = rgb2hsv(rgb)[..., 0] * 360.0  # (h, w) degrees
    pen = stained & (sat >= PEN_SATURATION) & (hue >= PEN_HUE_DEG[0]) & (hue <= PEN_HUE_DEG[1])
    grey = rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], dtype=np.float32)
    return PixelClasses(stained=stained, dark=dark, pen=pen, grey=grey, threshold=thr)
