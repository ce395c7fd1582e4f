"""One tile of a segment: its working set in memory, its FLOPs with halos, and its regions.

A segment (start, end] tiled with square tiles of ``edge`` output pixels: the working set is the
replay of the segment's nodes on the largest tile's extents (forward alone, and recompute plus
backward), the FLOPs count every tile's computed extents (halos included) for forward, recompute
and backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.fused_pool import AMAX, AVG
from wsitrain.sft.ops.space import spatial_extent, tile_numel
from wsitrain.sft.planning.costs import Work, forward_work
from wsitrain.sft.planning.memory_model import SimOp, simulate
from wsitrain.sft.planning.session import PlanSession
from wsitrain.sft.regions import AxisTile, SegmentRegions, axis_tile, representative_tiles, split_axis
from wsitrain.sft.trail import at_segment


@dataclass(frozen=True)
class TileChoice:
    edge: int  # tile edge in segment-output pixels
    fwd_peak: int  # one tile's forward working set
    bwd_peak: int  # one tile's recompute + backward working set
    flops: float  # forward + recompute + backward FLOPs over all tiles (halos included)
    time: float  # the same work in the time model's FLOP-equivalents (traffic and per-call costs; planning only)
    tile_shape: tuple[int, int]  # largest tile's input region incl. halo, segment-input pixels
    halo: tuple[int, int]  # per side, of an interior tile, segment-input pixels
    core: tuple[int, int] = (0, 0)  # the tile's own output, in segment-input pixels (without halo)
    out_tile_bytes: int = 0  # the largest tile's output: what is in flight when it goes to host memory
    # the forward sweep's share of ``flops`` and ``time`` (each node's forward over every tile, no autograd)
    sweep: Work = Work()
    # that sweep run on its own with this edge (forward.py: a forward sweep coarser than the recompute's tiles);
    # one tile covering the whole map is priced as a whole map's forward, not as tiles
    sweep_alone: Work = Work()
    grid: tuple[int, int] = (1, 1)  # tiles along H and W

    @property
    def worth_running(self) -> bool:
        """A tile smaller than its halo computes mostly its neighbours' pixels: never a plan worth offering."""
        return min(self.core) >= max(self.halo)

    @property
    def forward(self) -> ForwardTile:
        """What the forward sweep on these tiles needs."""
        return ForwardTile(self.edge, self.fwd_peak, self.tile_shape, self.out_tile_bytes, self.sweep_alone)


def _axis_sizes(facts: GraphFacts, start: int, end: int, axis: int) -> dict[int, int]:
    return {i: spatial_extent(facts.nodes[i].spec, facts.nodes[i].shape, axis) for i in range(start, end + 1)}


def _inputs(facts: GraphFacts, start: int, end: int) -> dict[int, tuple[int, ...]]:
    return {i: facts.nodes[i].inputs for i in range(start + 1, end + 1)}


def _axis_tile(facts: GraphFacts, start: int, end: int, axis: int, out: tuple[int, int]) -> AxisTile:
    nodes = list(range(start + 1, end + 1))
    specs = {i: facts.nodes[i].spec for i in nodes}
    return axis_tile(nodes, start, _inputs(facts, start, end), specs, _axis_sizes(facts, start, end, axis), axis, out)


def _planning_axis_tile(sess: PlanSession, start: int, end: int, axis: int, out: tuple[int, int]) -> AxisTile:
    """``_axis_tile`` for planning, shared by segments that end at the same node.

    What a node's tile needs depends only on its readers up to ``end``, never on where the segment starts (a
    start is a cut point: no edge crosses it), so the intervals computed for an earlier start hold for a later
    one, with the later start's own region as its computed extent. The search asks for the earliest start of
    an end first; a later call with an earlier start recomputes and replaces the memo.
    """
    key = ("axis", end, axis, out)
    memo = sess._tiles.get(key)
    if isinstance(memo, tuple) and memo[0] <= start:
        t: AxisTile = memo[1]
        return AxisTile(t.need, t.req, {**t.computed, start: t.need[start]})
    t = _axis_tile(sess.facts, start, end, axis, out)
    sess._tiles[key] = (start, t)
    return t


