"""The simulated device at whole-slide scale: one training step per case, simulated peaks against the plan.

Each case runs ``wsitrain.sft.simulate.simulate_step`` (the real executor on fake tensors, the simulated CUDA
runtime checking stream ordering) on the 2080 Ti preset's budget, float32, AdamW, uint8 host image, and records:
the simulated device peak and where it happens, the plan's replay and estimate, the budget, the simulated host
peak against the plan's host memory, and the plan's extra compute. Results are appended one JSON line per case as
each finishes (a long run keeps what it measured), then rendered as a markdown table.

    python benchmarks/bench_simulated.py --out docs/benchmarks                  # every case, a few minutes
    python benchmarks/bench_simulated.py --out /tmp/s --quick        # without the 100,000 px ones
    python benchmarks/bench_simulated.py --out docs/benchmarks --render-only    # redraw the table from the JSON lines

Writes ``bench_simulated.jsonl`` and ``bench_simulated.md`` into ``--out``. Figures are *simulated*: live tensor
bytes as the code allocates them; not allocator rounding, library workspaces, the CUDA context, or time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from wsitrain.gpus import gpu_preset
from wsitrain.models import build
from wsitrain.sft.simulate import simulate_step
from wsitrain.units import format_bytes

QUICK = [
    ("darknet19", 8192),
    ("resnet50", 8192),
    ("torchvision/efficientnet_b0", 4096),
    ("torchvision/convnext_tiny", 8192),
    ("vgg16", 20480),
]
SLOW = [("darknet19", 100_000), ("resnet50", 100_000), ("vgg16", 100_000)]

PAGE = "docs/benchmarks/bench_simulated.md"  # where this script's figures are documented (named in --help)
# The page's title and what kind of figures it holds, above the table this script writes.
PAGE_HEAD = (
    "# The simulated device: one training step against its plan\n"
    "\n"
    "**Simulated** peaks (the real executor on fake tensors, every live storage counted) against the plan's\n"
    "**planned** replay and estimate; written by `benchmarks/bench_simulated.py`.\n"
    "\n"
)


def run_case(name: str, size: int, gpu: str, every_tile: bool) -> dict[str, object]:
    with torch.device("meta"):
        model = build(name, 2)
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 30 or done == total:
            print(f"  {name} {size}: {done}/{total} tiles", file=sys.stderr, flush=True)
            last[0] = now

    preset = gpu_preset(gpu)
    s = simulate_step(
        model, (1, 3, size, size), preset.memory_bytes, optimizer="adamw", progress=progress, target=preset.target(),
        every_tile=every_tile,
    )  # fmt: skip
    p = s.plan
    return {
        "model": name,
        "size": size,
        "gpu": gpu,
        "budget_bytes": p.budget_bytes,
        "simulated_device_peak_bytes": s.device_peak.bytes,
        "peak_where": s.device_peak.where,
        "replayed_peak_bytes": p.replayed_peak_bytes,
        "estimated_peak_bytes": p.estimated_peak_bytes,
        "over_replay": s.over_replay,
        "within_budget": s.within_budget,
        "simulated_host_peak_bytes": s.host_peak.bytes,
        "planned_host_bytes": p.host_bytes,
        "host_within_plan": s.host_within_plan,
        "extra_compute": p.overhead,
        "tiled_segments": len(p.tiled_segments),
        "multipass": any(s.mode == "tiled" for s in p.segments) and "efficientnet" in name,
        "operators": s.operators,
        "accesses_checked": s.accesses_checked,
        "seconds_to_simulate": s.seconds,
        "tiles_visited": s.tiles_visited,
        "tiles_in_step": s.tiles_in_step,
    }


def render(rows: list[dict[str, object]]) -> str:
    head = (
        "| model | size | device peak, simulated | plan's replay | simulated vs replay | plan's estimate | budget "
        "| within budget | host peak, simulated | plan's host memory | extra compute (planned) | tile visits simulated "
        "| seconds to simulate |"
    )
    lines = [head, "|" + " --- |" * 13]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['size']} | {format_bytes(int(r['simulated_device_peak_bytes']))} "  # type: ignore[arg-type]
            f"| {format_bytes(int(r['replayed_peak_bytes']))} | {float(r['over_replay']):+.1%} "  # type: ignore[arg-type]
            f"| {format_bytes(int(r['estimated_peak_bytes']))} | {format_bytes(int(r['budget_bytes']))} "  # type: ignore[arg-type]
            f"| {'yes' if r['within_budget'] else 'NO'} | {format_bytes(int(r['simulated_host_peak_bytes']))} "  # type: ignore[arg-type]
            f"| {format_bytes(int(r['planned_host_bytes']))} | {float(r['extra_compute']):+.1%} "  # type: ignore[arg-type]
            f"| {r.get('tiles_visited', '?')} of {r.get('tiles_in_step', '?')} "
            f"| {float(r['seconds_to_simulate']):.0f} |"  # type: ignore[arg-type]
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu", default="2080ti")
    ap.add_argument("--quick", action="store_true", help="without the 100,000 px cases")
    ap.add_argument("--render-only", action="store_true")
    ap.add_argument("--every-tile", action="store_true", help="visit every tile (same peaks; hours at 100,000 px)")
    ap.add_argument("--case", action="append", default=[], help="NAME:SIZE, repeatable (replaces the default list)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    lines_path = args.out / "bench_simulated.jsonl"
    if not args.render_only:
        cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.case] or (QUICK if args.quick else QUICK + SLOW)
        for name, size in cases:
            print(f"simulating {name} at {size} px on the {args.gpu} preset", file=sys.stderr, flush=True)
            row = run_case(name, size, args.gpu, args.every_tile)
            with lines_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
    rows = [json.loads(line) for line in lines_path.read_text().splitlines() if line.strip()]
    (args.out / "bench_simulated.md").write_text(PAGE_HEAD + render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
