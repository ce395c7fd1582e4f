"""Where each host-side checkpoint lives: the host's RAM, or a memory-mapped file on local disk (engine.spill_dir).

The planner decides what leaves the device (``checkpoint_location == "host"``); this decides, within a host RAM
budget per rank (``engine.host_memory``, ``plan --host-memory``), which of those stay in RAM. The stager's
page-locked buffers must be RAM; each host checkpoint (the image, when it is segment 0's input on the host, and a
later checkpoint with its gradient buffer) is kept in RAM largest first while the budget holds it, and spills to
disk otherwise, so the fewest bytes go to disk for a budget a few large checkpoints dominate. Nothing on the device
changes: a spilled checkpoint is staged tile by tile exactly as a host one (execution/spill.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from wsitrain.sft.plan_types import Plan, SegmentPlan
from wsitrain.units import format_bytes


def host_items(plan: Plan) -> dict[int, int]:
    """Host RAM each host checkpoint takes, by segment index: the image (segment 0's input on the host; a uint8
    slide has no gradient buffer) and every later host checkpoint with its gradient buffer (twice its bytes)."""
    items: dict[int, int] = {}
    for s in plan.segments:
        if s.start == 0 and plan.input_on_host:
            items[s.index] = math.prod(plan.input_shape) * getattr(torch, plan.input_dtype).itemsize
        elif s.start and s.checkpoint_location == "host":
            items[s.index] = 2 * s.checkpoint_bytes
    return items


def place_host(plan: Plan, host_budget: int | None) -> Plan:
    """``plan`` with each host checkpoint placed in RAM or on disk within ``host_budget`` bytes per rank.

    ``host_budget`` None: no budget, everything stays in RAM (the plan unchanged). A plan whose RAM-only part (the
    staging buffers) exceeds the budget does not fit, with a note saying so."""
    if host_budget is None:
        return plan
    items = host_items(plan)
    used = plan.staging_bytes
    spilled: set[int] = set()
    for k, nbytes in sorted(items.items(), key=lambda kv: (-kv[1], kv[0])):
        if used + nbytes <= host_budget:
            used += nbytes
        else:
            spilled.add(k)
    segments = tuple(_placed(s, spilled) for s in plan.segments)
    notes = plan.notes
    fits = plan.fits
    if used > host_budget:
        fits = False
        notes = (
            *notes,
            f"host RAM per rank {format_bytes(used)} exceeds the host budget {format_bytes(host_budget)} even with "
            "every host checkpoint on disk: raise engine.host_memory (plan --host-memory), or run fewer ranks per "
            "node",
        )
    spill = sum(items[k] for k in spilled)
    return dataclasses.replace(
        plan,
        segments=segments,
        host_bytes=used,  # the staging buffers and what stays in RAM (placing a placed plan again changes nothing)
        spill_bytes=spill,
        host_budget_bytes=int(host_budget),
        fits=fits,
        notes=notes,
    )


def _placed(s: SegmentPlan, spilled: set[int]) -> SegmentPlan:
    on_disk, out_on_disk = s.index in spilled, s.index + 1 in spilled
    if on_disk == s.spilled and out_on_disk == s.output_spilled:
        return s
    return dataclasses.replace(s, spilled=on_disk, output_spilled=out_on_disk)


def image_on_disk(plan: Plan) -> bool:
    """The placement put the image, segment 0's host input, past the host RAM budget (a loader without
    data.stream_tiles decodes whole slides into engine.spill_dir then: ``train.engine.slide_spill``)."""
    return plan.input_on_host and bool(plan.segments) and plan.segments[0].spilled
