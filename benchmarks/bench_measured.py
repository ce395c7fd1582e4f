"""The simulated device against a real GPU: the measured CUDA peak of real training steps, case by case, beside the
simulated peak and the plan.

Each case builds the model on the GPU, plans it for a preset card (``--gpu``, default the 2080 Ti: the same budget
and generation ``benchmarks/bench_simulated.py`` simulates), caps the process's CUDA allocator at that budget
(``torch.cuda.set_per_process_memory_fraction``) and runs ``--steps`` training steps as ``wsitrain fit`` does: a
uint8 image in pinned host memory, cross entropy, backward, AdamW (foreach). Per step it records the allocator's
peak (``max_memory_allocated``: live tensor bytes, what the simulation counts) and its reserved peak (plus cached
and fragmented blocks), the wall time, and the error if the step failed. The simulated figures are read from
``--simulated`` (the JSON lines ``bench_simulated.py`` writes), so the GPU runs only real steps.

    python benchmarks/bench_measured.py --out OUT                       # the quick cases of bench_simulated.py
    python benchmarks/bench_measured.py --out OUT --case resnet50:16384 # one case (repeatable)
    python benchmarks/bench_measured.py --out OUT --render-only         # redraw the table from OUT/bench_measured.jsonl

Writes ``bench_measured.jsonl`` (a line per case as it finishes) and ``bench_measured.md`` into ``--out``. Figures
are *measured* on the GPU it ran on; the plan is for the preset, whatever card runs it (an H100 capped at 10.47 GiB
stands in for a 2080 Ti's memory, not for its speed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

from wsitrain.gpus import gpu_preset
from wsitrain.memory import cap_cuda_allocator, tune_cuda_allocator
from wsitrain.models import build
from wsitrain.sft import SFT
from wsitrain.units import format_bytes

REPO = Path(__file__).resolve().parents[1]
# The same cases as bench_simulated.py's --quick (keep the two lists in step: the table joins on them).
CASES = [
    ("darknet19", 8192),
    ("resnet50", 8192),
    ("torchvision/efficientnet_b0", 4096),
    ("torchvision/convnext_tiny", 8192),
    ("vgg16", 20480),
]

PAGE = "docs/benchmarks/bench_measured.md and docs/benchmarks/measured_on_gpu.md"  # named in --help
# The page's title and what kind of figures it holds, above the table this script writes.
PAGE_HEAD = (
    "# Plans on a real GPU against the simulated device\n"
    "\n"
    "**Measured** CUDA peaks and step times on the GPU named in each row (the committed table: one NVIDIA H100 80GB,\n"
    "2026-11-24) beside the **simulated** peaks of [bench_simulated.md](bench_simulated.md) and the **planned**\n"
    "estimates; written by `benchmarks/bench_measured.py`.\n"
    "\n"
)


def measure(name: str, size: int, gpu: str, steps: int) -> dict[str, object]:
    """``steps`` training steps of ``name`` at ``size`` px under the preset's budget, on this process's GPU."""
    preset = gpu_preset(gpu)
    dev = torch.device("cuda", torch.cuda.current_device())
    budget = preset.memory_bytes
    row: dict[str, object] = {"model": name, "size": size, "gpu": gpu, "budget_bytes": budget,
                              "device_name": torch.cuda.get_device_name(dev), "torch": torch.__version__}  # fmt: skip
    torch.cuda.empty_cache()
    cap_cuda_allocator(dev, budget)
    try:
        _steps(name, size, preset, dev, steps, row)
    except Exception as e:  # a first-run breaker is the finding: keep it, go on with the next case
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-6000:]
    finally:
        cap_cuda_allocator(dev, None)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        # beyond PyTorch's own segments: the CUDA context, cuBLAS/cuDNN handles and loaded kernels
        row["outside_allocator_bytes"] = int(total - free - torch.cuda.memory_reserved(dev))
    return row


def _steps(name: str, size: int, preset, dev: torch.device, steps: int, row: dict[str, object]) -> None:
    """The steps themselves, in their own frame: their tensors are gone when it returns or raises."""
    torch.manual_seed(0)
    model = build(name, 2).to(dev)
    sft = SFT(model, memory_budget=preset.memory_bytes, optimizer="adamw", target=preset.target())
    image = _host_image((1, 3, size, size))  # (B, C, H, W) uint8 in pinned host memory, as fit streams it
    target = torch.zeros(1, dtype=torch.long, device=dev)
    plan = sft.plan_of(image)
    row.update(
        replayed_peak_bytes=plan.replayed_peak_bytes, estimated_peak_bytes=plan.estimated_peak_bytes,
        planned_host_bytes=plan.host_bytes, extra_compute=plan.overhead,
        tiles=sum(s.n_tiles for s in plan.segments if s.mode == "tiled"), steps=[],
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    seen, last = [0], [time.perf_counter()]

    def progress(seg: int, r: int, c: int, phase: str) -> None:  # a whole-slide step takes minutes: say where it is
        seen[0] += 1
        if time.perf_counter() - last[0] > 30:
            last[0] = time.perf_counter()
            print(f"  {seen[0]} tile visits; segment {seg}, tile ({r}, {c}), {phase}", file=sys.stderr, flush=True)

    sft._hooks.on_tile = progress
    for i in range(steps):
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(sft(image).float(), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        stats = torch.cuda.memory_stats(dev)
        row["steps"].append({
            "step": i + 1, "seconds": time.perf_counter() - t0, "loss": float(loss),
            "peak_bytes": int(torch.cuda.max_memory_allocated(dev)),
            "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(dev)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0)), "ooms": int(stats.get("num_ooms", 0)),
        })  # fmt: skip
        print(f"  {name} {size}: step {i + 1} {row['steps'][-1]['seconds']:.1f} s, peak "
              f"{format_bytes(row['steps'][-1]['peak_bytes'])}", file=sys.stderr, flush=True)  # fmt: skip
    row["measured_peak_bytes"] = max(s["peak_bytes"] for s in row["steps"])
    row["measured_peak_reserved_bytes"] = max(s["peak_reserved_bytes"] for s in row["steps"])


def _host_image(shape: tuple[int, ...]) -> torch.Tensor:
    """Random uint8 pixels in pinned memory, fast at whole-slide size: one random 64 MiB block copied over it
    (a per-element generator takes minutes for 30 GB; the pixel values do not change memory or time)."""
    image = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
    flat = image.view(-1)
    block = torch.randint(0, 256, (min(flat.numel(), 1 << 26),), dtype=torch.uint8)
    for i in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - i)
        flat[i : i + n].copy_(block[:n])
    return image


def _simulated(path: Path) -> dict[tuple[str, int, str], dict[str, object]]:
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["model"], r["size"], r["gpu"]): r for r in rows}


def render(rows: list[dict[str, object]], simulated: dict[tuple[str, int, str], dict[str, object]]) -> str:
    out = [
        "| model | size | measured peak (allocated) | reserved | simulated | measured vs simulated | replay | "
        "estimate | budget | within budget | s per step (measured) | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        sim = simulated.get((r["model"], r["size"], r["gpu"]), {}).get("simulated_device_peak_bytes")
        if "error" in r:
            why = str(r["error"]).splitlines()[0][:120]
            out.append(f"| {r['model']} | {r['size']} | - | - | {format_bytes(sim) if sim else '-'} | - | - | - | "
                       f"{format_bytes(r['budget_bytes'])} | - | - | {why} |")  # fmt: skip
            continue
        peak = r["measured_peak_bytes"]
        vs = f"{peak / sim - 1:+.1%}" if sim else "-"
        secs = ", ".join(f"{s['seconds']:.1f}" for s in r["steps"])
        out.append(
            f"| {r['model']} | {r['size']} | {format_bytes(peak)} | {format_bytes(r['measured_peak_reserved_bytes'])} "
            f"| {format_bytes(sim) if sim else '-'} | {vs} | {format_bytes(r['replayed_peak_bytes'])} | "
            f"{format_bytes(r['estimated_peak_bytes'])} | {format_bytes(r['budget_bytes'])} | "
            f"{'yes' if r['measured_peak_reserved_bytes'] <= r['budget_bytes'] else 'NO'} | {secs} | "
            f"{r['device_name']} |"
        )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpu", default="2080ti", help="the preset whose budget and generation the plans are for")
    ap.add_argument("--steps", type=int, default=2, help="training steps per case (the second holds AdamW's state)")
    ap.add_argument("--case", action="append", default=[], help="MODEL:SIZE (repeatable); default: the quick cases")
    ap.add_argument("--simulated", type=Path, default=REPO / "docs" / "benchmarks" / "bench_simulated.jsonl")
    ap.add_argument("--render-only", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "bench_measured.jsonl"
    if not args.render_only:
        if not torch.cuda.is_available():
            print("bench_measured.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
            return 2
        cases = [(c.rsplit(":", 1)[0], int(c.rsplit(":", 1)[1])) for c in args.case] or CASES
        print(f"expandable segments: {tune_cuda_allocator(say=False)}", file=sys.stderr, flush=True)
        for name, size in cases:
            print(f"{name} at {size} px", file=sys.stderr, flush=True)
            row = measure(name, size, args.gpu, args.steps)
            with jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if "error" in row:
                print(row["traceback"], file=sys.stderr, flush=True)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.is_file() else []
    table = render(rows, _simulated(args.simulated))
    (args.out / "bench_measured.md").write_text(PAGE_HEAD + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
