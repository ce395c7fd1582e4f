"""The SFT paper's Figure 8 protocol: VGG-16 training steps (forward, MSE loss, backward; batch 1, fp32) across
image sizes with plain PyTorch, ``checkpoint_sequential`` (every segment count, the best kept) and SFT, every
configuration capped (``set_per_process_memory_fraction``) in its own process, so an out-of-memory error ends only
that configuration (``wsitrain.bench``'s worker and runner). Recorded: time per step and per megapixel, measured
peak against planned peak, out-of-memory marks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from wsitrain.bench.configs import BenchConfig, checkpoint_segment_counts, sft_tiles
from wsitrain.bench.report import result_row
from wsitrain.bench.runner import Predictor, machine_free_bytes, run_worker
from wsitrain.models import build
from wsitrain.units import format_bytes

FIG8_SIZES = (2048, 4096, 8192, 10240, 12288, 16384, 20480)
SMOKE_SIZES = (64, 128)


def figure8_configs(
    model: str, sizes: list[int], cap: int, device: str, runs: int, segments: list[int] | None, tiles: bool
) -> list[BenchConfig]:
    """Per size: plain, checkpoint_sequential at each segment count, SFT with the planner's tiles (and forced)."""
    with torch.device("meta"):
        net = build(model, 2)
    n_layers = 1 + len(net.features)  # what checkpoint_sequential splits: normalize + the trunk's layers
    counts = segments or checkpoint_segment_counts(n_layers, device)
    common = dict(model=model, budget_bytes=cap, device=device, precision="fp32", runs=runs)
    out: list[BenchConfig] = []
    for size in sizes:
        out.append(BenchConfig(size=size, strategy="base", **common))
        out += [BenchConfig(size=size, strategy="checkpoint", segments=s, **common) for s in counts if s <= n_layers]
        out.append(BenchConfig(size=size, strategy="sft", **common))
        if tiles:
            out += [BenchConfig(size=size, strategy="sft", tile=t, **common) for t in sft_tiles(size, net.stride)]
    return out


def run_figure8(configs: list[BenchConfig], timeout_s: float, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Each configuration in its own process; a variant that ran out of memory is not retried at larger sizes."""
    if not configs:
        return []
    c0 = configs[0]
    predictor = Predictor(c0.model, c0.budget_bytes or 0, c0.device, c0.precision)
    free = machine_free_bytes(c0.device)
    oom_from: dict[str, int] = {}
    rows = []
    for i, cfg in enumerate(configs, 1):
        key = f"{cfg.strategy}:{cfg.variant}"
        planned = predictor.planned_peak(cfg)
        if key in oom_from and cfg.strategy != "sft":
            result = {"status": "oom", "note": f"not run: out of memory at {oom_from[key]} px already"}
        elif planned is not None and planned > free:
            result = {"status": "predicted_oom", "note": f"not run: planned {format_bytes(planned)} > free memory"}
        else:
            result = run_worker(cfg, timeout_s=timeout_s)
        if result["status"] == "oom":
            oom_from.setdefault(key, cfg.size)
        row = result_row(cfg, result, planned)
        mpix = cfg.size * cfg.size / 1e6
        row["ms_per_mpix"] = row["mean_ms"] / mpix if row["mean_ms"] is not None else None
        peak, plan = row["peak_bytes"], row["planned_peak_bytes"]
        row["measured_over_planned"] = peak / plan if peak and plan else None
        rows.append(row)
        timing = f", {row['mean_ms'] / 1000:.2f} s/step, peak {format_bytes(peak)}" if row["mean_ms"] else ""
        log(f"[{i}/{len(configs)}] {cfg.size} px {cfg.strategy} {cfg.variant}: {row['status']}{timing}")
    return rows


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.3f}"


def figure8_markdown(fig: dict[str, Any], model: str, cap: int, runs: int) -> list[str]:
    lines = [
        f"## Figure 8 protocol: {model}, cap {format_bytes(cap)} (set_per_process_memory_fraction on CUDA; emulated "
        f"on CPU), {runs} timed runs after 1 warm-up",
        "",
        "Best configuration per series and size. Peaks: measured = max_memory_allocated (CUDA) or RSS growth (CPU); "
        "planned = the plan the worker ran (for plain and checkpoint: the engine's model of them).",
        "",
        "| size | series | variant | status | s/step | ms/MPix | measured peak | planned peak | measured/planned |",
        "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    planner_only = {r["size"] for r in fig["best"] if r["series"] == "sft" and r["variant"] == "planner"}
    for r in fig["best"]:
        if r["series"] == "sft-planner" and r["size"] in planner_only:
            continue  # the same row as "sft" when no forced tile beat the planner's choice
        ratio = f"{r['measured_over_planned']:.2f}" if r.get("measured_over_planned") else "-"
        mpix = f"{r['ms_per_mpix']:.1f}" if r.get("ms_per_mpix") is not None else "-"
        status = {"oom": "**OOM**", "predicted_oom": "OOM (planned)"}.get(r["status"], r["status"])
        lines.append(
            f"| {r['size']} | {r['series']} | {r['variant']} | {status} | {_s(r['mean_ms'])} | {mpix} | "
            f"{format_bytes(r['peak_bytes'])} | {format_bytes(r['planned_peak_bytes'])} | {ratio} |"
        )
    return [*lines, "", f"All {len(fig['rows'])} configurations are in doctor.json; the plot is figure8.png.", ""]
