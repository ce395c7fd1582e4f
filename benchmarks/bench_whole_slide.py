"""Whole-slide benchmark on CPU: memory that does not grow with the image, and time per megapixel.

For each model, one fixed budget and growing square images, one training step per configuration in a
fresh process (uint8 image, as ``wsitrain fit`` reads it). Reports per size: the measured peak memory
above the loaded model (VmHWM) plus the image (inside the budget on CPU), the planned peak, the budget, seconds
per megapixel, and the planned vs measured extra compute. The measured extra compute compares the SFT step with
plain PyTorch at the largest size plain training fits in host memory (time scales with pixels).

    python benchmarks/bench_whole_slide.py --out bench-whole-slide          # tiny 4096-16384, vgg16 2048-8192
    python benchmarks/bench_whole_slide.py --quick --out /tmp/wsb           # tiny only, for a smoke run
    python benchmarks/bench_whole_slide.py --plot-only --out bench-whole-slide  # redraw the plot from the JSON

Writes bench_whole_slide.json, bench_whole_slide.md and bench_whole_slide.png (peak memory against the
budget and the plan, and seconds per megapixel, per size). The time goal: every size's seconds per
megapixel within 15% of the smallest tiled size's.
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
plan = net.plan_of(x) if mode == "sft" else None  # on CPU the image is inside the budget (segment 0's checkpoint)
meter = PeakMeter("cpu")
meter.start()
base = meter.current()
t0 = time.perf_counter()
torch.nn.functional.cross_entropy(net(x), target).backward()
seconds = time.perf_counter() - t0
image = x.numel() * x.element_size()  # allocated before the measurement, and counted in the budget
out = {"model": name, "size": size, "mode": mode, "seconds": seconds, "measured_bytes": meter.peak() - base + image}
if plan is not None:
    fixed = plan.breakdown["parameters"]  # loaded before the measurement started
    out.update(planned_bytes=plan.estimated_peak_bytes - fixed, budget_bytes=plan.budget_bytes - fixed,
               planned_extra=plan.overhead, planned_slowdown=plan.slowdown, tiles=plan.recomputed_tiles,
               fits=plan.fits)
print(json.dumps(out))
"""

CONFIGS = {
    # model: (budget, SFT sizes, plain reference size)
    "tiny": ("1GiB", (4096, 8192, 16384), 2048),  # the 768 MiB uint8 image at 16384 px is inside the budget
    "vgg16": ("2GiB", (2048, 4096, 8192), 1024),
}

PAGE = "docs/benchmarks/bench_whole_slide.md"  # where this script's figures are documented (named in --help)
# The page's title and what kind of figures it holds, above the table this script writes.
PAGE_HEAD = (
    "# Whole slides on a fixed budget\n"
    "\n"
    "**Measured** peaks and times (on the machine that ran `benchmarks/bench_whole_slide.py`; the committed table:\n"
    "this project's 2-core CPU) beside the **planned** peaks and slowdowns.\n"
    "\n"
    "![peak memory and time per megapixel against the slide's edge](bench_whole_slide.png)\n"
    "\n"
)


