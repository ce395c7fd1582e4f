"""Host RAM and disk spill per rank at 40x sizes: planned, then one step simulated with the host accounted.

For each case (model, size, GPU preset, host RAM budget per rank) this plans as ``wsitrain plan --host-memory``
does (the image and host checkpoints kept in RAM largest first within the budget, the rest on disk:
``wsitrain.sft.planning.placement``) and runs one float32 AdamW training step of the real executor on the simulated
device (``simulate_step``, fake tensors: spilled tensors counted as disk, the rest of the host as RAM). Printed per
case: the plan's host RAM and disk spill per rank, where each host checkpoint lives, and the simulated host RAM
and disk peaks against them. Figures are *planned* and *simulated*; nothing is allocated.

    OMP_NUM_THREADS=1 python benchmarks/bench_host_spill.py             # the issue's two cases
    OMP_NUM_THREADS=1 python benchmarks/bench_host_spill.py --quick     # ResNet-50 at 8192 px on the 2080 Ti, 64 MiB
    OMP_NUM_THREADS=1 python benchmarks/bench_host_spill.py --step-time --spill-dir /tmp   # *measured*, this CPU

``--step-time`` instead times real CPU steps (one thread, median of 5 after a warm-up) of VGG-16 at
512 px, float32, every checkpoint after the image on the host (``host_checkpoints="always"``, the CUDA staging
code run synchronously), once in RAM and once with a host budget holding only the staging buffers (every host
checkpoint and its gradient buffer in a memory-mapped file in ``--spill-dir``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from wsitrain.gpus import gpu_preset
from wsitrain.models import build
from wsitrain.sft.simulate import simulate_step
from wsitrain.units import format_bytes, parse_bytes

CASES = [("resnet50", 100_000, "2080ti", "8GiB"), ("resnet50", 200_000, "rtx3090", "16GiB")]
QUICK = [("resnet50", 8192, "2080ti", "64MiB")]

PAGE = "docs/engine/index.md (host checkpoints and disk spill)"  # named in --help


def run(model: str, size: int, gpu: str, host: str) -> dict[str, object]:
    preset = gpu_preset(gpu)
    with torch.device("meta"):
        net = build(model, 2)
    s = simulate_step(net, (1, 3, size, size), preset.usable_bytes, optimizer="adamw", target=preset.target(),
                      host_memory=parse_bytes(host))  # fmt: skip
    p = s.plan
    return {
        "model": model, "size": size, "gpu": gpu, "host_memory": host,
        "fits": p.fits, "host_bytes_planned": p.host_bytes, "spill_bytes_planned": p.spill_bytes,
        "homes": [s.checkpoint_home for s in p.segments if s.mode == "tiled"],
        "host_peak_simulated": s.host_peak.bytes, "disk_peak_simulated": s.disk_peak.bytes,
        "host_within_plan": s.host_within_plan, "disk_within_plan": s.disk_within_plan, "seconds": s.seconds,
    }  # fmt: skip


def step_time(spill_dir: str, size: int = 512, repeats: int = 5) -> dict[str, float]:
    """Median CPU step seconds with host checkpoints in RAM and on disk (see the module doc); *measured*."""
    from wsitrain.sft import SFT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build("vgg16", 2)
    x = torch.randn(1, 3, size, size)
    cuts = ["features.4", "features.9", "features.16"]  # after each of three pools

    def engine(**kw: object) -> SFT:
        return SFT(model, tile_size=size // 4, memory_budget="8GiB", host_checkpoints="always", checkpoints=cuts,
                   **kw)  # type: ignore[arg-type]  # fmt: skip

    ram = engine()
    p = ram.plan_for(tuple(x.shape))
    disk = engine(host_memory=p.staging_bytes + 1, spill_dir=spill_dir)
    out: dict[str, float] = {"spill_bytes": float(disk.plan_for(tuple(x.shape)).spill_bytes)}
    times: dict[str, list[float]] = {"ram": [], "disk": []}
    for k in range(repeats + 1):
        for name, e in (("ram", ram), ("disk", disk)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            e(x).sum().backward()
            if k:  # the first step plans and warms up
                times[name].append(time.perf_counter() - t0)
    out.update({f"{k}_s": statistics.median(v) for k, v in times.items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="one small case")
    ap.add_argument("--step-time", action="store_true", help="time CPU steps, host checkpoints in RAM vs on disk")
    ap.add_argument("--spill-dir", default=None, help="the spill folder for --step-time (default: system temp)")
    args = ap.parse_args()
    if args.step_time:
        print(json.dumps(step_time(args.spill_dir)))
        return
    for case in QUICK if args.quick else CASES:
        r = run(*case)
        print(json.dumps(r))
        print(
            f"{r['model']} {r['size']} px on {r['gpu']}, host {r['host_memory']} per rank: planned RAM "
            f"{format_bytes(r['host_bytes_planned'])}, disk {format_bytes(r['spill_bytes_planned'])}; simulated RAM "
            f"peak {format_bytes(r['host_peak_simulated'])}, disk peak {format_bytes(r['disk_peak_simulated'])}"
        )


if __name__ == "__main__":
    main()
