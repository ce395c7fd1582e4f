"""Top-k mean pooling: per channel, the mean of the k largest values of the map (over the tissue mask), plain and fused.

Why (docs/research/plateau.md, issue 32): an average pool (and an attention head that starts uniform, which is one)
gives each position 1/N of the pooled gradient, so a lesion that is 0.6% of the map gets 0.6% of the signal and training
sits on a plateau of near-constant output; a max pool gives it all to one position per channel. The top-k mean is
between the two: each channel's gradient goes to its k strongest positions, ``g / k`` each, whatever the map's size.

Plain (``MaskedTopKMean``, (B, C, H, W) -> (B, C, 1, 1)): positions outside the mask set with ``masked()`` are -inf;
the values are ordered largest first, ties by the lower row-major index (a stable sort), and the first
``k_eff = min(k, positions kept)`` are averaged. A sample whose mask keeps nothing is pooled over its whole map
(``pool_mask.whole_map_when_empty``), as max and average pooling are.

Fused (``TopKAccumulator``): each tile's values and global flat indices are merged into a running (B, C, k) list in
that same order, so the tiled forward picks exactly the plain one's positions and sums them in the same order; in
backward a tile gets ``g / k_eff`` at the kept positions it holds, and the tiles holding none skip their recompute.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from wsitrain.sft.ops.pool_mask import MaskedPool, MaskSource

TOPK = "topk"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def ordered(values: torch.Tensor, index: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` first of (B, C, n) ``values`` and their global ``index`` (B, C, n) or (n,), largest value first,
    ties by the lower index."""
    index = index.expand_as(values)
    by_index = index.argsort(dim=-1)  # global indices are unique: no tie to break
    values, index = values.gather(-1, by_index), index.gather(-1, by_index)
    by_value = values.argsort(dim=-1, descending=True, stable=True)[..., :k]  # ties keep the lower index first
    return values.gather(-1, by_value), index.gather(-1, by_value)


def merge_tile(value: torch.Tensor | None, index: torch.Tensor | None, tile: torch.Tensor, rows: tuple[int, int],
               cols: tuple[int, int], width: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A running ordered list (B, C, <= k) of values and global flat indices (None before the first tile) with tile
    ``tile``'s values (B, C, th, tw) at ``rows`` x ``cols`` of a map ``width`` wide merged in (``ordered``)."""
    th, tw = tile.shape[2], tile.shape[3]
    r = torch.arange(rows[0], rows[0] + th, device=tile.device)
    c = torch.arange(cols[0], cols[0] + tw, device=tile.device)
    flat, gidx = tile.flatten(2), (r[:, None] * width + c[None, :]).flatten()  # (B, C, th * tw), (th * tw,)
    if value is not None:
        assert index is not None
        flat = torch.cat([value, flat], -1)
        gidx = torch.cat([index, gidx.expand(*flat.shape[:2], -1)], -1)
    return ordered(flat, gidx, k)


def scatter_kept(src: torch.Tensor, index: torch.Tensor, kept: torch.Tensor, rows: tuple[int, int],
                 cols: tuple[int, int], shape: tuple[int, ...], width: int) -> torch.Tensor:  # fmt: skip
    """A tile's gradient (B, C, th, tw) = ``shape``: each kept entry's ``src`` (B or 1, C, n) added at its global
    flat ``index`` (B or 1, C, n) where the tile at ``rows``, ``cols`` holds it; ``kept`` (B or 1, C, n) bool."""
    b, ch, th, tw = shape
    r, c = index // width - rows[0], index % width - cols[0]
    inside = kept & (r >= 0) & (r < th) & (c >= 0) & (c < tw)
    local = r.clamp(0, th - 1) * tw + c.clamp(0, tw - 1)
    src = torch.where(inside, src, torch.zeros((), dtype=src.dtype, device=src.device))
    out = torch.zeros(b, ch, th * tw, dtype=src.dtype, device=src.device)
    out.scatter_add_(2, local.expand(b, -1, -1), src.expand(b, -1, -1))
    return out.view(b, ch, th, tw)


def _mean_of_first(top: torch.Tensor, k_eff: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, C, k) ordered values -> (B, C): the mean of the first ``k_eff`` (B or 1,) of each row."""
    rank = torch.arange(top.shape[-1], device=top.device)
    keep = rank[None, None, :] < k_eff.to(top.device)[:, None, None]  # (B or 1, 1, k)
    acc = _acc_dtype(top.dtype)
    total = torch.where(keep, top, torch.zeros((), dtype=top.dtype, device=top.device)).sum(-1, dtype=acc)
    return (total / k_eff.to(device=top.device, dtype=acc)[:, None]).to(dtype)


def kept_count(mask: torch.Tensor | None, height: int, width: int, k: int) -> torch.Tensor:
    """``k_eff`` (B or 1,): k, or fewer where the mask keeps fewer positions (and never more than the map has)."""
    if mask is None:
        return torch.tensor([min(k, height * width)])
    return mask.flatten(1).sum(1).clamp(max=k)


def topk_mean(x: torch.Tensor, k: int, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, C, H, W) -> (B, C): the mean of each channel's ``k`` largest values over ``mask`` (B or 1, 1, H, W)."""
    flat = x.flatten(2)  # (B, C, N)
    if mask is not None:
        flat = flat.masked_fill(~mask.to(x.device).flatten(2), float("-inf"))
    idx = torch.arange(flat.shape[-1], device=x.device)
    top, _ = ordered(flat, idx, min(k, flat.shape[-1]))  # (B, C, k)
    return _mean_of_first(top, kept_count(mask, x.shape[2], x.shape[3], k), x.dtype)


class MaskedTopKMean(MaskedPool, nn.Module):
    """(B, C, H, W) -> (B, C, 1, 1): each channel's mean of its ``k`` largest values, over the tissue mask when one
    is set with ``masked()``."""

    def __init__(self, k: int) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"a top-k mean pool needs k >= 1, got {k!r}")
        self.k = k
        self.mask: MaskSource | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return topk_mean(x, self.k, self.mask_at(x.shape[-2], x.shape[-1]))[:, :, None, None]

    def extra_repr(self) -> str:
        return f"k={self.k}"


