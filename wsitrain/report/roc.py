"""The validation set's ROC curve (roc.png), confusion matrix (confusion.png) and per-slide table (validation.json)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from wsitrain.report.figures import save_png  # noqa: E402
from wsitrain.report.runlog import VALIDATION  # noqa: E402
from wsitrain.train.metrics import binary_roc_auc  # noqa: E402
from wsitrain.train.runfolder import write_json  # noqa: E402

ROC = "roc.png"
CONFUSION = "confusion.png"


def roc_points(is_positive: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(false positive rate, true positive rate) at every distinct threshold, from (0, 0) to (1, 1).

    Tied scores move both rates in one step, so the trapezoid area under these points is the rank AUC.
    """
    y = np.asarray(is_positive).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return np.array([0.0, 1.0]), np.array([0.0, 1.0])
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last_of_run = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # index of the last slide at each threshold
    tp = np.cumsum(y)[last_of_run]
    fp = np.cumsum(~y)[last_of_run]
    return np.r_[0.0, fp / n_neg], np.r_[0.0, tp / n_pos]


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, n_classes: int) -> np.ndarray:
    """(K, K) counts: row = true class, column = predicted class."""
    cm = np.zeros((n_classes, n_classes), dtype=np.int64)
    np.add.at(cm, (np.asarray(y_true, dtype=np.int64), np.asarray(y_pred, dtype=np.int64)), 1)
    return cm


def write_validation_figures(
    run_dir: Path,
    y_true: Sequence[int] | np.ndarray,
    y_prob: np.ndarray,
    class_names: Sequence[str],
    slides: Sequence[str] | None = None,
    paths: Sequence[str] | None = None,
    on_tissue: Sequence[list[bool] | None] | None = None,
) -> tuple[Path, Path]:
    """roc.png (one-vs-rest per class; binary: the positive class), confusion.png, and validation.json with the
    per-slide probabilities (``slides`` ids and ``paths`` when given, for the report's table and heatmaps).
    ``on_tissue``: a max-pooling head's record, per slide and class, of whether the class was decided on the tissue
    (report.decision; None for a slide without a tissue mask)."""
    run_dir = Path(run_dir)
    y = np.asarray(y_true, dtype=np.int64)
    p = np.asarray(y_prob, dtype=np.float64).reshape(len(y), -1)
    names = [str(c) for c in class_names]
    if p.shape[1] != len(names):
        raise ValueError(f"y_prob has {p.shape[1]} columns but there are {len(names)} class names")
    pred = p.argmax(axis=1) if len(y) else np.zeros(0, dtype=np.int64)

    fig, ax = plt.subplots(figsize=(4.2, 3.9), layout="constrained")
    shown = [1] if len(names) == 2 else range(len(names))
    for k in shown:
        fpr, tpr = roc_points(y == k, p[:, k])
        auc = binary_roc_auc(y == k, p[:, k])
        ax.step(fpr, tpr, where="post", label=f"{names[k]} vs rest: AUC {auc:.3f}" if len(names) > 2
                else f"{names[k]}: AUC {auc:.3f}")
    ax.plot([0, 1], [0, 1], ":", color="gray", lw=1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(f"validation ROC ({len(y)} slides)")
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(-0.01, 1.01)
    ax.legend(loc="lower right", fontsize=8)
    roc = run_dir / ROC
    save_png(fig, roc)

    cm = confusion_matrix(y, pred, len(names))
    fig, ax = plt.subplots(figsize=(0.9 * len(names) + 2.6, 0.8 * len(names) + 2.2), layout="constrained")
    ax.imshow(cm, cmap="Blues", vmin=0, vmax=max(1, int(cm.max())))
    for i in range(len(names)):
        for j in range(len(names)):
            ax.text(j, i, str(cm[i, j]), ha="center", va="center",
                    color="white" if cm[i, j] > cm.max() / 2 else "black", fontsize=12)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title("validation confusion matrix")
    confusion = run_dir / CONFUSION
    save_png(fig, confusion)

    ids = list(slides) if slides is not None else [f"#{i}" for i in range(len(y))]
    write_json(run_dir / VALIDATION, {
        "classes": names,
        "slides": [
            {"slide": ids[i], "path": paths[i] if paths is not None else None, "label": names[int(y[i])],
             "predicted": names[int(pred[i])], "probs": {c: float(v) for c, v in zip(names, p[i], strict=True)},
             **({} if on_tissue is None else {"decided_on_tissue": None if on_tissue[i] is None else
                                              dict(zip(names, on_tissue[i], strict=True))})}  # fmt: skip
            for i in range(len(y))
        ],
    })
    return roc, confusion
