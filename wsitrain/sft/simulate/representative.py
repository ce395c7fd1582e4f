"""Representative tiles: the few tiles of a grid whose simulation shows what every tile would.

A tile's memory depends on the shapes it computes, not on its position: the tile's intervals at every node of its
segment (what it needs, what each layer reads, what each layer computes before narrowing) fix every tensor it
allocates. Along one axis, rows with the same intervals relative to their own start are the same to memory: a
100,000 px grid of 49 x 49 tiles has three kinds of rows (the first, the interior, the last, more where halos
reach over several tiles at the border). What lives *across* tiles is allocated once per segment (the joined output,
the input gradient, the fused pool's accumulator, host checkpoints) or cycles with period two (the stager's double
buffers, a prefetch of the next tile): visiting every kind of row twice in a row, and the first and last two rows,
reproduces both. The same for columns; the tiles visited are the product, row by row.

``tests/test_sft_simulate.py`` checks the claim where it matters: on grids of up to hundreds of tiles, with
multi-pass segments, host checkpoints and staged inputs, the representative simulation's device and host peaks
equal those of the simulation that visits every tile, byte for byte.
"""

from __future__ import annotations

from wsitrain.sft.regions import AxisTile, SegmentRegions

# Rows (and columns) kept at each end of an axis: a tile and its successor, for the stager's two buffers.
ENDS = 2


def _signature(t: AxisTile) -> tuple[object, ...]:
    """A tile's intervals along one axis, each relative to the start of what its node needs (nodes at different
    strides shift by different amounts from one tile to the next): equal signatures allocate equal tensors."""
    start = {k: a for k, (a, _) in t.need.items()}
    lengths = tuple(sorted((k, b - a) for k, (a, b) in t.need.items()))
    reads = tuple(sorted((k, a - start[k[1]], b - start[k[1]]) for k, (a, b) in t.req.items()))
    made = tuple(sorted((k, a - start[k], b - start[k]) for k, (a, b) in t.computed.items()))
    border = tuple(sorted(k for k, a in start.items() if a <= 0))  # a crop at the image border pads; inside, slices
    return lengths, reads, made, border


def representative_indices(tiles: tuple[AxisTile, ...]) -> list[int]:
    """Indices along one axis: the first and last ``ENDS``, and each kind of tile at its first place and the next."""
    n = len(tiles)
    keep = set(range(min(ENDS, n))) | set(range(max(0, n - ENDS), n))
    seen: set[tuple[object, ...]] = set()
    for i, t in enumerate(tiles):
        sig = _signature(t)
        if sig not in seen:
            seen.add(sig)
            keep |= {i, min(i + 1, n - 1)}
    return sorted(keep)


def representative_tiles(regions: SegmentRegions) -> list[tuple[int, int]]:
    """The tiles the simulated device visits, row by row (see the module doc)."""
    rows = representative_indices(regions.rows)
    cols = representative_indices(regions.cols)
    return [(r, c) for r in rows for c in cols]


def representative_weights(tiles: tuple[AxisTile, ...]) -> dict[int, int]:
    """How many indices of an axis each representative index stands for (the simulated clock's weights): an
    index not visited counts for the first visited one with its signature. The weights add up to the axis."""
    keep = representative_indices(tiles)
    first: dict[tuple[object, ...], int] = {}
    for i in keep:
        first.setdefault(_signature(tiles[i]), i)
    weights = dict.fromkeys(keep, 1)
    for i, t in enumerate(tiles):
        if i not in weights:
            weights[first[_signature(t)]] += 1
    return weights


def tile_weight(regions: SegmentRegions, r: int, c: int) -> int:
    """Tiles of the grid the visit of (r, c) stands for when only representative tiles run."""
    return representative_weights(regions.rows)[r] * representative_weights(regions.cols)[c]
