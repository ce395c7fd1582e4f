"""Pictures per task, for validation and for the held-out test set: Kaplan-Meier curves of the patients split at
the median predicted risk with the log-rank p-value (survival), predicted against true (regression), and a ROC
curve per label (multi-label). Read from task_validation.json and test.json, which fit writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from wsitrain.report.figures import save_png  # noqa: E402
from wsitrain.report.heatmap import SlideMaps  # noqa: E402
from wsitrain.report.roc import roc_points  # noqa: E402
from wsitrain.report.runlog import read_json  # noqa: E402
from wsitrain.tasks.metrics import kaplan_meier, label_aucs, logrank_test  # noqa: E402
from wsitrain.tasks.objective import per_patient  # noqa: E402
from wsitrain.tasks.survival import risk_score  # noqa: E402

# (file with the rows, title word) of each evaluated set
SETS = (("task_validation.json", "validation"), ("test.json", "test"))


def write_task_figures(run_dir: Path) -> list[Path]:
    """The pictures of every evaluated set in ``run_dir``; returns the files written."""
    written = []
    for name, what in SETS:
        data = read_json(Path(run_dir) / name)
        if not data or not data.get("slides") or data.get("task") == "classification":
            continue
        png = Path(run_dir) / f"{data['task']}_{what}.png"
        draw = {"survival": _km, "regression": _scatter, "multilabel": _rocs}.get(data["task"])
        if draw is not None:
            draw(data, what, png)
            written.append(png)
    return written


def _arrays(data: dict[str, Any]) -> tuple[list[str], np.ndarray, np.ndarray]:
    rows = data["slides"]
    y = np.array([r["target"] for r in rows], dtype=np.float64)
    out = np.array([r["outputs"] for r in rows], dtype=np.float64)
    return per_patient([r.get("patient") for r in rows], y, out)


def _km(data: dict[str, Any], what: str, png: Path) -> None:
    ids, y, risk = _arrays(data)
    t, e, r = y[:, 0], y[:, 1], risk[:, 0]
    high = r > np.median(r)  # above the median predicted risk; ties at the median go low
    chi2, p = logrank_test(t, e, high)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for mask, label, colour in ((~high, "low risk", "tab:blue"), (high, "high risk", "tab:red")):
        if mask.any():
            km = kaplan_meier(t[mask], e[mask])
            ax.step(np.r_[km.times, t[mask].max()], np.r_[km.survival, km.survival[-1]], where="post", color=colour,
                    label=f"{label} (n={int(mask.sum())}, {int(e[mask].sum())} events)")  # fmt: skip
            cens = mask & (e == 0)
            for tc in t[cens]:  # censoring ticks on the curve
                ax.plot(tc, km.survival[np.searchsorted(km.times, tc, side="right") - 1], "|", color=colour, ms=8)
    ptext = "n/a" if np.isnan(p) else f"{p:.3g}"
    ax.set(xlabel="time", ylabel="survival", ylim=(0, 1.05),
           title=f"{what}: Kaplan-Meier by median predicted risk\n{len(ids)} patients, log-rank p = {ptext}")
    ax.legend(loc="lower left", fontsize=8)
    save_png(fig, png, tight=True)


def _scatter(data: dict[str, Any], what: str, png: Path) -> None:
    ids, y, pred = _arrays(data)
    names = data.get("outputs") or [f"target {j}" for j in range(y.shape[1])]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4), squeeze=False)
    for j, (ax, n) in enumerate(zip(axes[0], names, strict=True)):
        ax.scatter(y[:, j], pred[:, j], s=18)
        lo, hi = float(min(y[:, j].min(), pred[:, j].min())), float(max(y[:, j].max(), pred[:, j].max()))
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = true")
        ax.set(xlabel=f"true {n}", ylabel=f"predicted {n}", title=f"{what}: {n} ({len(ids)} patients)")
        ax.legend(fontsize=8)
    save_png(fig, png, tight=True)


def _rocs(data: dict[str, Any], what: str, png: Path) -> None:
    ids, y, prob = _arrays(data)
    names = data.get("outputs") or [f"label {j}" for j in range(y.shape[1])]
    aucs = label_aucs(y, prob)
    fig, ax = plt.subplots(figsize=(5, 4.5))
    for j, n in enumerate(names):
        fpr, tpr = roc_points(y[:, j] > 0.5, prob[:, j])
        ax.plot(fpr, tpr, label=f"{n} (AUC {aucs[j]:.3f})")
    ax.plot([0, 1], [0, 1], "k:", lw=1)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=f"{what}: ROC per label "
           f"({len(ids)} patients)")  # fmt: skip
    ax.legend(loc="lower right", fontsize=8)
    save_png(fig, png, tight=True)


def risk_map(maps: SlideMaps) -> SlideMaps:
    """Survival's heatmap: the risk (bins minus expected bins survived) of each position's hazard logits, as if
    that position were the whole slide; the head's per-bin maps are the class activation maps it starts from."""
    k, h, w = maps.cam.shape
    risk = risk_score(maps.cam.float().permute(1, 2, 0).reshape(-1, k)).reshape(1, h, w)
    slide_risk = risk_score(maps.logits.float()[None, :])
    # keywords: every other map (attention, saliency) is kept as the head produced it
    return dataclasses.replace(maps, cam=risk.to(maps.cam.dtype), logits=slide_risk, probs=slide_risk, decisive=None)
