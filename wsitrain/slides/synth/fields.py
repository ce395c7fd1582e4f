"""Smooth random fields the synthetic scenes paint with (stain variation, tissue outlines)."""

from __future__ import annotations

import numpy as np


def smooth_noise(rng: np.random.Generator, shape: tuple[int, int], grid: int) -> np.ndarray:
    """Bilinear upsampling of a ``grid`` x ``grid`` field of uniform [-1, 1] values to ``shape``."""
    g = rng.uniform(-1, 1, size=(grid, grid)).astype(np.float32)
    h, w = shape
    ys = np.linspace(0, grid - 1, h)
    xs = np.linspace(0, grid - 1, w)
    y0 = np.minimum(ys.astype(int), grid - 2)
    x0 = np.minimum(xs.astype(int), grid - 2)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = g[y0][:, x0] * (1 - fx) + g[y0][:, x0 + 1] * fx
    bot = g[y0 + 1][:, x0] * (1 - fx) + g[y0 + 1][:, x0 + 1] * fx
    return (top * (1 - fy) + bot * fy).astype(np.float32)


def upsample(a: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(a, dtype=np.float32), mode="F")
    return np.asarray(img.resize((shape[1], shape[0]), Image.Resampling.BILINEAR), dtype=np.float32)
