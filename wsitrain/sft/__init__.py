"""SFT engine: exact segmented fused-tiled training of CNNs on images larger than GPU memory.

from wsitrain.sft import SFT, plan
p = plan(model, input_shape=(1, 3, 20480, 20480), memory_budget="11GiB")
m = SFT(model, memory_budget="11GiB")
loss_fn(m(x), t).backward()    # same gradients as plain autograd
"""

from wsitrain.sft.api import SFT
from wsitrain.sft.execution.stats import StepStats, TileStat
from wsitrain.sft.plan_api import max_square_size, plan
from wsitrain.sft.plan_types import Plan, SegmentPlan

__all__ = ["SFT", "Plan", "SegmentPlan", "StepStats", "TileStat", "max_square_size", "plan"]
