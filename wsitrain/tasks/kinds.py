"""The task vocabulary, defined once: what a run learns from its labels CSV.

Every other module (config, losses, metrics, fit, predict, report) takes its names from here, so a new task is
one entry here plus its loss and metrics.
"""

from __future__ import annotations

from typing import Literal

TaskKind = Literal["classification", "regression", "survival", "multilabel"]
TASKS: tuple[TaskKind, ...] = ("classification", "regression", "survival", "multilabel")

RegressionLoss = Literal["mse", "huber"]

# The validation metric that picks best.pt, and whether larger is better. Classification keeps the validation
# loss (what it has always used, so existing runs choose the same checkpoint); the others use the metric the task
# is judged by, because their losses are on scales (standardized targets, per-bin hazards) users do not read.
SELECTION: dict[TaskKind, tuple[str, bool]] = {
    "classification": ("loss", False),
    "regression": ("r2", True),
    "survival": ("c_index", True),
    "multilabel": ("macro_auc", True),
}

# Split column values (the CSV's `split`): test rows are never trained on nor used to choose the checkpoint.
TEST_SPLITS = ("test", "holdout")
