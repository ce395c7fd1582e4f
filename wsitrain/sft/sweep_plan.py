"""What a multi-pass segment (``wsitrain.sft.multipass``) runs on and costs: owned regions and extra sweeps.

Each tile owns a part of every barrier input: the tiles' parts partition the map exactly, so a
statistic summed over them counts every position once. A tile's regions grow to cover its part.
"""

from __future__ import annotations

import math

from wsitrain.sft.barriers import barrier_kind, segment_barriers
from wsitrain.sft.costs import node_flops
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops_space import spatial_extent
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.regions import AxisTile, Interval, SegmentRegions, axis_tile
from wsitrain.sft.session import PlanSession


def owned_interval(out: Interval, size_out: int, size_v: int) -> Interval:
    """The part of a node's axis [0, size_v) a tile owns, from its output interval on [0, size_out).

    Boundaries scale monotonically and the last one is size_v, so the tiles' parts partition the axis.
    """
    return out[0] * size_v // size_out, out[1] * size_v // size_out


def multipass_regions(facts: GraphFacts, seg: SegmentPlan, sources: set[int], chain: set[int]) -> SegmentRegions:
    """The plan's tile grid with every tile's regions grown to cover its owned part of each barrier input.

    Squeeze-excitation pools and chains (``chain``) run outside the tiles: a tile reads their exits whole.
    """
    assert seg.regions is not None
    nodes = [i for i in range(seg.start + 1, seg.end + 1) if i not in chain]
    specs = {i: facts.nodes[i].spec for i in nodes}
    inputs = {i: tuple(v for v in facts.nodes[i].inputs if v not in chain) for i in nodes}
    per_axis: list[tuple[AxisTile, ...]] = []
    for axis, outs in ((0, seg.regions.rows_out), (1, seg.regions.cols_out)):
        sizes = {i: spatial_extent(facts.nodes[i].spec, facts.nodes[i].shape, axis) for i in [seg.start, *nodes]}
        size_out = sizes[seg.end]
        per_axis.append(
            tuple(
                axis_tile(
                    nodes,
                    seg.start,
                    inputs,
                    specs,
                    sizes,
                    axis,
                    o,
                    owned={v: owned_interval(o, size_out, sizes[v]) for v in sources},
                )
                for o in outs
            )
        )
    return SegmentRegions(seg.regions.rows_out, per_axis[0], seg.regions.cols_out, per_axis[1])


def sweep_flops_factor(sess: PlanSession, start: int, end: int) -> float:
    """Extra FLOPs of a segment's barrier sweeps, as a fraction of its one-sweep cost (0 without barriers).

    One-sweep cost: forward, recompute and backward. Each level adds a forward up to its last barrier
    input (every node before it: an upper bound on the ancestors the sweep runs) and a recompute plus
    backward of the whole segment. Memoized per segment in the session (it does not depend on the tile).
    """
    key = (start, end)
    if key not in sess._sweeps:
        sess._sweeps[key] = _sweep_factor(sess.facts, start, end)
    return sess._sweeps[key]


def _sweep_factor(facts: GraphFacts, start: int, end: int) -> float:
    nodes = range(start + 1, end + 1)
    if not any(barrier_kind(facts.nodes[i].spec) for i in nodes):
        return 0.0
    specs = {i: facts.nodes[i].spec for i in nodes}
    inputs = {i: facts.nodes[i].inputs for i in nodes}
    bars = segment_barriers(specs, inputs, start, end)
    fw_upto = [0.0]  # forward FLOPs of (start, i], i = start + k
    bw_all = 0.0
    for i in nodes:
        f, b = node_flops(facts, i, float(math.prod(facts.nodes[i].shape)))
        fw_upto.append(fw_upto[-1] + f)
        bw_all += b
    fw_all = fw_upto[-1]
    extra = 0.0
    for lv in sorted({b.level for b in bars}):
        last_src = max(b.source for b in bars if b.level == lv)
        extra += fw_upto[last_src - start] + fw_all + bw_all
    return extra / max(1.0, 2 * fw_all + bw_all)
