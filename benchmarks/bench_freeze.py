"""Fine-tuning speed: one training step through the SFT engine with the early stages frozen (``model.freeze``)
against the same step with nothing frozen, *measured* on this machine's CPU.

    python benchmarks/bench_freeze.py                                   # resnet50, 256 px, stem+layer1+layer2 frozen
    python benchmarks/bench_freeze.py --model resnet18 --size 768 --freeze layer1 --repeats 3

The engine's tiles are forced (``--tile``) so both runs tile the same way; a frozen segment runs forward only (no
recompute, no backward). Prints the median step time (forward + backward) of ``--repeats`` steps after one warm-up,
the engine's recomputed tiles, and the plan's FLOPs of each, as one JSON line per configuration. The two are
stepped in turn, so load from other processes falls on both.
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

PAGE = "docs/guide/training.md (model.freeze's measured step time)"  # named in --help


class Case:
    """One model (frozen or not) in its engine, with the input it trains on."""

    def __init__(self, model_name: str, size: int, freeze: str | None, tile: int) -> None:
        torch.manual_seed(0)
        self.freeze = freeze
        self.model = build(model_name, 2, freeze=FreezeSpec(freeze) if freeze else None).train()
        self.engine = SFT(self.model, memory_budget="8GiB", tile_size=tile)
        self.x = torch.rand(1, 3, size, size)
        self.times: list[float] = []

    def step(self) -> float:
        self.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        self.engine(self.x).sum().backward()
        return time.perf_counter() - t0

    def row(self, model_name: str, size: int, tile: int) -> dict[str, object]:
        plan = self.engine.plan_for(tuple(self.x.shape))
        return {"model": model_name, "size": size, "tile": tile, "freeze": self.freeze,
                "threads": torch.get_num_threads(), "step_s_median": statistics.median(self.times),
                "step_s": [round(t, 3) for t in self.times],
                "recomputed_tiles": self.engine.last_stats.recomputed_tiles,
                "planned_tflop": plan.flops_sft / 1e12}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--tile", type=int, default=64)
    ap.add_argument("--freeze", default="layer2")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cases = [Case(a.model, a.size, f, a.tile) for f in (None, a.freeze)]
    for c in cases:
        c.step()  # the first step plans and warms up
    for _ in range(a.repeats):  # interleaved, so a busy machine slows both alike
        for c in cases:
            c.times.append(c.step())
    rows = [c.row(a.model, a.size, a.tile) for c in cases]
    for r in rows:
        print(json.dumps(r))
    print(f"measured CPU step time: {rows[0]['step_s_median']:.2f} s -> {rows[1]['step_s_median']:.2f} s "
          f"({rows[1]['step_s_median'] / rows[0]['step_s_median'] - 1:+.0%}) with {a.freeze} frozen; planned "
          f"{rows[0]['planned_tflop']:.3f} -> {rows[1]['planned_tflop']:.3f} TFLOP")  # fmt: skip


if __name__ == "__main__":
    main()
