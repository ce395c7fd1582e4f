"""Out of memory in a training step is a plan problem, not a crash.

The engine plans every step within the run's budget; a CUDA out-of-memory error means the memory model was wrong
for this slide (or something else took device memory). ``OomRetry`` then says what the plan expected and what the
device held, lowers the engine's budget by the overshoot plus ``OOM_MARGIN``, re-plans, and runs the step again,
once. A second out-of-memory error ends the run with a ``PlanError`` (exit 2); no checkpoint is written on the way
out, so ``last.pt`` stays the last complete one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wsitrain.errors import PlanError
from wsitrain.sft import SFT, Plan
from wsitrain.train.loop import SlideStep, Trainer, as_batch
from wsitrain.units import format_bytes, parse_bytes

# The re-plan leaves this share of the old budget free on top of the overshoot seen. The CUDA memory model's own
# headroom (costs.HEADROOM["cuda"], 3%) is not measured on a GPU yet; an out-of-memory error says its error was
# larger than that, and the caching allocator's rounding and splitting (the 10% costs.ALLOCATOR_SLACK plans for)
# is the first suspect, so the retry keeps that much again: an error of the same size as the one just seen fits.
OOM_MARGIN = 0.10
# The largest blocks the report lists (torch.cuda.memory_snapshot): enough to see which tensors dominate.
LARGEST_BLOCKS = 5

_TRIED = re.compile(r"Tried to allocate ([0-9.]+ ?[KMGT]i?B)")


@dataclass(frozen=True)
class MemoryAtOom:
    """What the device held when the allocation failed (None: not known on this device)."""

    allocated: int | None = None  # torch.cuda.memory_allocated: live tensors
    reserved: int | None = None  # torch.cuda.memory_reserved: the caching allocator's segments
    peak: int | None = None  # torch.cuda.max_memory_allocated since the step started
    requested: int | None = None  # the failed allocation ("Tried to allocate ..." in torch's message)
    largest_blocks: tuple[int, ...] = ()  # sizes of the largest allocated blocks, largest first

    @property
    def needed(self) -> int | None:
        """Bytes the step needed at least: the larger of its peak and what was held plus the failed request."""
        held = None if self.allocated is None else self.allocated + (self.requested or 0)
        known = [v for v in (held, self.peak) if v is not None]
        return max(known) if known else None


MemoryProbe = Callable[[torch.device, str], MemoryAtOom]


def probe_memory_at_oom(device: torch.device, message: str) -> MemoryAtOom:
    """The CUDA allocator's figures at the failure; on another device only the failed request is known."""
    requested = _requested_bytes(message)
    if device.type != "cuda":
        return MemoryAtOom(requested=requested)
    blocks: list[int] = []
    try:
        for seg in torch.cuda.memory_snapshot():
            blocks += [int(b["size"]) for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
    except RuntimeError:  # snapshots need the native allocator; a pluggable one has none
        blocks = []
    return MemoryAtOom(
        allocated=int(torch.cuda.memory_allocated(device)),
        reserved=int(torch.cuda.memory_reserved(device)),
        peak=int(torch.cuda.max_memory_allocated(device)),
        requested=requested,
        largest_blocks=tuple(sorted(blocks, reverse=True)[:LARGEST_BLOCKS]),
    )


def _requested_bytes(message: str) -> int | None:
    m = _TRIED.search(message)
    return parse_bytes(m.group(1).replace(" ", ""), "requested") if m else None


def lowered_budget(budget: int, planned_peak: int, mem: MemoryAtOom, margin: float = OOM_MARGIN) -> tuple[int, int]:
    """(new budget, overshoot): the budget less the step's overshoot over its plan and ``margin`` of the budget."""
    needed = mem.needed
    overshoot = max(0, needed - planned_peak) if needed is not None else 0
    return int(budget - overshoot - margin * budget), overshoot


def describe(plan: Plan, budget: int, mem: MemoryAtOom) -> str:
    """One paragraph: the plan's peak against what the device held."""

    def b(v: int | None) -> str:
        return "not known on this device" if v is None else format_bytes(v)

    parts = [
        f"planned peak {format_bytes(plan.estimated_peak_bytes)} of a {format_bytes(budget)} budget",
        f"allocated {b(mem.allocated)}",
        f"reserved {b(mem.reserved)}",
        f"step peak {b(mem.peak)}",
        f"failed request {b(mem.requested)}",
    ]
    if mem.largest_blocks:
        parts.append("largest blocks " + ", ".join(format_bytes(s) for s in mem.largest_blocks))
    return "; ".join(parts)


class OomRetry:
    """Runs ``Trainer.train_slide`` and answers one out-of-memory error with a re-plan and a retry."""

    def __init__(
        self,
        trainer: Trainer,
        engine: SFT,
        log: Callable[[str], None],
        event: Callable[[dict[str, Any]], None],
        probe: MemoryProbe = probe_memory_at_oom,
    ) -> None:
        self.trainer = trainer
        self.engine = engine
        self.log = log
        self.event = event  # one row for metrics.jsonl
        self.probe = probe  # injectable: tests give the figures a GPU would
        self.replans = 0

    def train_slide(self, image: torch.Tensor, label: int | torch.Tensor, scale: float, slide: str) -> SlideStep:
        snapshot = _grad_snapshot(self.trainer.params)
        try:
            return self.trainer.train_slide(image, label, scale)
        except torch.OutOfMemoryError as err:
            # Only figures leave this block: the exception's traceback holds the failed step's tensors.
            first = self._failure(image, str(err))
        _restore_grads(self.trainer.params, snapshot)  # the failed backward may have added part of its gradient
        _free_cache(self.trainer.device)
        plan, budget, mem = first
        new_budget, overshoot = lowered_budget(budget, plan.estimated_peak_bytes, mem)
        what = f"out of device memory ({describe(plan, budget, mem)})"
        if new_budget <= 0:  # the recipe names the slide
            raise PlanError(f"{what}; no smaller budget is left to re-plan with", hint=_HINT)
        self.engine.replan(new_budget)
        self.replans += 1
        self.log(
            f"slide {slide}: {what}. Re-planning with the budget lowered to {format_bytes(new_budget)} (overshoot "
            f"{format_bytes(overshoot)} + {OOM_MARGIN:.0%} margin) and retrying the step once."
        )
        self.event({
            "kind": "oom_replan", "slide": slide, "budget_bytes": budget, "new_budget_bytes": new_budget,
            "planned_peak_bytes": plan.estimated_peak_bytes, "overshoot_bytes": overshoot,
            "allocated_bytes": mem.allocated, "reserved_bytes": mem.reserved, "peak_bytes": mem.peak,
            "requested_bytes": mem.requested, "largest_blocks": list(mem.largest_blocks),
        })  # fmt: skip
        try:
            return self.trainer.train_slide(image, label, scale)
        except torch.OutOfMemoryError as err:
            second = self._failure(image, str(err))
        except PlanError as err:  # nothing fits the lowered budget
            raise PlanError(f"{what}; re-planned within {format_bytes(new_budget)}: {err.message}", hint=_HINT) from err
        plan, budget, mem = second
        raise PlanError(
            f"out of device memory again after re-planning within {format_bytes(budget)} "
            f"({describe(plan, budget, mem)}); the run stops here, the last checkpoint is unchanged",
            hint=_HINT,
        )

    def _failure(self, image: torch.Tensor, message: str) -> tuple[Plan, int, MemoryAtOom]:
        mem = self.probe(self.trainer.device, message)
        plan = self.engine.plan_of(as_batch(image), self.trainer.activation_dtype)
        return plan, self.engine.budget_bytes, mem


_HINT = (
    "set engine.memory_budget below the planned peak shown (other processes may share the GPU), train in bf16 "
    "(train.precision), or read slides at a coarser resolution (data.mpp / data.level); then continue with "
    "`wsitrain fit CONFIG --resume RUN_DIR`, and report the figures above if the GPU was otherwise idle"
)


def _grad_snapshot(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None] | None:
    """Host copies of the gradients earlier slides of the accumulation window left (None: there are none).

    Costs a device-to-host copy of the gradients per slide only inside a window of ``train.accumulate`` > 1.
    """
    if all(p.grad is None for p in params):
        return None
    return [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in params]


def _restore_grads(params: list[torch.nn.Parameter], snapshot: list[torch.Tensor | None] | None) -> None:
    """Gradients back to what they were before the failed slide, so the retry does not count it twice."""
    for i, p in enumerate(params):
        saved = None if snapshot is None else snapshot[i]
        if saved is None:
            p.grad = None
        else:
            assert p.grad is not None
            p.grad.copy_(saved)


def _free_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the failed step's cached blocks back before the smaller plan allocates
