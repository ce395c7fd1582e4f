"""Background tiles computed once per sweep: a tile whose input is one flat colour reuses the first such tile's work.

With ``data.mask_background`` every pixel outside the tissue has the slide's background colour, and every feature-map
position whose receptive field lies wholly in that background has one value per channel. A tile whose input region,
halo included, is spatially constant therefore computes what any other such tile computes, provided both run the same
layers on the same relative crops (their *geometry key*, ``axis_key``) and neither touches a map border, where padding
makes the position matter. Which tiles are background is found by content (``torch.equal``), not by a mask, so
"background" carries through segments by itself and a library user with flat regions gets the same saving.

Exactness: a reused tile's contribution is the cached tensors, added at that tile's turn in the usual order, so the
step is bitwise the one that computes every tile (tests/test_tile_reuse.py). In backward a tile is reused only when
its output-gradient tile also equals the cached one (under average pooling it does).

Bound: one entry per sweep, filled by the first flat tile with a key and dropped when the sweep ends; a flat tile
with another key is computed. What an entry holds (``planning/reuse_memory.py`` prices it): forward, the output tile;
backward, the output tile, its gradient, the input-gradient tile and the segment's parameter gradients; a copy of the
input region when it was staged from host memory (the staging buffer is reused for the next tile).

Fake tensors (the simulated device) have no content: there the first tile with a key fills the entry and no tile
ever matches it, so every later tile computes while the entry is held, the worst case for memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake

from wsitrain.sft.ops.registry import WINDOW, OpSpec
from wsitrain.sft.regions import AxisTile

Key = tuple[object, ...]
T = TypeVar("T")


def axis_key(
    t: AxisTile,
    start: int,
    nodes: Sequence[int],
    inputs: Mapping[int, tuple[int, ...]],
    specs: Mapping[int, OpSpec],
    extent: Mapping[int, int],
    axis: int,
) -> Key | None:
    """What a tile's computation depends on along one axis besides its input's content: every crop relative to
    the value it is cut from, and where each window layer's kept outputs start in what it produced. None when the
    tile touches a border of any map it computes (padding sees the border there)."""
    parts: list[object] = []
    for v in [start, *nodes]:
        if specs[v].spatial_dims is None or v not in t.need:  # sizes and constants: not cut
            continue
        lo, hi = t.need[v]
        if lo <= 0 or hi >= extent[v]:
            return None
        parts.append(hi - lo)
    for u in nodes:
        for v in inputs[u]:
            if (u, v) in t.req and v in t.need:
                (rl, rh), nv = t.req[(u, v)], t.need[v][0]
                parts.append((rl - nv, rh - nv))
        spec = specs[u]
        if spec.kind == WINDOW and spec.windows is not None and inputs[u]:
            parts.append(t.need[u][0] - spec.windows[axis].first_output(t.req[(u, inputs[u][0])][0]))
    return tuple(parts)


def is_flat(region: torch.Tensor, dims: tuple[int, int]) -> bool:
    """Is ``region`` one value per (sample, channel) over its image axes ``dims``?"""
    first = region.narrow(dims[0], 0, 1).narrow(dims[1], 0, 1)
    return bool(torch.equal(region, first.expand_as(region)))


@dataclass
class _Entry(Generic[T]):
    key: Key
    region: torch.Tensor
    grad: torch.Tensor | None
    value: T


class ReuseCache(Generic[T]):
    """One sweep's cached background tile (see the module doc); ``value``: what the sweep adds per tile."""

    def __init__(self, enabled: bool, dims: tuple[int, int] | None) -> None:
        self.enabled = enabled and dims is not None  # a segment input without image axes has nothing to compare
        self.dims = dims or (2, 3)
        self.entry: _Entry[T] | None = None

    def find(self, key: Key | None, region: torch.Tensor) -> _Entry[T] | None:
        """The entry this tile may reuse: same key and an equal input region (its gradient is compared apart)."""
        e = self.entry
        if e is None or key is None or key != e.key or e.region.shape != region.shape or is_fake(region):
            return None
        return e if torch.equal(region, e.region) else None

    def wants(self, key: Key | None, region: torch.Tensor) -> bool:
        """Should this computed tile fill the entry? Only the first flat tile with a key (fake: the first keyed)."""
        if not self.enabled or self.entry is not None or key is None:
            return False
        return is_fake(region) or is_flat(region, self.dims)

    def keep(self, key: Key, region: torch.Tensor, grad: torch.Tensor | None, value: T, staged: bool) -> None:
        """Fill the entry; a staged region is copied (its staging buffer carries the next tile)."""
        self.entry = _Entry(key, region.detach().clone() if staged else region.detach(), grad, value)

    def same_grad(self, e: _Entry[T], grad: torch.Tensor | None) -> bool:
        if e.grad is None or grad is None:
            return e.grad is None and grad is None
        return e.grad.shape == grad.shape and bool(torch.equal(grad, e.grad))

    def clear(self) -> None:
        self.entry = None
