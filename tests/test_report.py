"""Run-folder pictures: curves, validation ROC and confusion matrix, and the self-contained report.html."""

from __future__ import annotations

import base64
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.report.curves import write_curves
from wsitrain.report.html import write_report
from wsitrain.report.roc import confusion_matrix, roc_points, write_validation_figures
from wsitrain.report.runlog import epoch_curves
from wsitrain.train.metrics import binary_roc_auc, classification_metrics

CLASSES = ["negative", "positive"]


def _png_ok(data: bytes) -> tuple[int, int]:
    img = Image.open(io.BytesIO(data))
    assert img.format == "PNG"
    img.load()  # decodes every pixel; a truncated file raises
    return img.size


def _rows(tmp_path: Path) -> list[dict]:
    """Two epochs of 4 slides, a validation per epoch, and a resume that redoes epoch 2's last two slides."""
    rng = np.random.default_rng(0)
    rows = []
    for epoch in (1, 2):
        mine = []
        for i in range(4):
            label = i % 2
            p1 = float(rng.uniform(0.2, 0.9)) if label else float(rng.uniform(0.1, 0.6))
            mine.append({"kind": "train", "epoch": epoch, "step": (epoch - 1) * 4 + i + 1, "index": i,
                         "slide": f"s{i}", "label": label, "loss": float(rng.uniform(0.2, 1.0)),
                         "probs": [1 - p1, p1], "lr": 0.01 * (1 - ((epoch - 1) * 4 + i) / 8)})
        rows += mine
        if epoch == 2:
            rows.append({"kind": "resume", "epoch": 2, "index": 2, "step": 6, "forced": False})
            rows += [{**mine[i], "loss": 5.0 + i, "probs": [0.9, 0.1]} for i in (2, 3)]  # replace the two above
        rows.append({"kind": "val", "epoch": epoch, "step": epoch * 4, "loss": 0.5 / epoch, "n": 4,
                     "accuracy": 0.5 + 0.25 * epoch, "balanced_accuracy": 0.5 + 0.2 * epoch,
                     "roc_auc": 0.6 + 0.2 * epoch})
    return rows


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A small fake run folder with what fit writes (no training)."""
    import torch

    from wsitrain.models import build
    from wsitrain.sft import plan

    d = tmp_path / "runs" / "fake"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(tmp_path)) + '{"kind": "tr')
    (d / "config.yaml").write_text(yaml.safe_dump({"name": "fake", "model": {"name": "tiny", "pool": "max"},
                                                   "log": {"tiles": "all"}}))
    (d / "versions.json").write_text(json.dumps({"python": "3.11", "torch": torch.__version__, "device": "cpu (x)"}))
    (d / "summary.json").write_text(json.dumps({"epochs": 2, "val_loss": 0.25, "peak_bytes": 123456789}))
    p = plan(build("tiny", 2), (1, 3, 128, 128), memory_budget="64MiB", tile_size=64)
    (d / "plans.jsonl").write_text(json.dumps({"slide": "s0", "shape": [1, 3, 128, 128], "plan": p.to_dict()}) + "\n")
    tiles = [{"epoch": 1, "step": 1, "slide": "s0", "segment": 0, "row": r, "col": c, "phase": ph, "ms": 1.0 + r + c,
              "bytes": 1000 * (r + 1)} for r in range(2) for c in range(2) for ph in ("forward", "backward")]
    (d / "tiles.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tiles))
    return d


def test_epoch_curves_aggregate_per_epoch_and_resumed_rows_win(run_dir: Path) -> None:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]
    c = epoch_curves(run_dir)
    assert c.epochs == [1, 2] and c.train_has_probs
    for epoch in (1, 2):
        last: dict[int, dict] = {}
        for r in rows:
            if r.get("kind") == "train" and r["epoch"] == epoch:
                last[r["index"]] = r
        mine = [last[i] for i in sorted(last)]
        assert c.train["loss"][epoch - 1] == pytest.approx(np.mean([r["loss"] for r in mine]))
        m = classification_metrics(np.array([r["label"] for r in mine]), np.array([r["probs"] for r in mine]))
        for k in ("accuracy", "balanced_accuracy", "roc_auc"):  # the curves' metrics (runlog.METRICS)
            assert c.train[k][epoch - 1] == pytest.approx(m[k])
        val = next(r for r in rows if r.get("kind") == "val" and r["epoch"] == epoch)
        for k in ("loss", "accuracy", "balanced_accuracy", "roc_auc"):
            assert c.val[k][epoch - 1] == pytest.approx(val[k])
    epoch2 = [r for r in rows if r.get("kind") == "train" and r["epoch"] == 2]
    assert c.train["loss"][1] == pytest.approx((epoch2[0]["loss"] + epoch2[1]["loss"] + 7.0 + 8.0) / 4)
    assert len(c.lr_steps) == 8


def test_write_curves_png(run_dir: Path) -> None:
    path = write_curves(run_dir)
    assert path == run_dir / "curves.png"
    w, h = _png_ok(path.read_bytes())
    assert w > 3 * h  # one row of five panels


def test_curves_of_an_empty_run_folder(tmp_path: Path) -> None:
    assert _png_ok(write_curves(tmp_path).read_bytes())


def test_roc_points_area_is_the_rank_auc() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 200).astype(bool)
    s = np.round(rng.normal(size=200) + y, 1)  # rounding makes ties
    fpr, tpr = roc_points(y, s)
    assert fpr[0] == tpr[0] == 0 and fpr[-1] == tpr[-1] == 1
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    area = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
    assert area == pytest.approx(binary_roc_auc(y, s), abs=1e-12)


def test_confusion_matrix_counts() -> None:
    y = np.array([0, 0, 1, 2, 2, 2])
    p = np.array([0, 1, 1, 2, 0, 2])
    cm = confusion_matrix(y, p, 3)
    expected = np.zeros((3, 3), dtype=int)
    for a, b in zip(y, p, strict=True):
        expected[a, b] += 1
    np.testing.assert_array_equal(cm, expected)
    assert cm.sum() == len(y)


@pytest.mark.parametrize("classes", [CLASSES, ["a", "b", "c"]])
def test_write_validation_figures(tmp_path: Path, classes: list[str]) -> None:
    rng = np.random.default_rng(2)
    y = np.arange(9) % len(classes)
    prob = rng.dirichlet(np.ones(len(classes)), size=9)
    roc, conf = write_validation_figures(tmp_path, y, prob, classes, [f"s{i}" for i in range(9)],
                                         [f"/x/s{i}.svs" for i in range(9)])
    _png_ok(roc.read_bytes())
    _png_ok(conf.read_bytes())
    val = json.loads((tmp_path / "validation.json").read_text())
    assert val["classes"] == classes
    assert [r["slide"] for r in val["slides"]] == [f"s{i}" for i in range(9)]
    for r, yy, pp in zip(val["slides"], y, prob, strict=True):
        assert r["label"] == classes[yy] and r["predicted"] == classes[int(pp.argmax())]
        assert [r["probs"][c] for c in classes] == pytest.approx(pp.tolist())


def test_write_validation_figures_rejects_wrong_class_count(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="3 columns but there are 2 class names"):
        write_validation_figures(tmp_path, [0, 1], np.ones((2, 3)) / 3, CLASSES)


def _fake_heatmaps(run_dir: Path) -> None:
    d = run_dir / "heatmaps"
    d.mkdir()
    Image.fromarray(np.full((40, 60, 3), 200, np.uint8)).save(d / "s1.png")
    (d / "heatmaps.json").write_text(json.dumps({"classes": CLASSES, "slides": [
        {"slide": "s1.svs", "png": "s1.png", "label": "positive", "predicted": "positive",
         "probs": {"negative": 0.2, "positive": 0.8}}]}))


def _images(page: str) -> list[str]:
    return re.findall(r'<img [^>]*src="([^"]*)"', page)


def test_report_is_self_contained_and_every_image_decodes(run_dir: Path) -> None:
    write_validation_figures(run_dir, [0, 1, 1], np.array([[0.7, 0.3], [0.4, 0.6], [0.8, 0.2]]), CLASSES,
                             ["v0", "v1", "v2"])
    _fake_heatmaps(run_dir)
    path = write_report(run_dir, heatmaps=False)
    page = path.read_text()
    assert path == run_dir / "report.html"
    assert "http://" not in page and "https://" not in page
    srcs = _images(page)
    # curves, roc, confusion, plan memory, tile histograms, one heatmap
    assert len(srcs) == 6 and page.count("<img") == 6
    for src in srcs:
        assert src.startswith("data:image/png;base64,")
        _png_ok(base64.b64decode(src.split(",", 1)[1], validate=True))
    assert not re.search(r'\b(href|src)="(?!data:)', page)  # nothing is fetched from anywhere
    for text in ("Training curves", "Validation slides", "Engine plan", "Per-tile timing", "Config",
                 "Library versions", "v1", "<details>", "segment", "tiled"):
        assert text in page
    assert "2 of 3 correct" in page


def test_report_says_what_is_missing(tmp_path: Path) -> None:
    d = tmp_path / "bare"
    d.mkdir()
    (d / "config.yaml").write_text("name: bare\nlog: {tiles: 'off'}\n")
    page = write_report(d, heatmaps=True).read_text()
    for text in ("summary.json is missing", "no plans.jsonl", "no tiles.jsonl (log.tiles: off)", "no validation.json",
                 "no heatmaps", "no metrics.jsonl"):
        assert text in page
    assert _images(page) == []


def test_report_command(run_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"COLUMNS": "200", "NO_COLOR": "1"}
    ok = runner.invoke(app, ["report", str(run_dir), "--no-heatmaps"], env=env)
    assert ok.exit_code == 0, ok.output
    assert ok.output.strip().splitlines()[-1] == str(run_dir / "report.html")
    bad = runner.invoke(app, ["report", str(tmp_path)], env=env)
    assert bad.exit_code == 2
    assert "not a run folder" in bad.output and str(tmp_path) in bad.output
    assert not (tmp_path / "report.html").exists()
    assert runner.invoke(app, ["report", "--help"], env=env).exit_code == 0


def test_report_nan_metrics_show_as_dash(run_dir: Path) -> None:
    (run_dir / "summary.json").write_text(json.dumps({"epochs": 1, "val_roc_auc": math.nan}))
    assert "–" in write_report(run_dir, heatmaps=False).read_text()


def test_predict_saliency_needs_heatmaps(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["predict", "cfg.yaml", "--checkpoint", "x.pt", "--slides", str(tmp_path),
                                      "--out", str(tmp_path / "p.csv"), "--saliency"],
                                env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 2
    assert "--saliency needs --heatmaps" in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("spread", "flagged"), [(0.0031, True), (0.25, False)])
def test_report_flags_near_constant_outputs(run_dir: Path, spread: float, flagged: bool) -> None:
    """summary.json's val_output_spread below FLAT_SPREAD: the page says the run is still on the plateau."""
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "val_output_spread": spread}))
    page = write_report(run_dir, heatmaps=False).read_text()
    assert ("val_output_spread 0.0031 is below 0.02" in page) == flagged
    assert "val_output_spread" in page  # the row of the summary table either way
