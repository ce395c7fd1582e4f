"""data.stream_tiles in predict, its heatmaps and the report's run maps: every output file is bitwise the one the
whole-image read writes (odd, non-square slides, masked background, a ragged tile grid), and the slide is read tile
by tile (never materialized) unless the saliency needs the image itself."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from rich.console import Console

from wsitrain.config import WsiTrainConfig, config_to_dict
from wsitrain.models import build
from wsitrain.report.overlay import shrink_image
from wsitrain.report.run_maps import validation_heatmaps
from wsitrain.report.runlog import VALIDATION
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.slides.tile_source import SlideTileSource, open_tile_source
from wsitrain.train.checkpoint import save_checkpoint
from wsitrain.train.predict import run_predict

QUIET = Console(file=io.StringIO())
CLASSES = ["negative", "positive"]
SIDES = [(137, 203), (211, 119)]  # (w, h): odd, one tall and one wide


@pytest.fixture(scope="module")
def slides(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("streamed-predict")
    for i, side in enumerate(SIDES):
        write_synthetic_slide(root / "slides" / f"s{i}.svs", size=side, positive=bool(i % 2), seed=20 + i)
    return root / "slides"


def _cfg(stream: bool, pool: str, region: str) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": "p",
        "data": {"region": region, "mask_background": True, "read_threads": 2, "stream_tiles": stream,
                 "val_fraction": 0.0},
        "model": {"name": "tiny", "pool": pool},
        # 64 px tiles: a ragged grid on every slide (e.g. 144 columns: 64, 64, 16)
        "engine": {"memory_budget": "1GiB", "tile_size": 64, "device": "cpu"},
    })  # fmt: skip


def _checkpoint(path: Path, pool: str, cfg: WsiTrainConfig) -> Path:
    torch.manual_seed(7)
    model = build("tiny", len(CLASSES), weights=None, pool=pool)
    save_checkpoint(path, model=model.state_dict(), class_names=CLASSES, config=config_to_dict(cfg))
    return path


class _Spy:
    """Counts regions a SlideTileSource decodes; makes reading one whole an error (the test must see tiles only)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allow_whole: bool) -> None:
        self.regions = 0
        read = SlideTileSource.read

        def counted(src: SlideTileSource, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
            self.regions += 1
            return read(src, rows, cols)

        monkeypatch.setattr(SlideTileSource, "read", counted)
        if not allow_whole:
            monkeypatch.setattr(SlideTileSource, "materialize", lambda src: pytest.fail("the slide was read whole"))


def _files(folder: Path) -> dict[str, bytes]:
    """Each file's bytes; an OME-TIFF's UUID (new per write, same length) blanked."""
    return {p.name: re.sub(rb"urn:uuid:[0-9a-f-]{36}", b"urn:uuid:" + b"0" * 36, p.read_bytes())
            for p in sorted(folder.iterdir())}  # fmt: skip


def test_predict_and_heatmaps_streamed_equal_the_whole_read(
    slides: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CSV (probabilities, max pooling's on-tissue columns), CAM, PNG, GeoJSON, heatmap TIFF and the index: the same
    bytes with data.stream_tiles as without, and the streamed slides were never read whole."""
    ckpt = _checkpoint(tmp_path / "m.pt", "max", _cfg(False, "max", "tissue"))
    out = {}
    for stream in (False, True):
        spy = _Spy(monkeypatch, allow_whole=False)
        d = tmp_path / f"stream-{stream}"
        d.mkdir()
        run_predict(_cfg(stream, "max", "tissue"), checkpoint=ckpt, slides=slides, out=d / "p.csv", console=QUIET,
                    heatmaps=d / "maps")  # fmt: skip
        out[stream] = (d / "p.csv").read_text().replace(str(d), ""), _files(d / "maps")
        assert (spy.regions > 0) == stream  # streamed: read tile by tile; whole: no tile source at all
    (csv_a, maps_a), (csv_b, maps_b) = out[False], out[True]
    assert csv_a == csv_b and len(csv_a.splitlines()) == 1 + len(SIDES)
    assert "on_tissue_positive" in csv_a.splitlines()[0]
    assert maps_a.keys() == maps_b.keys() and {"s0.cam.npy", "s1.png", "s1.geojson", "s0.heatmap.tif"} <= maps_a.keys()
    for name in maps_a:
        assert maps_a[name] == maps_b[name], name


def test_saliency_of_a_streamed_slide_is_the_whole_images(slides: Path) -> None:
    """slide_maps on a tile source: CAM, logits and the saliency (which reads the image whole) bitwise the same."""
    from wsitrain.report.heatmap import slide_maps
    from wsitrain.sft import SFT

    torch.manual_seed(3)
    engine = SFT(build("tiny", 2, weights=None, pool="avg"), memory_budget="1GiB", tile_size=64).eval()
    src = open_tile_source(slides / "s0.svs", mask_background=True, pad_multiple=16).image
    try:
        whole = src.materialize()
        for block in (None, 16):
            a, b = slide_maps(engine, whole, saliency_block=block), slide_maps(engine, src, saliency_block=block)
            assert torch.equal(a.cam, b.cam) and torch.equal(a.logits, b.logits)
            assert (a.saliency is None and b.saliency is None) or torch.equal(a.saliency, b.saliency)
        assert b.saliency is not None and src.regions_read > 0
    finally:
        src.close()


def test_run_maps_streamed_equal_the_whole_read(slides: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`wsitrain report`'s validation heatmaps with data.stream_tiles in the run's config: the same files."""
    files = {}
    for stream in (False, True):
        run = tmp_path / f"run-{stream}"
        run.mkdir()
        cfg = _cfg(stream, "max", "whole")
        (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
        _checkpoint(run / "best.pt", "max", cfg)
        rows = [{"slide": "s1.svs", "path": str(slides / "s1.svs"), "label": "positive"}]
        (run / VALIDATION).write_text(json.dumps({"classes": CLASSES, "slides": rows}))
        spy = _Spy(monkeypatch, allow_whole=False)
        assert validation_heatmaps(run, run / "maps") is None
        assert (spy.regions > 0) == stream
        files[stream] = _files(run / "maps")
    assert files[False].keys() == files[True].keys() and {"s1.cam.npy", "s1.png"} <= files[True].keys()
    for name in files[False]:
        assert files[False][name] == files[True][name], name


def test_thumbnail_of_a_streamed_slide_is_the_whole_images(slides: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """shrink_image reads a tile source band by band: the whole image's thumbnail, for any band height."""
    import wsitrain.report.overlay as overlay

    src = open_tile_source(slides / "s1.svs", mask_background=True, pad_multiple=16).image
    assert isinstance(src, SlideTileSource)
    try:
        whole = src.materialize()[0]  # (3, H, W)
        for side in (64, 100, 1024):
            ref, f = shrink_image(whole, side)  # one band
            monkeypatch.setattr(overlay, "BAND_PX", 300)  # bands of a few rows
            for got, g in (shrink_image(src, side), shrink_image(whole, side)):
                assert g == f and np.array_equal(got, ref)
            monkeypatch.undo()
            got, g = shrink_image(src, side)
            assert g == f and np.array_equal(got, ref)
    finally:
        src.close()
