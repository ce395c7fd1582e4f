"""The regions a multi-pass segment (``wsitrain.sft.execution.multipass``) runs on: each tile's owned part.

Each tile owns a part of every barrier input: the tiles' parts partition the map exactly, so a
statistic summed over them counts every position once. A tile's regions grow to cover its part.
"""

from __future__ import annotations

from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.space import spatial_extent
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.regions import AxisTile, Interval, SegmentRegions, axis_tile


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
