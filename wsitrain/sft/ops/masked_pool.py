"""Global max, amax and average pooling over the positions of a tissue mask only: the plain (whole-map) modules.

With ``data.mask_background`` the slide's background is one flat colour, so every background position of the trunk's
map has the same value, and positions near the image border see the convolutions' zero padding. An unmasked max pool
can decide a class there: a constant of the image frame, not evidence (issue 33: the demo's negative class was
decided at map cell (0, 0) on every validation slide). With a mask set (``with pool.masked(mask)``, as for
``AttentionPool``):

- max (``MaskedMaxPool2d``, adaptive max pool to 1 x 1): the largest value over masked positions; its gradient goes
  to the first such position in row-major order; off-mask positions never win;
- amax (``MaskedAmax``, ``x.amax((2, 3))``): the same maximum, its gradient split between the masked positions
  equal to it;
- average (``MaskedAvgPool2d``): the mean over masked positions, ``sum(x * m) / sum(m)`` per sample.

A sample whose mask keeps no position is pooled over its whole map (``pool_mask.whole_map_when_empty``). Without a
mask each module is exactly its unmasked torch counterpart. These forwards are the reference the fused accumulator
(fused_pool.py) is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.sft.ops.pool_mask import MaskedPool, MaskSource

AVG, MAX, AMAX = "avg", "max", "amax"


def masked_global_pool(kind: str, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """(B, C, H, W) -> (B, C) pooled by ``kind`` over the positions of ``mask`` (B or 1, 1, H, W) (all when None)."""
    if mask is None:
        if kind == AVG:
            return x.mean((2, 3))
        return F.adaptive_max_pool2d(x, 1).flatten(1) if kind == MAX else x.amax((2, 3))
    m = mask.to(x.device)
    if kind == AVG:
        count = m.flatten(1).sum(1, keepdim=True)  # (B or 1, 1) positions kept per sample
        return torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum((2, 3)) / count.to(x.dtype)
    off = x.masked_fill(~m, float("-inf"))  # (B, C, H, W): off-mask positions never win, get no gradient
    return F.adaptive_max_pool2d(off, 1).flatten(1) if kind == MAX else off.amax((2, 3))


class _MaskedAdaptivePool(MaskedPool):
    """The adaptive pool to 1 x 1 it is mixed into, reduced by ``kind`` over the mask's positions when one is set."""

    kind: str

    def __init__(self) -> None:
        super().__init__(1)  # type: ignore[call-arg]  # the torch pool's output size, next in the MRO
        self.mask: MaskSource | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.mask_at(x.shape[-2], x.shape[-1])
        if mask is None:
            return super().forward(x)  # type: ignore[misc]  # the torch pool's own
        return masked_global_pool(self.kind, x, mask)[:, :, None, None]  # (B, C, 1, 1) as the unmasked pool


class MaskedAvgPool2d(_MaskedAdaptivePool, nn.AdaptiveAvgPool2d):
    """``AdaptiveAvgPool2d(1)`` that averages over the positions of the mask set with ``masked()`` only."""

    kind = AVG


class MaskedMaxPool2d(_MaskedAdaptivePool, nn.AdaptiveMaxPool2d):
    """``AdaptiveMaxPool2d(1)`` that takes the maximum over the positions of the mask set with ``masked()`` only."""

    kind = MAX


class MaskedAmax(MaskedPool, nn.Module):
    """``x.amax((2, 3))`` (B, C, H, W) -> (B, C) over the positions of the mask set with ``masked()`` only; ties
    share the gradient, as torch's amax."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: MaskSource | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return masked_global_pool(AMAX, x, self.mask_at(x.shape[-2], x.shape[-1]))