def run(name: str, size: int, budget: str, mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", WORKER, name, str(size), budget, mode], capture_output=True,
                          text=True, timeout=7200)  # fmt: skip
    if proc.returncode != 0:
        return {"model": name, "size": size, "mode": mode, "error": proc.stderr.strip().splitlines()[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# seconds per megapixel may grow this much above the smallest tiled size's (issue 10's goal)
TIME_GOAL = 0.15


def time_goal(rows: list[dict]) -> None:
    """Mark each row with its seconds per megapixel relative to its model's smallest size."""
    for name in {r["model"] for r in rows}:
        ok = [r for r in rows if r["model"] == name and "s_per_mp" in r]
        if ok:
            first = min(ok, key=lambda r: r["size"])["s_per_mp"]
            for r in ok:
                r["vs_smallest"] = r["s_per_mp"] / first - 1
                r["time_goal_met"] = r["vs_smallest"] <= TIME_GOAL


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    names = sorted({r["model"] for r in rows if "s_per_mp" in r})
    fig, axes = plt.subplots(2, len(names), figsize=(5 * len(names), 7), squeeze=False)
    mib = 2**20
    for k, name in enumerate(names):
        rs = sorted((r for r in rows if r["model"] == name and "s_per_mp" in r), key=lambda r: r["size"])
        sizes = [r["size"] for r in rs]
        ax = axes[0][k]
        ax.plot(sizes, [r["measured_bytes"] / mib for r in rs], "o-", label="measured peak")
        ax.plot(sizes, [r["planned_bytes"] / mib for r in rs], "s--", label="planned peak")
        ax.plot(sizes, [r["budget_bytes"] / mib for r in rs], "k:", label="budget")
        ax.set(title=f"{name}: memory above model and image", xscale="log", ylabel="MiB", ylim=(0, None))
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()  # the log axis's own labels would overlap the sizes
        ax.legend(fontsize=8)
        ax = axes[1][k]
        ax.plot(sizes, [r["s_per_mp"] for r in rs], "o-", label="measured s/MP")
        first = rs[0]["s_per_mp"]
        ax.axhline(first * (1 + TIME_GOAL), color="k", ls=":", label=f"goal: +{100 * TIME_GOAL:.0f}% of smallest")
        if rs[0].get("plain_s_per_mp"):
            ax.axhline(rs[0]["plain_s_per_mp"], color="gray", ls="--", label="plain PyTorch s/MP")
        ax.set(title=f"{name}: time per megapixel", xscale="log", xlabel="image edge (px)", ylabel="s / MP")
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()  # the log axis's own labels would overlap the sizes
        ax.set_ylim(0, None)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="only the tiny model")
    ap.add_argument("--models", default=None, help="comma-separated subset of: " + ", ".join(CONFIGS))
    ap.add_argument("--sizes", default=None, help="comma-separated subset of the sizes to run")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot and table from --out's JSON")
    args = ap.parse_args()
    if args.plot_only:
        rows = json.loads((args.out / "bench_whole_slide.json").read_text())
        write(rows, args.out)
        return
    names = ["tiny"] if args.quick else (args.models.split(",") if args.models else list(CONFIGS))
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        budget, sizes, ref = CONFIGS[name]
        plain = run(name, ref, budget, "plain")
        plain_s_per_mp = plain["seconds"] / (ref * ref / 1e6) if "seconds" in plain else None
        for size in sizes:
            if args.sizes and str(size) not in args.sizes.split(","):
                continue
            r = run(name, size, budget, "sft")
            mp = size * size / 1e6
            if "seconds" in r:
                r["s_per_mp"] = r["seconds"] / mp
                r["measured_extra"] = r["s_per_mp"] / plain_s_per_mp - 1 if plain_s_per_mp else None
                r["within_budget"] = r["measured_bytes"] <= r["budget_bytes"]
            r["plain_s_per_mp"] = plain_s_per_mp
            rows.append(r)
            print(json.dumps(r), flush=True)
    path = args.out / "bench_whole_slide.json"
    if args.sizes and path.exists():  # a partial run adds to (replaces its rows in) the earlier results
        done = {(r["model"], r["size"]) for r in rows}
        rows = [r for r in json.loads(path.read_text()) if (r["model"], r["size"]) not in done] + rows
    write(rows, args.out)


def write(rows: list[dict], out: Path) -> None:
    rows = sorted(rows, key=lambda r: (r["model"], r["size"]))
    time_goal(rows)
    (out / "bench_whole_slide.json").write_text(json.dumps(rows, indent=1))
    head = (
        "| model | size | budget | planned peak | measured peak | within | s/MP | vs smallest | "
        "extra planned (FLOPs) | slowdown planned (time model) | extra measured |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['size']} | | | | | | | | | error: {r['error']} |")
            continue
        mib = 2**20
        lines.append(
            f"| {r['model']} | {r['size']} | {r['budget_bytes'] / mib:.0f} MiB | {r['planned_bytes'] / mib:.0f} MiB | "
            f"{r['measured_bytes'] / mib:.0f} MiB | {'yes' if r['within_budget'] else 'NO'} | {r['s_per_mp']:.2f} | "
            f"{100 * r['vs_smallest']:+.0f}% | {100 * r['planned_extra']:+.0f}% | "
            + (f"{r['planned_slowdown']:.2f}x | " if r.get("planned_slowdown") else "- | ")
            + (f"{100 * r['measured_extra']:+.0f}% |" if r.get("measured_extra") is not None else "- |")
        )
    (out / "bench_whole_slide.md").write_text(PAGE_HEAD + "\n".join(lines) + "\n")
    plot(rows, out / "bench_whole_slide.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
