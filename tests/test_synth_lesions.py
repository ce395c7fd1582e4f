"""`synth --lesions small`: seeded scenes, 1-3 lesions on positives only, lesions under 1% of the tissue, and a
thumbnail on which a lesion and a distractor look alike (the low-resolution shortcut is closed)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.errors import WsiTrainError
from wsitrain.slides.synth import MANIFEST, write_synthetic_dataset
from wsitrain.slides.synth.lesions import (
    BLOCK,
    LESION_MPP,
    LesionScene,
    _distractor_from,
    _lesion_patch,
    read_sidecar,
    render_lesion_slide,
)


def _kinds(scene: LesionScene) -> list[str]:
    return [b["kind"] for b in scene.boxes]


def _thumb(img: np.ndarray) -> np.ndarray:
    """BLOCK x BLOCK means: the slide's 512 px thumbnail at 2048 px (pyramid level 2)."""
    h, w = img.shape[0] // BLOCK, img.shape[1] // BLOCK
    return img[: h * BLOCK, : w * BLOCK].reshape(h, BLOCK, w, BLOCK, 3).astype(np.float64).mean(axis=(1, 3))


def test_same_seed_same_slide_other_seed_other_slide() -> None:
    a, sa = render_lesion_slide(1024, True, 7)
    b, sb = render_lesion_slide(1024, True, 7)
    assert np.array_equal(a, b) and sa.boxes == sb.boxes
    c, _ = render_lesion_slide(1024, True, 8)
    assert not np.array_equal(a, c)


def test_lesions_on_positives_only_one_to_three() -> None:
    counts = {True: set(), False: set()}
    for seed in range(10):
        for positive in (True, False):
            kinds = _kinds(LesionScene(1024, 1024, positive, seed))
            n = kinds.count("lesion")
            counts[positive].add(n)
            assert 1 <= len(kinds) <= 3  # every slide carries structures: their presence says nothing
            if positive:
                assert 1 <= n <= 3
            else:
                assert n == 0 and kinds.count("distractor") >= 1
    assert counts[True] == {1, 2, 3}  # the range is used, not one fixed count


@pytest.mark.heavy  # 9 s of rendering (measured); CI runs it (`make test-heavy`)
def test_paired_puts_a_look_alike_on_every_slide() -> None:
    """``--lesions paired``: two or three structures on every slide, at least one a look-alike in both classes, so a
    look-alike's presence says nothing of the label; positives keep one or two lesions."""
    counts: dict[bool, set[tuple[int, int]]] = {True: set(), False: set()}
    for seed in range(12):
        for positive in (True, False):
            kinds = _kinds(LesionScene(1024, 1024, positive, seed, paired=True))
            counts[positive].add((len(kinds), kinds.count("lesion")))
            assert 2 <= len(kinds) <= 3 and kinds.count("distractor") >= 1
    assert {n for n, _ in counts[True]} == {n for n, _ in counts[False]} == {2, 3}  # same structure counts
    assert {k for _, k in counts[True]} == {1, 2} and {k for _, k in counts[False]} == {0}
    # the default mode's draws are untouched: the same seed gives the same scene as before the mode existed
    assert _kinds(LesionScene(1024, 1024, True, 3)) == _kinds(LesionScene(1024, 1024, True, 3, paired=False))


def test_paired_dataset_is_its_own_cache(tmp_path: Path) -> None:
    write_synthetic_dataset(tmp_path, n=4, size=512, seed=1, lesions="paired")
    assert json.loads((tmp_path / MANIFEST).read_text())["params"]["lesions"] == "paired"
    side = read_sidecar(tmp_path)
    assert all(any(b["kind"] == "distractor" for b in e["boxes"]) for e in side["slides"].values())
    stamp = (tmp_path / "slide_000.svs").stat().st_mtime_ns
    write_synthetic_dataset(tmp_path, n=4, size=512, seed=1, lesions="small")  # another cohort: rewritten
    assert (tmp_path / "slide_000.svs").stat().st_mtime_ns != stamp
    assert json.loads((tmp_path / MANIFEST).read_text())["params"]["lesions"] == "small"


def test_lesions_are_small_and_inside_the_slide() -> None:
    for seed in range(6):
        scene = LesionScene(2048, 2048, True, seed)
        lesion_px = sum(b["area_px"] for b in scene.boxes if b["kind"] == "lesion")
        assert 0 < lesion_px < 0.01 * scene.tissue_px
        for b in scene.boxes:
            assert 0 <= b["x0"] < b["x1"] <= 2048 and 0 <= b["y0"] < b["y1"] <= 2048
            assert b["x0"] % BLOCK == 0 and b["y0"] % BLOCK == 0  # on the thumbnail's pixel grid
            assert b["diameter_um"] / LESION_MPP == pytest.approx(2 * np.sqrt(b["area_px"] / np.pi))


