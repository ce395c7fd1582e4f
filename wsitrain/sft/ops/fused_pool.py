"""Global pooling fused into the last tiled segment: the trunk's last feature map never exists whole.

When the trunk ends in a global reduction over H and W (``AdaptiveAvgPool2d(1)``, ``AdaptiveMaxPool2d(1)``,
their functional forms, ``mean`` / ``amax`` over the spatial dims), each tile of the last tiled segment
adds its partial sum or maximum in forward, and in backward each recomputed tile receives exactly its
share of the pooled gradient, the same values plain PyTorch would give:
- avg: ``g / (H * W)`` at every position (the mean divides by the true H x W);
- max (adaptive max pool): all of ``g`` to the one position plain PyTorch picks, the first maximum in
  row-major order (compared by global flat index across tiles, since tile order is not row-major);
- amax: ``g / count`` at every position equal to the maximum, ``count`` over all tiles (ties split);
- attention (``AttentionPool``): an online softmax over the tiles (attention_pool.py);
- topk (``MaskedTopKMean``): a running top k per channel, ``g / k`` to each kept position (topk_pool.py).

With a tissue mask set on the pool (``masked_pool.MaskedAvgPool2d`` / ``MaskedMaxPool2d`` / ``MaskedAmax``, as
``with model.pool.masked(mask)``), each tile reads only its masked positions: avg divides by the masked count and
gives ``g / count`` to masked positions only; max and amax see off-mask positions as -inf, so they never win and get
no gradient. A tile wholly off the mask then holds no gradient and skips its recompute and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import is_fake

from wsitrain.sft.ops.attention_pool import AttentionAccumulator, AttentionPool
from wsitrain.sft.ops.masked_pool import AMAX, AVG, MAX, MaskedAmax
from wsitrain.sft.ops.pool_mask import MaskedPool
from wsitrain.sft.ops.topk_pool import TOPK, MaskedTopKMean, TopKAccumulator

ATTENTION = AttentionAccumulator.kind
_SPATIAL_DIMS = ({2, 3}, {-2, -1})


@dataclass(frozen=True)
class PoolFusion:
    """The global pooling node that ends the trunk, and how it reduces."""

    node: int  # index of the pooling node (its only input is the trunk's last node)
    kind: str  # AVG | MAX | AMAX | ATTENTION | TOPK
    out_shape: tuple[int, ...]  # its output: (B, C, 1, 1) or (B, C); attention: (B, K, C)


def _is_one(v: object) -> bool:
    return v == 1 or v == (1, 1) or v == [1, 1]


def _dims(v: object) -> set[int] | None:
    if isinstance(v, int):
        return {v}
    if isinstance(v, (tuple, list)) and all(isinstance(d, int) for d in v):
        return set(v)
    return None


def pool_kind(node: fx.Node, module: nn.Module | None) -> str | None:
    """AVG / MAX / AMAX / ATTENTION / TOPK when ``node`` reduces a (B, C, H, W) input over H and W completely; else
    None."""
    if node.op == "call_module":
        if isinstance(module, AttentionPool):
            return ATTENTION
        if isinstance(module, MaskedTopKMean):
            return TOPK
        if isinstance(module, MaskedAmax):
            return AMAX
        if isinstance(module, nn.AdaptiveAvgPool2d) and _is_one(module.output_size):
            return AVG
        if isinstance(module, nn.AdaptiveMaxPool2d) and _is_one(module.output_size) and not module.return_indices:
            return MAX
        return None
    args, kw = node.args, node.kwargs
    target = node.target
    if node.op == "call_function" and target in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
        size = args[1] if len(args) > 1 else kw.get("output_size")
        if not _is_one(size) or kw.get("return_indices", False):
            return None
        return AVG if target is F.adaptive_avg_pool2d else MAX
    name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
    if name in ("mean", "amax") and (node.op == "call_method" or target in (torch.mean, torch.amax)):
        dims = _dims(args[1] if len(args) > 1 else kw.get("dim"))
        if dims is not None and dims in _SPATIAL_DIMS and "dtype" not in kw:
            return AVG if name == "mean" else AMAX
    return None


class PoolAccumulator:
    """Forward: folds tiles of the (B, C, H, W) map into the pooled (B, C), keeping what backward needs."""


    def __init__(self, kind: str, height: int, width: int, mask: torch.Tensor | None = None) -> None:
        self.kind, self.h, self.w = kind, height, width
        if mask is not None and tuple(mask.shape[-2:]) != (height, width):
            raise ValueError(f"pool mask is {tuple(mask.shape[-2:])} but the map is {(height, width)}")
        self.mask = mask  # (B or 1, 1, H, W) bool where the caller made it (holds_gradient reads it: no device sync)
        self._device_mask: torch.Tensor | None = None  # the same on the tiles' device, copied once, not per tile
        # AVG: positions kept per sample (B or 1, 1), the mean's divisor (H * W without a mask)
        self.count_kept = None if mask is None else mask.flatten(1).sum(1, keepdim=True)
        self.value: torch.Tensor | None = None  # (B, C): running sum or maximum
        self.index: torch.Tensor | None = None  # (B, C) int64: global flat index of the maximum (MAX)
        self.count: torch.Tensor | None = None  # (B, C): positions equal to the maximum (AMAX)
        self.dtype: torch.dtype | None = None  # the tiles' dtype: the pooled value's, as plain PyTorch gives it
        # AMAX: each tile's maximum (B, C) by its output rows and cols, to tell in backward which tiles hold a
        # maximum without recomputing them (B x C values per tile: 8 KiB at 2048 channels in fp32)
        self.tile_max: dict[tuple[tuple[int, int], tuple[int, int]], torch.Tensor] = {}

    def tile_mask(self, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor | None:
        """The mask's (B or 1, 1, th, tw) part under the tile, on the tile's device; None without a mask."""
        if self.mask is None:
            return None
        if self._device_mask is None or self._device_mask.device != y.device:
            self._device_mask = self.mask.to(y.device)
        return self._device_mask[:, :, rows[0] : rows[0] + y.shape[2], cols[0] : cols[0] + y.shape[3]]

    def masked(self, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The tile as the pool reads it: off-mask positions 0 (avg) or -inf (max, amax); ``y`` without a mask."""
        m = self.tile_mask(y, rows, cols)
        if m is None:
            return y
        fill = 0.0 if self.kind == AVG else float("-inf")
        return y.masked_fill(~m, fill)

    def add(self, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """One tile ``y`` (B, C, th, tw) covering ``rows`` x ``cols`` of the map."""
        self.dtype = y.dtype
        y = self.masked(y, rows, cols)
        if self.kind == AVG:
            acc = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
            part = y.sum((2, 3), dtype=acc)
            self.value = part if self.value is None else self.value + part
            return
        tile_max, local = y.flatten(2).max(-1)  # first maximum in the tile's row-major order
        if self.kind == MAX:
            tw = y.shape[3]
            gidx = (rows[0] + local // tw) * self.w + cols[0] + local % tw
            if self.value is None:
                self.value, self.index = tile_max, gidx
                return
            assert self.index is not None
            take = (tile_max > self.value) | ((tile_max == self.value) & (gidx < self.index))
            self.value = torch.where(take, tile_max, self.value)
            self.index = torch.where(take, gidx, self.index)
            return
        cnt = (y == tile_max[:, :, None, None]).sum((2, 3))
        self.tile_max[(rows, cols)] = tile_max
        if self.value is None:
            self.value, self.count = tile_max, cnt
            return
        assert self.count is not None
        self.count = torch.where(
            tile_max > self.value, cnt, torch.where(tile_max == self.value, self.count + cnt, self.count)
        )
        self.value = torch.maximum(self.value, tile_max)

    def result(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The pooled (B, C), as plain PyTorch computes it (in ``dtype``, by default the tiles')."""
        assert self.value is not None and self.dtype is not None, "no tile was added"
        dtype = dtype or self.dtype
        if self.kind == AVG:
            return (self.value / self.divisor()).to(dtype)
        return self.value

    def divisor(self) -> torch.Tensor | int:
        """The mean's divisor: H * W, or the masked positions per sample (B or 1, 1) on the pooled value's device."""
        if self.count_kept is None:
            return self.h * self.w
        assert self.value is not None
        return self.count_kept.to(device=self.value.device, dtype=self.value.dtype)

    @property
    def share_reads_output(self) -> bool:
        """Does a tile's gradient share read the tile's own output? (amax: its ties with the maximum)"""
        return self.kind == AMAX

    def grad_view(self, grad_out: torch.Tensor) -> torch.Tensor:
        """The pooled value's gradient as (B, C)."""
        return grad_out.reshape(grad_out.shape[0], grad_out.shape[1])

    def holds_gradient(self, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
        """May the tile covering ``rows`` x ``cols`` receive a nonzero share? Under max pooling only the tiles
        holding a maximum do; the others skip their recompute and backward (``TiledSegment.backward_all``)."""
        if is_fake(self.value):  # fake tensors (the simulated device): computed, no content
            return True
        if self.mask is not None and not is_fake(self.mask):  # a tile wholly off the mask holds nothing
            if not bool(self.mask[:, :, rows[0] : rows[1], cols[0] : cols[1]].any()):
                return False
        if self.kind == AVG:
            return True
        if self.kind == AMAX:
            assert self.value is not None
            tile_max = self.tile_max.get((rows, cols))
            return tile_max is None or bool((tile_max == self.value).any())
        assert self.index is not None
        r, c = self.index // self.w, self.index % self.w
        inside = (r >= rows[0]) & (r < rows[1]) & (c >= cols[0]) & (c < cols[1])
        return bool(inside.any())

    def tile_grad(self, g: torch.Tensor, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The share of the pooled gradient ``g`` (B, C) that falls on tile ``y`` (B, C, th, tw)."""
        if self.kind == AVG:
            share = (g / self.divisor()).to(y.dtype)[:, :, None, None].expand_as(y)
            m = self.tile_mask(y, rows, cols)
            return share if m is None else share * m.to(y.dtype)
        if self.kind == AMAX:
            assert self.count is not None and self.value is not None
            share = (g / self.count).to(y.dtype)
            return share[:, :, None, None] * (self.masked(y, rows, cols) == self.value[:, :, None, None]).to(y.dtype)
        assert self.index is not None
        r, c = self.index // self.w, self.index % self.w
        th, tw = y.shape[2], y.shape[3]
        inside = (r >= rows[0]) & (r < rows[0] + th) & (c >= cols[0]) & (c < cols[0] + tw)
        local = ((r - rows[0]).clamp(0, th - 1) * tw + (c - cols[0]).clamp(0, tw - 1)).unsqueeze(-1)  # (B, C, 1)
        out = torch.zeros_like(y).flatten(2)  # (B, C, th * tw)
        out.scatter_(2, local, torch.where(inside, g.to(y.dtype), torch.zeros_like(g, dtype=y.dtype)).unsqueeze(-1))
        return out.view_as(y)


Accumulator = PoolAccumulator | AttentionAccumulator | TopKAccumulator


def new_accumulator(fusion: PoolFusion, pool: nn.Module | None, height: int, width: int) -> Accumulator:
    """The accumulator a fused segment folds its tiles into; ``pool`` is the pooling node's module (attention reads
    its branches and the mask set for this forward)."""
    if fusion.kind == ATTENTION:
        assert isinstance(pool, AttentionPool)
        return AttentionAccumulator(pool.branches, height, width, pool.mask_at(height, width), pool.instance_k)
    if fusion.kind == TOPK:
        assert isinstance(pool, MaskedTopKMean)
        return TopKAccumulator(pool.k, height, width, pool.mask_at(height, width))
    mask = pool.mask_at(height, width) if isinstance(pool, MaskedPool) else None
    return PoolAccumulator(fusion.kind, height, width, mask)
