"""Tissue detection pieces: the saturation threshold, pieces judged by size, colour and shape, bounding boxes,
resolution choice."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from wsitrain.errors import SlideError
from wsitrain.slides.metadata import SlideInfo
from wsitrain.slides.resolution import choose_resolution
from wsitrain.slides.tissue import UNKNOWN_MPP, level0_mpp, mask_box, tissue_mask
from wsitrain.slides.tissue.colour import MIN_SATURATION, classify_pixels, saturation_threshold
from wsitrain.slides.tissue.pieces import classify_pieces


def test_threshold_splits_two_modes_and_has_a_floor() -> None:
    v = np.concatenate([np.full(1000, 10), np.full(500, 200)]).astype(np.uint8)
    t = saturation_threshold(v)
    assert 10 <= t < 200
    assert saturation_threshold(np.full(50, 3, dtype=np.uint8)) == MIN_SATURATION  # one value: nothing to split
    noise = np.random.default_rng(0).integers(0, 8, size=1000).astype(np.uint8)
    assert saturation_threshold(noise) == MIN_SATURATION  # glass noise alone never counts as tissue


def _glass(n: int = 200) -> np.ndarray:
    return np.full((n, n, 3), 245, dtype=np.uint8)


def test_tissue_mask_keeps_pieces_by_area_and_box_covers_them() -> None:
    img = _glass()
    yy, xx = np.mgrid[:200, :200]
    img[(yy - 80) ** 2 + (xx - 120) ** 2 < 40**2] = (220, 120, 180)  # tissue blob
    img[10:12, 10:12] = (200, 60, 60)  # a 2x2 stained speck
    img[(yy - 155) ** 2 + (xx - 25) ** 2 < 6**2] = (220, 120, 180)  # a fragment far from the blob
    # 1 thumbnail px = 1e-4 mm²: the speck is 4e-4 mm², the fragment 0.0109 mm²
    mask, _ = tissue_mask(img, px_mm2=1e-4, min_fragment_mm2=0.001)
    assert mask[80, 120] and not mask[10, 10] and mask[155, 25]
    # the box grows to the far fragment: columns 20..159, rows 41..160
    assert mask_box(mask, 4.0, (800, 800), margin_px=0) == (80, 164, 560, 480)
    # a larger threshold drops the fragment, a smaller one keeps the speck; no scale keeps every stained piece
    assert not tissue_mask(img, px_mm2=1e-4, min_fragment_mm2=0.02)[0][155, 25]
    assert tissue_mask(img, px_mm2=1e-4, min_fragment_mm2=0.0001)[0][10, 10]
    assert tissue_mask(img)[0][10, 10]


def _kinds(img: np.ndarray, px_mm2: float = 1e-4) -> dict[tuple[int, int], str]:
    """The kind of the piece under each candidate pixel, by (row, col) of a probe point."""
    labels, pieces = classify_pieces(classify_pixels(img), px_mm2, 0.001)
    return {(int(r), int(c)): pieces[labels[r, c] - 1].kind for r, c in zip(*np.nonzero(labels), strict=True)}


def test_pen_dust_and_label_are_dropped_by_colour_and_shape_not_size() -> None:
    img = _glass(300)
    yy, xx = np.mgrid[:300, :300]
    img[(yy - 150) ** 2 + (xx - 200) ** 2 < 50**2] = (225, 130, 185)  # main tissue
    img[100:104, 20:140] = (40, 75, 175)  # blue pen stroke: 4 x 120 px, 0.048 mm²
    img[(yy - 250) ** 2 + (xx - 40) ** 2 < 12**2] = (70, 70, 72)  # dust clump, 0.045 mm²
    img[0:30, 0:60] = (236, 222, 150)  # flat label in the corner, 0.18 mm²
    img[(yy - 250) ** 2 + (xx - 120) ** 2 < 12**2] = (40, 75, 175)  # a blue round blob: pen colour, not pen shape
    img[(yy - 40) ** 2 + (xx - 250) ** 2 < 10**2] = (70, 30, 120)  # a dense dark purple fragment
    k = _kinds(img)
    assert k[(150, 200)] == "tissue" and k[(102, 80)] == "pen" and k[(250, 40)] == "dust"
    assert k[(15, 30)] == "label" and k[(250, 120)] == "tissue" and k[(40, 250)] == "tissue"


def test_a_thin_strip_of_stained_tissue_is_not_pen() -> None:
    img = _glass(300)
    img[100:106, 20:280] = (200, 110, 170)  # a needle-biopsy-like strip: thin and long, but tissue-coloured
    img[200:206, 20:280] = (60, 60, 60)  # the same shape in black ink
    k = _kinds(img)
    assert k[(103, 100)] == "tissue" and k[(203, 100)] == "pen"


def test_a_textured_rectangle_is_tissue_and_the_largest_piece_is_never_a_label() -> None:
    img = _glass(200)
    img[20:180, 20:180] = (236, 222, 150)  # one flat rectangle, the only piece: kept
    assert _kinds(img)[(100, 100)] == "tissue"
    img = _glass(200)
    img[120:180, 20:180] = (225, 130, 185)
    tex = np.random.default_rng(0).integers(-40, 40, size=(40, 60, 3))
    img[10:50, 10:70] = np.clip(np.array([225, 130, 185]) + tex, 0, 255)  # textured rectangle: tissue
    assert _kinds(img)[(30, 40)] == "tissue"


def test_unknown_mpp_falls_back() -> None:
    def reader(mpp: tuple[float, float] | None) -> SimpleNamespace:
        return SimpleNamespace(info=SimpleNamespace(mpp=mpp))

    assert level0_mpp(reader((0.25, 0.26)), None) == (pytest.approx(0.255), False)  # type: ignore[arg-type]
    assert level0_mpp(reader(None), 0.5) == (0.5, True)  # type: ignore[arg-type]
    assert level0_mpp(reader(None), None) == (UNKNOWN_MPP, True)  # type: ignore[arg-type]


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
