"""One training step of the real executor on the simulated device: forward, loss, backward, optimizer step.

The model is built on the ``meta`` device (no parameter holds memory); under ``FakeTensorMode`` the image is a fake
host tensor (uint8, as ``wsitrain fit`` streams it) and every operator computes shapes only. ``SFT`` runs its real
plan with the simulated CUDA runtime (``runtime.SimRuntime``), so the host staging code issues the same copies,
streams and events it would on a GPU, and every ordering rule is checked. ``tracker.LiveMemory`` counts live
storages on the device and the host. Nothing is allocated for real, and only representative tiles run
(``representative.py``): VGG-16 at 20480 px simulates in 5-25 s on one core, at 100,000 px in under 10 s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from wsitrain.errors import PlanError
from wsitrain.sft.api import SFT
from wsitrain.sft.execution.multipass import MultiPassSegment
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.execution.tiled import TiledSegment
from wsitrain.sft.execution.transfers import Copies
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.costs import TimeModel
from wsitrain.sft.regions import SegmentRegions
from wsitrain.sft.simulate.clock import OpClock
from wsitrain.sft.simulate.fast_ops import FAST_OPS
from wsitrain.sft.simulate.fused_attention import fused_attention
from wsitrain.sft.simulate.representative import representative_tiles, tile_weight
from wsitrain.sft.simulate.runtime import DEVICE_TYPE, SimRuntime
from wsitrain.sft.simulate.tracker import LiveMemory, Peak, SimSpill
from wsitrain.sft.target import TargetDevice

# Host bytes outside the plan's host memory a step may hold: the optimizer's per-parameter step counters
# (measured: 161 x 4 B for ResNet-50's Adam). 1 MiB leaves room for any model's.
HOST_BOOKKEEPING = 1 << 20

# fn(tiles done, tiles in the step): progress of a long simulation
Progress = Callable[[int, int], None]

# Optimizers the simulation runs, with the foreach implementation CUDA uses by default (its temporaries count).
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, foreach=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, foreach=True),
}


@dataclass(frozen=True)
class SimulatedStep:
    """What one simulated step held, next to what its plan said."""

    plan: Plan
    device_peak: Peak  # live tensor bytes on the simulated device, at their peak
    host_peak: Peak  # live host RAM bytes (the image, host checkpoints, staging buffers), at their peak
    seconds: float  # wall time of the simulation (not of a GPU step)
    operators: int  # operators the executor ran
    accesses_checked: int  # data accesses the stream-ordering checker verified
    tiles_visited: int  # forward and recompute visits simulated
    tiles_in_step: int  # ... of those a real step makes (equal when every tile was simulated)
    disk_peak: Peak = Peak(0, "start", ())  # live bytes spilled to engine.spill_dir's files, at their peak

    @property
    def over_replay(self) -> float:
        """Simulated device peak over the plan's replay, minus one (+0.03: 3% above)."""
        return self.device_peak.bytes / max(1, self.plan.replayed_peak_bytes) - 1.0

    @property
    def within_budget(self) -> bool:
        return self.device_peak.bytes <= self.plan.budget_bytes and self.plan.estimated_peak_bytes <= (
            self.plan.budget_bytes
        )

    @property
    def host_within_plan(self) -> bool:
        # Adam keeps each parameter's step count as a 4-byte CPU tensor (as on CUDA without capturable/fused):
        # a few KiB the plan does not name
        return self.host_peak.bytes <= self.plan.host_bytes + HOST_BOOKKEEPING

    @property
    def disk_within_plan(self) -> bool:
        return self.disk_peak.bytes <= self.plan.spill_bytes


def _tiles_in_step(plan: Plan, every_tile: bool) -> int:
    """Tiles the executor visits in one step: forward and recompute (sweeps of multi-pass segments not counted)."""

    def visits(n: int, regions: SegmentRegions | None) -> int:
        return n if every_tile or regions is None else len(representative_tiles(regions))

    return sum(
        visits(s.n_forward_tiles, s.sweep_regions) + visits(s.n_tiles, s.regions)
        for s in plan.segments
        if s.mode == "tiled"
    )


