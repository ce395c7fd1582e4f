"""A global pool's tissue mask, set for one forward: which map positions the pool may read (attention, max, average).

The mask is (B or 1, 1, H, W) bool at the pooled map's resolution, or a callable that makes it for the map's (H, W)
(a slide read knows its tissue, not the trunk's output size). ``MaskedPool`` holds it for the pools that take one
(``AttentionPool``, ``masked_pool.MaskedAvgPool2d`` / ``MaskedMaxPool2d`` / ``MaskedAmax``); the fused engine reads
it through ``mask_at`` when it makes the pool's accumulator, so the plain and the tiled forward see the same mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import is_fake

# A mask, or what makes it for the map's (H, W).
MaskSource = torch.Tensor | Callable[[int, int], torch.Tensor | None]


def check_mask(mask: torch.Tensor, allow_empty: bool = False) -> None:
    """A (B, 1, H, W) bool tensor; unless ``allow_empty``, every sample keeps at least one position."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"a pool mask is a (B, 1, H, W) bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    if not allow_empty and not is_fake(mask) and not bool(mask.flatten(1).any(1).all()):
        raise ValueError("an attention mask excludes every position of a sample: nothing to attend to")


def whole_map_when_empty(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with every position kept in a sample that keeps none: a read without tissue is pooled as if unmasked
    (as the reader masks nothing when it finds no tissue), not to -inf (max) or 0 / 0 (average)."""
    if is_fake(mask):
        return mask
    empty = ~mask.flatten(1).any(1)  # (B,)
    return mask | empty[:, None, None, None] if bool(empty.any()) else mask


class MaskedPool:
    """Mixin: a pool that reads only the positions of the mask set with ``masked()`` (everywhere without one)."""

    mask: MaskSource | None = None
    # may a sample keep no position? (max / average: pooled over the whole map; attention: an error)
    allows_empty_mask: bool = True

    @contextmanager
    def masked(self, mask: MaskSource | None) -> Iterator[None]:
        """Pool only over positions inside ``mask`` (B or 1, 1, H, W), or inside ``mask(H, W)``, while the block
        runs (forward; the fused engine's backward reuses what its forward saw)."""
        if isinstance(mask, torch.Tensor):
            check_mask(mask, self.allows_empty_mask)
        old, self.mask = self.mask, mask
        try:
            yield
        finally:
            self.mask = old

    def mask_at(self, height: int, width: int) -> torch.Tensor | None:
        """The mask (B or 1, 1, H, W) bool for a map of ``height`` x ``width``, or None (pool everywhere). A sample
        that keeps no position keeps every one when empty masks are allowed (``whole_map_when_empty``)."""
        mask = self.mask(height, width) if callable(self.mask) else self.mask
        if mask is None:
            return None
        check_mask(mask, self.allows_empty_mask)
        if tuple(mask.shape[-2:]) != (height, width):
            raise ValueError(f"pool mask is {tuple(mask.shape[-2:])} but the map is {(height, width)}")
        return whole_map_when_empty(mask) if self.allows_empty_mask else mask
