"""bench.png: step time versus image size per strategy with out of memory marked (the SFT paper's
Figure 8), and a peak-memory panel with the budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

from wsitrain.units import format_bytes  # noqa: E402

OOM = ("oom", "predicted_oom")
STYLE = {
    "base": ("tab:gray", "o", "-", "plain PyTorch"),
    "checkpoint": ("tab:blue", "s", "-", "checkpoint_sequential (best s)"),
    "sft": ("tab:red", "D", "-", "SFT (best tile)"),
    "sft-planner": ("tab:orange", "^", "--", "SFT (planner's choice)"),
}


def _unit(max_bytes: float) -> tuple[str, float]:
    for name, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2)):
        if max_bytes >= scale:
            return name, float(scale)
    return "KiB", 1024.0


def plot_bench(path: Path, best: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    sizes = sorted({r["size"] for r in best})
    ok_times = [r["mean_ms"] / 1000 for r in best if r["status"] == "ok"]
    # Out-of-memory marks sit on a band above every measured time, one height per strategy so they don't overlap.
    top = max(ok_times) * 2.0 if ok_times else 1.0
    budget = meta.get("budget_bytes") or 0
    mem_values = [r.get("peak_bytes") or r.get("planned_peak_bytes") or 0 for r in best] + [budget]
    unit, scale = _unit(max(mem_values))
    for k, (name, (color, marker, ls, label)) in enumerate(STYLE.items()):
        rows = sorted((r for r in best if r["series"] == name), key=lambda r: r["size"])
        if not rows:
            continue
        ok = [r for r in rows if r["status"] == "ok"]
        ax_t.errorbar(
            [r["size"] for r in ok], [r["mean_ms"] / 1000 for r in ok], yerr=[r["std_ms"] / 1000 for r in ok],
            color=color, marker=marker, linestyle=ls, label=label, capsize=3,
        )  # fmt: skip
        oom = [r for r in rows if r["status"] in OOM]
        if oom:
            ax_t.scatter([r["size"] for r in oom], [top * 1.25**k] * len(oom), color=color, marker="x", s=70)
        ax_m.plot([r["size"] for r in ok], [r["peak_bytes"] / scale for r in ok], color=color, marker=marker,
                  linestyle=ls, label=label)  # fmt: skip
        ran_oom = [r for r in oom if r.get("peak_bytes")]  # ran, and needed more than the budget
        ax_m.scatter([r["size"] for r in ran_oom], [r["peak_bytes"] / scale for r in ran_oom], color=color,
                     marker="x", s=70)  # fmt: skip
        planned = [r for r in oom if not r.get("peak_bytes") and r.get("planned_peak_bytes")]
        ax_m.scatter([r["size"] for r in planned], [r["planned_peak_bytes"] / scale for r in planned],
                     facecolors="none", edgecolors=color, marker=marker, s=60)  # fmt: skip
    if any(r["status"] in OOM for r in best):
        ax_t.axhspan(top * 0.9, top * 1.25**4, color="0.92", zorder=0)
        ax_t.text(sizes[-1], top * 0.9, "x: out of memory ", ha="right", va="top", fontsize=8)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("image edge (px)")
        ax.grid(True, which="major", alpha=0.3)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 6, not 6 x 10^0
        ax.yaxis.set_minor_formatter(NullFormatter())
    if budget:
        ax_m.axhline(budget / scale, color="black", ls=":", lw=1, label=f"budget {format_bytes(budget)}")
    ax_t.set_ylabel("training step time (s)")
    ax_m.set_ylabel(f"peak memory ({unit})")
    ax_m.text(0.01, 0.99, "x: over the budget; hollow: planned, not run", transform=ax_m.transAxes, fontsize=8,
              va="top")  # fmt: skip
    ax_t.set_title("time per training step (mean ± std)")
    ax_m.set_title("peak memory")
    ax_t.legend(fontsize=8, loc="lower right")  # the out-of-memory band is at the top
    ax_m.legend(fontsize=8, loc="best")
    fig.suptitle(
        f"{meta.get('model')} on {meta.get('device_name')} ({meta.get('precision')}, batch 1, "
        f"{meta.get('runs')} runs after 1 warm-up)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