def simulate_step(
    model: nn.Module,
    input_shape: tuple[int, ...],
    memory_budget: int | str,
    *,
    optimizer: str = "adam",
    input_dtype: torch.dtype = torch.uint8,
    tile_size: int | None = None,
    checkpoints: list[str] | None = None,
    host_checkpoints: str = "auto",
    progress: Progress | None = None,
    copies: Callable[[SimRuntime], Copies] | None = None,
    fast_ops: bool = True,
    every_tile: bool = False,
    target: TargetDevice | None = None,
    clock: OpClock | None = None,
    act_dtype: torch.dtype | None = None,
    time_model: TimeModel | None = None,
    host_memory: int | str | None = None,
    plan_optimizer: str | None | Literal["same"] = "same",
    one_pass_falls_back: bool = False,
) -> SimulatedStep:
    """Run one training step of ``SFT(model)`` on the simulated CUDA device (see the module doc).

    ``model`` must live on the ``meta`` device (build it under ``with torch.device("meta")``); its parameters
    receive fake gradients. Raises ``PlanError`` when the plan does not fit, ``StreamOrderError`` when the transfer
    code breaks an ordering rule. ``copies(runtime)``, when given, replaces the stager's stream copies (the tests'
    deliberately broken variants). ``fast_ops``: shape-only BatchNorm (``fast_ops.py``; the same bytes, 10-100x
    faster than the fake implementation). ``every_tile``: visit every tile; by default only the representative
    tiles (``representative.py``: every kind of tile, twice in a row; the same peaks, tested), which makes a
    100,000 px step seconds instead of hours. ``target``: the GPU the plan is for (a preset's generation and
    allowances); None plans for a CUDA device not named. ``clock``: price every operator on a GPU preset
    (``clock.py``; representative tiles count for the tiles they stand for). ``act_dtype``: plan and run the
    executor for autocast's activation dtype (bf16) while the fake tensors stay float32 (the simulated device has
    no autocast): only the clock's figures mean anything then (it counts two bytes per element), not the peaks.
    ``time_model``: the planner's (None: the device's defaults). ``host_memory``: the host RAM budget per rank
    (``SFT``'s): host checkpoints past it, and the image when the plan spills it, are counted as disk.
    ``plan_optimizer``: the optimizer the plan holds the state of, when it is not the one the step runs (a GPU kit's
    ``SFT`` of before 2026-11-27 planned with none and trained with AdamW: its replay plans so).
    ``one_pass_falls_back``: one-pass segments recompute after their pass, as a bf16 step did on a GPU before
    2026-11-27 (``ExecHooks.one_pass_falls_back``); fake tensors have no gradient to find off the direction.
    """
    if any(t.device.type != DEVICE_TYPE for t in [*model.parameters(), *model.buffers()]):
        raise PlanError(
            "the simulated device needs a model built on the meta device",
            hint='build it under `with torch.device("meta"):` (nothing is allocated) and pass that model',
        )
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer {optimizer!r} is not simulated", hint=f"use one of: {', '.join(OPTIMIZERS)}")
    rt = SimRuntime()
    sft = SFT(
        model, memory_budget=memory_budget, tile_size=tile_size, checkpoints=checkpoints,
        optimizer=optimizer if plan_optimizer == "same" else plan_optimizer,
        collect_stats=False, host_checkpoints=host_checkpoints, runtime=rt, target=target, time_model=time_model,
        host_memory=host_memory,
    )  # fmt: skip
    memory = LiveMemory(observer=rt.observe, fast=FAST_OPS if fast_ops else None)
    spill = SimSpill(memory)
    sft._stager = HostStager(copies(rt) if copies is not None else None, runtime=rt, spill=spill)  # before any plan
    sft._hooks.one_pass_falls_back = one_pass_falls_back
    if clock is not None:  # CUDA packs tiles on the stager's worker thread: the clock prices them on that lane
        sft._stager.pack_scope = clock.staging
    shape = tuple(input_shape)
    plan = sft.plan_for(shape, dtype=act_dtype, input_dtype=input_dtype, input_on_host=True)  # raises: no fit
    if act_dtype is not None:  # forward finds the plan made for autocast's dtype (see the doc above)
        sft._act_dtype = lambda device: act_dtype  # type: ignore[method-assign]
    visits = _tiles_in_step(plan, every_tile)
    total = max(1, visits)
    memory.on_free = rt.on_free
    done = [0]

    def at_tile(seg: int, r: int, c: int, phase: str) -> None:
        memory.where = f"segment {seg}, tile ({r}, {c}), {phase}"
        if clock is not None:
            sp = plan.segments[seg]
            regions = sp.sweep_regions if phase == "forward" else sp.regions
            weight = 1 if every_tile or regions is None else tile_weight(regions, r, c)
            # a forward sweep whose one tile is the whole map runs whole-map convolutions, not tiles
            tiled = regions is not None and not (phase == "forward" and sp.forward_grid == (1, 1))
            clock.mark(memory.where, weight, tiled, sweep=_cast_sweep(sft, seg, phase))
        done[0] += 1
        if progress is not None:
            progress(min(done[0], total), total)

    sft._hooks.on_tile = at_tile
    sft._hooks.visit = None if every_tile else representative_tiles
    sft._hooks.on_sync = clock.sync if clock is not None else None  # fake tensors: the executor says where it reads
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    timed = clock if clock is not None else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True), memory, fused_attention():
        memory.adopt([*model.parameters(), *model.buffers()], "the model")
        # A step of a run holds the optimizer's state from the steps before it through forward and backward
        # (measured on an H100: every step after the first peaked 0.1-0.2 GiB higher, AdamW's two moments of
        # ResNet-50 / DarkNet-19): create it with an earlier step on zero gradients, as training's first step would.
        memory.where = "optimizer state (an earlier step)"
        opt = OPTIMIZERS[optimizer](params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in params:
            p.grad = None
        # (B, C, H, W) on the host, as the loader streams it; in a spill file where the plan puts the image on disk
        image = (spill.empty if plan.segments[0].spilled else torch.empty)(shape, dtype=input_dtype)
        target = torch.zeros(shape[0], dtype=torch.long, device=DEVICE_TYPE)
        with timed:
            _mark(clock, "forward")
            memory.where = "forward"
            logits = sft(image)
            memory.where = "loss"
            _mark(clock, "loss and backward")
            loss = nn.functional.cross_entropy(logits.float(), target)
            del logits
            memory.where = "backward (head)"
            loss.backward()
            del loss
            memory.where = "optimizer step"
            _mark(clock, "optimizer step", optimizer=True)
            opt.step()
        memory.where = "end of step"
        del opt
    for p in params:
        p.grad = None
    sft._hooks.on_tile = None
    sft._hooks.visit = None
    sft._hooks.on_sync = None
    return SimulatedStep(
        plan=plan,
        device_peak=memory.peaks[DEVICE_TYPE],
        host_peak=memory.peaks["cpu"],
        disk_peak=memory.peaks.get("disk", Peak(0, "start", ())),
        seconds=time.perf_counter() - t0,
        operators=memory.ops,
        accesses_checked=rt.checked,
        tiles_visited=visits,
        tiles_in_step=_tiles_in_step(plan, True),
    )


def _cast_sweep(sft: SFT, seg: int, phase: str) -> str | None:
    """The sweep a tile visit belongs to when that sweep casts each weight once (a tiled segment's forward or
    recompute: ``TiledSegment.cast_once``; multi-pass segments cast per tile), else None."""
    if phase not in ("forward", "backward"):
        return None
    segment = next(reversed(sft._cache.values())).segments[seg]  # the plan this step runs (the newest)
    once = isinstance(segment, TiledSegment) and not isinstance(segment, MultiPassSegment) and segment.cast_once
    return f"segment {seg} {phase}" if once else None


def _mark(clock: OpClock | None, label: str, optimizer: bool = False) -> None:
    if clock is not None:
        clock.mark(label)
        clock.optimizer_phase = optimizer
