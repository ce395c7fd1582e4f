"""A task's head, loss, outputs and metrics in one object, built from the config and the training records.

The recipe, predict and the report call the same four methods whatever the task:
``target(record)`` (the tensor the loss compares against), ``loss(logits, target)``, ``outputs(logits)`` (what a
slide's prediction is: class probabilities, target values, label probabilities, or the survival risk) and
``metrics(targets, outputs)``. ``state()`` holds what training data fixed (regression's target scale, survival's
time bins) so a checkpoint predicts exactly as it was trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from wsitrain.config import TaskConfig
from wsitrain.errors import ConfigError
from wsitrain.slides.dataset import SlideRecord
from wsitrain.tasks import metrics as M
from wsitrain.tasks.columns import output_names
from wsitrain.tasks.kinds import SELECTION, TaskKind
from wsitrain.tasks.survival import bin_index, risk_score, survival_nll, time_bins


@dataclass
class Objective:
    """Head size, loss, outputs and metrics of a regression, survival or multi-label task.

    Classification does not use this class: its path (train.loss, softmax, accuracy and AUC) is unchanged.
    """

    kind: TaskKind
    names: list[str]  # one per output column of ``outputs``
    n_outputs: int  # the head's size
    loss_name: str = "mse"
    mean: list[float] = field(default_factory=list)  # regression: training targets' mean and std per column
    std: list[float] = field(default_factory=list)
    cuts: list[float] = field(default_factory=list)  # survival: inner bin edges (n_outputs = len(cuts) + 1)

    # ---- building
    @classmethod
    def from_training(cls, task: TaskConfig, train: Sequence[SlideRecord]) -> Objective:
        """Fix what the training slides decide: regression's scale, survival's bins (from training events only)."""
        names = output_names(task)
        if task.kind == "regression":
            y = np.array([r.target for r in train], dtype=np.float64).reshape(len(train), -1)
            # targets are standardized for the loss: a head starting near 0 then learns at the same pace
            # whatever the unit (days, percent); outputs are put back on the CSV's scale
            std = np.where(y.std(axis=0) > 0, y.std(axis=0), 1.0)
            return cls("regression", names, len(names), task.loss, y.mean(axis=0).tolist(), std.tolist())
        if task.kind == "multilabel":
            return cls("multilabel", names, len(names), "bce")
        if task.kind == "survival":
            t = np.array([r.target[0] for r in train])
            e = np.array([r.target[1] for r in train])
            cuts = time_bins(t, e, task.bins)
            return cls("survival", names, len(cuts) + 1, "nll", cuts=cuts)
        raise ValueError(f"no Objective for task {task.kind}")

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "names": self.names, "n_outputs": self.n_outputs, "loss_name": self.loss_name,
                "mean": self.mean, "std": self.std, "cuts": self.cuts}  # fmt: skip

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Objective:
        return cls(**state)

    def check_head(self, num_classes: int | None) -> None:
        """model.num_classes, when set, must be the task's head size (it follows from the task)."""
        if num_classes is not None and num_classes != self.n_outputs:
            raise ConfigError([f"model.num_classes is {num_classes} but task {self.kind} needs {self.n_outputs} "
                               f"outputs ({self.describe_head()}); leave model.num_classes unset"])  # fmt: skip

    def describe_head(self) -> str:
        if self.kind == "survival":
            return f"{self.n_outputs} time-bin hazards, cut at {', '.join(f'{c:g}' for c in self.cuts) or 'none'}"
        return ", ".join(self.names)

    # ---- per slide
    def target(self, record: SlideRecord) -> torch.Tensor:
        """(1, m) float: standardized values (regression), 0/1 labels, or (bin, event) for survival."""
        t = list(record.target)
        if self.kind == "regression":
            t = [(v - m) / s for v, m, s in zip(t, self.mean, self.std, strict=True)]
        elif self.kind == "survival":
            t = [float(bin_index(np.array([t[0]]), self.cuts)[0]), t[1]]
        return torch.tensor([t], dtype=torch.float32)

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits, target = logits.float(), target.float()
        if self.kind == "regression":
            return F.huber_loss(logits, target) if self.loss_name == "huber" else F.mse_loss(logits, target)
        if self.kind == "multilabel":
            return F.binary_cross_entropy_with_logits(logits, target)
        return survival_nll(logits, target[:, 0].long(), target[:, 1])

    def outputs(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, len(names)): values on the CSV's scale, label probabilities, or the survival risk."""
        logits = logits.float()
        if self.kind == "regression":
            mean = torch.tensor(self.mean, device=logits.device)
            std = torch.tensor(self.std, device=logits.device)
            return logits * std + mean
        if self.kind == "multilabel":
            return torch.sigmoid(logits)
        return risk_score(logits)[:, None]

    # ---- over slides (or patients)
    def metrics(self, targets: np.ndarray, outputs: np.ndarray) -> dict[str, float]:
        """targets (N, m) as in the CSV, outputs (N, len(names)) from ``outputs``."""
        y = np.asarray(targets, dtype=np.float64).reshape(len(targets), -1)
        p = np.asarray(outputs, dtype=np.float64).reshape(len(outputs), -1)
        if self.kind == "survival":
            return {"c_index": M.concordance_index(y[:, 0], y[:, 1], p[:, 0])}
        if self.kind == "multilabel":
            aucs = M.label_aucs(y, p)
            return {"macro_auc": M.macro_auc(aucs), **{f"auc_{n}": a for n, a in zip(self.names, aucs, strict=True)}}
        per = {n: (M.r2_score(y[:, j], p[:, j]), M.pearson(y[:, j], p[:, j]), M.spearman(y[:, j], p[:, j]))
               for j, n in enumerate(self.names)}  # fmt: skip
        out = {"r2": _mean([v[0] for v in per.values()]), "pearson": _mean([v[1] for v in per.values()]),
               "spearman": _mean([v[2] for v in per.values()])}  # fmt: skip
        if len(self.names) > 1:  # the means above are over the columns; each column's own figures too
            for n, (r2, pr, sp) in per.items():
                out.update({f"r2_{n}": r2, f"pearson_{n}": pr, f"spearman_{n}": sp})
        return out

    @property
    def selection(self) -> tuple[str, bool]:
        """(validation metric that picks best.pt, larger is better)."""
        return SELECTION[self.kind]


def _mean(values: list[float]) -> float:
    defined = [v for v in values if not math.isnan(v)]
    return float(np.mean(defined)) if defined else math.nan


def per_patient(
    patients: Sequence[str | None], targets: np.ndarray, outputs: np.ndarray
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(patient ids, targets, outputs) with each patient's slide outputs averaged (a slide without a patient is its
    own patient). A patient's targets agree on every slide (the CSV check refuses otherwise): the first is taken."""
    order: dict[str, list[int]] = {}
    for i, p in enumerate(patients):
        order.setdefault(p if p is not None else f"#slide{i}", []).append(i)
    ids = list(order)
    y = np.stack([np.asarray(targets)[rows[0]] for rows in order.values()])
    p = np.stack([np.asarray(outputs)[rows].mean(axis=0) for rows in order.values()])
    return ids, y, p
