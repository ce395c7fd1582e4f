"""Benchmark of the SFT engine on CPU (issue "SFT engine"): VGG-16, plain vs best checkpoint_sequential vs SFT.

    .venv/bin/python benchmarks/bench_sft.py [--sizes 512,1024,2048] [--runs 2] [--out bench_sft.json]

SFT's budget is 35% of plain PyTorch's measured peak at the same size (1 GiB at 2048 px and above, where
plain may not be run). Each configuration runs in its own process (wsitrain.bench's worker): one
warm-up step, then ``--runs`` timed training steps (forward, MSE loss, backward; batch 1, float32).
Plain PyTorch at a size whose planned peak exceeds this machine's free memory is predicted, not run.
Slow on 2 cores: the 2048 px row takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from wsitrain.bench.configs import BenchConfig, checkpoint_segment_counts
from wsitrain.bench.runner import Predictor, machine_free_bytes, run_worker
from wsitrain.units import format_bytes, parse_bytes

MODEL = "vgg16"
SFT_FRACTION = 0.35  # of plain PyTorch's peak
LARGE_SIZE = 2048  # from here on SFT gets a fixed budget
LARGE_BUDGET = "1GiB"
N_LAYERS = 32  # normalize + VGG-16's 31 feature layers: what checkpoint_sequential splits

PAGE = "docs/benchmarks/engine-cpu.md"  # where this script's figures are documented (named in --help)


def _row(size: int, strategy: str, r: dict[str, Any], budget: int | None, plain_ms: float | None) -> dict[str, Any]:
    peak = r.get("peak_bytes")
    return {
        "size": size,
        "strategy": strategy,
        "status": r["status"],
        "mean_ms": r.get("mean_ms"),
        "std_ms": r.get("std_ms"),
        "peak_bytes": peak,
        "planned_peak_bytes": r.get("planned_peak_bytes"),
        "budget_bytes": budget,
        "within_budget": None if budget is None or peak is None else peak <= budget,
        "ratio_to_plain": r["mean_ms"] / plain_ms if plain_ms and r.get("mean_ms") else None,
        "note": r.get("note", ""),
    }


def bench_size(size: int, runs: int, console: Console) -> list[dict[str, Any]]:
    free = machine_free_bytes("cpu")
    predictor = Predictor(MODEL, free, "cpu", "fp32")
    plain_cfg = BenchConfig(model=MODEL, size=size, strategy="base", runs=runs)
    planned_plain = predictor.planned_peak(plain_cfg)
    if planned_plain is not None and planned_plain > free:
        plain = {"status": "predicted_oom", "planned_peak_bytes": planned_plain, "note": "planned above free memory"}
    else:
        console.print(f"{size} px: plain PyTorch")
        plain = run_worker(plain_cfg)
    plain_ms = plain.get("mean_ms")
    rows = [_row(size, "plain", {**plain, "planned_peak_bytes": planned_plain}, None, None)]

    best: dict[str, Any] | None = None
    for s in checkpoint_segment_counts(N_LAYERS, "cpu"):
        console.print(f"{size} px: checkpoint_sequential, {s} segments")
        r = run_worker(BenchConfig(model=MODEL, size=size, strategy="checkpoint", segments=s, runs=runs))
        if r["status"] == "ok" and (best is None or r["mean_ms"] < best["mean_ms"]):
            best = {**r, "note": f"best of s = {checkpoint_segment_counts(N_LAYERS, 'cpu')}: s={s}"}
    rows.append(_row(size, "checkpoint (best)", best or {"status": "error", "note": "no run"}, None, plain_ms))

    if size >= LARGE_SIZE or not plain.get("peak_bytes"):
        budget = parse_bytes(LARGE_BUDGET)
    else:
        budget = int(SFT_FRACTION * plain["peak_bytes"])
    console.print(f"{size} px: SFT within {format_bytes(budget)}")
    r = run_worker(BenchConfig(model=MODEL, size=size, strategy="sft", budget_bytes=budget, runs=runs))
    if r["status"] == "oom" and r.get("peak_bytes"):
        r = {**r, "status": "ok", "note": "peak above the budget"}  # reported in "within budget?", not as OOM
    rows.append(_row(size, "SFT", r, budget, plain_ms))
    return rows


def render(rows: list[dict[str, Any]], console: Console) -> None:
    t = Table(title=f"SFT engine benchmark: {MODEL}, CPU, float32, batch 1")
    for col in ("size", "strategy", "time (mean ± std)", "peak", "budget", "within budget?", "time / plain", "note"):
        t.add_column(col, justify="left" if col in ("strategy", "note") else "right")
    for r in rows:
        if r["mean_ms"] is not None:
            time_text = f"{r['mean_ms'] / 1000:.2f} ± {r['std_ms'] / 1000:.2f} s"
        else:
            time_text = r["status"]
        peak = format_bytes(r["peak_bytes"]) if r["peak_bytes"] else f"planned {format_bytes(r['planned_peak_bytes'])}"
        within = "-" if r["within_budget"] is None else ("yes" if r["within_budget"] else "[red]no[/]")
        ratio = f"{r['ratio_to_plain']:.2f}x" if r["ratio_to_plain"] else "-"
        t.add_row(str(r["size"]), r["strategy"], time_text, peak, format_bytes(r["budget_bytes"]), within, ratio,
                  r["note"])  # fmt: skip
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="512,1024,2048", help="image edges, comma-separated")
    ap.add_argument("--runs", type=int, default=2, help="timed steps per configuration after 1 warm-up")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    console = Console(width=max(Console().width, 150))  # the table is wide; don't fold it into a pipe's 80
    rows: list[dict[str, Any]] = []
    for size in sorted({int(s) for s in args.sizes.split(",") if s.strip()}):
        rows.extend(bench_size(size, args.runs, console))
        render(rows, console)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
        console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
