"""Localisation scores: pointing game and attention mass on lesion boxes, cell placement in level-0 pixels."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wsitrain.report.localisation import inside_mask, score_heatmaps, score_map

BOX = {"kind": "lesion", "x0": 64, "y0": 32, "x1": 96, "y1": 64}


def test_inside_mask_places_cells_in_level0() -> None:
    # stride 16, downsample 2: cells of 32 level-0 px; origin (0, 0): cell (1, 2) covers x 64-96, y 32-64
    m = inside_mask((4, 5), 16, (0, 0), 2.0, [BOX])
    assert m.sum() == 1 and m[1, 2]
    # the image placed at x = 32: the same box is now cell (1, 1)
    m = inside_mask((4, 5), 16, (32, 0), 2.0, [BOX])
    assert m.sum() == 1 and m[1, 1]


def test_score_map() -> None:
    inside = np.zeros((4, 4), dtype=bool)
    inside[1, 2] = True
    att = np.full((4, 4), 0.5 / 15)
    att[1, 2] = 0.5
    s = score_map(att, inside)
    assert s.pointing and s.mass == pytest.approx(0.5)
    att[0, 0] = 0.9
    assert not score_map(att, inside).pointing


def test_score_heatmaps_positive_slides_only(tmp_path: Path) -> None:
    att = np.full((1, 4, 5), 0.01)
    att[0, 1, 2] = 0.8
    np.save(tmp_path / "a.attention.npy", att)
    np.save(tmp_path / "b.attention.npy", att)
    rec = {"attention": "a.attention.npy", "stride": 16, "box": [0, 0, 160, 128], "downsample": 2.0}
    (tmp_path / "heatmaps.json").write_text(json.dumps({"classes": ["negative", "positive"], "slides": [
        {**rec, "slide": "a.tiff"}, {**rec, "slide": "b.tiff", "attention": "b.attention.npy"}]}))
    lesions = tmp_path / "lesions.json"
    lesions.write_text(json.dumps({"slides": {
        "a.tiff": {"label": "positive", "boxes": [BOX, {**BOX, "kind": "distractor", "x0": 0, "x1": 32}]},
        "b.tiff": {"label": "negative", "boxes": [{**BOX, "kind": "distractor"}]}}}))
    s = score_heatmaps(tmp_path, lesions)
    assert s["n_positive"] == 1 and s["pointing_game"] == 1.0
    assert s["lesion_mass"] == pytest.approx(0.8 / (0.8 + 19 * 0.01))
    # a.tiff also carries a look-alike: its hit counts in the split's first part only
    assert s["n_with_lookalike"] == 1 and s["pointing_game_with_lookalike"] == 1.0
    assert np.isnan(s["pointing_game_without_lookalike"])


def test_pointing_split_by_lookalike(tmp_path: Path) -> None:
    """A map that peaks on the look-alike misses where one is present; a slide without one is scored apart."""
    att = np.full((1, 4, 5), 0.01)
    att[0, 0, 0] = 0.9  # cell (0, 0): centre (16, 16) level-0 px, inside the look-alike below, not the lesion
    np.save(tmp_path / "a.attention.npy", att)
    hit = np.full((1, 4, 5), 0.01)
    hit[0, 1, 2] = 0.8
    np.save(tmp_path / "c.attention.npy", hit)
    rec = {"stride": 16, "box": [0, 0, 160, 128], "downsample": 2.0}
    (tmp_path / "heatmaps.json").write_text(json.dumps({"classes": ["negative", "positive"], "slides": [
        {**rec, "slide": "a.tiff", "attention": "a.attention.npy"},
        {**rec, "slide": "c.tiff", "attention": "c.attention.npy"}]}))  # fmt: skip
    lesions = tmp_path / "lesions.json"
    lookalike = {**BOX, "kind": "distractor", "x0": 0, "x1": 32, "y0": 0, "y1": 32}
    lesions.write_text(json.dumps({"slides": {"a.tiff": {"label": "positive", "boxes": [BOX, lookalike]},
                                              "c.tiff": {"label": "positive", "boxes": [BOX]}}}))  # fmt: skip
    s = score_heatmaps(tmp_path, lesions)
    assert s["pointing_game"] == 0.5 and s["n_with_lookalike"] == 1
    assert s["pointing_game_with_lookalike"] == 0.0 and s["pointing_game_without_lookalike"] == 1.0


def test_max_pooling_is_scored_where_it_decided(tmp_path: Path) -> None:
    """``key="decisive"``: the positive class's deciding cell (heatmaps.json's ``decisive``), not the CAM's peak; a
    CAM that peaks off the lesion still hits when the cell that decided the score is in it, and the other way."""
    cam = np.zeros((2, 4, 5))
    cam[1, 0, 0] = 3.0  # the positive CAM peaks at (0, 0), outside the lesion (cell (1, 2))
    np.save(tmp_path / "a.cam.npy", cam)
    np.save(tmp_path / "b.cam.npy", cam)
    rec = {"stride": 16, "box": [0, 0, 160, 128], "downsample": 2.0}
    (tmp_path / "heatmaps.json").write_text(json.dumps({"classes": ["negative", "positive"], "slides": [
        {**rec, "slide": "a.tiff", "cam": "a.cam.npy", "decisive": [[3, 4], [1, 2]]},  # decided in the lesion
        {**rec, "slide": "b.tiff", "cam": "b.cam.npy", "decisive": [[1, 2], [2, 2]]}]}))  # fmt: skip
    lesions = tmp_path / "lesions.json"
    lesions.write_text(json.dumps({"slides": {"a.tiff": {"label": "positive", "boxes": [BOX]},
                                              "b.tiff": {"label": "positive", "boxes": [BOX]}}}))  # fmt: skip
    assert score_heatmaps(tmp_path, lesions, key="cam")["pointing_game"] == 0.0
    decided = score_heatmaps(tmp_path, lesions, key="decisive")
    assert decided["pointing_game"] == 0.5 and decided["n_positive"] == 2  # a's positive cell, not b's
    assert decided["lesion_mass"] == score_heatmaps(tmp_path, lesions, key="cam")["lesion_mass"]  # the CAM's mass
