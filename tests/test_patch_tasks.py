"""A patch encoder (a tiny timm ViT on every 32 px patch, ``model.patch``) through the rest of wsitrain: a survival
target and a multi-label target (fit, the held-out test, the task's state in the checkpoint), ``wsitrain cv``, and a
fit over two gloo ranks, which trains the same weights as one process accumulating two slides a step.

Tiny cohorts of 128 px slides (a 4 x 4 patch grid), tiled in chunks of 2 x 2 patches (tile_size 64), one epoch."""

from __future__ import annotations

import io
import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from rich.console import Console
from test_fit_distributed import _six_train_two_val

from wsitrain.config import WsiTrainConfig
from wsitrain.slides.synth.targets import write_task_dataset
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.cv import run_cv
from wsitrain.train.fit import run_fit

pytest.importorskip("timm", reason="the encoder is a timm ViT")

MODEL = {"name": "python:tiny_encoders:tiny_vit", "patch": 32}
ENGINE = {"device": "cpu", "memory_budget": "1GiB", "tile_size": 64}
TASKS: dict[str, dict[str, Any]] = {
    "survival": {"kind": "survival", "bins": 2},
    "multilabel": {"kind": "multilabel", "columns": ["purple", "brown", "teal"]},
}


def _task_cfg(labels: Path, log_dir: Path, task: str, pool: str, name: str | None = None) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": name or task, "seed": 0,
        "data": {"labels": str(labels), "slides_dir": str(labels.parent), "region": "tissue", "prefetch": False},
        "model": {**MODEL, "pool": pool},
        "engine": ENGINE,
        "train": {"epochs": 1, "optimizer": "adam", "lr": 1e-3},
        "log": {"dir": str(log_dir), "tiles": "off"},
        "task": TASKS[task],
    })  # fmt: skip


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("patch_tasks")


@pytest.fixture(scope="module")
def survival_labels(root: Path) -> Path:
    # 8 patients of 2 slides: 2 test, 2 val, 4 train
    return write_task_dataset(root / "data-survival", "survival", n=16, size=128, seed=0, slides_per_patient=2,
                              test_fraction=0.25)  # fmt: skip


def _finite_metrics(summary: dict[str, Any], names: list[str]) -> None:
    for name in names:
        value = summary.get(name)
        assert isinstance(value, float) and math.isfinite(value), (name, summary)


def _check_task_run(run: Path, task: str, n_outputs: int, metrics: list[str]) -> None:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == task and summary["test_n"] > 0, summary
    _finite_metrics(summary, metrics)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows].count("test") == 1
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r), rows
    ck = load_checkpoint(run / "last.pt")  # best.pt needs a validation metric, which 2 val slides may not give
    assert ck["task"]["kind"] == task and ck["task"]["n_outputs"] == n_outputs, ck["task"]
    # the encoder trained: its weights in the checkpoint are a ViT's, and the head outputs one value per target
    assert any(k.startswith("features.encoder.blocks.") for k in ck["model"]), list(ck["model"])[:10]
    assert (run / f"{task}_test.png").is_file()


def test_survival_target_with_a_patch_encoder(survival_labels: Path, root: Path) -> None:
    run = run_fit(_task_cfg(survival_labels, root / "runs", "survival", "attention"), console=_quiet(), quiet=True)
    ck = load_checkpoint(run / "last.pt")
    _check_task_run(run, "survival", len(ck["task"]["cuts"]) + 1, ["val_c_index", "test_c_index"])
    # the time model's share of the work, counted per patch for a patch encoder (flat patches encoded once a chunk)
    train = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in x]
    shares = [r["tissue_tile_share"] for r in train]
    assert shares and all(s is not None and 0 < s <= 1 for s in shares), shares


def test_multilabel_target_with_a_patch_encoder(root: Path) -> None:
    labels = write_task_dataset(root / "data-multilabel", "multilabel", n=12, size=128, seed=0, test_fraction=0.25)
    run = run_fit(_task_cfg(labels, root / "runs", "multilabel", "max"), console=_quiet(), quiet=True)
    _check_task_run(run, "multilabel", 3, ["test_macro_auc"])


def test_cv_with_a_patch_encoder(survival_labels: Path, root: Path) -> None:
    cfg = _task_cfg(survival_labels, root / "cv", "survival", "gated_attention", name="t")
    out = run_cv(cfg, folds=2, console=_quiet(), quiet=True)
    assert out == root / "cv" / "t-cv2"
    for k in (1, 2):
        s = json.loads((out / f"fold-{k}" / "summary.json").read_text())
        _finite_metrics(s, ["val_c_index", "test_c_index"])
        assert (out / f"fold-{k}" / "best.pt").is_file() and (out / f"fold-{k}" / "report.html").is_file()
    summary = json.loads((out / "cv_summary.json").read_text())
    assert summary["n_folds"] == 2 and len(summary["metrics"]["val_c_index"]["folds"]) == 2
    assert math.isfinite(summary["metrics"]["test_c_index"]["mean"])
    assert "mean ± sd" in (out / "cv.html").read_text()


# --- two ranks ----------------------------------------------------------------------------------------------------


def _dist_cfg(root: Path, name: str, accumulate: int) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": name, "seed": 1,
        "data": {"labels": str(root / "labels.csv"), "slides_dir": str(root / "slides"), "region": "whole",
                 "augment": {"flips": False, "rot90": False}, "prefetch": False},
        "model": {**MODEL, "pool": "attention"},
        "engine": ENGINE,
        "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.05, "accumulate": accumulate},
        # 50 KB buckets: the ViT's gradients take several. round_robin: these slides' tissue differs, so their predicted
        # costs (patches encoded) differ and balance: time would group them into other steps than the one process's
        "distributed": {"backend": "gloo", "bucket_mb": 0.05, "balance": "round_robin"},
        "log": {"dir": str(root / "runs"), "tiles": "off"},
    })  # fmt: skip


def _fit_worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    run_fit(_dist_cfg(Path(root), "ddp", accumulate=1), console=Console(file=io.StringIO()), quiet=True)


@pytest.mark.heavy  # two spawned interpreters importing torch and timm: 8.6 s alone, 15 s wall (measured, 2 cores)
def test_two_rank_fit_equals_one_process_with_accumulation(tmp_path: Path) -> None:
    _six_train_two_val(tmp_path, size=128)  # 6 slides of 128 px to train (3 per rank), 2 to validate
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fit_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    single = run_fit(_dist_cfg(tmp_path, "single", accumulate=2), console=_quiet(), quiet=True)

    a = load_checkpoint(tmp_path / "runs" / "ddp" / "last.pt")
    b = load_checkpoint(single / "last.pt")
    assert a["global_step"] == b["global_step"] == 3
    assert any(k.startswith("features.encoder.") for k in a["model"])
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-5, atol=1e-6, msg=key)
    val = [[json.loads(x) for x in (tmp_path / "runs" / n / "metrics.jsonl").read_text().splitlines()
            if '"val"' in x][-1] for n in ("ddp", "single")]  # fmt: skip
    assert val[0]["n"] == val[1]["n"] == 2
    assert val[0]["loss"] == pytest.approx(val[1]["loss"], rel=1e-5)
