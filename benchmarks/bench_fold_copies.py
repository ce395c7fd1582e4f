"""Issue 57 on the simulated clock: a whole-slide step with and without the BatchNorm fold and the copy-free tiles,
against plain PyTorch and patch training as users run it. Every figure is *simulated* (the fake-tensor device priced
with a GPU preset's constants, docs/research/simulated-clock.md); the plan is the one ``wsitrain plan --simulate`` runs.

    PYTHONPATH=. python benchmarks/bench_fold_copies.py                    # ResNet-50, 8192 px, bf16, 10.47 GiB, h200
    PYTHONPATH=. python benchmarks/bench_fold_copies.py --model darknet19 --json out.jsonl

Rows: ``before`` (fold off, the earlier copies: the executor before issue 57), ``copies`` (part 2 alone), ``fold``
(part 1 alone), ``fold + copies`` (both: what runs by default), then plain PyTorch on one image (the model as built,
BatchNorm unfolded) and patch training (``timing.clock_patch_reference``: 256 patches of 224 px, BatchNorm in
training mode). Columns: step, Mpx/s, share of patch training's Mpx/s, copy kernels per step (the clock's copy
counter), BatchNorm kernels per step, the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from wsitrain.gpu_speed import gpu_speed
from wsitrain.gpus import gpu_preset
from wsitrain.models import build
from wsitrain.sft.planning.calibration import run_time_model
from wsitrain.sft.simulate.timing import clock_patch_reference, clock_plain_step, clock_sft_step

VARIANTS = {  # name: (fold_bn, copy_free)
    "before (fold off, earlier copies)": (False, False),
    "copies only (part 2)": (False, True),
    "fold only (part 1)": (True, False),
    "fold + copies (default)": (True, True),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=f"{__doc__}\nDocs page: docs/benchmarks/fold-and-copies.md",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--budget", default="10.47GiB")
    ap.add_argument("--gpu", default="h200", help="a speed preset (wsitrain/gpu_speed.py)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--variants", default=",".join(str(i) for i in range(len(VARIANTS))),
                    help="indices into the variants to run (default all)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="also append one JSON line per row here")
    a = ap.parse_args(argv)
    speed = gpu_speed(a.gpu)
    low = a.precision in ("bf16", "fp16")
    # the constants `wsitrain plan --gpu ... --simulate` plans with (plan/command.py: _time_model)
    tm = run_time_model("cuda", gpu_preset(a.gpu).label, low, a.gpu)[0]
    with torch.device("meta"):
        model = build(a.model, 2)
    shape = (1, 3, a.size, a.size)
    px = a.size * a.size
    t0 = time.perf_counter()
    patch, patch_mpx = clock_patch_reference(model, speed, a.precision)
    plain = clock_plain_step(model, shape, speed, a.precision)[0]
    rows = []
    names = list(VARIANTS)
    for i in (int(k) for k in a.variants.split(",")):
        name = names[i]
        fold, free = VARIANTS[name]
        r, sim, _ = clock_sft_step(model, shape, a.budget, speed, a.precision, time_model=tm, fold_bn=fold,
                                   copy_free=free)  # fmt: skip
        rows.append({"run": f"SFT capped at {a.budget}, {name}", "seconds": r.seconds, "mpx_s": px / r.seconds / 1e6,
                     "copies": r.copies, "copies_by_op": r.copies_by_op, "norm_kernels": r.norm_kernels,
                     "by_kind": r.by_kind, "plan": sim.plan.brief})  # fmt: skip
        print(f"[{time.perf_counter() - t0:5.0f} s] {rows[-1]['run']}: {r.seconds:.3f} s", file=sys.stderr)
    rows.append({"run": "plain PyTorch, one image (BatchNorm frozen, unfolded)", "seconds": plain.seconds,
                 "mpx_s": px / plain.seconds / 1e6, "copies": plain.copies, "copies_by_op": plain.copies_by_op,
                 "norm_kernels": plain.norm_kernels, "by_kind": plain.by_kind, "plan": ""})  # fmt: skip
    rows.append({"run": "patch training, 256 x 224 px (BatchNorm in training mode)", "seconds": patch.seconds,
                 "mpx_s": patch_mpx, "copies": patch.copies, "copies_by_op": patch.copies_by_op,
                 "norm_kernels": patch.norm_kernels, "by_kind": patch.by_kind, "plan": ""})  # fmt: skip
    print(f"*Simulated* ({a.gpu} preset, {a.precision}): {a.model}, {a.size} px, batch 1, AdamW; "
          f"`PYTHONPATH=. python benchmarks/bench_fold_copies.py {' '.join(argv or sys.argv[1:])}`\n")
    print("| run | step | Mpx/s | share of patch training | copy kernels | BatchNorm kernels | plan |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['seconds']:.3f} s | {r['mpx_s']:.0f} | {r['mpx_s'] / patch_mpx:.2f} | "
              f"{r['copies']:.0f} | {r['norm_kernels']:.0f} | {r['plan']} |")
    if a.json is not None:
        with a.json.open("a") as f:
            for r in rows:
                f.write(json.dumps({"model": a.model, "size": a.size, "budget": a.budget, "gpu": a.gpu,
                                    "precision": a.precision, **r}) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
