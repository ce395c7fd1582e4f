"""Viewer files of `predict --heatmaps`: NAME.geojson (QuPath detections) and NAME.heatmap.tif (a slide-sized
pyramidal TIFF) put every map cell on the level-0 slide pixels it was computed from."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import tifffile
from rich.console import Console
from test_predict import make_cfg

from wsitrain.report.geojson import MAX_CELLS, auto_k, write_geojson
from wsitrain.report.heatmap_tiff import OUTSIDE, colour_lut, write_heatmap_tiff
from wsitrain.report.map_grid import MapGrid
from wsitrain.slides.readers import open_slide
from wsitrain.slides.stream import read_slide_region
from wsitrain.slides.synth import write_synthetic_slide

QUIET = Console(file=io.StringIO())
HOT = (3, 7)  # (row, col) of the hot map cell


def _hot_map(shape: tuple[int, int]) -> np.ndarray:
    m = np.full(shape, -1.0)
    m[HOT] = 2.0
    return m


@pytest.fixture(scope="module")
def region(tmp_path_factory: pytest.TempPathFactory) -> tuple[MapGrid, tuple[int, int, int, int], float]:
    """A real read off a pyramid level (> 0) of a box that does not start at the slide's corner."""
    root = tmp_path_factory.mktemp("viewer")
    slide = write_synthetic_slide(root / "s.svs", size=(1536, 1280), positive=True, seed=3, mpp=0.25)
    with open_slide(slide) as reader:
        assert reader.info.level_count > 1 and reader.info.level_downsamples[1] == pytest.approx(2.0, rel=0.01)
        wh = tuple(reader.info.dimensions)
    read = read_slide_region(slide, level=1, region="fixed", size=(160, 192), pad_multiple=16)
    assert read.level == 1 and read.downsample > 1 and read.box[0] > 0 and read.box[1] > 0
    stride = 16
    shape = (read.image.shape[1] // stride, read.image.shape[2] // stride)  # (10, 12)
    grid = MapGrid.of_read(read.box, read.downsample, stride, shape, wh, 0.25)  # type: ignore[arg-type]
    return grid, read.box, read.downsample


def _hot_box(box: tuple[int, int, int, int], ds: float, stride: int = 16) -> tuple[float, float, float, float]:
    """Level-0 (x0, y0, x1, y1) of the hot cell: its image pixels, scaled by the read's downsample, from the box."""
    r, c = HOT
    return (box[0] + c * stride * ds, box[1] + r * stride * ds, box[0] + (c + 1) * stride * ds,
            box[1] + (r + 1) * stride * ds)


def test_geojson_hot_cell_covers_its_level0_box(tmp_path: Path, region: tuple) -> None:
    grid, box, ds = region
    hot = _hot_map(grid.shape)
    info = write_geojson(tmp_path / "s.geojson", {"cam positive": hot, "attention": -hot}, grid, k=1)
    doc = json.loads((tmp_path / "s.geojson").read_text())
    assert doc["type"] == "FeatureCollection" and len(doc["features"]) == info.features == hot.size
    for f in doc["features"]:
        assert f["type"] == "Feature" and f["geometry"]["type"] == "Polygon"
        assert f["properties"]["objectType"] == "detection"
        assert set(f["properties"]["measurements"]) == {"cam positive", "attention"}
        ring = f["geometry"]["coordinates"][0]
        assert len(ring) == 5 and ring[0] == ring[-1]
    hot_f = [f for f in doc["features"] if f["properties"]["measurements"]["cam positive"] > 0]
    assert len(hot_f) == 1
    assert hot_f[0]["properties"]["measurements"] == {"cam positive": 2.0, "attention": -2.0}
    ring = np.array(hot_f[0]["geometry"]["coordinates"][0])
    x0, y0, x1, y1 = _hot_box(box, ds)
    assert (ring[:, 0].min(), ring[:, 1].min(), ring[:, 0].max(), ring[:, 1].max()) == pytest.approx((x0, y0, x1, y1))
    assert x1 - x0 == pytest.approx(16 * ds)  # one cell: stride image px of downsample level-0 px each


def test_geojson_aggregates_k_by_k_and_skips_what_is_not_kept(tmp_path: Path, region: tuple) -> None:
    grid, box, ds = region
    hot = _hot_map(grid.shape)
    keep = np.ones(grid.shape, dtype=bool)
    keep[:2, :] = False  # e.g. off tissue: the top block row has no kept cell
    info = write_geojson(tmp_path / "s.geojson", {"cam positive": hot}, grid, k=2, keep=keep)
    doc = json.loads((tmp_path / "s.geojson").read_text())
    assert info.k == 2 and info.cell_px == pytest.approx(32 * ds) and len(doc["features"]) == 4 * 6
    means = [f["properties"]["measurements"]["cam positive"] for f in doc["features"]]
    assert sorted(means)[-1] == pytest.approx((2.0 - 3.0) / 4)  # the hot cell averaged with three cold ones
    hot_f = doc["features"][int(np.argmax(means))]
    ring = np.array(hot_f["geometry"]["coordinates"][0])
    r0, c0 = HOT[0] // 2 * 2, HOT[1] // 2 * 2  # the block's first cell
    x = box[0] + c0 * 16 * ds
    y = box[1] + r0 * 16 * ds
    assert (ring[:, 0].min(), ring[:, 1].min(), ring[:, 0].max(), ring[:, 1].max()) == pytest.approx(
        (x, y, x + 32 * ds, y + 32 * ds))
    assert all(np.array(f["geometry"]["coordinates"][0])[:, 1].min() >= box[1] + 32 * ds for f in doc["features"])


def test_geojson_leaves_out_cells_off_the_slide_and_clips_to_it(tmp_path: Path) -> None:
    grid = MapGrid((-64.0, -32.0), 32.0, (4, 5), (100, 60), None)  # a read box hanging over the top-left corner
    write_geojson(tmp_path / "s.geojson", {"v": np.arange(20.0).reshape(4, 5)}, grid, k=1)
    feats = json.loads((tmp_path / "s.geojson").read_text())["features"]
    rings = [np.array(f["geometry"]["coordinates"][0]) for f in feats]
    # Columns 2..4 (x -64 + 64.. ) and rows 1..2 (y -32 + 32..96, the slide is 60 high) overlap the slide.
    assert len(feats) == 3 * 2
    assert all(r[:, 0].min() >= 0 and r[:, 0].max() <= 100 and r[:, 1].min() >= 0 and r[:, 1].max() <= 60
               for r in rings)
    assert sorted(f["properties"]["measurements"]["v"] for f in feats) == [7, 8, 9, 12, 13, 14]


def test_auto_k_keeps_a_100k_slide_under_the_cap() -> None:
    shape = (100_000 // 32, 100_000 // 32)
    k = auto_k(shape)
    assert -(-shape[0] // k) * -(-shape[1] // k) <= MAX_CELLS < -(-shape[0] // (k - 1)) * -(-shape[1] // (k - 1))
    assert auto_k((10, 12)) == 1


def test_heatmap_tiff_reads_back_with_slide_geometry_tiles_pixel_size_and_hot_colour(
    tmp_path: Path, region: tuple
) -> None:
    grid, box, ds = region
    path = tmp_path / "s.heatmap.tif"
    info = write_heatmap_tiff(path, _hot_map(grid.shape), grid, vmin=-1.0, vmax=2.0)  # cold: lut[0], hot: lut[255]
    lut = colour_lut()
    w0, h0 = grid.slide_wh
    with tifffile.TiffFile(path) as tif:
        assert tif.is_ome and 'PhysicalSizeX="0.25"' in tif.ome_metadata  # type: ignore[operator]
        levels = tif.series[0].levels
        assert [lv.shape for lv in levels] == [(h, w, 3) for w, h in info.levels]
        assert levels[0].shape == (h0, w0, 3) and len(levels) > 2 and max(info.levels[-1]) <= 256
        page = tif.pages[0]
        assert page.is_tiled and (page.tilewidth, page.tilelength) == (256, 256)
        assert page.tags["ResolutionUnit"].value == 3  # centimetre
        for lv, (w, _h) in zip(levels, info.levels, strict=True):
            xres = lv.keyframe.tags["XResolution"].value
            assert 1e4 / (xres[0] / xres[1]) == pytest.approx(0.25 * w0 / w, rel=1e-6)  # microns per pixel
        img = levels[0].asarray()
        small = levels[1].asarray()
    x0, y0, x1, y1 = (int(v) for v in _hot_box(box, ds))
    hot, cold, white = lut[OUTSIDE - 1], lut[0], lut[OUTSIDE]
    assert (img[y0:y1, x0:x1] == hot).all()
    assert (img[y0 - 1, x0:x1] == cold).all() and (img[y0:y1, x0 - 1] == cold).all()
    assert (img[y1, x0:x1] == cold).all() and (img[y0:y1, x1] == cold).all()
    assert int((img == hot).all(axis=2).sum()) == (x1 - x0) * (y1 - y0)  # nowhere else
    assert (img[: box[1]] == white).all() and (img[:, : box[0]] == white).all()  # off the map: white
    assert (small[y0 // 2 + 1, x0 // 2 + 1] == hot).all() and (small[0, 0] == white).all()


def test_predict_heatmaps_writes_and_indexes_viewer_files(tmp_path: Path) -> None:
    from wsitrain.train.fit import run_fit
    from wsitrain.train.predict import run_predict

    cfg = make_cfg(tmp_path)
    run = run_fit(cfg, console=QUIET, quiet=True)
    maps = tmp_path / "maps"
    run_predict(cfg, checkpoint=run / "best.pt", slides=tmp_path / "synth", out=tmp_path / "p.csv", console=QUIET,
                heatmaps=maps)
    index = json.loads((maps / "heatmaps.json").read_text())
    assert len(index["slides"]) == 4
    for rec in index["slides"]:
        stem = rec["slide"].removesuffix(".svs")
        assert rec["geojson"] == f"{stem}.geojson" and rec["heatmap_tif"] == f"{stem}.heatmap.tif"
        doc = json.loads((maps / rec["geojson"]).read_text())
        assert doc["features"] and len(doc["features"]) == rec["geojson_features"]
        names = set(doc["features"][0]["properties"]["measurements"])
        assert names == {"cam negative", "cam positive"}
        assert rec["heatmap_tif_map"] == f"cam {rec['predicted']}"
        with tifffile.TiffFile(maps / rec["heatmap_tif"]) as tif:
            assert tif.series[0].levels[0].shape == (256, 256, 3)  # the synthetic slide's level-0 size
    off = tmp_path / "off"
    run_predict(cfg, checkpoint=run / "best.pt", slides=tmp_path / "synth", out=tmp_path / "q.csv", console=QUIET,
                heatmaps=off, viewer_files=False)
    assert not list(off.glob("*.geojson")) and not list(off.glob("*.heatmap.tif"))
    assert all(r["geojson"] is None for r in json.loads((off / "heatmaps.json").read_text())["slides"])
