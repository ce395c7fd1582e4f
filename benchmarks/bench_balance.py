"""Balanced ranks on CPU: the share of rank-time spent waiting at the gradient all_reduce, round_robin against time.

    python benchmarks/bench_balance.py --out /tmp/bench-balance             # measured: 2 ranks (gloo), ~4 minutes
    python benchmarks/bench_balance.py --out /tmp/bench-balance --quick     # 16 slides, 2 epochs: a smoke run
    python benchmarks/bench_balance.py --simulate                           # the balancer alone, on drawn costs

Measured: a synthetic cohort (``write_synthetic_slide``) whose slide sides are drawn log-uniform in
[--min-size, --max-size] (2x in side: 4x in area), read with ``data.region: tissue`` (the tissue box, so the read
areas vary more than the slides do; the table gives their spread from the preflight). Two ranks (``mp.spawn``, gloo,
one torch thread and one read thread each, as the 2-core machine has two cores) train the tiny model for --epochs
epochs with ``distributed.balance`` round_robin, then time; the same seed, so both runs see the same epoch orders.
Per epoch: the waiting share the fit logs (metrics.jsonl "ranks" rows; ``wsitrain.train.balance.waiting``) and optimizer
steps per second (rank 0's step ends, first step of the epoch excluded). The first epoch plans every new shape
and warms up, so the summary row averages the later epochs. Also: the Pearson correlation of each slide's predicted
cost (``wsitrain.train.balance.cost``) with its measured forward + backward seconds on rank 0.

Simulated (--simulate): costs drawn uniform in [1, 4] (the 4x spread), every slide taking exactly its cost; the
waiting share of round_robin and of time with windows of 1 to 32 steps (``balance.WINDOW_STEPS``).

Writes bench_balance.jsonl (one row per run and epoch) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

PAGE = "docs/benchmarks/bench_balance.md"  # where this script's figures are documented (named in --help)


def write_cohort(folder: Path, n: int, min_size: int, max_size: int, seed: int) -> Path:
    """n slides with sides log-uniform in [min_size, max_size], all training slides; the CSV's path."""
    from wsitrain.slides.synth import write_synthetic_slide

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sides = np.exp(rng.uniform(np.log(min_size), np.log(max_size), size=(n, 2))).astype(int)
    rows = []
    for i, (h, w) in enumerate(sides):
        name = f"slide_{i:03d}_{h}x{w}.svs"
        if not (folder / name).is_file():
            write_synthetic_slide(folder / name, size=(int(h), int(w)), positive=bool(i % 2), seed=seed * 1000 + i)
        rows.append(f"{name},{'positive' if i % 2 else 'negative'}")
    labels = folder / "labels.csv"
    labels.write_text("slide,label\n" + "\n".join(rows) + "\n")
    return labels


def config(labels: Path, runs: Path, name: str, balance: str, epochs: int) -> dict[str, Any]:
    return {
        "name": name, "seed": 0,
        # prefetch off: a rank's read thread would take the other rank's core (2 ranks on 2 cores); reading is then
        # part of each rank's compute, and its time grows with the area too
        "data": {"labels": str(labels), "region": "tissue", "val_fraction": 0.0, "read_threads": 1,
                 "prefetch": False},
        "model": {"name": "tiny"},
        "engine": {"device": "cpu", "memory_budget": "2GiB"},
        "train": {"epochs": epochs, "optimizer": "sgd", "lr": 0.01, "schedule": "constant"},
        "distributed": {"backend": "gloo", "balance": balance},
        "log": {"dir": str(runs), "tiles": "off"},
    }  # fmt: skip


