"""Benchmark results: one row per configuration, the best per strategy, and bench.csv / .json / .png."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from wsitrain.bench.configs import BenchConfig

CSV_FIELDS = (
    "size", "strategy", "variant", "status", "mean_ms", "std_ms", "min_ms", "runs", "peak_bytes",
    "planned_peak_bytes", "budget_bytes", "within_budget", "note", "simulated_ms", "host_ms_per_step",
    "launches_per_step", "syncs_per_step",
)  # fmt: skip


def result_row(cfg: BenchConfig, result: dict[str, Any], planned: int | None) -> dict[str, Any]:
    """Flatten a worker result (or a not-run marker) into one row."""
    times = result.get("times_ms") or []
    peak = result.get("peak_bytes")
    planned_here = result.get("planned_peak_bytes") or planned
    return {
        "size": cfg.size,
        "strategy": cfg.strategy,
        "variant": cfg.variant,
        "segments": cfg.segments,
        "tile": cfg.tile,
        "status": result["status"],
        "mean_ms": result.get("mean_ms"),
        "std_ms": result.get("std_ms"),
        "min_ms": min(times) if times else None,
        "runs": len(times),
        "times_ms": times,
        "peak_bytes": peak,
        "peaks_bytes": result.get("peaks_bytes") or [],
        "planned_peak_bytes": planned_here,
        "budget_bytes": cfg.budget_bytes,
        "within_budget": None if peak is None or not cfg.budget_bytes else peak <= cfg.budget_bytes,
        "note": result.get("note", ""),
        "sft_stats": result.get("sft_stats"),
        "plan": result.get("plan"),  # the plan the worker ran (SFT only), whose peak is planned_peak_bytes
        "traceback": result.get("traceback"),
    }


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and series, the fastest successful row (series: base, checkpoint, sft, sft-planner).

    A series with no successful row at a size gets its out-of-memory row instead, so plots can mark it.
    """
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        names = [r["strategy"]] + (["sft-planner"] if r["strategy"] == "sft" and r["variant"] == "planner" else [])
        for name in names:
            series.setdefault((name, r["size"]), []).append(r)
    out = []
    for (name, size), group in sorted(series.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in group if r["status"] == "ok"]
        pick = min(ok, key=lambda r: r["mean_ms"]) if ok else group[0]
        out.append({**pick, "series": name, "size": size})
    return out


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def write_outputs(out_dir: Path, rows: list[dict[str, Any]], meta: dict[str, Any], plot: bool = True) -> list[Path]:
    """bench.csv (every configuration), bench.json (meta, every row, the best per series), bench.png (``plot``:
    not for a simulated-only run, which measured nothing to plot)."""
    from wsitrain.bench.plot import plot_bench  # matplotlib import is slow; only here

    csv_path, json_path, png_path = out_dir / "bench.csv", out_dir / "bench.json", out_dir / "bench.png"
    write_csv(csv_path, rows)
    best = best_rows(rows)
    json_path.write_text(json.dumps({"meta": meta, "results": rows, "best": best}, indent=1, default=str))
    if not plot:
        return [csv_path, json_path]
    plot_bench(png_path, best, meta)
    return [csv_path, json_path, png_path]
