"""Tissue detection pieces: Otsu, connected components, small-object removal, bounding boxes, resolution choice."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from wsitrain.errors import SlideError
from wsitrain.slides.metadata import SlideInfo
from wsitrain.slides.resolution import choose_resolution
from wsitrain.slides.tissue import label_components, mask_box, otsu_threshold, remove_small_objects, tissue_mask


def _flood_labels(mask: np.ndarray) -> np.ndarray:
    """Reference 8-connected labelling by breadth-first flood fill."""
    labels = np.zeros(mask.shape, dtype=np.int64)
    n = 0
    for start in zip(*np.nonzero(mask), strict=True):
        if labels[start]:
            continue
        n += 1
        labels[start] = n
        q = deque([start])
        while q:
            y, x = q.popleft()
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    v, u = y + dy, x + dx
                    if 0 <= v < mask.shape[0] and 0 <= u < mask.shape[1] and mask[v, u] and not labels[v, u]:
                        labels[v, u] = n
                        q.append((v, u))
    return labels


@pytest.mark.parametrize("seed", range(4))
def test_components_match_flood_fill(seed: int) -> None:
    mask = np.random.default_rng(seed).random((40, 50)) < 0.45
    got, want = label_components(mask), _flood_labels(mask)
    assert got.max() == want.max()
    # Same partition: each reference component maps to exactly one label and vice versa.
    pairs = set(zip(got[mask].tolist(), want[mask].tolist(), strict=True))
    assert len(pairs) == want.max() and (got[~mask] == 0).all()


def test_otsu_splits_two_modes() -> None:
    v = np.concatenate([np.full(1000, 10), np.full(500, 200)]).astype(np.uint8)
    t = otsu_threshold(v)
    assert 10 <= t < 200


def test_tissue_mask_drops_specks_and_keeps_blob() -> None:
    img = np.full((200, 200, 3), 245, dtype=np.uint8)
    yy, xx = np.mgrid[:200, :200]
    img[(yy - 80) ** 2 + (xx - 120) ** 2 < 40**2] = (220, 120, 180)  # tissue blob
    img[10:12, 10:12] = (200, 60, 60)  # a 2x2 speck
    mask, thr = tissue_mask(img)
    assert mask[80, 120] and not mask[10, 10]
    assert mask_box(mask, 4.0, (800, 800), margin_px=0) == (324, 164, 316, 316)  # circle spans px 81..159
    big = np.zeros((50, 50), bool)
    big[5:30, 5:30] = True
    big[40, 40] = True
    assert remove_small_objects(big, 4).sum() == 625


def _info(mpp: tuple[float, float] | None, power: float | None) -> SlideInfo:
    return SlideInfo(
        "x.svs",
        "openslide",
        "aperio",
        (8000, 6000),
        3,
        ((8000, 6000), (2000, 1500), (500, 375)),
        (1.0, 4.0, 16.0),
        mpp,
        power,
    )


def test_resolution_choice() -> None:
    info = _info((0.25, 0.25), 40.0)
    r = choose_resolution(info, mpp=0.5)  # 2x: level 0 halved
    assert (r.level, r.scale, r.mpp) == (0, 0.5, 0.5)
    r = choose_resolution(info, mpp=1.0)  # exactly level 1
    assert (r.level, r.scale) == (1, 1.0)
    r = choose_resolution(info, magnification=5)  # 8x: level 1 halved
    assert (r.level, r.scale, r.mpp) == (1, 0.5, 2.0)
    assert choose_resolution(info, level=2).mpp == 4.0
    assert choose_resolution(_info(None, None), mpp=1.0, fallback_mpp=0.25).level == 1
    with pytest.raises(SlideError, match="not mpp and magnification"):
        choose_resolution(info, mpp=1.0, magnification=10)
    with pytest.raises(SlideError, match="x.svs: the slide has no mpp"):
        choose_resolution(_info(None, 20.0), mpp=1.0)
    assert choose_resolution(_info(None, 20.0), magnification=5).level == 1  # objective power suffices
