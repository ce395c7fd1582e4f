"""curves.png: training and validation loss, accuracy, balanced accuracy, ROC AUC and learning rate per epoch."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from wsitrain.report.figures import save_png  # noqa: E402
from wsitrain.report.runlog import epoch_curves  # noqa: E402

CURVES = "curves.png"
_TITLES = {"loss": "loss", "accuracy": "accuracy", "balanced_accuracy": "balanced accuracy", "roc_auc": "ROC AUC",
           "c_index": "c-index", "patient_c_index": "c-index per patient", "r2": "R²", "pearson": "Pearson r",
           "spearman": "Spearman ρ", "macro_auc": "macro AUC", "patient_macro_auc": "macro AUC per patient"}


def write_curves(run_dir: Path) -> Path:
    """Draw ``run_dir/curves.png`` from ``run_dir/metrics.jsonl`` (rewritten at every call; empty panels say so)."""
    run_dir = Path(run_dir)
    c = epoch_curves(run_dir)
    keys = list(c.val) or list(_TITLES)[:4]  # classification: its four metrics; a task: its own (runlog)
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(3.8 * (len(keys) + 1), 3.6), layout="constrained")
    for ax, key in zip(axes[:-1], keys, strict=True):
        drew = False
        for series, style, label, color in ((c.train, "o-", "training", "tab:blue"),
                                            (c.val, "s-", "validation", "tab:orange")):
            ys = series.get(key, [])
            pts = [(e, y) for e, y in zip(c.epochs, ys, strict=False) if not math.isnan(y)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, ms=4, color=color)
                drew = True
        if key != "loss" and c.epochs and not c.train_has_probs and key in list(_TITLES)[:4]:
            ax.text(0.02, 0.02, "no training curve: train rows carry no probabilities", fontsize=7, color="gray",
                    transform=ax.transAxes)
        ax.set_title(_TITLES[key])
        ax.set_xlabel("epoch")
        if key != "loss" and key not in ("r2", "pearson", "spearman"):  # R^2 and correlations can go below 0
            ax.set_ylim(-0.02, 1.02)
        if drew:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged yet", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax = axes[-1]
    if c.lr_steps:
        ax.plot([s[0] for s in c.lr_steps], [s[1] for s in c.lr_steps], "-", color="tab:purple")
    else:
        ax.text(0.5, 0.5, "not logged yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_title("learning rate (per step)")
    ax.set_xlabel("epoch")
    ax.grid(alpha=0.3)
    return save_png(fig, run_dir / CURVES)
