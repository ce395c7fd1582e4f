"""Throughput on masked slides: background tiles computed once, zero-gradient tiles skipped, and read rates.

    python benchmarks/bench_throughput.py --out docs/benchmarks  # tiny 4096 + 8192, resnet18 2048 (~15 min)
    python benchmarks/bench_throughput.py --out /tmp/bt --quick       # tiny at 2048 px only: a smoke run (~20 s)
    python benchmarks/bench_throughput.py --out docs/benchmarks --models resnet18 --sizes 4096 --pools avg --runs 1 \
        --read-size 0
    python benchmarks/bench_throughput.py --out docs/benchmarks --plot-only  # the table and plot from the JSONL

A run with ``--models`` or ``--sizes`` replaces its own rows in ``--out``'s earlier results (and keeps their read
rows when ``--read-size 0``); ``--read-only`` keeps the step rows and measures the reads again. On this project's
2-core CPU, one step takes (one thread, without reuse): tiny 4096 px ~10 s, tiny 8192 px ~43 s, ResNet-18 2048 px
~31 s, ResNet-18 4096 px ~2 min; ResNet-18 at 8192 px (~8 min a step) is not in the default cases.

The image of each size is a synthetic *masked* slide, as ``data.mask_background`` makes them: a few ellipses of
tissue (H&E-like colour with pixel noise; the mask drawn on a 1/16 thumbnail, as tissue detection does) cover 30-50%
of the area (40% here), every other pixel is exactly the background colour (240, 240, 240). uint8, batch 1, float32,
BatchNorm frozen (``wsitrain.models.build``: ResNet-18 is torchvision's ``resnet18(weights=None)`` trunk).

Per case (model, size, pool), each variant runs one warm-up step, then ``--runs`` timed steps (forward,
cross-entropy, backward; no optimizer), the variants interleaved, in a fresh process per model and size:

- ``avg``: the model's global average pool. *Without* = ``SFT(reuse_tiles=False)``, *with* = ``reuse_tiles=True``.
- ``max``: the pool swapped for ``AdaptiveMaxPool2d(1)``, fused at the trunk end: tiles holding no maximum skip their
  recompute and backward with ``reuse_tiles=True``; ``reuse_tiles=False`` computes every tile.

The warm-up steps' logits and every parameter gradient with and without must be equal (``torch.equal``), or the
script stops: it never reports a speed-up of a different computation.

Tiling is forced (``TILING`` below): 256 px tiles, so 16 x 16 tiles at 4096 px and 32 x 32 at 8192 px. A tile
touching a map border is never reused, and the planner's own grids at these sizes and budgets are 2 x 2 to 4 x 4
tiles, under which almost no tile could be. The target per case, with the step split into tile time and the rest::

    step_with <= 1.15 * computed_fraction * tile_time_without + fixed

``tile_time_without``: the sum of the per-tile times (``last_stats`` forward_ms + backward_ms) without reuse;
``fixed = step_without - tile_time_without``: what no tile saving touches (cross-entropy and the head, autograd's
own work between segments, joining tiles into checkpoints, the plan cache hit); ``computed_fraction``: the share of
that tile time still computed, from the tile counts (forward tiles computed / all and backward tiles computed / all,
weighted by the forward and backward tile time without). The looser form ``1.15 * computed_fraction * step_without
+ fixed`` is reported too.

Threads: one intra-op thread (``--threads``). This machine's two cores are shared with other jobs, and with two
threads every parallel region waits for a thread the other job has descheduled: the same tiny 2048 px step took
117 s on two threads and 1.9 s on one while another process held a core.

Read throughput: ``benchmarks/bench_read.py``'s readers (wsitrain's OpenSlide and tifffile readers on 1 and 2 threads,
OpenSlide's one-call ``read_region``, pyvips when installed) on the masked slide of ``--read-size`` px written as a
JPEG-tiled TIFF, and on bench_read's tissue-everywhere slide of the same size, in this (the parent) process.

Writes ``bench_throughput.jsonl`` (one row per case and per reader), ``bench_throughput.md`` and
``bench_throughput.png``. Every figure is measured on the machine that runs it (torch version and ``nproc`` are in
every row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.models import build
from wsitrain.sft import SFT

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is no package: bench_read beside this file
import bench_read  # noqa: E402

BACKGROUND = (240, 240, 240)  # the background colour data.mask_background writes (uint8 RGB)
TARGET_FACTOR = 1.15
BUDGET = "4GiB"  # above every forced plan's peak (<= 1.6 GiB); plain PyTorch would need 2-31 GiB at these sizes

# model -> forced tiling (``tile_size`` in image px, ``checkpoints`` between the tiled segments): 256 px tiles, so
# 16 x 16 tiles at 4096 px and 32 x 32 at 8192 px. The tiny trunk is one tiled segment (halo 15 px) with the fused
# pool; ResNet-18 is cut after each stage (layer1-3) into four tiled segments (halos 21, 7, 7, 7 px of their
# inputs), +110% compute over plain (one segment over the whole trunk carries a 217 px halo: +220%).
TILING: dict[str, dict[str, Any]] = {
    "tiny": {"tile_size": 256, "checkpoints": []},
    "resnet18": {
        "tile_size": 256,
        "checkpoints": ["features.layer1.1.relu", "features.layer2.1.relu", "features.layer3.1.relu"],
    },
}
DEFAULT_CASES = (("tiny", 4096), ("tiny", 8192), ("resnet18", 2048))
QUICK_TILE = 128  # --quick: 16 x 16 tiles at 2048 px

PAGE = "docs/benchmarks/bench_throughput.md"  # where this script's figures are documented (named in --help)


# ---- the synthetic masked slide ---------------------------------------------------------------------------------
def masked_slide(size: int, seed: int = 0, tissue: tuple[float, float] = (0.3, 0.5)) -> tuple[np.ndarray, float]:
    """(H, W, 3) uint8 with ellipses of textured tissue over ``tissue`` of the area, the rest exactly BACKGROUND.

    The mask is drawn on a 1/16 thumbnail and scaled up (tissue detection works on a thumbnail too), so its edges
    are steps of 16 px; the tissue is an H&E-like mix of pink and purple with a smooth field and pixel noise."""
    rng = np.random.default_rng(seed)
    thumb = max(size // 16, 8)
    yy, xx = np.ogrid[0:thumb, 0:thumb]
    yy, xx = (yy + 0.5) / thumb, (xx + 0.5) / thumb
    mask = np.zeros((thumb, thumb), dtype=bool)
    while mask.mean() < (tissue[0] + tissue[1]) / 2:
        cy, cx = rng.uniform(0.25, 0.75, 2)
        ay, ax = rng.uniform(0.1, 0.25, 2)
        blob = ((yy - cy) / ay) ** 2 + ((xx - cx) / ax) ** 2 <= 1
        if (mask | blob).mean() <= tissue[1]:
            mask |= blob
    full = np.repeat(np.repeat(mask, 16, 0), 16, 1)[:size, :size]
    if full.shape != (size, size):
        full = np.pad(full, ((0, size - full.shape[0]), (0, size - full.shape[1])))
    gen = torch.Generator().manual_seed(seed)
    field = F.interpolate(torch.rand(1, 1, 32, 32, generator=gen), size=(size, size), mode="bilinear")[0, 0]
    pink, purple = torch.tensor([225.0, 150.0, 195.0]), torch.tensor([120.0, 75.0, 160.0])
    img = torch.empty((size, size, 3), dtype=torch.uint8)
    for c in range(3):
        band = pink[c] + (purple[c] - pink[c]) * field + torch.randn(size, size, generator=gen) * 18
        img[..., c] = band.clamp_(0, 255).to(torch.uint8)
    out = img.numpy()
    out[~full] = BACKGROUND
    return out, float(full.mean())


# ---- one case ---------------------------------------------------------------------------------------------------
def make_model(name: str, pool: str) -> nn.Sequential:
    """``wsitrain.models.build(name, 2)`` (BatchNorm frozen, seed 0); ``pool="max"`` swaps in AdaptiveMaxPool2d(1)."""
    torch.manual_seed(0)
    model = build(name, 2)
    if pool == "max":
        assert isinstance(model.pool, nn.AdaptiveAvgPool2d)
        model.pool = nn.AdaptiveMaxPool2d(1)
    return model


def step(net: SFT, x: torch.Tensor, target: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One training step without optimizer; returns its seconds and the logits."""
    net.model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = net(x)
    F.cross_entropy(out, target).backward()
    return time.perf_counter() - t0, out.detach()


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def grid_text(net: SFT, x: torch.Tensor) -> str:
    plan = net.plan_for(tuple(x.shape), input_dtype=x.dtype)
    grids = [f"{'x'.join(map(str, s.regions.grid))}" if s.regions is not None else "plain" for s in plan.segments]
    return f"{len(grids)} x {grids[0]}" if len(set(grids)) == 1 and len(grids) > 1 else " + ".join(grids)


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def bench_case(name: str, size: int, pool: str, x: torch.Tensor, tissue: float, runs: int, tile: int | None) -> dict:
    """Without and with, each one warm-up step (planning, first touch of memory; their logits and gradients are
    compared), then ``runs`` timed steps of each, interleaved so that a drift of the machine hits both alike."""
    tiling = dict(TILING[name])
    if tile is not None:
        tiling["tile_size"] = tile
    model = make_model(name, pool)
    target = torch.tensor([1])
    # one pass off (execution/one_pass.py): this measures reuse in the forward sweep and in the recompute, the path
    # docs/benchmarks/bench_throughput.md was measured on; one pass reuses background tiles within its single sweep
    # (tests/test_sft_one_pass.py)
    nets = {False: SFT(model, memory_budget=BUDGET, reuse_tiles=False, one_pass=False, **tiling),
            True: SFT(model, memory_budget=BUDGET, reuse_tiles=True, one_pass=False, **tiling)}  # fmt: skip

    logits, grads = {}, {}
    for reuse, net in nets.items():
        _, logits[reuse] = step(net, x, target)
        grads[reuse] = grads_of(model)
    equal = torch.equal(logits[False], logits[True]) and all(
        torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True)
    )
    if not equal:
        raise SystemExit(f"{name} {size} px {pool}: the step with tile reuse differs from the step without")
    secs: dict[bool, list[float]] = {False: [], True: []}
    stats: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(runs):
        for reuse, net in nets.items():
            s, _ = step(net, x, target)
            secs[reuse].append(s)
            stats[reuse].append(net.last_stats.summary())
    s0, s1 = stats[False][-1], stats[True][-1]  # counts are the same every step; times are averaged below
    step0, step1 = statistics.mean(secs[False]), statistics.mean(secs[True])
    fwd0 = statistics.mean(s["forward_ms"] for s in stats[False]) / 1000
    bwd0 = statistics.mean(s["backward_ms"] for s in stats[False]) / 1000
    fixed = step0 - fwd0 - bwd0
    fwd_computed = 1 - s1["tiles_reused_forward"] / s1["tiles_forward"]
    bwd_done = s1["tiles_reused_backward"] + s1["tiles_skipped_backward"]
    # a last segment in one pass (execution/one_pass.py) back-propagates its tiles in forward: none in backward
    bwd_computed = 1 - bwd_done / s1["tiles_backward"] if s1["tiles_backward"] else fwd_computed
    computed = (fwd_computed * fwd0 + bwd_computed * bwd0) / (fwd0 + bwd0)
    bound = TARGET_FACTOR * computed * (fwd0 + bwd0) + fixed
    bound_as_stated = TARGET_FACTOR * computed * step0 + fixed
    return {
        "kind": "step",
        "case": f"{name} {size} px, {pool} pool",
        "model": name,
        "size": size,
        "pool": pool,
        "tile_size": tiling["tile_size"],
        "checkpoints": tiling["checkpoints"],
        "grids": grid_text(nets[True], x),
        "budget": BUDGET,
        "runs": runs,
        "tissue_pixel_fraction": round(tissue, 4),
        "tiles_forward": s1["tiles_forward"],
        "tiles_backward": s1["tiles_backward"],
        "tiles_reused_forward": s1["tiles_reused_forward"],
        "tiles_reused_backward": s1["tiles_reused_backward"],
        "tiles_skipped_backward": s1["tiles_skipped_backward"],
        "tiles_skipped_backward_without": s0["tiles_skipped_backward"],
        "reused_forward_fraction": round(s1["tiles_reused_forward"] / s1["tiles_forward"], 4),
        # None without backward tiles: a last segment in one pass back-propagates its tiles in forward
        "reused_backward_fraction": _share(s1["tiles_reused_backward"], s1["tiles_backward"]),
        "skipped_backward_fraction": _share(s1["tiles_skipped_backward"], s1["tiles_backward"]),
        "step_s_without": [round(s, 3) for s in secs[False]],
        "step_s_with": [round(s, 3) for s in secs[True]],
        "mean_step_s_without": round(step0, 3),
        "mean_step_s_with": round(step1, 3),
        "speedup": round(step0 / step1, 3),
        "tile_s_without": round(fwd0 + bwd0, 3),
        "tile_s_with": round(statistics.mean(s["forward_ms"] + s["backward_ms"] for s in stats[True]) / 1000, 3),
        "fixed_s": round(fixed, 3),
        "computed_fraction": round(computed, 4),
        "target_s": round(bound, 3),
        "target_holds": step1 <= bound,
        "target_as_stated_s": round(bound_as_stated, 3),
        "target_as_stated_holds": step1 <= bound_as_stated,
        "equal_with_without": equal,
        "stats_without": stats[False],
        "stats_with": stats[True],
        **machine(),
    }


