"""A patch encoder's frozen prefix: the stem and leading blocks ``model.freeze`` froze, run once per step.

With ``model.freeze: {last_blocks: N}`` everything before the first trainable block (patch and position
embeddings, class token, the frozen blocks) receives no gradient. Autograd keeps nothing for it, yet each chunk's
recompute in backward (``sft/execution/tiled.py``) would still run it forward again. Where the plan keeps it
(``SegmentPlan.kept_prefix_bytes``, decided in ``sft/planning/kept_prefix.py``), the forward sweep keeps the first
trainable block's input per chunk, ``(n_patches, tokens, D)``, and the chunk's recompute starts from it: the frozen
prefix runs once per step.

The encoder is split where its forward is known to be a stem followed by a sequence of blocks: timm's
``VisionTransformer`` (every timm ViT, DeiT, the pathology foundation models timm loads) with its own
``forward_features`` and ``forward_head``. Any other encoder recomputes as before (``split_point`` is None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode


def _is_timm_vit(encoder: nn.Module) -> bool:
    try:
        from timm.models.vision_transformer import VisionTransformer
    except ImportError:  # timm absent: no timm encoder either
        return False
    cls = type(encoder)
    return (
        isinstance(encoder, VisionTransformer)
        and cls.forward is VisionTransformer.forward
        and cls.forward_features is VisionTransformer.forward_features
        and isinstance(encoder.blocks, nn.Sequential)
        and not encoder.grad_checkpointing
    )


def split_point(encoder: nn.Module) -> int:
    """How many leading blocks of ``encoder``, with everything before them, hold no trainable parameter and are
    in eval mode or deterministic (so a kept output equals a recompute): 0 when none, or when the encoder cannot be
    split (not a timm ViT) or its stem trains."""
    if not _is_timm_vit(encoder):
        return 0
    blocks = encoder.blocks
    block_params = {id(p) for p in blocks.parameters()}
    tail = {id(p) for m in (encoder.norm, encoder.fc_norm, encoder.head) for p in m.parameters()}
    if encoder.attn_pool is not None:
        tail |= {id(p) for p in encoder.attn_pool.parameters()}
    stem = [p for p in encoder.parameters() if id(p) not in block_params and id(p) not in tail]
    if any(p.requires_grad for p in stem):
        return 0
    k = 0
    for blk in blocks:
        if any(p.requires_grad for p in blk.parameters()):
            break
        k += 1
    return k if k < len(blocks) else 0  # a wholly frozen encoder has nothing to recompute: no split needed


def run_prefix(encoder: nn.Module, cells: torch.Tensor, k: int) -> torch.Tensor:
    """The first trainable block's input for ``cells`` (N, 3, p, p): (N, tokens, D). timm's forward_features up to
    block ``k``."""
    x = encoder.patch_embed(cells)
    x = encoder._pos_embed(x)
    x = encoder.patch_drop(x)
    x = encoder.norm_pre(x)
    return encoder.blocks[:k](x)  # (N, tokens, D)


def run_rest(encoder: nn.Module, h: torch.Tensor, k: int) -> torch.Tensor:
    """The encoder's output from the first trainable block's input ``h`` (N, tokens, D): (N, dim)."""
    x = encoder.blocks[k:](h)
    return encoder.forward_head(encoder.norm(x))


@dataclass(frozen=True)
class PrefixCost:
    """One patch's kept prefix output and the FLOPs its forward costs (what a recompute from it saves)."""

    blocks: int  # frozen leading blocks (with the stem)
    bytes: int  # the first trainable block's input per patch (tokens x D x element size)
    flops: float  # the prefix's forward FLOPs per patch


def measure_prefix(encoder: nn.Module, patch: int, act_dtype: torch.dtype) -> PrefixCost | None:
    """The encoder's frozen prefix per patch at ``act_dtype`` (autocast's when half), on fake tensors; None when
    there is no split (``split_point``)."""
    from wsitrain.patch.cost import _fake_copy

    k = split_point(encoder)
    if k == 0:
        return None
    low = act_dtype in (torch.float16, torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        enc = _fake_copy(encoder)
        pdtype = next((p.dtype for p in enc.parameters()), torch.float32)
        x = torch.empty((1, 3, patch, patch), dtype=torch.float32 if low else pdtype)
        flops = FlopCounterMode(display=False)
        with flops, torch.no_grad(), torch.autocast("cpu", dtype=act_dtype, enabled=low):
            h = run_prefix(enc, x, k)
        return PrefixCost(k, h.numel() * h.element_size(), float(flops.get_total_flops()))
