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
with another key is computed. What an entry holds (``planning/tile_memory.reuse_bytes`` prices it): forward, the
output tile; backward, the input-gradient tile, the segment's parameter gradients and the output-gradient tile (the
output too under amax); a copy of the input region when it was staged from host memory (the staging buffer is reused
for the next tile). Where the entry is what does not fit, the planner plans without it (``Plan.reuse_tiles``).

Fake tensors (the simulated device) have no content: there the first tile with a key fills the entry and no tile
ever matches it, so every later tile computes while the entry is held, the worst case for memory.

Synchronizations: every content check reads a device value on the host, which on a GPU waits for the queue to drain
(the GPU then idles while the host issues the next work). Each one is reported to ``on_sync`` (the simulated clock
prices it; fake tensors report where a GPU would wait). The zero-gradient checks of a segment's backward are read
together, before its first tile, when its output gradient is on the device (``zero_tiles``: one synchronization per
segment instead of one per tile); tiles of a gradient in host memory are checked as they are staged (``all_zero``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake

from wsitrain.sft.ops.fused_pool import Accumulator
from wsitrain.sft.ops.registry import WINDOW, OpSpec
from wsitrain.sft.regions import AxisTile, SegmentRegions

Key = tuple[object, ...]
T = TypeVar("T")
Sync = Callable[[str], None]  # told what the host reads of device content (ExecHooks.on_sync)
Interval = tuple[int, int]
# a backward entry's value: the tile's output (kept only when amax's gradient share reads it), autograd's results
BackwardValue = tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...]]


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


class TileKeys:
    """Every tile's geometry key in a segment (both axes' ``axis_key``), computed once per regions."""

    def __init__(
        self,
        start: int,
        nodes: Sequence[int],
        inputs: Mapping[int, tuple[int, ...]],
        specs: Mapping[int, OpSpec],
        sizes: Mapping[int, tuple[int, int]],
    ) -> None:
        self.start, self.nodes, self.inputs, self.specs, self.sizes = start, list(nodes), inputs, specs, sizes
        self._keys: dict[tuple[int, int], Key | None] = {}
        self._for: object = None  # the regions the keys are for

    def key(self, regions: SegmentRegions, r: int, c: int, extra: Key = ()) -> Key | None:
        """Tile (r, c)'s key, None when it touches a border. ``extra``: what else its work depends on (the parts
        of barrier inputs a multi-pass tile owns)."""
        if self._for is not regions:
            self._keys, self._for = {}, regions
        if (r, c) not in self._keys:
            keys: list[Key] = []
            for axis, t in ((0, regions.rows[r]), (1, regions.cols[c])):
                ext = {v: hw[axis] for v, hw in self.sizes.items()}
                k = axis_key(t, self.start, self.nodes, self.inputs, self.specs, ext, axis)
                if k is None:
                    break
                keys.append(k)
            self._keys[(r, c)] = tuple(keys) if len(keys) == 2 else None
        k = self._keys[(r, c)]
        return None if k is None else (*k, *extra)


def has_content(t: torch.Tensor) -> bool:
    """Can the host read ``t``'s values? Not those of the simulated device (fake tensors, the meta device)."""
    return not is_fake(t) and t.device.type != "meta"


def all_zero(t: torch.Tensor, on_sync: Sync | None = None) -> bool:
    """Is every element of ``t`` zero? A synchronization where ``t`` is on a device; never where ``t`` has no
    content (``has_content``: the simulated device computes every tile)."""
    if t.device.type != "cpu" and on_sync is not None:
        on_sync("a zero-gradient check")
    return has_content(t) and not bool(t.any())


def zero_tiles(
    grad_out: torch.Tensor,
    tiles: Iterable[tuple[int, int]],
    rows_out: Sequence[Interval],
    cols_out: Sequence[Interval],
    on_sync: Sync | None = None,
) -> set[tuple[int, int]]:
    """The tiles whose share of ``grad_out`` (B, C, Ho, Wo) is all zero, read for all tiles at once: one
    synchronization on a device (none for a host tensor) instead of one per tile. Fake tensors have no content:
    none is zero (the simulated device computes them), and the read is reported where a GPU would wait."""
    tiles = list(tiles)
    if not tiles:
        return set()
    # (N,) one flag per tile, computed on grad_out's device (the simulated one launches them too)
    flags = torch.stack([grad_out[:, :, rows_out[r][0] : rows_out[r][1], cols_out[c][0] : cols_out[c][1]].any()
                         for r, c in tiles])  # fmt: skip
    if grad_out.device.type != "cpu" and on_sync is not None:
        on_sync("the zero-gradient check")
    if not has_content(grad_out):
        return set()
    return {t for t, held in zip(tiles, flags.tolist(), strict=True) if not held}  # the one read


def is_flat(region: torch.Tensor, dims: tuple[int, int]) -> bool:
    """Is ``region`` one value per (sample, channel) over its image axes ``dims``?"""
    first = region.narrow(dims[0], 0, 1).narrow(dims[1], 0, 1)
    return bool(torch.equal(region, first.expand_as(region)))