def segment_regions(facts: GraphFacts, start: int, end: int, edge: int) -> SegmentRegions:
    """Every tile's intervals along H and W: what the executor runs."""
    at_segment(start, end)
    per_axis = []
    for axis in (0, 1):
        outs = split_axis(facts.nodes[end].shape[2 + axis], edge)
        per_axis.append((tuple(outs), tuple(_axis_tile(facts, start, end, axis, o) for o in outs)))
    (rows_out, rows), (cols_out, cols) = per_axis
    return SegmentRegions(rows_out, rows, cols_out, cols)


@dataclass(frozen=True)
class TileGeometry:
    """A segment's tiles along each axis for one edge: representative tiles, extents, core and halo (no memory)."""

    rows: tuple[tuple[AxisTile, int], ...]  # (representative tile, how many tiles it stands for)
    cols: tuple[tuple[AxisTile, int], ...]
    n_tiles: int
    core: tuple[int, int]  # the tile's own output, in segment-input pixels
    halo: tuple[int, int]  # per side, of an interior tile, in segment-input pixels
    grid: tuple[int, int] = (1, 1)  # tiles along H and W

    @property
    def worth_running(self) -> bool:
        return min(self.core) >= max(self.halo)


def _extent(t: AxisTile, i: int) -> int:
    lo, hi = t.computed[i]
    return hi - lo


