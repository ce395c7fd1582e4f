"""The slide's tissue mask for the model's global pool: background positions are not pooled (attention gives them no
weight, as CLAM attends to tissue patches only; max and average pooling reduce over tissue only, so no class is
decided on the background or the image border). The mask is the one ``data.mask_background`` painted the background
with, at the map's resolution and moved with the image's augmentation (``ReadResult.map_mask``). A model built with
``model.mask_pool: false`` has unmaskable max / average pools (``wsitrain.models.build``) and pools everywhere."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch import nn

from wsitrain.sft.ops.attention_pool import AttentionPool
from wsitrain.sft.ops.pool_mask import MaskedPool
from wsitrain.slides.stream import ReadResult


def attention_pool(model: nn.Module) -> AttentionPool | None:
    """The model's attention pool (an SFT wrapper is looked through), or None."""
    return next((m for m in model.modules() if isinstance(m, AttentionPool)), None)


def masked_pool(model: nn.Module) -> MaskedPool | None:
    """The model's maskable global pool (attention, max, average; an SFT wrapper is looked through), or None."""
    return next((m for m in model.modules() if isinstance(m, MaskedPool)), None)


def tissue_masked(model: nn.Module, read: ReadResult | None) -> AbstractContextManager[None]:
    """Forwards inside the block pool only ``read``'s tissue (everywhere when it has no mask)."""
    pool = masked_pool(model)
    if pool is None or read is None or read.mask is None:
        return nullcontext()
    return pool.masked(read.map_mask)
