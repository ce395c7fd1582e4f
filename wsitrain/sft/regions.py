"""Tile regions: which slice of every tensor in a segment one output tile needs, per axis.

H and W are independent, so a tile (i, j) of a grid is the product of row interval i and column
interval j. Walking the segment backwards from the output tile, each operator asks its inputs for
the exact interval it reads (halos shrink layer by layer: each layer computes only what later layers
need). Running the *original* layer on that crop and keeping the needed outputs is exact:
the crop is aligned to the layer's stride and starts at 0 only at the true image border.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from wsitrain.sft.ops.registry import WINDOW, OpSpec
from wsitrain.sft.trail import WHERE

Interval = tuple[int, int]


@dataclass(frozen=True)
class AxisTile:
    """One tile's intervals along one axis, for every node of a segment."""

    need: dict[int, Interval]  # node -> interval of its output that consumers need (incl. the segment input)
    req: dict[tuple[int, int], Interval]  # (consumer, producer) -> interval the consumer reads from the producer
    computed: dict[int, Interval]  # node -> interval its operator produces before narrowing


@dataclass(frozen=True)
class SegmentRegions:
    """A tiled segment's grid: output intervals and every tile's regions, per axis (tile (r, c) = rows[r] x cols[c])."""

    rows_out: tuple[Interval, ...]
    rows: tuple[AxisTile, ...]
    cols_out: tuple[Interval, ...]
    cols: tuple[AxisTile, ...]

    @property
    def grid(self) -> tuple[int, int]:
        return len(self.rows), len(self.cols)


def _hull(a: Interval | None, b: Interval) -> Interval:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]))


def axis_tile(
    seg_nodes: list[int],
    seg_input: int,
    inputs: Mapping[int, tuple[int, ...]],
    specs: Mapping[int, OpSpec] | Sequence[OpSpec],
    sizes: Mapping[int, int],
    axis: int,
    out_interval: Interval,
    owned: Mapping[int, Interval] | None = None,
) -> AxisTile:
    """Intervals for one tile along ``axis`` (0 = H, 1 = W) of the segment whose last node is ``seg_nodes[-1]``.

    ``sizes`` maps each node (and the segment input) to its extent along this axis. ``owned``: nodes
    whose statistics the tile accumulates (barrier inputs, see ``wsitrain.sft.execution.multipass``) with the
    interval the tile owns; the tile computes at least that, even where no later layer reads it.
    """
    extra = {v: r for v, r in (owned or {}).items() if r[1] > r[0]}
    need: dict[int, Interval] = {seg_nodes[-1]: out_interval}
    req: dict[tuple[int, int], Interval] = {}
    computed: dict[int, Interval] = {}
    u = seg_nodes[-1]
    try:
        for u in reversed(seg_nodes):
            if u in extra:
                need[u] = _hull(need.get(u), extra[u])
            a, b = need[u]
            spec = specs[u]
            for v in inputs[u]:
                # a WINDOW op reads its window of its first input; any other input is a size measured on the
                # tile (a resize to out.shape), read from a value as large as its output
                if spec.kind == WINDOW and v == inputs[u][0]:
                    assert spec.windows is not None
                    r = spec.windows[axis].input_interval(a, b, sizes[v])
                else:
                    r = (a, b)
                req[(u, v)] = r
                need[v] = _hull(need.get(v), r)
            if spec.kind == WINDOW:
                assert spec.windows is not None
                w = spec.windows[axis]
                lo, hi = req[(u, inputs[u][0])]
                n_out = w.output_count(lo, hi)
                g0 = w.first_output(lo)
                computed[u] = (g0, g0 + max(n_out, b - g0))
            else:
                computed[u] = (a, b)
    except Exception:
        WHERE.node = u  # internal errors name the node (trail.guarded); free when nothing fails
        raise
    if seg_input in extra:
        need[seg_input] = _hull(need.get(seg_input), extra[seg_input])
    computed[seg_input] = need[seg_input]
    return AxisTile(need, req, computed)


def split_axis(length: int, tile: int) -> list[Interval]:
    """Split ``[0, length)`` into consecutive tiles of ``tile``.

    A ragged remainder shorter than half a tile joins the tile before it: a sliver costs a whole
    tile's launches and halo for a few pixels (and 1-pixel crops hit kernel corner cases).
    """
    tile = max(1, min(tile, length))
    out = [(s, min(length, s + tile)) for s in range(0, length, tile)]
    if len(out) > 1 and 2 * (out[-1][1] - out[-1][0]) < tile:
        out[-2:] = [(out[-2][0], length)]
    return out


def representative_tiles(intervals: list[Interval]) -> list[tuple[int, int]]:
    """(index, multiplicity) of tiles whose regions stand for all others.

    With tile edges a multiple of every cumulative stride in the segment, interior tiles are
    translates of one another: the first, a middle one (far from both borders, so its halo is never
    clipped) and the last tile describe the grid.
    """
    n = len(intervals)
    if n <= 3:
        return [(i, 1) for i in range(n)]
    return [(0, 1), (n // 2, n - 2), (n - 1, 1)]
