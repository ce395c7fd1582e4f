"""Peak memory of a patch-encoder training step against the number of patches: flat, measured and simulated.

*Measured* (CPU): one training step of a random timm ViT patch encoder (64 px patches of 8 px tokens) with a gated
attention head under ``SFT`` with a fixed memory budget, each size in a fresh process (``--worker``): the growth of
the process's peak resident size (VmHWM, ``wsitrain.memory.PeakMeter``) over its size before the step, at two slide
sizes with 4x the patches. The target: the larger slide's peak at most 10% above the smaller's.

*Simulated* (``--simulate``): one step of the real executor on the fake-tensor CUDA device (``sft.simulate``) for a
timm ViT-B/16 at two slide sizes with 4x the patches on a GPU preset, float32 (the simulated device has no
autocast): the device peaks, next to the plan's.

    python benchmarks/bench_patch_memory.py                 # measured, 512 and 1024 px (64 and 256 patches)
    python benchmarks/bench_patch_memory.py --sizes 1024 2048 --simulate
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATCH = 64
BUDGET = "64MiB"  # CPU budget for the measured steps: below plain training of the smaller slide (97 MiB measured)


def tiny_vit():  # type: ignore[no-untyped-def]
    import timm

    return timm.create_model(
        "vit_small_patch16_224", pretrained=False, num_classes=0, img_size=PATCH, patch_size=8, depth=3, embed_dim=96,
        num_heads=3,
    )  # fmt: skip


def worker(size: int, budget: str) -> dict:
    """One measured step at ``size`` px (run in a fresh process)."""
    import torch

    from wsitrain.memory import PeakMeter
    from wsitrain.models.zoo import patch_model
    from wsitrain.sft import SFT

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = patch_model("tiny-vit", tiny_vit(), PATCH, 96, 2, pool="gated_attention")
    net = SFT(model, memory_budget=budget)
    x = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8)
    plan = net.plan_for(tuple(x.shape), input_dtype=torch.uint8)
    target = torch.tensor([1])
    meter = PeakMeter("cpu")
    meter.start()
    base = meter.current()
    torch.nn.functional.cross_entropy(net(x), target).backward()
    tiled = [s for s in plan.segments if s.mode == "tiled"]
    return {"size": size, "patches": (size // PATCH) ** 2, "growth": meter.peak() - base,
            "planned_peak": plan.estimated_peak_bytes, "chunk": tiled[0].tile_edge ** 2 if tiled else None,
            "modes": [s.mode for s in plan.segments]}  # fmt: skip


def measured(sizes: list[int], budget: str = BUDGET) -> list[dict]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}  # fmt: skip
    out = []
    for size in sizes:
        r = subprocess.run([sys.executable, __file__, "--worker", str(size), "--budget", budget],
                           capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
        if r.returncode != 0:
            raise SystemExit(r.stderr)
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def simulated(sizes: list[int], gpu: str) -> list[dict]:
    import torch

    from wsitrain.gpus import resolve_budget
    from wsitrain.models import build
    from wsitrain.sft.simulate import simulate_step

    budget = resolve_budget(gpu, None)
    out = []
    for size in sizes:
        with torch.device("meta"):
            net = build("timm/vit_base_patch16_224", 2, pool="gated_attention")
        s = simulate_step(net, (1, 3, size, size), budget.bytes, optimizer="adamw", target=budget.target)
        out.append({"size": size, "patches": (size // 224) ** 2, "device_peak": s.device_peak.bytes,
                    "planned_peak": s.plan.estimated_peak_bytes, "budget": budget.bytes,
                    "within_budget": s.within_budget, "seconds": s.seconds})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs=2, default=[512, 1024], help="two slide edges in px (4x the patches)")
    ap.add_argument("--budget", default=BUDGET, help="the measured steps' memory budget")
    ap.add_argument("--simulate", action="store_true", help="also the simulated CUDA device (ViT-B/16, float32)")
    ap.add_argument("--sim-sizes", type=int, nargs=2, default=[22400, 44800])
    ap.add_argument("--gpu", default="2080ti")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.budget)))
        return
    rows = measured(args.sizes, args.budget)
    a, b = rows
    print(json.dumps({"measured_cpu": rows, "ratio": b["growth"] / a["growth"]}))
    print(f"measured (CPU, VmHWM growth): {a['patches']} patches {a['growth'] / 2**20:.1f} MiB, {b['patches']} "
          f"patches {b['growth'] / 2**20:.1f} MiB: {b['growth'] / a['growth']:.3f}x")  # fmt: skip
    if args.simulate:
        sims = simulated(args.sim_sizes, args.gpu)
        c, d = sims
        print(json.dumps({"simulated": sims, "ratio": d["device_peak"] / c["device_peak"]}))
        print(f"simulated ({args.gpu}, ViT-B/16 fp32): {c['patches']} patches {c['device_peak'] / 2**30:.2f} GiB, "
              f"{d['patches']} patches {d['device_peak'] / 2**30:.2f} GiB: {d['device_peak'] / c['device_peak']:.3f}x")


if __name__ == "__main__":
    main()
