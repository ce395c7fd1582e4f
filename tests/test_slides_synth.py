"""Synthetic SVS slides: OpenSlide sees a real Aperio pyramid, and pixels round-trip at level 0 and coarser mpp."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import openslide
import pytest
from PIL import Image

from wsitrain.slides.info import slide_info
from wsitrain.slides.stream import read_slide_region
from wsitrain.slides.synth import _halve, render_synthetic, write_synthetic_dataset, write_synthetic_slide

SIZE = 1024


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_slide(tmp_path_factory.mktemp("syn") / "s.svs", size=SIZE, positive=True, seed=3)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    """Equal within JPEG Q=90 error: small on average, and only rare large errors at sharp nucleus edges."""
    assert got.shape == want.shape
    d = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert d.mean() < 3.0, d.mean()
    assert np.percentile(d, 99) < 16


def test_openslide_sees_an_aperio_pyramid(slide: Path) -> None:
    props = openslide.OpenSlide(str(slide)).properties
    assert props["openslide.vendor"] == "aperio"
    assert float(props["openslide.mpp-x"]) == 0.5 and float(props["openslide.objective-power"]) == 20
    info = slide_info(slide)
    assert info.level_dimensions == ((1024, 1024), (512, 512)) and info.level_downsamples == (1.0, 2.0)
    big = slide_info(write_synthetic_slide(slide.parent / "big.svs", size=(300, 2100), positive=False, seed=1))
    assert big.dimensions == (2100, 300) and big.level_count == 1  # short side below 512: no pyramid


def test_round_trip_level0(slide: Path) -> None:
    want = render_synthetic(SIZE, True, 3)
    res = read_slide_region(slide, chunk=300)  # odd chunk size: seams would show as mismatches
    assert res.level == 0 and res.mpp == 0.5
    _close(res.image.permute(1, 2, 0).numpy(), want)


def test_round_trip_coarser_mpp_reads_level_one(slide: Path) -> None:
    res = read_slide_region(slide, mpp=1.0)
    assert res.level == 1 and res.scale == 1.0 and tuple(res.image.shape) == (3, 512, 512)
    _close(res.image.permute(1, 2, 0).numpy(), _halve(render_synthetic(SIZE, True, 3)))


def test_round_trip_between_levels_resizes(slide: Path) -> None:
    res = read_slide_region(slide, mpp=0.8, chunk=256)  # 1.6x: level 0 resized; 1024 / 1.6 = 640 exactly
    n = 640
    assert res.level == 0 and res.scale == pytest.approx(1 / 1.6) and tuple(res.image.shape) == (3, n, n)
    want = Image.fromarray(render_synthetic(SIZE, True, 3)).resize((n, n), Image.Resampling.BILINEAR)
    _close(res.image.permute(1, 2, 0).numpy(), np.asarray(want))
    by_mag = read_slide_region(slide, magnification=5)  # 20x slide at 5x: level 1 (10x) halved
    assert by_mag.level == 1 and tuple(by_mag.image.shape) == (3, 256, 256)


def test_positive_slides_have_dark_nuclei_clusters() -> None:
    # The learnable signal: many dark (haematoxylin-like) pixels in positives, almost none in negatives.
    def dark_fraction(img: np.ndarray) -> float:
        return float((img.mean(axis=-1) < 120).mean())

    pos = [dark_fraction(render_synthetic(512, True, s)) for s in range(4)]
    neg = [dark_fraction(render_synthetic(512, False, s)) for s in range(4)]
    assert min(pos) > 0.005 and max(neg) < 0.0005


def test_dataset_labels_and_reuse(tmp_path: Path) -> None:
    csv_path = write_synthetic_dataset(tmp_path, n=4, size=256, seed=5)
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["slide"] for r in rows] == [f"slide_{i:03d}.svs" for i in range(4)]
    assert sorted(r["label"] for r in rows) == ["negative", "negative", "positive", "positive"]
    stamp = (tmp_path / "slide_000.svs").stat().st_mtime_ns
    assert write_synthetic_dataset(tmp_path, n=4, size=256, seed=5) == csv_path
    assert (tmp_path / "slide_000.svs").stat().st_mtime_ns == stamp  # reused, not rewritten
    write_synthetic_dataset(tmp_path, n=4, size=256, seed=6)  # other params: rewritten
    assert (tmp_path / "slide_000.svs").stat().st_mtime_ns != stamp
