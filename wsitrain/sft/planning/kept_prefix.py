"""Keep a patch encoder's frozen prefix output from the forward sweep, or recompute it: decided per plan.

A patch trunk whose stem and leading blocks are frozen (``wsitrain/patch/prefix.py``) gives each chunk's recompute
a choice: run the frozen prefix forward again (autograd keeps nothing for it, but it costs its FLOPs), or start
from the first trainable block's input kept by the forward sweep, (patches, tokens, D) for the whole slide, held
from the sweep to the chunk's backward. The plan keeps it where the plan's peak plus those bytes stays within the
budget (with the plan's headroom) and the step gets faster, and counts them in its peak, its breakdown
(``kept_prefix``) and its time. A forward sweep planned on its own larger tiles (planning/forward.py) then runs on
the recompute's, so each kept chunk is one the recompute reads back: the time model prices the sweep's extra calls
against the prefix FLOPs saved, and the sweep's smaller tiles only lower its peak. Not kept where the image wants
its gradient (it flows back through the frozen blocks, which must then run under autograd), in a one-pass
segment (no sweep, no recompute), or in a segment run in sweeps around a statistics barrier.
"""

from __future__ import annotations

import dataclasses

from wsitrain.sft.ops.barriers import segment_barriers
from wsitrain.sft.ops.patch_grid import patches_in, prefix_cost
from wsitrain.sft.plan_types import Plan, SegmentPlan
from wsitrain.sft.planning.costs import forward_work
from wsitrain.sft.planning.session import PlanSession

KEEP_MODES = ("auto", "always", "never")  # SFT(keep_prefix=...): by the budget, whenever possible, never


def _prefix(sess: PlanSession, seg: SegmentPlan) -> tuple[int, int, float] | None:
    """(blocks, bytes for every patch, prefix FLOPs for every patch) of the patch trunk in ``seg``; None without."""
    f = sess.facts
    for i in range(seg.start + 1, seg.end + 1):
        memo = prefix_cost(f.nodes[i].spec)
        pc = memo(f.act_dtype) if memo is not None else None
        if pc is not None:
            n = patches_in(f.nodes[i].spec, sess.numel(i))  # patches times the batch
            return pc.blocks, int(n * pc.bytes), n * pc.flops
    return None


def _sweep_on_recompute_tiles(sess: PlanSession, seg: SegmentPlan) -> float:
    """What running ``seg``'s forward sweep on the recompute's tiles rather than its own adds to the step in the time
    model: the same FLOPs and traffic in more calls (0 when it runs on them already)."""
    if not seg.forward_grid:
        return 0.0
    f, extra = sess.facts, 0.0
    for i in range(seg.start + 1, seg.end + 1):
        out, ins = sess.numel(i), sum(sess.numel(v) for v in f.nodes[i].inputs)
        more = forward_work(f, i, out, ins, seg.n_tiles, sess.tm).time
        extra += more - forward_work(f, i, out, ins, seg.n_forward_tiles, sess.tm).time
    return max(0.0, extra)


NO_ROOM = "does not fit the budget beside the plan"


def prefix_room(plan: Plan) -> int:
    """The bytes a plan would have to leave free to keep a frozen prefix the budget did not hold beside it (with
    the plan's allocator slack and headroom, a quarter more), 0 when none: the planner then plans again within
    the budget less that, and keeps the faster of the two steps (planning/planner.py)."""
    return sum(s.prefix_bytes for s in plan.segments if s.prefix_why == NO_ROOM) * 5 // 4


def keep_prefix(sess: PlanSession, plan: Plan, budget: int, mode: str = "auto") -> Plan:
    """``plan`` with each tiled patch segment's frozen prefix kept or recomputed (see the module doc)."""
    if mode not in KEEP_MODES:
        raise ValueError(f"keep_prefix {mode!r}: use one of {', '.join(KEEP_MODES)}")
    f = sess.facts
    replayed = plan.replayed_peak_bytes + sess.terms.runtime
    segments, saved_flops, saved_time = [], 0.0, 0.0
    for seg in plan.segments:
        found = _prefix(sess, seg) if seg.mode == "tiled" else None
        if found is None:
            segments.append(seg)
            continue
        blocks, need, flops = found
        fits = replayed + need <= sess.terms.effective_budget(budget)
        sweep = _sweep_on_recompute_tiles(sess, seg)
        nodes = range(seg.start, seg.end + 1)
        sweeps = segment_barriers({i: f.nodes[i].spec for i in nodes}, {i: f.nodes[i].inputs for i in nodes},
                                  seg.start, seg.end)  # fmt: skip
        why = (
            "the image wants its gradient, which flows back through the frozen blocks" if f.nodes[0].requires_grad
            else "one pass: no forward sweep, no recompute" if seg.one_pass
            else "the segment runs in sweeps (a statistics barrier; execution/multipass.py)" if sweeps
            else "engine keep_prefix: never" if mode == "never"
            else "" if mode == "always"
            else "the plan does not fit" if not plan.fits
            else NO_ROOM if not fits
            # the prefix FLOPs saved (at their FLOP price) must beat the sweep's extra calls on smaller tiles
            else "the forward sweep on the recompute's tiles would cost more than it saves" if flops <= sweep
            else ""
        )  # fmt: skip
        kept = not why
        seg = dataclasses.replace(seg, prefix_bytes=need, kept_prefix=kept, prefix_blocks=blocks, prefix_why=why)
        if kept:
            replayed += need
            saved_flops += flops
            saved_time += flops - sweep
            seg = dataclasses.replace(seg, forward_grid=(), forward_tile_shape=(), forward_tile_edge=0,
                                      forward_regions=None)  # fmt: skip
        segments.append(seg)
    kept_bytes = sum(s.prefix_bytes for s in segments if s.kept_prefix)
    if not kept_bytes:
        return dataclasses.replace(plan, segments=tuple(segments))
    peak = sess.terms.scale_peak(replayed)
    # held from the patch segment's forward sweep to its backward: every segment from it on runs beside it
    first = next(k for k, s in enumerate(segments) if s.kept_prefix)
    segments = [s if k < first else dataclasses.replace(s, peak_bytes=s.peak_bytes + kept_bytes)
                for k, s in enumerate(segments)]  # fmt: skip
    # the recompute no longer runs the prefix: its FLOPs leave the step, in the time model at their FLOP price
    return dataclasses.replace(
        plan, segments=tuple(segments), estimated_peak_bytes=peak, fits=plan.fits and peak <= budget,
        breakdown={**plan.breakdown, "kept_prefix": kept_bytes}, replayed_peak_bytes=int(replayed - sess.terms.runtime),
        flops_sft=plan.flops_sft - saved_flops, time_sft=plan.time_sft - saved_time,
    )  # fmt: skip
