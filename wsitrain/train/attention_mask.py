"""The slide's tissue mask for an attention pool: background positions get no attention (as CLAM attends to tissue
patches only). The mask is the one ``data.mask_background`` painted the background with, at the map's resolution
and moved with the image's augmentation (``ReadResult.map_mask``)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn

from wsitrain.sft.ops.attention_pool import AttentionPool
from wsitrain.slides.stream import ReadResult


def attention_pool(model: nn.Module) -> AttentionPool | None:
    """The model's attention pool (an SFT wrapper is looked through), or None."""
    return next((m for m in model.modules() if isinstance(m, AttentionPool)), None)


def attention_masked(model: nn.Module, read: ReadResult | None) -> AbstractContextManager[None]:
    """Forwards inside the block attend only to ``read``'s tissue (everywhere when it has no mask)."""
    pool = attention_pool(model)
    if pool is None or read is None or read.mask is None:
        return nullcontext()
    return pool.masked(read.map_mask)