def worker(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One model and size, every pool asked for, in this process (``--worker``)."""
    torch.set_num_threads(spec["threads"])
    img, tissue = masked_slide(spec["size"])
    x = torch.from_numpy(img).permute(2, 0, 1).unsqueeze(0).contiguous()  # (1, 3, H, W) uint8
    del img
    return [
        bench_case(spec["model"], spec["size"], pool, x, tissue, spec["runs"], spec["tile"]) for pool in spec["pools"]
    ]


def run_worker(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """``worker(spec)`` in a fresh process (as wsitrain fit runs: the engine tunes glibc's allocator at its first
    step), so that no case inherits another's heap or threads."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise SystemExit(f"worker {spec} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def machine() -> dict[str, Any]:
    return {
        "measured_on": f"CPU, {os.cpu_count()} cores (nproc {len(os.sched_getaffinity(0))}), no GPU",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "nproc": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.date.today().isoformat(),
    }


# ---- read throughput --------------------------------------------------------------------------------------------
def read_rows(size: int, runs: int, tmp: Path, img: np.ndarray | None) -> list[dict[str, Any]]:
    """bench_read's readers on the masked slide (``img``) and on bench_read's own tissue-everywhere slide."""
    rows: list[dict[str, Any]] = []
    slides = [("masked", img), ("tissue everywhere", None)]
    for label, pixels in slides:
        path = tmp / f"{label.replace(' ', '-')}-{size}.tif"
        if pixels is None:
            bench_read.write_synthetic(path, size, "jpeg")
        else:
            bench_read.write_tiff(path, pixels, "jpeg")
        for r in bench_read.measure(path, [1, 2], runs, 1024):
            rows.append({"kind": "read", "slide": label, "size": size, "file_mb": path.stat().st_size / 1e6, **r})
        path.unlink()
    return [{**r, **machine()} for r in rows]


# ---- output -----------------------------------------------------------------------------------------------------
def header(rows: list[dict[str, Any]]) -> str:
    m = next((r for r in rows if r["kind"] == "step"), rows[0])
    threads = f"{m['torch_threads']} intra-op thread" + ("s" if m["torch_threads"] != 1 else "")
    return (
        f"Measured on this project's {m['nproc']}-core CPU machine (nproc {m['nproc']}, no GPU), torch {m['torch']}, "
        f"{threads}, float32, batch 1, {m['date']}. The machine is shared with other jobs: steps run on one "
        "thread (with two, a step took 60x longer while another process held a core), and the figures carry "
        "about +-15% noise."
    )


def markdown(rows: list[dict[str, Any]]) -> str:
    steps = [r for r in rows if r["kind"] == "step"]
    reads = [r for r in rows if r["kind"] == "read"]
    lines = [
        "# Throughput: background reuse and zero-gradient skipping (measured)",
        "",
        header(rows),
        "",
        "Produced by " + ", then ".join(f"`{c}`" for c in dict.fromkeys(r.get("command", "?") for r in rows)),
        "",
    ]
    if steps:
        lines += [
            "Image: a synthetic masked slide, uint8, ellipses of textured tissue, every other pixel exactly "
            f"{BACKGROUND}. Tiling forced: 256 px tiles (tiny: one tiled segment over the trunk; ResNet-18: four, cut "
            "after layer1, layer2 and layer3), budget 4 GiB; ResNet-18 is torchvision's with random weights and frozen "
            "BatchNorm. Steps: forward, cross-entropy, backward (no optimizer); mean of the timed steps (the JSONL "
            "has each) after one warm-up per variant, the variants interleaved. "
            "*without* = `reuse_tiles=False` (max pool: and the zero-gradient skip off); *with* = `reuse_tiles=True`. "
            "Tiles reused/skipped: of the with-step's forward / backward tiles. "
            "Target: step with <= 1.15 x computed fraction x tile time without + fixed (fixed = step without - its "
            "per-tile times: loss and head, autograd between segments, joining tiles); the looser form "
            "(1.15 x computed fraction x step without + fixed) after the slash. "
            "Equal: logits and every parameter gradient `torch.equal` with and without.",
            "",
            "| case | tiles (grid) | tissue (pixels) | tiles reused fwd / bwd | tiles skipped bwd | step s without "
            "| step s with | speed-up | fixed s | computed fraction | target s | target holds? | equal |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in steps:
            tf, tb = r["tiles_forward"], r["tiles_backward"]
            lines.append(
                f"| {r['case']} | {r['grids']} | {100 * r['tissue_pixel_fraction']:.0f}% | "
                f"{r['tiles_reused_forward']}/{tf} ({100 * r['reused_forward_fraction']:.0f}%) / "
                f"{r['tiles_reused_backward']}/{tb} ({_pct(r['reused_backward_fraction'])}) | "
                f"{r['tiles_skipped_backward']}/{tb} ({_pct(r['skipped_backward_fraction'])}) | "
                f"{r['mean_step_s_without']:.2f} | {r['mean_step_s_with']:.2f} | {r['speedup']:.2f}x | "
                f"{r['fixed_s']:.2f} | {r['computed_fraction']:.2f} | {r['target_s']:.2f} | "
                f"{'yes' if r['target_holds'] else 'NO'} / {'yes' if r['target_as_stated_holds'] else 'NO'} | "
                f"{'yes' if r['equal_with_without'] else 'NO'} |"
            )
        lines.append("")
    if reads:
        lines += [
            f"Read throughput ({reads[0]['size']} px JPEG-tiled TIFF in the page cache, `benchmarks/bench_read.py`'s "
            "readers; best and median of the timed reads after a warm-up; speed-up over 1 thread; bytes equal: "
            "the same pixels as wsitrain's OpenSlide reader):",
            "",
            "| slide | reader | threads | Mpx/s best | Mpx/s median | speed-up | bytes equal |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in reads:
            if "error" in r:
                lines.append(f"| {r['slide']} | {r['reader']} | - | - | - | - | {r['error']} |")
                continue
            same = {None: "(reference)", True: "yes", False: "NO"}[r.get("bytes_equal_first")]
            reader = r["reader"] + (f" ({r['version']})" if "version" in r else "")
            lines.append(
                f"| {r['slide']} | {reader} | {r['threads']} | {r['mpx_per_s_best']:.1f} | "
                f"{r['mpx_per_s_median']:.1f} | {r['speedup']:.2f}x | {same} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    steps = [r for r in rows if r["kind"] == "step"]
    if not steps:
        return
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 2.4 * len(steps) + 3), 5), width_ratios=(3, 2))
    labels = [f"{r['model']} {r['size']}\n{r['pool']} pool" for r in steps]
    ax = axes[0]
    xs = np.arange(len(steps))
    ax.bar(xs - 0.2, [r["mean_step_s_without"] for r in steps], 0.4, label="without (every tile computed)")
    ax.bar(xs + 0.2, [r["mean_step_s_with"] for r in steps], 0.4, label="with reuse / skip")
    ax.scatter(xs + 0.2, [r["target_s"] for r in steps], marker="_", s=400, color="k", zorder=3, label="target")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set(ylabel="s per training step", title="step time (measured)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar(xs - 0.27, [100 * r["tissue_pixel_fraction"] for r in steps], 0.27, label="tissue (pixels)")
    ax.bar(xs, [100 * r["reused_forward_fraction"] for r in steps], 0.27, label="fwd tiles reused")
    skipped = [100 * ((r["reused_backward_fraction"] or 0) + (r["skipped_backward_fraction"] or 0)) for r in steps]
    ax.bar(xs + 0.27, skipped, 0.27, label="bwd tiles reused or skipped")
    ax.set_xticks(xs, labels, fontsize=7, rotation=45, ha="right", rotation_mode="anchor")
    ax.set(ylabel="%", ylim=(0, 105), title="tissue and tiles saved (with)")
    ax.legend(fontsize=7)
    m = steps[0]
    threads = f"{m['torch_threads']} intra-op thread" + ("s" if m["torch_threads"] != 1 else "")
    fig.suptitle(f"measured on a {m['nproc']}-core CPU (nproc {m['nproc']}, no GPU), {threads}, torch {m['torch']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "bench_throughput.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / "bench_throughput.md").write_text(markdown(rows))
    plot(rows, out / "bench_throughput.png")


# ---- main -------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, help="folder for bench_throughput.{jsonl,md,png}")
    ap.add_argument(
        "--quick", action="store_true", help=f"tiny at 2048 px ({QUICK_TILE} px tiles), 1 run, 1024 px read"
    )
    ap.add_argument("--models", default=None, help="comma-separated subset of: " + ", ".join(TILING))
    ap.add_argument("--sizes", default=None, help="comma-separated image edges (default: the cases above)")
    ap.add_argument("--pools", default="avg,max", help="avg, max or both")
    ap.add_argument("--runs", type=int, default=2, help="timed steps per variant after one warm-up")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the module doc)")
    ap.add_argument("--read-size", type=int, default=8192, help="edge of the slides read (0: no read benchmark)")
    ap.add_argument("--read-runs", type=int, default=3)
    ap.add_argument("--read-only", action="store_true", help="only the read benchmark (keeps --out's step rows)")
    ap.add_argument("--plot-only", action="store_true", help="rewrite the table and plot from --out's JSONL")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        for row in worker(json.loads(args.worker)):
            print(json.dumps(row), flush=True)
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.plot_only:
        text = (args.out / "bench_throughput.jsonl").read_text()
        write([json.loads(line) for line in text.splitlines() if line.strip()], args.out)
        return 0
    command = "python benchmarks/bench_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    tile = None
    if args.quick:
        cases: list[tuple[str, int]] = [("tiny", 2048)]
        tile, args.runs, args.read_size, args.read_runs = QUICK_TILE, 1, 1024, 1
    else:
        names = args.models.split(",") if args.models else list(TILING)
        sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else None
        cases = [(n, s) for n in names for s in sizes] if sizes else [c for c in DEFAULT_CASES if c[0] in names]
        cases = [] if args.read_only else cases
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for name, size in cases:
        t0 = time.perf_counter()
        spec = {"model": name, "size": size, "pools": args.pools.split(","), "runs": args.runs, "tile": tile,
                "threads": args.threads}  # fmt: skip
        for r in run_worker(spec):
            rows.append(r)
            print(
                f"{r['case']} ({r['grids']} tiles): tissue {100 * r['tissue_pixel_fraction']:.0f}%, reused fwd "
                f"{r['tiles_reused_forward']}/{r['tiles_forward']} bwd {r['tiles_reused_backward']}/"
                f"{r['tiles_backward']}, skipped bwd {r['tiles_skipped_backward']}; step {r['mean_step_s_without']:.2f}"
                f" s -> {r['mean_step_s_with']:.2f} s ({r['speedup']:.2f}x), target {r['target_s']:.2f} s: "
                f"{'holds' if r['target_holds'] else 'MISSED'}; equal: {r['equal_with_without']}",
                flush=True,
            )
        print(f"  ({time.perf_counter() - t0:.0f} s with the worker's start and image)", flush=True)
    if args.read_size:
        with tempfile.TemporaryDirectory() as tmp:
            reads = read_rows(args.read_size, args.read_runs, Path(tmp), masked_slide(args.read_size)[0])
        rows.extend(reads)
        for r in reads:
            print(json.dumps({k: r[k] for k in ("slide", "reader", "threads", "mpx_per_s_best", "error") if k in r}))
    rows = [{**r, "command": command} for r in rows]
    path = args.out / "bench_throughput.jsonl"
    if (args.models or args.sizes or args.read_only) and path.exists():  # a partial run: replace its own rows
        done = {(r["model"], r["size"], r["pool"]) for r in rows if r["kind"] == "step"}
        old = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        keep = [r for r in old if r["kind"] == "step" and (r["model"], r["size"], r["pool"]) not in done]
        keep_reads = [r for r in old if r["kind"] == "read"] if not args.read_size else []
        rows = keep + [r for r in rows if r["kind"] == "step"] + keep_reads + [r for r in rows if r["kind"] == "read"]
    write(rows, args.out)
    print(f"wrote {args.out}/bench_throughput.{{jsonl,md,png}} in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
