"""Figures drawn only for the report (kept in memory as PNG bytes): plan memory by part, per-tile histograms."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from wsitrain.report.runlog import TileTimes  # noqa: E402
from wsitrain.units import format_bytes  # noqa: E402
from wsitrain.write_errors import named_write_errors  # noqa: E402

MiB = 1024**2


def save_png(fig: Any, path: Path, dpi: int = 100, *, tight: bool = False) -> Path:
    """Write ``fig`` to ``path`` as PNG and close it (pyplot keeps every open figure alive until then)."""
    if tight:
        fig.tight_layout()
    try:
        with named_write_errors(path, "the figure"):
            fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def plan_memory_figure(plan: dict[str, Any]) -> bytes:
    """Horizontal bars: the plan's memory breakdown by part, with its estimated peak, the budget and plain PyTorch."""
    parts = [(k, v) for k, v in (plan.get("breakdown") or {}).items() if v]
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * (len(parts) + 3) + 1.0), layout="constrained")
    labels = [k for k, _ in parts] + ["estimated peak", "budget", "plain PyTorch"]
    values = [v for _, v in parts] + [plan.get("estimated_peak_bytes") or 0, plan.get("budget_bytes") or 0,
                                      plan.get("baseline_peak_bytes") or 0]
    colors = ["tab:blue"] * len(parts) + ["tab:red", "tab:gray", "tab:orange"]
    ax.barh(range(len(values)), [v / MiB for v in values], color=colors)
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v / MiB, i, " " + format_bytes(v), va="center", fontsize=7)
    ax.set_xlabel("MiB")
    ax.set_xlim(0, max(values) / MiB * 1.3 if max(values) else 1)
    ax.set_title("memory by part (planner's estimate)", fontsize=10)
    return png_bytes(fig)


def tile_histograms(t: TileTimes, device: str) -> bytes:
    """Time per tile by phase, and peak memory (per tile, or per step when only summaries were logged)."""
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 3.4), layout="constrained")
    for phase, color in (("forward", "tab:blue"), ("backward", "tab:red")):
        ms = t.ms.get(phase) or []
        if ms:
            ax_t.hist(ms, bins=40, alpha=0.6, color=color, label=f"{phase} ({len(ms)})")
    ax_t.set_xlabel("ms per tile" if t.per_tile else "mean ms per tile, one value per step")
    ax_t.set_ylabel("tiles" if t.per_tile else "steps")
    ax_t.set_title("tile time", fontsize=10)
    ax_t.legend(fontsize=8)
    for ax in (ax_t, ax_m):
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
    colors = {"forward": "tab:blue", "backward": "tab:red", "step": "tab:purple"}
    for key, values in t.bytes.items():
        if values:
            ax_m.hist([v / MiB for v in values], bins=40, alpha=0.6, color=colors.get(key),
                      label=f"{key} ({len(values)})")
    where = "CUDA max allocated" if "cpu" not in device.lower() else "process peak RSS so far (CPU)"
    ax_m.set_xlabel(f"MiB, {where}")
    ax_m.set_title("peak memory" + (" per tile" if "forward" in t.bytes else " per step"), fontsize=10)
    if any(t.bytes.values()):
        ax_m.legend(fontsize=8)
    else:
        ax_m.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax_m.transAxes, color="gray")
    return png_bytes(fig)