def tile_geometry(sess: PlanSession, start: int, end: int, edge: int) -> TileGeometry:
    """Where the tiles of (start, end] with ``edge`` output pixels fall (memoized per session)."""
    key = ("geometry", start, end, edge)
    cached = sess._tiles.get(key)
    if isinstance(cached, TileGeometry):
        return cached
    f = sess.facts
    at_segment(start, end)
    per_axis = []
    square = f.nodes[end].shape[2] == f.nodes[end].shape[3] and f.nodes[start].shape[2] == f.nodes[start].shape[3]
    for axis in (0,) if square else (0, 1):  # square: the W axis is the H axis
        outs = split_axis(f.nodes[end].shape[2 + axis], edge)
        reps = tuple((_planning_axis_tile(sess, start, end, axis, outs[k]), m) for k, m in representative_tiles(outs))
        per_axis.append((len(outs), reps))
    (nr, rows), (nc, cols) = per_axis[0], per_axis[-1]
    in_h, in_w = f.nodes[start].shape[2], f.nodes[start].shape[3]
    core_h = min(in_h, edge * in_h // max(1, f.nodes[end].shape[2]))
    core_w = min(in_w, edge * in_w // max(1, f.nodes[end].shape[3]))
    halo_h = max(0, (_extent(rows[len(rows) // 2][0], start) - core_h + 1) // 2)
    halo_w = max(0, (_extent(cols[len(cols) // 2][0], start) - core_w + 1) // 2)
    geo = TileGeometry(rows, cols, nr * nc, (core_h, core_w), (halo_h, halo_w), (nr, nc))
    sess._tiles[key] = geo
    return geo


@dataclass(frozen=True)
class ForwardTile:
    """A forward sweep's tiles of one edge (forward.py): what the sweep needs of a tile choice. A forward sweep on
    tiles coarser than the recompute's never runs backward on them, so it skips the backward replay."""

    edge: int
    fwd_peak: int  # one tile's forward working set
    tile_shape: tuple[int, int]  # largest tile's input region incl. halo, segment-input pixels
    out_tile_bytes: int  # the largest tile's output
    sweep_alone: Work  # the sweep run on its own with this edge (see TileChoice.sweep_alone)


@dataclass(frozen=True)
class _TileParts:
    """A tile choice without its backward replay, and what that replay reads (memoized per session)."""

    forward: ForwardTile
    flops: float
    time: float
    sweep: Work
    geo: TileGeometry
    ops: Callable[[bool], list[SimOp]]  # the segment's replay steps on the largest tile, with or without grad
    tb: dict[int, int]  # per node (the start included): the largest tile's bytes
    crop: int  # the staged input region's bytes (0: the tile's input is a view of its checkpoint)
    bwd_extra: int  # what backward holds beyond the replay: background-reuse entries and the sweep's weight casts


def tile_choice(sess: PlanSession, start: int, end: int, edge: int, staged: bool = False) -> TileChoice:
    """Memory and FLOPs of tiling segment (start, end] with square tiles of ``edge`` output pixels."""
    key = (start, end, edge, staged)  # staged: the segment input lives on the host, each tile's crop is copied
    cached = sess._tiles.get(key)
    if isinstance(cached, TileChoice):
        return cached
    parts = _tile_parts(sess, start, end, edge, staged)
    f, tb, crop = sess.facts, parts.tb, parts.crop
    at_segment(start, end)
    bres = simulate(parts.ops(True), {start: crop}, result_held=True, grad_bytes={start: tb[start]})
    bwd = max(bres.forward_peak, bres.backward_peak)
    # the stager (staging.py) keeps up to two input-gradient tiles of a host checkpoint alive until their copies
    # down are done
    bwd += crop + (2 * tb[start] if staged and f.nodes[start].requires_grad else 0) + parts.bwd_extra
    fw = parts.forward
    geo = parts.geo
    choice = TileChoice(edge, fw.fwd_peak, bwd, parts.flops, parts.time, fw.tile_shape, geo.halo, geo.core,
                        fw.out_tile_bytes, parts.sweep, fw.sweep_alone, geo.grid)  # fmt: skip
    sess._tiles[key] = choice
    return choice


def forward_tile(sess: PlanSession, start: int, end: int, edge: int, staged: bool = False) -> ForwardTile:
    """The forward sweep of segment (start, end] on tiles of ``edge`` output pixels (no backward replay)."""
    cached = sess._tiles.get((start, end, edge, staged))
    if isinstance(cached, TileChoice):
        return cached.forward
    return _tile_parts(sess, start, end, edge, staged).forward


def _tile_parts(sess: PlanSession, start: int, end: int, edge: int, staged: bool) -> _TileParts:
    key = ("parts", start, end, edge, staged)
    cached = sess._tiles.get(key)
    if isinstance(cached, _TileParts):
        return cached
    f = sess.facts
    nodes = list(range(start + 1, end + 1))
    geo = tile_geometry(sess, start, end, edge)
    at_segment(start, end)
    # per node: the largest tile's bytes (its working set) and the elements over all tiles (halos included); a
    # node after the start has the same tiles whatever the start (_planning_axis_tile), so segments sharing an end
    # and edge share these (timm EfficientNet-B0 at 8192 px, 2080 Ti preset: planned in 44.9 s against 56.0 s
    # computing them per choice, the same plan; measured on one thread of the 2-core CPU)
    shared = _node_tiles(sess, end, edge)
    for i in nodes:
        if i not in shared:
            shared[i] = _tiles_of(f, geo, i)
    own = _tiles_of(f, geo, start)  # the start's region is what its segment needs, not what an earlier one computed
    tb = {start: own.largest_bytes, **{i: shared[i].largest_bytes for i in nodes}}
    total = {start: own.numel_all, **{i: shared[i].numel_all for i in nodes}}

    # the image crop is staged to the device, and an integer image is converted per tile
    image_staged = start == 0 and (sess.input_on_host or not f.input_dtype.is_floating_point)
    crop = tb[start] if staged or image_staged else 0

    ip = sess.in_place(start, end)  # activations the tiles run in place (in_place.py): their input's storage

    def ops(grad: bool) -> list[SimOp]:  # constants read nothing
        return [
            sess.tile_op(i, tb[i], tb[f.nodes[i].inputs[0]] if f.nodes[i].inputs else 0, grad, i in ip) for i in nodes
        ]

    fwd = simulate(ops(False), {start: crop}, backward=False).forward_peak
    fwd += crop  # the stager (staging.py) uploads the next tile's region while this one computes
    kept_bwd = 0
    if sess.reuse_tiles and min(geo.grid) >= 3:  # only a tile touching no border is ever kept
        kept_fwd, kept_bwd = reuse_bytes(sess, start, end, tb, crop)
        fwd += kept_fwd
    casts = cast_bytes(f, nodes)  # held through every tile of a sweep
    fwd += casts
    # the sums of Work, field by field as plain floats in the same order (bitwise Work's sums, without an object per
    # addition: 8 million of them planning EfficientNet-B0 at 8192 px)
    wf = wt = sf = st = af = at = 0.0
    for i in nodes:
        ins = sum(total[v] for v in f.nodes[i].inputs if v in total)
        out_n = total[i]
        both, recompute = sess.tile_node_work(i, out_n, ins, geo.n_tiles)
        wf, wt = wf + both.flops + recompute.flops, wt + both.time + recompute.time
        sf, st = sf + recompute.flops, st + recompute.time
        one = recompute if geo.n_tiles > 1 else forward_work(f, i, out_n, ins, 1, sess.tm, tiled=False)
        af, at = af + one.flops, at + one.time
    forward = ForwardTile(edge, fwd, own.largest_hw, tb[end], Work(af, at))
    parts = _TileParts(forward, wf, wt, Work(sf, st), geo, ops, tb, crop, kept_bwd + casts)
    sess._tiles[key] = parts
    return parts


@dataclass(frozen=True)
class NodeTiles:
    """One node's share of a segment's tiles."""

    largest_hw: tuple[int, int]  # the largest tile's extent along H and W (each axis's largest)
    largest_bytes: int  # that tile's bytes
    numel_all: int  # elements over all tiles, halos included


def _tiles_of(f: GraphFacts, geo: TileGeometry, i: int) -> NodeTiles:
    spec, shape = f.nodes[i].spec, f.nodes[i].shape
    h = max(_extent(t, i) for t, _ in geo.rows)
    w = max(_extent(t, i) for t, _ in geo.cols)
    elem = f.nodes[i].nbytes // max(1, math.prod(shape))
    all_h = sum(_extent(t, i) * m for t, m in geo.rows)
    all_w = sum(_extent(t, i) * m for t, m in geo.cols)
    return NodeTiles((h, w), tile_numel(spec, shape, h, w) * elem, tile_numel(spec, shape, all_h, all_w))


def _node_tiles(sess: PlanSession, end: int, edge: int) -> dict[int, NodeTiles]:
    """The per-node tiles segments ending at ``end`` with ``edge`` share (nodes after their start; memoized in the
    session, which lives for one plan)."""
    key = ("nodes", end, edge)
    memo = sess._tiles.get(key)
    if not isinstance(memo, dict):
        memo = sess._tiles[key] = {}
    return memo


def cast_bytes(f: GraphFacts, nodes: list[int]) -> int:
    """The low-precision copies of a segment's weights that a sweep of its tiles holds under autocast (float32 weights,
    bf16/fp16 activations): each weight cast once, at its first tile, kept to the sweep's end (execution/autocast.py).
    Counted for every tiled segment, also those that cast per tile (a shared weight, multi-pass segments)."""
    act = f.act_dtype.itemsize
    return 0 if act >= 4 else sum(f.nodes[i].param_bytes for i in nodes) * act // 4


def reuse_bytes(sess: PlanSession, start: int, end: int, tb: dict[int, int], crop: int) -> tuple[int, int]:
    """What the executor's background-tile entry (execution/reuse.py, one per sweep) holds, forward and backward.

    Forward: the output tile and a copy of a staged input region (``crop``). Backward: that copy, the input-gradient
    tile, the segment's parameter gradients and the output-gradient tile (a view of the segment's output gradient
    under average pooling; a tile of its own under max pooling, plus the output amax's share reads; a copy when
    staged from host memory).
    """
    f = sess.facts
    params = sess.param_bytes_between(start, end)
    fused = end == f.trunk_end and f.fusion is not None
    kind = f.fusion.kind if fused and f.fusion is not None else None
    g = 0 if kind == AVG else 2 * tb[end] if kind == AMAX else tb[end]
    grad_in = tb[start] if f.nodes[start].requires_grad else 0
    return tb[end] + crop, crop + grad_in + params + g


def edge_candidates(sess: PlanSession, end: int, forced_tile: int | None) -> list[int]:
    """Tile edges (segment-output pixels) to try, largest first: powers of two and the whole extent."""
    shape = sess.facts.nodes[end].shape
    length = max(shape[2], shape[3])
    if forced_tile is not None:
        # the forced edge in this segment's output pixels, rounded, and at least 2 pixels: 1-pixel
        # tiles recompute their whole halo for a single output (and hit kernel corner cases)
        return [min(length, max(2, round(forced_tile / sess.image_stride(end))))]
    # Powers of two and the eighth steps between them: any whole number of segment-output pixels is
    # aligned with every stride inside the segment, and a tile that cannot double may still grow by an
    # eighth. Measured on plans: DarkNet-19 at 100,000 px on 11 GiB used 5.5 of 11 GiB with 2048 px tiles
    # (+68% extra compute) because the next power of two did not fit; with eighths it takes 2816 px tiles.
    edges = {length}
    e = 1
    while e < length:
        edges.update(k for k in ((e * (8 + j)) // 8 for j in range(8)) if 0 < k < length)
        e *= 2
    return sorted(edges, reverse=True)