@dataclass
class Entry(Generic[T]):
    key: Key
    region: torch.Tensor
    grad: torch.Tensor | None
    value: T


class ReuseCache(Generic[T]):
    """One sweep's cached background tile (see the module doc); ``value``: what the sweep adds per tile."""

    def __init__(self, enabled: bool, dims: tuple[int, int] | None, on_sync: Sync | None = None) -> None:
        self.enabled = enabled and dims is not None  # a segment input without image axes has nothing to compare
        self.dims = dims or (2, 3)
        self.entry: Entry[T] | None = None
        self.on_sync = on_sync

    def _reads(self, t: torch.Tensor, what: str) -> bool:
        """Report a content read of ``t`` (a synchronization where ``t`` is on a device); False where ``t`` has
        nothing to read (``has_content``)."""
        if t.device.type != "cpu" and self.on_sync is not None:
            self.on_sync(what)
        return has_content(t)

    def find(self, key: Key | None, region: torch.Tensor) -> Entry[T] | None:
        """The entry this tile may reuse: same key and an equal input region (its gradient is compared apart)."""
        e = self.entry
        if e is None or key is None or key != e.key or e.region.shape != region.shape:
            return None
        if not self._reads(region, "a reuse comparison"):
            return None
        return e if torch.equal(region, e.region) else None

    def wants(self, key: Key | None, region: torch.Tensor) -> bool:
        """Should this computed tile fill the entry? Only the first flat tile with a key (fake: the first keyed, the
        most memory; the meta device of the host-time measurement: none, a slide all tissue)."""
        if not self.enabled or self.entry is not None or key is None:
            return False
        if not self._reads(region, "a flatness check"):
            return is_fake(region)
        return is_flat(region, self.dims)

    def keep(self, key: Key, region: torch.Tensor, grad: torch.Tensor | None, value: T, staged: bool) -> None:
        """Fill the entry; a staged region is copied (its staging buffer carries the next tile)."""
        self.entry = Entry(key, region.detach().clone() if staged else region.detach(), grad, value)

    def same_grad(self, e: Entry[T], grad: torch.Tensor | None) -> bool:
        if e.grad is None or grad is None:
            return e.grad is None and grad is None
        if e.grad.shape != grad.shape or not self._reads(grad, "a gradient comparison"):
            return False
        return bool(torch.equal(grad, e.grad))

    def clear(self) -> None:
        self.entry = None


def through(cache: ReuseCache[T], key: Key | None, region: torch.Tensor, compute: Callable[[], T], staged: bool
            ) -> tuple[T, bool]:  # fmt: skip
    """A tile's forward work: the cached value when it may reuse it (and True), else ``compute()``, kept when this tile
    fills the entry (``staged``: its region came through the stager and is copied)."""
    hit = cache.find(key, region)
    if hit is not None:
        return hit.value, True
    value = compute()
    if key is not None and cache.wants(key, region):
        cache.keep(key, region, None, value, staged)
    return value, False


def backward_hit(
    cache: ReuseCache[BackwardValue],
    key: Key | None,
    region: torch.Tensor,
    g: torch.Tensor | None,
    acc: Accumulator | None,
    pooled_grad: torch.Tensor | None,
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> Entry[BackwardValue] | None:
    """The cached tile a tile covering ``rows`` x ``cols`` of the output may reuse in backward: an equal input region
    and an equal output-gradient tile (``g``; with a fused pool its share of ``pooled_grad``, computed from the
    cached tile's shape, or from its output for amax)."""
    hit = cache.find(key, region)
    if hit is None or hit.grad is None:  # no output gradient: only a multi-pass tile's corrections, equal
        return hit
    if acc is not None:
        assert pooled_grad is not None
        like = hit.value[0] if hit.value[0] is not None else hit.grad
        g = acc.tile_grad(pooled_grad, like, rows, cols)
    return hit if cache.same_grad(hit, g) else None


def keep_backward(
    cache: ReuseCache[BackwardValue],
    key: Key,
    region: torch.Tensor,
    g: torch.Tensor | None,
    y: torch.Tensor | None,
    res: tuple[torch.Tensor | None, ...],
    acc: Accumulator | None,
    grad_staged: bool,
    region_staged: bool,
) -> None:
    """Fill a backward entry: the output is kept only when amax's share reads it; a staged gradient is copied."""
    kept_y = y.detach() if y is not None and acc is not None and acc.share_reads_output else None
    # owned copies: a tensor autograd returned may share memory with what it reuses for later tiles (bf16 weight
    # gradients summed in place turned to NaN, TiledSegment.add_tile_grads); the entry outlives many tiles
    owned = tuple(t.clone() if t is not None else None for t in res)
    cache.keep(key, region, g.clone() if g is not None and grad_staged else g, (kept_y, owned), region_staged)
