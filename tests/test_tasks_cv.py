"""`wsitrain cv`: folds never divide a patient, test rows stay out of every fold, the summary has each metric per fold
and as mean +/- sd, and a rerun keeps finished folds and resumes an interrupted one."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.errors import WsiTrainError
from wsitrain.slides.synth.targets import write_task_dataset
from wsitrain.train.cv import run_cv


def _cfg(labels: Path, log_dir: Path, **task: Any) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": "t", "seed": 1,
        "data": {"labels": str(labels), "slides_dir": str(labels.parent), "region": "whole", "prefetch": False},
        "model": {"name": "tiny", "pool": "avg"},
        "engine": {"device": "cpu", "memory_budget": "1GiB"},
        "train": {"epochs": 1, "optimizer": "adam", "lr": 1e-3},
        "log": {"dir": str(log_dir), "tiles": "off"},
        "task": {"kind": "survival", "bins": 2, **task},
    })  # fmt: skip


def _cv(cfg: WsiTrainConfig, folds: int) -> tuple[Path, str]:
    buf = io.StringIO()
    out = run_cv(cfg, folds=folds, console=Console(file=buf, width=200), quiet=True)
    return out, buf.getvalue()


@pytest.mark.heavy
def test_cv_folds_summary_and_resume(tmp_path: Path) -> None:
    labels = write_task_dataset(tmp_path / "data", "survival", n=16, size=128, seed=0, slides_per_patient=2,
                                test_fraction=0.25)  # fmt: skip
    cfg = _cfg(labels, tmp_path / "runs")
    cv_dir, out = _cv(cfg, 3)
    assert cv_dir == tmp_path / "runs" / "t-cv3"
    test_slides = {r["slide"] for r in csv.DictReader(labels.open()) if r["split"] == "test"}
    val_patients: list[set[str]] = []
    for k in (1, 2, 3):
        rows = list(csv.DictReader((cv_dir / "folds" / f"fold-{k}.csv").open()))
        by_split = {s: {r["patient"] for r in rows if r["split"] == s} for s in ("train", "val", "test")}
        assert by_split["val"] and not by_split["val"] & by_split["train"]  # a patient in one side only
        assert {Path(r["slide"]).name for r in rows if r["split"] == "test"} == test_slides
        val_patients.append(by_split["val"])
        assert (cv_dir / f"fold-{k}" / "summary.json").is_file()
    assert not (val_patients[0] & val_patients[1]) and not (val_patients[1] & val_patients[2])
    assert len(set().union(*val_patients)) == 6  # every non-test patient validates exactly once (8 - 2 test)
    summary = json.loads((cv_dir / "cv_summary.json").read_text())
    m = summary["metrics"]
    assert summary["n_folds"] == 3 and len(m["val_c_index"]["folds"]) == 3
    assert "test_c_index" in m and m["test_c_index"]["mean"] is not None
    page = (cv_dir / "cv.html").read_text()
    assert "mean ± sd" in page and "(held-out test)" in page and "fold-3/report.html" in page
    assert all((cv_dir / f"fold-{k}" / "report.html").is_file() for k in (1, 2, 3))

    # a rerun keeps the finished folds; a fold with last.pt but no summary resumes from it
    (cv_dir / "fold-2" / "summary.json").unlink()
    before = (cv_dir / "fold-1" / "summary.json").read_text()
    _, out = _cv(cfg, 3)
    assert "fold-1: finished earlier, kept" in out and "fold-2: resuming" in out
    assert (cv_dir / "fold-1" / "summary.json").read_text() == before
    assert (cv_dir / "fold-2" / "summary.json").is_file()

    # another seed is another cross-validation: refused, not mixed into this folder
    other = _cfg(labels, tmp_path / "runs").model_copy(update={"seed": 2})
    with pytest.raises(WsiTrainError, match="holds another cross-validation"):
        _cv(other, 3)


def _cv_worker(rank: int, world: int, port: int, labels: str, log_dir: str) -> None:
    import os

    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    cfg = _cfg(Path(labels), Path(log_dir)).model_copy(update={"distributed": _gloo()})
    run_cv(cfg, folds=2, console=Console(file=io.StringIO()), quiet=True)


def _gloo() -> Any:
    from wsitrain.config import DistributedConfig

    return DistributedConfig(backend="gloo")


@pytest.mark.heavy  # 30-50 s on 2 cores (measured 2026-11-27); CI runs it, `make test` does not
def test_cv_under_two_processes_trains_every_fold_on_both_ranks(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    labels = write_task_dataset(tmp_path / "data", "survival", n=12, size=128, seed=1, test_fraction=0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_cv_worker, args=(2, port, str(labels), str(tmp_path / "runs")), nprocs=2, join=True)
    cv_dir = tmp_path / "runs" / "t-cv2"
    for k in (1, 2):
        rows = list(csv.DictReader((cv_dir / "folds" / f"fold-{k}.csv").open()))
        n_train = sum(r["split"] == "train" for r in rows)
        s = json.loads((cv_dir / f"fold-{k}" / "summary.json").read_text())
        assert s["optimizer_steps"] == -(-n_train // 2)  # each step took one slide on each of the 2 ranks
        assert s["val_n"] == sum(r["split"] == "val" for r in rows) and s["test_n"] == 2  # gathered from both
    assert json.loads((cv_dir / "cv_summary.json").read_text())["n_folds"] == 2
