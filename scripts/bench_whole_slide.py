"""Whole-slide benchmark on CPU: memory that does not grow with the image, and time per megapixel.

For each model, one fixed budget and growing square images, one training step per configuration in a
fresh process (uint8 image, as ``wsitrain fit`` streams it). Reports per size: the measured peak memory
above the loaded model and image (VmHWM), the planned peak, the budget, seconds per megapixel, and the
planned vs measured extra compute. The measured extra compute compares the SFT step with plain PyTorch
at the largest size plain training fits in host memory (time scales with pixels).

    python scripts/bench_whole_slide.py --out bench-whole-slide          # tiny 4096-16384, vgg16 2048-8192
    python scripts/bench_whole_slide.py --quick --out /tmp/wsb           # tiny only, for a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time, torch
from wsitrain.memory import PeakMeter, tune_cpu_allocator
from wsitrain.models import build
from wsitrain.sft import SFT
tune_cpu_allocator()  # what wsitrain fit does on CPU
torch.manual_seed(0)
name, size, budget, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
model = build(name, 2)
x = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8)
target = torch.tensor([1])
net = SFT(model, memory_budget=budget) if mode == "sft" else model
plan = net.plan_for((1, 3, size, size), input_dtype=torch.uint8, input_on_host=True) if mode == "sft" else None
meter = PeakMeter("cpu")
meter.start()
base = meter.current()
t0 = time.perf_counter()
torch.nn.functional.cross_entropy(net(x), target).backward()
seconds = time.perf_counter() - t0
out = {"model": name, "size": size, "mode": mode, "seconds": seconds, "measured_bytes": meter.peak() - base}
if plan is not None:
    fixed = plan.breakdown["parameters"]  # loaded before the measurement started
    out.update(planned_bytes=plan.estimated_peak_bytes - fixed, budget_bytes=plan.budget_bytes - fixed,
               planned_extra=plan.overhead, tiles=plan.recomputed_tiles, fits=plan.fits)
print(json.dumps(out))
"""

CONFIGS = {
    # model: (budget, SFT sizes, plain reference size)
    "tiny": ("256MiB", (4096, 8192, 16384), 2048),
    "vgg16": ("1GiB", (2048, 4096, 8192), 1024),
}


def run(name: str, size: int, budget: str, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", WORKER, name, str(size), budget, mode], capture_output=True,
                          text=True, timeout=7200)  # fmt: skip
    if proc.returncode != 0:
        return {"model": name, "size": size, "mode": mode, "error": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="only the tiny model")
    ap.add_argument("--models", default=None, help="comma-separated subset of: " + ", ".join(CONFIGS))
    args = ap.parse_args()
    names = ["tiny"] if args.quick else (args.models.split(",") if args.models else list(CONFIGS))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        budget, sizes, ref = CONFIGS[name]
        plain = run(name, ref, budget, "plain")
        plain_s_per_mp = plain["seconds"] / (ref * ref / 1e6) if "seconds" in plain else None
        for size in sizes:
            r = run(name, size, budget, "sft")
            mp = size * size / 1e6
            if "seconds" in r:
                r["s_per_mp"] = r["seconds"] / mp
                r["measured_extra"] = r["s_per_mp"] / plain_s_per_mp - 1 if plain_s_per_mp else None
                r["within_budget"] = r["measured_bytes"] <= r["budget_bytes"]
            r["plain_s_per_mp"] = plain_s_per_mp
            rows.append(r)
            print(json.dumps(r), flush=True)
    (args.out / "bench_whole_slide.json").write_text(json.dumps(rows, indent=1))
    head = "| model | size | budget | planned peak | measured peak | within | s/MP | extra planned | extra measured |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['size']} | | | | | | | error: {r['error']} |")
            continue
        mib = 2**20
        lines.append(
            f"| {r['model']} | {r['size']} | {r['budget_bytes'] / mib:.0f} MiB | {r['planned_bytes'] / mib:.0f} MiB | "
            f"{r['measured_bytes'] / mib:.0f} MiB | {'yes' if r['within_budget'] else 'NO'} | {r['s_per_mp']:.2f} | "
            f"{100 * r['planned_extra']:+.0f}% | "
            + (f"{100 * r['measured_extra']:+.0f}% |" if r.get("measured_extra") is not None else "- |")
        )
    (args.out / "bench_whole_slide.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
