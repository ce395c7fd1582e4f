"""The slide's tissue mask at the attention map's resolution: from the read's separable mask, moved with the image's
flips and turns, and through fit and predict."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wsitrain.slides.augment import AugmentConfig, augment_from_config, geometry_of
from wsitrain.slides.pixels import RegionMask
from wsitrain.slides.stream import ReadResult


def region_mask(h: int, w: int, seed: int) -> RegionMask:
    rng = np.random.default_rng(seed)
    gh, gw = 7, 5
    grid = np.zeros((gh + 1, gw + 1), dtype=bool)
    grid[:gh, :gw] = rng.random((gh, gw)) < 0.35
    rows = np.arange(h) * gh // h
    cols = np.arange(w) * gw // w
    rows[-3:] = -1  # past the slide's edge: never tissue
    return RegionMask(grid=grid, rows=rows, cols=cols, background=(255, 255, 255))


def cells_of(full: np.ndarray, h: int, w: int) -> np.ndarray:
    """Brute force: cell i holds rows y with y * h // H == i; True when any pixel is."""
    big_h, big_w = full.shape
    out = np.zeros((h, w), dtype=bool)
    ys, xs = np.nonzero(full)
    out[ys * h // big_h, xs * w // big_w] = True
    return out


@pytest.mark.parametrize(("h", "w"), [(4, 3), (8, 6), (5, 7), (64, 48)])
def test_cells_equal_brute_force(h: int, w: int) -> None:
    m = region_mask(64, 48, seed=h * w)
    full = np.take(m.grid[m.rows], m.cols, axis=1)  # (64, 48): the mask the read applied
    assert np.array_equal(m.cells(h, w), cells_of(full, h, w))


@pytest.mark.parametrize("seed", range(8))
def test_map_mask_follows_the_augmentation(seed: int) -> None:
    """The mask moved by the drawn flips and turns equals the mask of the augmented image."""
    m = region_mask(64, 48, seed=seed)
    full = np.take(m.grid[m.rows], m.cols, axis=1)
    image = torch.from_numpy(np.repeat(full[None].astype(np.uint8) * 200, 3, axis=0)).contiguous()  # (3, 64, 48)
    cfg = AugmentConfig(flips=True, rot90=True)
    rng_seed = [0, 1, seed]
    read = ReadResult(image=image, path="x", level=0, scale=1.0, downsample=1.0, box=(0, 0, 48, 64), mpp=None,
                      bytes=0, seconds=0.0, mask=m)  # fmt: skip
    read.geometry = geometry_of(np.random.default_rng(rng_seed), cfg)
    out = augment_from_config(image, np.random.default_rng(rng_seed), cfg)
    hh, ww = out.shape[1] // 8, out.shape[2] // 8
    got = read.map_mask(hh, ww)
    assert got is not None and got.shape == (1, 1, hh, ww)
    want = cells_of(out[0].numpy() > 0, hh, ww)
    assert np.array_equal(got[0, 0].numpy(), want)


def test_no_mask_no_attention_mask() -> None:
    read = ReadResult(image=torch.zeros(3, 8, 8, dtype=torch.uint8), path="x", level=0, scale=1.0, downsample=1.0,
                      box=(0, 0, 8, 8), mpp=None, bytes=0, seconds=0.0)  # fmt: skip
    assert read.map_mask(2, 2) is None
