"""Fit learns each task on synthetic cohorts whose targets depend on what the slides show (synth.targets), and
is judged on held-out test slides: survival c-index >= 0.75, regression R^2 >= 0.6, multi-label macro AUC >= 0.9.

Each cohort: 48 slides of 256 px, one per patient, 16 patients split=test, 8 val, 24 train; the tiny CNN trains for
a few epochs on the CPU. The run folder's task outputs (test metrics marked as test, task state in the checkpoint,
pictures, predict's per-patient file, the report) are checked on the survival run.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.report.html import write_report
from wsitrain.slides.synth.targets import write_task_dataset
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.fit import run_fit
from wsitrain.train.predict import run_predict

TASKS: dict[str, dict[str, Any]] = {
    "survival": {"kind": "survival", "bins": 4},
    "regression": {"kind": "regression", "columns": ["score"]},
    "multilabel": {"kind": "multilabel", "columns": ["purple", "brown", "teal"]},
}
# The pooling each learns with in 6 epochs (measured on these cohorts; avg pooling learns regression's scale slowly:
# R^2 0.36 after 8 epochs where max pooling, which reads the nuclei's darkness, reached 0.78 after 6).
POOL = {"survival": "avg", "regression": "max", "multilabel": "max"}
EPOCHS = {"survival": 6, "regression": 6, "multilabel": 6}


def _fit(task: str, root: Path) -> Path:
    data = root / f"data-{task}"
    labels = write_task_dataset(data, task, n=48, size=256, seed=0, test_fraction=0.33)
    cfg = WsiTrainConfig.model_validate({
        "name": task, "seed": 0,
        "data": {"labels": str(labels), "slides_dir": str(data), "region": "tissue"},
        "model": {"name": "tiny", "pool": POOL[task]},
        "engine": {"device": "cpu", "memory_budget": "1GiB"},
        "train": {"epochs": EPOCHS[task], "optimizer": "adamw", "lr": 4e-3, "schedule": "constant"},
        "log": {"dir": str(root / "runs"), "tiles": "off"},
        "task": TASKS[task],
    })  # fmt: skip
    return run_fit(cfg, console=Console(file=io.StringIO(), width=200), quiet=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("learn")


@pytest.mark.heavy
@pytest.mark.parametrize(("task", "metric", "floor"), [
    ("survival", "test_c_index", 0.75), ("regression", "test_r2", 0.6), ("multilabel", "test_macro_auc", 0.9),
])  # fmt: skip
def test_fit_learns_the_task_on_held_out_slides(root: Path, task: str, metric: str, floor: float) -> None:
    run = _fit(task, root)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == task and summary["test_n"] == 16
    assert summary[metric] >= floor, summary
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows].count("test") == 1  # evaluated once, at the end
    assert (run / f"{task}_validation.png").is_file() and (run / f"{task}_test.png").is_file()


@pytest.mark.heavy
def test_task_run_outputs_predict_and_report(root: Path, tmp_path: Path) -> None:
    run = root / "runs" / "survival"
    if not (run / "best.pt").is_file():
        run = _fit("survival", root)
    ck = load_checkpoint(run / "best.pt")
    assert ck["task"]["kind"] == "survival" and ck["task"]["n_outputs"] == len(ck["task"]["cuts"]) + 1
    data = json.loads((run / "data.json").read_text())
    assert len(data["test"]) == 16 and not set(data["test"]) & set(data["train"] + data["val"])
    test = json.loads((run / "test.json").read_text())
    assert test["kind"] == "test" and len(test["slides"]) == 16

    labels = root / "data-survival" / "labels.csv"
    out = tmp_path / "pred.csv"
    cfg = WsiTrainConfig.model_validate({**json.loads(json.dumps(_cfg_of(run))), "log": {"dir": str(tmp_path)}})
    run_predict(cfg, checkpoint=run / "best.pt", slides=root / "data-survival", out=out,
                console=Console(file=io.StringIO()), patients=labels)  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 48 and set(rows[0]) == {"slide", "path", "risk"}
    patients = list(csv.DictReader(out.with_name("pred.patients.csv").open()))
    assert len(patients) == 48 and set(patients[0]) == {"patient", "slides", "risk"}

    # heatmaps work for a task: survival's is the risk map (one panel), from the per-bin hazard maps
    few = tmp_path / "few"
    few.mkdir()
    for name in ("slide_000.svs", "slide_001.svs"):
        shutil.copy(root / "data-survival" / name, few / name)
    run_predict(cfg, checkpoint=run / "best.pt", slides=few, out=tmp_path / "few.csv",
                console=Console(file=io.StringIO()), heatmaps=tmp_path / "maps")  # fmt: skip
    index = json.loads((tmp_path / "maps" / "heatmaps.json").read_text())
    assert index["classes"] == ["risk"] and len(index["slides"]) == 2
    risks = [float(r["risk"]) for r in csv.DictReader((tmp_path / "few.csv").open())]
    for rec, risk in zip(index["slides"], risks, strict=True):
        assert rec["cam_shape"][0] == 1 and (tmp_path / "maps" / rec["png"]).is_file()
        assert rec["probs"]["risk"] == pytest.approx(risk, abs=1e-5)  # the map's slide risk is predict's

    page = write_report(run, heatmaps=False).read_text()
    assert "Task results" in page and "test_c_index (held-out test)" in page
    assert "held-out test: evaluated once, with best.pt" in page
    assert page.count('alt="test survival"') == 1 and page.count('alt="validation survival"') == 1


def _cfg_of(run: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())
