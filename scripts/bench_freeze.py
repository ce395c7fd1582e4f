"""Fine-tuning speed: one training step through the SFT engine with the early stages frozen (``model.freeze``)
against the same step with nothing frozen, *measured* on this machine's CPU.

    python scripts/bench_freeze.py                                   # resnet50, 512 px, stem+layer1+layer2 frozen
    python scripts/bench_freeze.py --model resnet18 --size 768 --freeze layer1 --repeats 3

The engine's tiles are forced (``--tile``) so both runs tile the same way; a frozen segment runs forward only (no
recompute, no backward). Prints the median step time (forward + backward) of ``--repeats`` steps after one warm-up,
the engine's recomputed tiles, and the plan's FLOPs of each, as one JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from wsitrain.models import build
from wsitrain.models.freeze import FreezeSpec
from wsitrain.sft import SFT


def step_times(model_name: str, size: int, freeze: str | None, tile: int, repeats: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = build(model_name, 2, freeze=FreezeSpec(freeze) if freeze else None).train()
    engine = SFT(model, memory_budget="8GiB", tile_size=tile)
    x = torch.rand(1, 3, size, size)
    times = []
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        engine(x).sum().backward()
        if i:  # the first step plans and warms up
            times.append(time.perf_counter() - t0)
    plan = engine.plan_for(tuple(x.shape))
    return {"model": model_name, "size": size, "tile": tile, "freeze": freeze, "threads": torch.get_num_threads(),
            "step_s_median": statistics.median(times), "step_s": [round(t, 3) for t in times],
            "recomputed_tiles": engine.last_stats.recomputed_tiles, "planned_tflop": plan.flops_sft / 1e12}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--freeze", default="layer2")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows = [step_times(a.model, a.size, f, a.tile, a.repeats) for f in (None, a.freeze)]
    for r in rows:
        print(json.dumps(r))
    print(f"measured CPU step time: {rows[0]['step_s_median']:.2f} s -> {rows[1]['step_s_median']:.2f} s "
          f"({rows[1]['step_s_median'] / rows[0]['step_s_median'] - 1:+.0%}) with {a.freeze} frozen; planned "
          f"{rows[0]['planned_tflop']:.3f} -> {rows[1]['planned_tflop']:.3f} TFLOP")  # fmt: skip


if __name__ == "__main__":
    main()
