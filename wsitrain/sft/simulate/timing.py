"""Timed steps on the simulated device: ``SFT``'s real executor, or plain PyTorch, priced by the clock (clock.py).

from wsitrain.sft.simulate.timing import clock_plain_step, clock_sft_step
with torch.device("meta"):
    model = build("resnet50", 2)
print(clock_sft_step(model, (1, 3, 8192, 8192), "10.47GiB", gpu_speed("h200"), "bf16").text())
"""

from __future__ import annotations

import copy
from typing import Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from wsitrain.gpu_speed import GpuSpeed
from wsitrain.sft.planning.costs import TimeModel
from wsitrain.sft.simulate.clock import ClockReading, OpClock
from wsitrain.sft.simulate.fast_ops import FAST_OPS
from wsitrain.sft.simulate.runtime import DEVICE_TYPE
from wsitrain.sft.simulate.step import OPTIMIZERS, SimulatedStep, simulate_step
from wsitrain.sft.simulate.tracker import LiveMemory
from wsitrain.sft.target import TargetDevice

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Patch training as users run it (issue 57's reference): a batch of 256 patches of 224 px, the H200's measured case
# (0.075 s a step, 172 Mpx/s for ResNet-50 in bf16, channels_last: docs/benchmarks/gpu_time_breakdown.md)
PATCHES, PATCH = 256, 224


def _act(precision: str) -> torch.dtype | None:
    return LOW_PRECISION.get(precision)


def clock_sft_step(
    model: nn.Module,
    shape: tuple[int, ...],
    memory_budget: int | str,
    speed: GpuSpeed,
    precision: str = "fp32",
    *,
    optimizer: str = "adamw",
    target: TargetDevice | None = None,
    every_tile: bool = False,
    tile_size: int | None = None,
    time_model: TimeModel | None = None,
    plan_optimizer: str | None | Literal["same"] = "same",
    one_pass_falls_back: bool = False,
    fold_bn: bool = True,
    copy_free: bool = True,
) -> tuple[ClockReading, SimulatedStep, OpClock]:
    """One ``SFT`` step (the image a uint8 host tensor, as ``fit`` feeds it) on the simulated device, timed for
    ``speed``'s card in ``precision``. The step's memory figures are valid in fp32 only (see simulate_step). The
    clock is returned too: ``clock.reading(other_speed, precision)`` prices the same step with other constants.
    ``time_model``: the planner's constants (None: the device's defaults), as ``SFT(time_model=...)``.
    ``plan_optimizer``, ``one_pass_falls_back``, ``fold_bn``, ``copy_free``: as ``simulate_step``'s."""
    clock = OpClock(precision in LOW_PRECISION)
    sim = simulate_step(
        model, shape, memory_budget, optimizer=optimizer, target=target, every_tile=every_tile, clock=clock,
        act_dtype=_act(precision), tile_size=tile_size, time_model=time_model, plan_optimizer=plan_optimizer,
        one_pass_falls_back=one_pass_falls_back, fold_bn=fold_bn, copy_free=copy_free,
    )  # fmt: skip
    return clock.reading(speed, precision), sim, clock


def clock_plain_step(
    model: nn.Module, shape: tuple[int, ...], speed: GpuSpeed, precision: str = "fp32", *, optimizer: str = "adamw"
) -> tuple[ClockReading, OpClock]:
    """One plain PyTorch step (the image already on the device, as the issue's measurement had it), timed (and
    its clock, to price again)."""
    clock = OpClock(precision in LOW_PRECISION)
    params = [p for p in model.parameters() if p.requires_grad]
    memory = LiveMemory(fast=FAST_OPS)  # only for its shape-only BatchNorm: 10-100x faster than the fake one
    with FakeTensorMode(allow_non_fake_inputs=True), memory:
        opt = OPTIMIZERS[optimizer](params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()  # the optimizer's state exists from earlier steps, as in a timed step after a warm-up
        for p in params:
            p.grad = None
        image = torch.empty(shape, dtype=torch.uint8, device=DEVICE_TYPE)  # (B, C, H, W) on the device
        target = torch.zeros(shape[0], dtype=torch.long, device=DEVICE_TYPE)
        with clock:
            clock.mark("forward")
            logits = model(image.float())
            clock.mark("loss and backward")
            loss = nn.functional.cross_entropy(logits.float(), target)
            loss.backward()
            clock.mark("optimizer step")
            clock.optimizer_phase = True
            opt.step()
        del opt, loss, logits
    for p in params:
        p.grad = None
    return clock.reading(speed, precision), clock


def patch_training_model(model: nn.Module) -> nn.Module:
    """A copy of ``model`` as torchvision or timm builds it for patch training: every BatchNorm that
    ``freeze_batchnorm`` froze back to its own class, in training mode (batch statistics), nothing folded (plain
    PyTorch). The copy shares nothing with ``model`` (a meta model copies for free)."""
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if getattr(m, "sft_frozen_bn", False):
            m.__class__ = next(c for c in type(m).__mro__[1:] if not c.__dict__.get("sft_frozen_bn", False))
    return ref.train()


def clock_patch_reference(
    model: nn.Module,
    speed: GpuSpeed,
    precision: str = "fp32",
    *,
    optimizer: str = "adamw",
    patches: int = PATCHES,
    patch: int = PATCH,
) -> tuple[ClockReading, float]:
    """Patch training's step on the simulated device (``patch_training_model``, ``patches`` images of ``patch`` px
    on the device) and its throughput in Mpx/s. The clock has no memory-format term: the channels_last the users'
    step runs in is priced as NCHW (measured on the H200: 0.075 s; the clock's 0.081 s,
    docs/research/simulated-clock.md)."""
    reading = clock_plain_step(patch_training_model(model), (patches, 3, patch, patch), speed, precision,
                               optimizer=optimizer)[0]  # fmt: skip
    return reading, patches * patch * patch / reading.seconds / 1e6

