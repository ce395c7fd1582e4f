"""The simulated clock's time for a bench configuration, printed beside the measured one.

Plain steps (``base``) and SFT steps (the planner's plan, or a forced tile edge) are run on the simulated device
and priced with the preset's constants (``wsitrain.sft.simulate.clock``). ``checkpoint_sequential`` is not
simulated (None). A configuration that does not fit its budget has no simulated time either.
"""

from __future__ import annotations

import torch

from wsitrain.bench.configs import BenchConfig
from wsitrain.errors import PlanError
from wsitrain.gpu_speed import GpuSpeed
from wsitrain.models import build
from wsitrain.sft.simulate.timing import clock_plain_step, clock_sft_step
from wsitrain.sft.target import TargetDevice

BENCH_CLASSES = 2  # bench builds its models with two classes (worker.py)


def simulated_ms(cfg: BenchConfig, speed: GpuSpeed, target: TargetDevice) -> float | None:
    """The configuration's step on the preset, simulated, in milliseconds; None where it is not simulated."""
    if cfg.strategy not in ("base", "sft") or cfg.budget_bytes is None:
        return None
    with torch.device("meta"):
        model = build(cfg.model, BENCH_CLASSES)
    shape = (1, 3, cfg.size, cfg.size)
    if cfg.strategy == "base":
        return 1000.0 * clock_plain_step(model, shape, speed, cfg.precision)[0].seconds
    try:
        reading, _, _ = clock_sft_step(
            model, shape, cfg.budget_bytes, speed, cfg.precision, target=target, tile_size=cfg.tile
        )  # fmt: skip
    except PlanError:
        return None
    return 1000.0 * reading.seconds
