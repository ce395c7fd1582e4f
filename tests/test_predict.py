"""`wsitrain predict`: slide-level probabilities from a fit checkpoint, equal to the plain model's."""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.errors import SlideError, WsiTrainError
from wsitrain.models import build
from wsitrain.slides.stream import read_slide_region
from wsitrain.train.attention_mask import tissue_masked
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.fit import run_fit
from wsitrain.train.predict import run_predict

QUIET = Console(file=io.StringIO())


def make_cfg(root: Path) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": "p",
        "data": {"synthetic": {"n": 4, "size": 256, "cache_dir": str(root / "synth")}, "region": "whole",
                 "val_fraction": 0.5},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": "1GiB", "tile_size": 128, "device": "cpu"},  # 2x2 tiles, as in training
        "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.01},
        "log": {"dir": str(root / "runs"), "tiles": "off"},
    })


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[WsiTrainConfig, Path, Path]:
    root = tmp_path_factory.mktemp("predict")
    cfg = make_cfg(root)
    run = run_fit(cfg, console=QUIET, quiet=True)
    return cfg, run / "best.pt", root / "synth"


def test_predict_writes_probabilities_equal_to_the_plain_model(
    trained: tuple[WsiTrainConfig, Path, Path], tmp_path: Path
) -> None:
    cfg, ckpt, slides = trained
    out = run_predict(cfg, checkpoint=ckpt, slides=slides, out=tmp_path / "preds.csv", console=QUIET)
    rows = list(csv.DictReader(out.open()))
    # labels.csv and the manifest in that folder are not slides.
    assert [r["slide"] for r in rows] == [f"slide_{i:03d}.svs" for i in range(4)]
    assert set(rows[0]) == {"slide", "path", "prob_negative", "prob_positive", "predicted"}

    model = build("tiny", 2)
    model.load_state_dict(load_checkpoint(ckpt)["model"])
    model.eval()
    assert cfg.data.mask_background  # the default: predict masks background as training does
    for row in rows:
        read = read_slide_region(
            row["path"], region="whole", pad_multiple=model.stride, mask_background=cfg.data.mask_background
        )
        with torch.no_grad(), tissue_masked(model, read):  # the pool averages over the tissue (model.mask_pool)
            expected = torch.softmax(model(read.image.unsqueeze(0)), dim=1)[0]
        got = torch.tensor([float(row["prob_negative"]), float(row["prob_positive"])])
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)
        assert row["predicted"] == ("positive" if expected[1] > expected[0] else "negative")


def test_predict_refuses_unreadable_slides_before_predicting(
    trained: tuple[WsiTrainConfig, Path, Path], tmp_path: Path
) -> None:
    cfg, ckpt, slides = trained
    folder = tmp_path / "slides"
    folder.mkdir()
    shutil.copy(slides / "slide_000.svs", folder)
    (folder / "broken.svs").write_bytes(b"not a slide" * 10)
    out = tmp_path / "preds.csv"
    with pytest.raises(SlideError, match="broken.svs"):
        run_predict(cfg, checkpoint=ckpt, slides=folder, out=out, console=QUIET)
    assert not out.exists()


def test_predict_input_errors(trained: tuple[WsiTrainConfig, Path, Path], tmp_path: Path) -> None:
    cfg, ckpt, slides = trained
    with pytest.raises(WsiTrainError, match="does not exist"):
        run_predict(cfg, checkpoint=tmp_path / "none.pt", slides=slides, out=tmp_path / "p.csv", console=QUIET)
    with pytest.raises(SlideError, match="no slide files"):
        run_predict(cfg, checkpoint=ckpt, slides=tmp_path, out=tmp_path / "p.csv", console=QUIET)


def test_slide_suffixes_are_one_list_matched_on_the_lower_cased_name(tmp_path: Path) -> None:
    from wsitrain.slides.suffixes import is_slide_name
    from wsitrain.train.predict import list_slides

    names = ["a.svs", "b.OME.TIFF", "c.ome.tif", "d.dcm", "e.qptiff", "f.NDPI", "labels.csv", "notes.txt", "g.tif.bak"]
    for n in names:
        (tmp_path / n).write_bytes(b"")
    expected = ["a.svs", "b.OME.TIFF", "c.ome.tif", "d.dcm", "e.qptiff", "f.NDPI"]
    assert [p.name for p in list_slides(tmp_path)] == sorted(expected)
    assert [n for n in names if is_slide_name(n)] == expected
