"""Read what a fit left in its run folder: per-epoch metrics, plans, tile stats, validation predictions.

Only reads; every reader tolerates a missing file (an older run, a run killed early) by returning nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from wsitrain.train.metrics import classification_metrics

VALIDATION = "validation.json"  # the last validation's per-slide predictions (written by write_validation_figures)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; a torn last line (a killed run) is skipped."""
    if not path.is_file():
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def metrics_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without superseded rows: in runs resumed before resumes dropped them, the rows a stopped run
    logged past its checkpoint (steps after a later resume marker's step) precede that marker; they are skipped."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    out: list[dict[str, Any]] = []
    for r in rows:
        if r.get("kind") == "resume" and isinstance(r.get("step"), int):
            out = [x for x in out if not (isinstance(x.get("step"), int) and x["step"] > r["step"])]
        out.append(r)
    return out


def read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    with open(path) as f:
        return json.load(f)


@dataclass
class EpochCurves:
    """Per-epoch series (nan where a value was not logged). ``lr_steps`` is (fractional epoch, lr) per step."""

    epochs: list[int] = field(default_factory=list)
    train: dict[str, list[float]] = field(default_factory=dict)
    val: dict[str, list[float]] = field(default_factory=dict)
    lr_steps: list[tuple[float, float]] = field(default_factory=list)
    train_has_probs: bool = False


METRICS = ("loss", "accuracy", "balanced_accuracy", "roc_auc")
# The curves of a task's run: its validation metrics (training rows hold task outputs, not class probabilities).
TASK_METRICS = {"survival": ("loss", "c_index", "patient_c_index"), "regression": ("loss", "r2", "pearson", "spearman"),
                "multilabel": ("loss", "macro_auc", "patient_macro_auc")}  # fmt: skip


def run_task(run_dir: Path) -> str:
    """The run's task.kind from its config.yaml (classification when absent: runs before tasks existed)."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        cfg = None
    task = (cfg or {}).get("task") if isinstance(cfg, dict) else None
    return str(task.get("kind", "classification")) if isinstance(task, dict) else "classification"


def epoch_curves(run_dir: Path) -> EpochCurves:
    """From metrics.jsonl: training loss (mean over the epoch's slides) and, when the rows carry class probabilities,
    training accuracy / balanced accuracy / ROC AUC; validation rows as logged; the learning rate per step.

    A resumed run re-logs the steps after its last checkpoint: for each (epoch, slide index) and each validated
    epoch the last row wins.
    """
    rows = metrics_rows(run_dir)
    metrics = TASK_METRICS.get(run_task(run_dir), METRICS)
    train: dict[tuple[int, int], dict[str, Any]] = {}
    val: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r.get("kind") == "train":
            train[(int(r["epoch"]), int(r.get("index", len(train))))] = r
        elif r.get("kind") == "val":
            val[int(r["epoch"])] = r
    epochs = sorted({e for e, _ in train} | set(val))
    out = EpochCurves(epochs=epochs)
    out.train = {k: [] for k in metrics}
    out.val = {k: [] for k in metrics}
    for e in epochs:
        mine = [train[k] for k in sorted(train) if k[0] == e]
        losses = [float(r["loss"]) for r in mine if r.get("loss") is not None]
        out.train["loss"].append(float(np.mean(losses)) if losses else math.nan)
        with_probs = [r for r in mine if r.get("probs") is not None and r.get("label") is not None
                      and metrics is METRICS]  # fmt: skip
        if with_probs:
            out.train_has_probs = True
            m = classification_metrics(np.array([int(r["label"]) for r in with_probs]),
                                       np.array([r["probs"] for r in with_probs], dtype=np.float64))
        else:
            m = {}
        for k in metrics[1:]:
            out.train[k].append(float(m.get(k, math.nan)))
        v = val.get(e, {})
        for k in metrics:
            x = v.get(k)
            out.val[k].append(float(x) if x is not None else math.nan)
        n = max(1, len(mine))
        for i, r in enumerate(mine):
            if r.get("lr") is not None:
                out.lr_steps.append((e - 1 + (i + 1) / n, float(r["lr"])))
    return out


def plans(run_dir: Path) -> list[dict[str, Any]]:
    """plans.jsonl rows: {"slide", "shape", "plan": Plan.to_dict()}, one per input shape."""
    return read_jsonl(Path(run_dir) / "plans.jsonl")


@dataclass
class TileTimes:
    """Per-tile milliseconds and peak bytes by phase (log.tiles: all), or per-step means (log.tiles: summary)."""

    per_tile: bool
    ms: dict[str, list[float]]
    bytes: dict[str, list[float]]
    rows: int


def tile_times(run_dir: Path) -> TileTimes | None:
    rows = read_jsonl(Path(run_dir) / "tiles.jsonl")
    if not rows:
        return None
    phases = ("forward", "backward")
    if "phase" in rows[0]:
        return TileTimes(
            True,
            {p: [float(r["ms"]) for r in rows if r.get("phase") == p] for p in phases},
            {p: [float(r["bytes"]) for r in rows if r.get("phase") == p and r.get("bytes") is not None]
             for p in phases},
            len(rows),
        )
    return TileTimes(
        False,
        {p: [float(r[f"{p}_tile_ms_mean"]) for r in rows if r.get(f"{p}_tile_ms_mean") is not None] for p in phases},
        {"step": [float(r["peak_bytes"]) for r in rows if r.get("peak_bytes")]},
        len(rows),
    )


def step_peaks(run_dir: Path) -> list[float]:
    """Each training step's peak bytes from metrics.jsonl (the fallback when tiles carry no memory)."""
    return [float(r["peak_bytes"]) for r in metrics_rows(run_dir)
            if r.get("kind") == "train" and r.get("peak_bytes")]
