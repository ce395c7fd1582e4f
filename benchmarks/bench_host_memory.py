"""Host memory of a fit on CPU, whole-image against streamed tiles (data.stream_tiles): peak process RSS and step time.

    python benchmarks/bench_host_memory.py --out bench-host-memory                 # two 16,384 px slides (issue 34)
    python benchmarks/bench_host_memory.py --size 2048 --out /tmp/bhm              # a quick smoke run

Writes two synthetic slides of ``--size`` px, then runs ``wsitrain fit`` (tiny, one epoch, read threads on) once
per configuration, each in a fresh process under ``/usr/bin/time -v``, in this order: the whole-image path at the
small budget (today it is refused by the preflight: its message is recorded), then the whole-image path at the
larger budget and the streamed path at the small and at the larger budget, back to back. Per run: the peak RSS
(``Maximum resident set size``, the whole process tree), the wall time, and from the run's metrics.jsonl every
step's seconds and the fit's own peak meter. Rows are appended to ``host_memory.jsonl`` as each run ends, and
``host_memory.md`` holds the table. Long runs: set OMP_NUM_THREADS=1 (one torch thread), as the numbers in
docs/benchmarks/host_memory.md were measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# (label, stream_tiles, budget key): the small budget is where the streamed target is set (issue 34), the large
# one is where the whole-image path runs today
RUNS = (("whole", False, "small"), ("whole", False, "large"), ("streamed", True, "small"),
        ("streamed", True, "large"))  # fmt: skip

PAGE = "docs/benchmarks/host_memory.md"  # where this script's figures are documented (named in --help)


def config(root: Path, name: str, stream: bool, budget: str, read_threads: int) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(
        f"name: {name}\nseed: 0\n"
        f"data:\n  labels: {root / 'slides' / 'labels.csv'}\n  region: whole\n  val_fraction: 0.0\n"
        f"  read_threads: {read_threads}\n  stream_tiles: {str(stream).lower()}\n"
        f"model: {{name: tiny}}\nengine: {{memory_budget: {budget}, device: cpu}}\n"
        f"train: {{epochs: 1, optimizer: sgd, lr: 0.001}}\n"
        f"log: {{dir: {root / 'runs'}, tiles: 'off'}}\n"
    )
    return path


def max_rss_bytes(time_v: str) -> int | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_v)
    return int(m.group(1)) * 1024 if m else None


def run_one(root: Path, label: str, stream: bool, budget: str, read_threads: int, timeout: int) -> dict[str, Any]:
    name = f"{label}-{budget.lower()}"
    cfg = config(root, name, stream, budget, read_threads)
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "wsitrain", "--quiet", "fit", str(cfg)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"run": name, "stream_tiles": stream, "budget": budget, "error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"run": name, "stream_tiles": stream, "budget": budget, "exit": proc.returncode,
                           "wall_s": round(wall, 1), "max_rss_bytes": max_rss_bytes(proc.stderr)}  # fmt: skip
    if proc.returncode != 0:
        lines = [x.strip() for x in proc.stdout.splitlines() + proc.stderr.splitlines() if x.strip()]
        end = next((i for i, x in enumerate(lines) if x.startswith("Command being timed")), len(lines))
        row["message"] = " ".join(lines[:end])  # the refusal, without /usr/bin/time's report
        return row
    metrics = root / "runs" / name / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if json.loads(x).get("kind") == "train"]
    row["steps"] = [{k: s.get(k) for k in ("slide", "step_s", "forward_s", "backward_s", "wait_s", "read_s",
                                           "peak_bytes", "shape")} for s in steps]  # fmt: skip
    row["mean_step_s"] = round(sum(s["step_s"] for s in steps) / max(1, len(steps)), 2)
    return row


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def table(rows: list[dict[str, Any]], size: int) -> str:
    out = [
        f"Fit of two {size:,} px synthetic slides on CPU, tiny, one epoch (*measured*; "
        f"`benchmarks/bench_host_memory.py`).",
        "",
        "| run | data.stream_tiles | budget | exit | max RSS | fit's peak meter (max over steps) | step s (each) |"
        " mean step s | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        steps = r.get("steps") or []
        peak = max((s["peak_bytes"] or 0 for s in steps), default=None)
        each = ", ".join(f"{s['step_s']:.1f}" for s in steps) or "-"
        note = r.get("error") or (r.get("message") if r.get("exit") else None)
        out.append(
            f"| {r['run']} | {r['stream_tiles']} | {r['budget']} | {r.get('exit', '-')} | {gib(r.get('max_rss_bytes'))}"
            f" | {gib(peak) if peak else '-'} | {each} | {r.get('mean_step_s', '-')} | {r.get('wall_s', '-')} |"
            + (f" {note}" if note else "")
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="folder for the slides, runs and results")
    ap.add_argument("--size", type=int, default=16384, help="slide edge in px")
    ap.add_argument("--small", default="512MiB", help="the budget streaming is measured at")
    ap.add_argument("--large", default="1200MiB", help="a budget the whole-image path runs at")
    ap.add_argument("--read-threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per fit")
    ap.add_argument("--only", nargs="*", help="run names to run (e.g. whole-large streamed-small)")
    args = ap.parse_args()
    root = args.out.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "slides" / "labels.csv").is_file():
        from wsitrain.slides.synth import write_synthetic_dataset

        t0 = time.perf_counter()
        write_synthetic_dataset(root / "slides", n=2, size=args.size, seed=0, positive_fraction=0.5)
        print(f"wrote two {args.size} px slides in {time.perf_counter() - t0:.0f} s", flush=True)
    budgets = {"small": args.small, "large": args.large}
    rows = []
    with open(root / "host_memory.jsonl", "a") as log:
        for label, stream, key in RUNS:
            name = f"{label}-{budgets[key].lower()}"
            if args.only and name not in args.only:
                continue
            row = run_one(root, label, stream, budgets[key], args.read_threads, args.timeout)
            row.update(size=args.size, omp_threads=os.environ.get("OMP_NUM_THREADS"))
            rows.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(json.dumps(row), flush=True)
    (root / "host_memory.md").write_text(table(rows, args.size))
    print(table(rows, args.size))


if __name__ == "__main__":
    main()
