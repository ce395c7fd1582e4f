"""End to end: fit leaves curves and validation figures, `wsitrain report` writes the page with heatmaps, and
`predict --heatmaps` writes maps whose probabilities are the CSV's."""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.config import WsiTrainConfig

QUIET = Console(file=io.StringIO())


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[WsiTrainConfig, Path, Path]:
    from wsitrain.train.fit import run_fit

    root = tmp_path_factory.mktemp("report")
    cfg = WsiTrainConfig.model_validate({
        "name": "r",
        "data": {"synthetic": {"n": 4, "size": 256, "cache_dir": str(root / "synth")}, "region": "whole",
                 "val_fraction": 0.5},
        "model": {"name": "tiny", "pool": "max"},
        "engine": {"memory_budget": "1GiB", "tile_size": 128, "device": "cpu"},
        "train": {"epochs": 2, "optimizer": "sgd", "lr": 0.01},
        "log": {"dir": str(root / "runs"), "tiles": "all"},
    })
    return cfg, run_fit(cfg, console=QUIET, quiet=True), root / "synth"


def test_fit_leaves_curves_and_validation_figures(run: tuple[WsiTrainConfig, Path, Path]) -> None:
    _, run_dir, _ = run
    for name in ("curves.png", "roc.png", "confusion.png", "validation.json"):
        assert (run_dir / name).is_file(), name
    val = json.loads((run_dir / "validation.json").read_text())
    assert len(val["slides"]) == 2 and all(Path(r["path"]).is_file() for r in val["slides"])
    train_rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["probs"]) == 2 for r in train_rows if r["kind"] == "train")


def test_report_command_computes_validation_heatmaps(run: tuple[WsiTrainConfig, Path, Path]) -> None:
    _, run_dir, _ = run
    result = CliRunner().invoke(app, ["report", str(run_dir)], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == str(run_dir / "report.html")
    index = json.loads((run_dir / "heatmaps" / "heatmaps.json").read_text())
    val = json.loads((run_dir / "validation.json").read_text())
    assert [r["slide"] for r in index["slides"]] == [Path(r["path"]).name for r in val["slides"]]
    for r, v in zip(index["slides"], val["slides"], strict=True):
        assert r["label"] == v["label"]
    page = (run_dir / "report.html").read_text()
    assert "http://" not in page and "https://" not in page
    assert len(re.findall(r"<details><summary><img", page)) == 2


def test_predict_heatmaps_match_the_csv(run: tuple[WsiTrainConfig, Path, Path], tmp_path: Path) -> None:
    from wsitrain.train.predict import run_predict

    cfg, run_dir, slides = run
    out = run_predict(cfg, checkpoint=run_dir / "best.pt", slides=slides, out=tmp_path / "p.csv", console=QUIET,
                      heatmaps=tmp_path / "maps", saliency=True)
    rows = list(csv.DictReader(out.open()))
    index = json.loads((tmp_path / "maps" / "heatmaps.json").read_text())
    assert [r["slide"] for r in index["slides"]] == [r["slide"] for r in rows]
    for r, m in zip(rows, index["slides"], strict=True):
        assert m["predicted"] == r["predicted"]
        for c in ("negative", "positive"):
            assert m["probs"][c] == pytest.approx(float(r[f"prob_{c}"]), abs=2e-6)
        stem = r["slide"].removesuffix(".svs")
        for f in (f"{stem}.png", f"{stem}.cam.npy", f"{stem}.saliency.npy"):
            assert (tmp_path / "maps" / f).is_file()
        assert np.load(tmp_path / "maps" / f"{stem}.cam.npy").shape == (2, 16, 16)