class TopKAccumulator:
    """Forward: merges tiles of the (B, C, H, W) map into each channel's running top k; backward: each tile's share."""

    kind = TOPK
    share_reads_output = False  # a tile's share depends on the kept indices only

    def __init__(self, k: int, height: int, width: int, mask: torch.Tensor | None) -> None:
        self.k, self.h, self.w = min(k, height * width), height, width
        if mask is not None and tuple(mask.shape[-2:]) != (height, width):
            raise ValueError(f"pool mask is {tuple(mask.shape[-2:])} but the map is {(height, width)}")
        self.mask = mask  # (B or 1, 1, H, W) bool where the caller made it (holds_gradient reads it: no device sync)
        self._device_mask: torch.Tensor | None = None
        self.k_eff = kept_count(mask, height, width, k)  # (B or 1,)
        self.value: torch.Tensor | None = None  # (B, C, k) the running top values, ordered
        self.index: torch.Tensor | None = None  # (B, C, k) int64: their global flat indices
        self.dtype: torch.dtype | None = None

    def add(self, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """One tile ``y`` (B, C, th, tw) covering ``rows`` x ``cols`` of the map."""
        self.dtype = y.dtype
        th, tw = y.shape[2], y.shape[3]
        if self.mask is not None:
            if self._device_mask is None or self._device_mask.device != y.device:
                self._device_mask = self.mask.to(y.device)
            m = self._device_mask[:, :, rows[0] : rows[0] + th, cols[0] : cols[0] + tw]
            y = y.masked_fill(~m, float("-inf"))
        self.value, self.index = merge_tile(self.value, self.index, y, rows, cols, self.w, self.k)

    def result(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The pooled (B, C), as ``topk_mean`` computes it on the whole map."""
        assert self.value is not None and self.dtype is not None, "no tile was added"
        return _mean_of_first(self.value, self.k_eff, dtype or self.dtype)

    def grad_view(self, grad_out: torch.Tensor) -> torch.Tensor:
        """The pooled value's gradient as (B, C)."""
        return grad_out.reshape(grad_out.shape[0], grad_out.shape[1])

    def _inside(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """(B, C, k) bool: kept entries (rank < k_eff) whose position lies in ``rows`` x ``cols``."""
        assert self.index is not None
        r, c = self.index // self.w, self.index % self.w
        rank = torch.arange(self.index.shape[-1], device=self.index.device)
        kept = rank[None, None, :] < self.k_eff.to(self.index.device)[:, None, None]
        return kept & (r >= rows[0]) & (r < rows[1]) & (c >= cols[0]) & (c < cols[1])

    def holds_gradient(self, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
        """Only tiles holding one of a channel's kept positions receive a nonzero share."""
        if is_fake(self.index):  # fake tensors (the simulated device): computed, no content
            return True
        return bool(self._inside(rows, cols).any())

    def tile_grad(self, g: torch.Tensor, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The share of the pooled gradient ``g`` (B, C) that falls on tile ``y`` (B, C, th, tw)."""
        assert self.index is not None
        th, tw = y.shape[2], y.shape[3]
        inside = self._inside((rows[0], rows[0] + th), (cols[0], cols[0] + tw))  # (B, C, k)
        share = (g.to(_acc_dtype(g.dtype)) / self.k_eff.to(g.device)[:, None]).to(y.dtype)  # (B, C)
        return scatter_kept(share[:, :, None].expand_as(inside), self.index, inside, rows, cols, tuple(y.shape), self.w)
