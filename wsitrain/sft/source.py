"""An input read region by region: what the engine accepts in place of a whole host image.

A ``RegionSource`` stands in for a (B, C, H, W) host tensor that is never built (a slide decoded tile by tile,
``wsitrain.slides.tile_source``). A tiled first segment cuts its input regions from it exactly as from a tensor
(the stager slices ``x[:, :, r0:r1, c0:c1]``), after ``expect`` told it the regions in the order the tiles are
visited, so it can read ahead. A plan whose first segment is not tiled gets the whole image (``materialize``).
The source never changes in place (``_version`` 0: a prefetched region never goes stale) and needs no gradient.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

Interval = tuple[int, int]


@runtime_checkable
class RegionSource(Protocol):
    """A host image read region by region (see the module doc)."""

    shape: torch.Size  # (B, C, H, W)
    dtype: torch.dtype
    device: torch.device  # the host
    requires_grad: bool  # always False
    _version: int  # always 0: the image never changes

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The region ``[:, :, r0:r1, c0:c1]`` as a new (B, C, r1 - r0, c1 - c0) tensor."""

    def expect(self, order: list[tuple[Interval, Interval]]) -> None:
        """The (rows, cols) regions about to be asked for, in that order (a hint: any other order is still exact)."""

    def materialize(self) -> torch.Tensor:
        """The whole image as one (B, C, H, W) tensor."""

    def dim(self) -> int: ...


def is_source(x: object) -> bool:
    """Is ``x`` a region source rather than a tensor?"""
    return not isinstance(x, torch.Tensor) and isinstance(x, RegionSource)