def test_distractor_has_the_block_means_of_its_lesion() -> None:
    rng = np.random.default_rng(0)
    base = np.full((88, 88, 3), (230, 150, 195), dtype=np.int16)
    lesion, mask = _lesion_patch(rng, base, 40.0, LESION_MPP)
    distractor, dmask = _distractor_from(rng, base, lesion, mask)
    diff = np.abs(_thumb(lesion) - _thumb(distractor))
    assert diff.max() <= 0.5  # equal block sums up to rounding each pixel to an integer
    assert dmask.sum() < 0.6 * mask.sum()  # fewer, darker pixels: the nuclei differ at full resolution
    assert distractor[dmask].mean() < lesion[mask].mean() - 20


def test_thumbnail_shortcut_closed_full_resolution_differs() -> None:
    # Mean colour of each structure's box on the 4x-down thumbnail, as an offset from the slide's tissue colour
    # (slides differ in stain); lesions and distractors must agree within a few levels there, while at level 0
    # the share of dark pixels (the distractors' small dark nuclei) tells them apart.
    offsets: dict[str, list[np.ndarray]] = {"lesion": [], "distractor": []}
    dark: dict[str, list[float]] = {"lesion": [], "distractor": []}
    for seed in range(6):
        img, scene = render_lesion_slide(2048, seed % 2 == 0, seed)
        th = _thumb(img)
        tissue = np.median(th[scene.tissue[::BLOCK, ::BLOCK]], axis=0)
        for b in scene.boxes:
            box = th[b["y0"] // BLOCK : b["y1"] // BLOCK, b["x0"] // BLOCK : b["x1"] // BLOCK]
            offsets[b["kind"]].append(box.reshape(-1, 3).mean(axis=0) - tissue)
            full = img[b["y0"] : b["y1"], b["x0"] : b["x1"]].astype(np.float64)
            dark[b["kind"]].append(float((full.mean(axis=-1) < 100).mean()))
    les, dis = np.mean(offsets["lesion"], axis=0), np.mean(offsets["distractor"], axis=0)
    assert np.abs(les).min() > 5  # the structures are visible on the thumbnail...
    assert np.abs(les - dis).max() < 4.0  # ...but a lesion and a distractor have the same colour there
    assert np.mean(dark["distractor"]) > 2 * np.mean(dark["lesion"])


def test_dataset_writes_boxes_beside_the_labels(tmp_path: Path) -> None:
    csv_path = write_synthetic_dataset(tmp_path, n=4, size=512, seed=1, lesions="small")
    with csv_path.open() as f:
        labels = {r["slide"]: r["label"] for r in csv.DictReader(f)}
    side = read_sidecar(tmp_path)
    assert side["mpp"] == LESION_MPP and set(side["slides"]) == set(labels)
    for name, entry in side["slides"].items():
        n = [b["kind"] for b in entry["boxes"]].count("lesion")
        assert entry["label"] == labels[name] and ((1 <= n <= 3) if labels[name] == "positive" else n == 0)
    stamp = (tmp_path / "slide_000.svs").stat().st_mtime_ns
    write_synthetic_dataset(tmp_path, n=4, size=512, seed=1, lesions="small")
    assert (tmp_path / "slide_000.svs").stat().st_mtime_ns == stamp  # reused
    from wsitrain.slides.info import slide_info

    assert slide_info(tmp_path / "slide_000.svs").mpp == pytest.approx((LESION_MPP, LESION_MPP))


def test_default_mode_manifest_unchanged(tmp_path: Path) -> None:
    write_synthetic_dataset(tmp_path, n=2, size=256, seed=5)
    params = json.loads((tmp_path / MANIFEST).read_text())["params"]
    assert params == {"version": 1, "n": 2, "size": 256, "seed": 5, "positive_fraction": 0.5, "mpp": 0.5,
                      "app_mag": 20.0}  # fmt: skip
    assert not (tmp_path / "lesions.json").exists()


def test_bad_lesion_input_exits_2(tmp_path: Path) -> None:
    runner = CliRunner()
    r = runner.invoke(app, ["synth", str(tmp_path / "a"), "--lesions", "big"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "none, small, paired" in r.output
    r = runner.invoke(app, ["synth", str(tmp_path / "b"), "--size", "256", "--lesions", "small"])
    assert r.exit_code == 2 and "too small" in r.output
    assert not (tmp_path / "b").exists()  # checked before any folder is made
    with pytest.raises(WsiTrainError, match="not one of"):
        write_synthetic_dataset(tmp_path / "c", n=2, size=512, lesions="large")
