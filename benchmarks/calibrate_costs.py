"""Fit the planner's time model on this machine and print it (``wsitrain.doctor.calibrate`` does the work).

``wsitrain doctor --calibrate`` does the same and writes the calibration where ``plan`` and ``fit`` find it; this
script prints the fit, micro-model by micro-model, and writes it only with ``--out``.

Usage:
    python benchmarks/calibrate_costs.py [--device cpu|cuda] [--threads 1] [--runs 5] [--out calib.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from wsitrain.doctor.calibrate import calibrate
from wsitrain.sft.planning.calibration import device_name

PAGE = "docs/benchmarks/engine-cpu.md (the CPU constants of wsitrain/sft/planning/costs.py)"  # named in --help


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = device_name(device)
    cal, rows = calibrate(device, name, runs=args.runs)
    print(f"{'micro-model':<24s} {'measured':>10s} {'model':>10s}  GFLOP   MB     calls")
    for r in rows:
        f, b, n = r.terms
        ms, model_ms = 1e3 * r.seconds, 1e3 * r.modelled
        print(f"{r.name:<24s} {ms:8.2f}ms {model_ms:8.2f}ms  {f / 1e9:5.2f} {b / 1e6:6.1f} {n:6.0f}")
    result = {**asdict(cal), "rows": [asdict(r) for r in rows]}
    print(json.dumps(asdict(cal), indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