class StepClock:
    """Rank 0's wall-clock time at every optimizer step's end (epoch, step, seconds)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self, state: Any) -> None:
        if os.environ.get("RANK") == "0":
            with self.path.open("a") as f:
                f.write(json.dumps({"epoch": state.epoch, "t": time.perf_counter()}) + "\n")


def worker(rank: int, world: int, port: int, raw: dict[str, Any], clock: str) -> None:
    from rich.console import Console

    from wsitrain.config import WsiTrainConfig
    from wsitrain.train.fit import run_fit

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    run_fit(WsiTrainConfig.model_validate(raw), console=Console(file=io.StringIO()), quiet=True,
            callbacks=[StepClock(Path(clock))])  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(labels: Path, work: Path, balance: str, epochs: int, repeat: int) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    name = f"{balance}-{repeat}-{int(time.time())}"
    raw = config(labels, work / "runs", name, balance, epochs)
    clock = work / f"{name}.clock.jsonl"
    t0 = time.perf_counter()
    mp.spawn(worker, args=(2, free_port(), raw, str(clock)), nprocs=2, join=True)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (work / "runs" / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ticks = [json.loads(x) for x in clock.read_text().splitlines()]
    out = []
    for r in (r for r in rows if r.get("kind") == "ranks" and r.get("scope") == "epoch"):
        t = [x["t"] for x in ticks if x["epoch"] == r["epoch"] - 1]  # FitState.epoch counts finished epochs
        out.append({"balance": balance, "repeat": repeat, "epoch": r["epoch"], "steps": r["steps"],
                    "wait_share": r["wait_share"],
                    "steps_per_s": (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else None,
                    "compute_s": r["compute_s"], "slowest_s": r["slowest_s"], "run_wall_s": wall,
                    "run": str(work / "runs" / name), "loadavg_1min": os.getloadavg()[0]})  # fmt: skip
    return out


def cost_check(labels: Path, run: Path, epochs: int) -> dict[str, float]:
    """Predicted cost against measured forward + backward seconds of rank 0's slides (later epochs), the spread of
    the read areas the preflight found, and each mode's waiting share in epochs 2+ were every slide to take exactly
    its predicted cost (what the balancer can see; the measured share adds what it cannot)."""
    from wsitrain.config import WsiTrainConfig
    from wsitrain.preflight import run_preflight
    from wsitrain.slides.dataset import load_labels
    from wsitrain.train.balance.cost import slide_costs
    from wsitrain.train.balance.deal import Balance

    cfg = WsiTrainConfig.model_validate(config(labels, run, "check", "time", 1))  # the runs' data settings
    report = run_preflight(cfg, 2 * 2**30, "cpu")
    records, _ = load_labels(labels)
    costs, _ = slide_costs(report, records)
    cost_of = {r.slide_id: c for r, c in zip(records, costs, strict=True)}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    seen = [(cost_of[r["slide"]], r["forward_s"] + r["backward_s"]) for r in rows
            if r.get("kind") == "train" and r["epoch"] > 1]  # fmt: skip
    areas = [s.shape[0] * s.shape[1] for s in report.slides]
    c, m = np.array(seen).T
    predicted = {}
    for mode in ("round_robin", "time"):
        b = Balance(mode, 0, 2, 1, tuple(costs))
        steps = np.array([[costs[i] for i in pair] for e in range(1, epochs)
                          for pair in zip(*(b.rank_slides(len(costs), e, r) for r in range(2)), strict=True)])
        slowest = steps.max(axis=1)
        predicted[f"predicted_wait_share_{mode}"] = float((slowest[:, None] - steps).sum() / (2 * slowest.sum()))
    return {**predicted, "pearson_cost_vs_seconds": float(np.corrcoef(c, m)[0, 1]), "slides_timed": len(seen),
            "read_area_min_mpx": min(areas) / 1e6, "read_area_max_mpx": max(areas) / 1e6,
            "read_area_ratio": max(areas) / min(areas), "buckets": len(report.buckets)}  # fmt: skip


def simulate(n: int = 4096, seed: int = 0) -> list[dict[str, Any]]:
    from wsitrain.train.balance.deal import balanced, round_robin
    from wsitrain.train.data import epoch_order

    costs = np.random.default_rng(seed).uniform(1.0, 4.0, n).tolist()
    order = epoch_order(n, seed, 0)
    out = []
    for world, accumulate in ((2, 1), (4, 1), (2, 4)):
        plans = {"round_robin": round_robin(order, world)}
        for w in (1, 2, 4, 8, 16, 32):
            plans[f"time, window {w}"] = balanced(order, costs, world, accumulate, window_steps=w)
        for name, ranks in plans.items():
            per_rank = len(ranks[0])
            steps = np.array([[sum(costs[i] for i in r[s : s + accumulate]) for r in ranks]
                              for s in range(0, per_rank, accumulate)])  # fmt: skip
            slowest = steps.max(axis=1)
            share = float((slowest[:, None] - steps).sum() / (world * slowest.sum()))
            out.append({"world": world, "accumulate": accumulate, "balance": name, "wait_share": share})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-balance"), help="cohort, runs and the JSONL")
    ap.add_argument("--n", type=int, default=24, help="slides (all train)")
    ap.add_argument("--min-size", type=int, default=1024, help="smallest slide side, px")
    ap.add_argument("--max-size", type=int, default=2048, help="largest slide side, px (2x the side: 4x the area)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved (the machine is shared)")
    ap.add_argument("--quick", action="store_true", help="16 slides, 2 epochs, 1 repeat")
    ap.add_argument("--simulate", action="store_true", help="the balancer alone on drawn costs (no training)")
    args = ap.parse_args(argv)
    if args.simulate:
        print("| ranks | accumulate | balance | waiting share (simulated) |\n| --- | --- | --- | --- |")
        for r in simulate():
            print(f"| {r['world']} | {r['accumulate']} | {r['balance']} | {100 * r['wait_share']:.1f}% |")
        return 0
    if args.quick:
        args.n, args.epochs, args.repeats = 16, 2, 1
    labels = write_cohort(args.out / "cohort", args.n, args.min_size, args.max_size, seed=0)
    rows = []
    load0 = os.getloadavg()[0]
    for repeat in range(args.repeats):
        for balance in ("round_robin", "time"):
            rows += run_mode(labels, args.out, balance, args.epochs, repeat)
    check = cost_check(labels, Path(rows[-1]["run"]), args.epochs)
    with (args.out / "bench_balance.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write(json.dumps({"kind": "cost_check", **check}) + "\n")
    print(f"cohort: {args.n} slides, read areas {check['read_area_min_mpx']:.2f}-{check['read_area_max_mpx']:.2f} "
          f"Mpx ({check['read_area_ratio']:.1f}x), {check['buckets']} shape buckets; predicted cost vs measured "
          f"forward+backward s (rank 0, epochs 2+): Pearson r = {check['pearson_cost_vs_seconds']:.3f} over "
          f"{check['slides_timed']} slides; waiting share were every slide to take its predicted cost (simulated, "
          f"epochs 2+): round_robin {100 * check['predicted_wait_share_round_robin']:.1f}%, time "
          f"{100 * check['predicted_wait_share_time']:.1f}%")  # fmt: skip
    print(f"1-minute load average: {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (2 cores)")
    print("\n| balance | run | epoch | steps | waiting share (measured) | steps/s (measured) | rank compute s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        sps = "-" if r["steps_per_s"] is None else f"{r['steps_per_s']:.3f}"
        print(f"| {r['balance']} | {r['repeat'] + 1} | {r['epoch']} | {r['steps']} | {100 * r['wait_share']:.1f}% | "
              f"{sps} | {', '.join(f'{c:.1f}' for c in r['compute_s'])} |")
    for balance in ("round_robin", "time"):
        later = [r for r in rows if r["balance"] == balance and r["epoch"] > 1]
        if later:  # waiting: rank-seconds over rank-seconds, pooled over the epochs; steps/s: the median epoch
            share = sum(r["wait_share"] * r["slowest_s"] for r in later) / sum(r["slowest_s"] for r in later)
            sps = float(np.median([r["steps_per_s"] for r in later if r["steps_per_s"]]))
            print(f"| {balance} | all | 2-{args.epochs} | {sum(r['steps'] for r in later)} | {100 * share:.1f}% | "
                  f"{sps:.3f} (median) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
