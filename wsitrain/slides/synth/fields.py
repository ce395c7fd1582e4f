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


def coarse_grid(w: int, h: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """The grid smooth shapes are drawn on for a w x h image: at most 256 cells a side (then upsampled), and the
    cell centres in [0, 1] along x (u, gw values) and y (v, gh values): (gw, gh, u, v)."""
    g = max(1, int(np.ceil(max(w, h) / 256)))
    gw, gh = -(-w // g), -(-h // g)
    return gw, gh, (np.arange(gw) + 0.5) / gw, (np.arange(gh) + 0.5) / gh


def add_lobe(
    field: np.ndarray, rng: np.random.Generator, u: np.ndarray, v: np.ndarray,
    centre: tuple[float, float], radii: tuple[float, float],
) -> np.ndarray:
    """``field`` with one more tissue lobe: an elliptical Gaussian at a random centre (both coordinates uniform in
    ``centre``), with random radii (uniform in ``radii``) and a random angle, drawn from ``rng`` in that order."""
    cx, cy = rng.uniform(*centre, size=2)
    rx, ry = rng.uniform(*radii, size=2)
    th = rng.uniform(0, np.pi)
    dx, dy = u[None, :] - cx, v[:, None] - cy
    a = (dx * np.cos(th) + dy * np.sin(th)) / rx
    b = (-dx * np.sin(th) + dy * np.cos(th)) / ry
    return np.maximum(field, np.exp(-(a * a + b * b)).astype(np.float32))
