"""The memory model against reality: planned peaks vs measured peak RSS growth of real CPU steps.

Each measurement runs in a fresh process: the baseline is the resident size with the model loaded,
the peak is the process's peak RSS after one training step. glibc's malloc is pinned to a fixed
mmap threshold there: with its default, dynamic threshold the heap fragments by an amount that
depends on tensor sizes (+0 to +35% here), which measures the allocator rather than the step.
The planner covers that with its allocator slack; this test checks the tensors it replays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = r"""
import json, sys, torch
from wsitrain.memory import PeakMeter
from wsitrain.models import build
from wsitrain.sft import SFT, plan
from wsitrain.sft.planning.costs import ALLOCATOR_SLACK
torch.manual_seed(0)
torch.set_num_threads(2)
name, size, frac = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
model = build(name, 2)
x = torch.rand(1, 3, size, size)
target = torch.randn(1, 2)
# BatchNorm unfolded: a fraction of plain's peak with BatchNorm as it is (folded, DarkNet-19 at 448 px holds a copy
# of its 80 MB of folded weights, which leaves 60% of plain no room; the fold's memory: test_sft_simulate.py)
base_plan = plan(model, (1, 3, size, size), "100GiB", device="cpu", fold_bn=False)
budget = int(frac * base_plan.baseline_peak_bytes)
net = SFT(model, memory_budget=budget, fold_bn=False) if frac < 1 else model
p = net.plan_for((1, 3, size, size)) if frac < 1 else base_plan
model_bytes = p.breakdown["parameters"]
fixed = model_bytes + p.breakdown["optimizer"] + p.breakdown["runtime"]
replayed = fixed + (p.estimated_peak_bytes - fixed) / ALLOCATOR_SLACK  # the tensors alone, without slack
meter = PeakMeter("cpu")  # restarts the high-water mark: imports and planning before the step must not count
meter.start()
base = meter.current()
torch.nn.functional.mse_loss(net(x), target).backward()
growth = meter.peak() - base
print(json.dumps({"planned": p.estimated_peak_bytes - model_bytes, "measured": growth,
                  "replayed": replayed - model_bytes,
                  "budget": budget - model_bytes, "modes": [s.mode for s in p.segments]}))
"""


def measure(name: str, size: int, frac: float) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, name, str(size), str(frac)], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def within(m: dict) -> None:
    assert 0.85 * m["replayed"] <= m["measured"] <= 1.15 * m["planned"], m
    # 25%: plans whose last segment folds the global pool are conservative by up to ~20% on DarkNet-19
    # (measured 125 MB against 151 MB planned at 448 px); the budget check below is what must never slip
    assert abs(m["planned"] - m["measured"]) / m["measured"] < 0.25, m


# Fresh processes measuring RSS: VGG-16 at 512 px 10 s alone, DarkNet-19 at 448 px 19-35 s in CI (measured); CI
# runs them (`make test-heavy`), `make test` does not (the planner's figures: test_sft_simulate.py,
# test_sft_cpu_budget.py). The untiled step is measured on DarkNet-19 only: on VGG-16 it was the same check of the
# plain plan, one more full step at 512 px, while the tiled step is VGG-16's own. VGG-16 runs at half its plain peak:
# two tiled segments, 10 s alone, where at 35% (one segment of 16x16 tiles, +138% compute) it took 20 s alone and
# 52-54 s in CI (measured 2026-12-02, the 2-core CPU).
@pytest.mark.heavy
@pytest.mark.parametrize(
    ("name", "size", "frac", "plain"), [("vgg16", 512, 0.5, False), ("darknet19", 448, 0.6, True)]
)
def test_planned_peak_matches_measured_rss(name: str, size: int, frac: float, plain: bool) -> None:
    """The measured peak lies within 15% of the plan: above the tensors replayed, below the estimate with slack."""
    if plain:
        within(measure(name, size, 1.0))
    sft = measure(name, size, frac)
    assert "tiled" in sft["modes"], sft
    within(sft)
    assert sft["measured"] <= 1.05 * sft["budget"], sft  # the budget holds up to the model's error
