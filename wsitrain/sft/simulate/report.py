"""A simulated step side by side with its plan, as text and as JSON."""

from __future__ import annotations

from typing import Any

from wsitrain.sft.simulate.step import SimulatedStep
from wsitrain.sft.simulate.tracker import Peak
from wsitrain.units import format_bytes

# What a simulated step cannot show; printed under every simulated figure.
NOT_SIMULATED = (
    "allocator rounding and fragmentation, cuBLAS/cuDNN workspaces and the CUDA context (the plan's runtime "
    "allowance and slack cover them), and time"
)


def _peak_dict(p: Peak) -> dict[str, Any]:
    return {
        "bytes": p.bytes,
        "where": p.where,
        "largest": [{"bytes": t.nbytes, "made_by": t.made_by, "allocated_at": t.where} for t in p.largest],
    }


def simulation_dict(s: SimulatedStep) -> dict[str, Any]:
    return {
        "device_peak": _peak_dict(s.device_peak),
        "host_peak": _peak_dict(s.host_peak),
        "replayed_peak_bytes": s.plan.replayed_peak_bytes,
        "estimated_peak_bytes": s.plan.estimated_peak_bytes,
        "budget_bytes": s.plan.budget_bytes,
        "host_bytes_planned": s.plan.host_bytes,
        "over_replay": s.over_replay,
        "within_budget": s.within_budget,
        "host_within_plan": s.host_within_plan,
        "disk_peak": _peak_dict(s.disk_peak),
        "spill_bytes_planned": s.plan.spill_bytes,
        "disk_within_plan": s.disk_within_plan,
        "stream_order": "checked",
        "accesses_checked": s.accesses_checked,
        "operators": s.operators,
        "tiles_visited": s.tiles_visited,
        "tiles_in_step": s.tiles_in_step,
        "seconds": s.seconds,
        "not_simulated": NOT_SIMULATED,
    }


def simulation_text(s: SimulatedStep) -> str:
    p = s.plan
    dev, host = s.device_peak, s.host_peak
    lines = [
        "simulated step (the real executor on fake tensors; forward, loss, backward, optimizer step):",
        f"  device peak, simulated: {format_bytes(dev.bytes)} at {dev.where}",
        f"    plan's replay {format_bytes(p.replayed_peak_bytes)} ({s.over_replay:+.1%} simulated over replay), "
        f"plan's estimate {format_bytes(p.estimated_peak_bytes)}, budget {format_bytes(p.budget_bytes)}: "
        + ("within budget" if s.within_budget else "OVER BUDGET"),
        "    largest live tensors then: "
        + "; ".join(f"{format_bytes(t.nbytes)} {t.made_by} (from {t.where})" for t in dev.largest[:4]),
        f"  host peak, simulated: {format_bytes(host.bytes)} at {host.where}; plan's host memory "
        f"{format_bytes(p.host_bytes)}: " + ("within" if s.host_within_plan else "OVER the plan"),
        *(
            [f"  disk spill peak, simulated: {format_bytes(s.disk_peak.bytes)} at {s.disk_peak.where}; plan's disk "
             f"spill {format_bytes(p.spill_bytes)}: " + ("within" if s.disk_within_plan else "OVER the plan")]
            if p.spill_bytes or s.disk_peak.bytes else []
        ),
        f"  stream ordering: {s.accesses_checked} data accesses checked, no violation "
        f"({s.operators} operators, {s.seconds:.1f} s to simulate)",
        f"  tiles: {s.tiles_visited} of the step's {s.tiles_in_step} forward and recompute visits simulated"
        + (
            ""
            if s.tiles_visited == s.tiles_in_step
            else " (every kind of tile, twice in a row: the same peaks as every tile; --every-tile visits all)"
        ),
        f"  not simulated: {NOT_SIMULATED}",
    ]
    return "\n".join(lines)
