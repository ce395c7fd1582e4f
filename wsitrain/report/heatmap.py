"""Slide heatmaps: class activation maps (and optionally the exact input-gradient saliency) of one slide.

Through the SFT engine the CAM is filled tile by tile from ``observe_trunk`` and the saliency is block-summed
from ``input_gradient_sink``; only the small maps are ever held. A model without those hooks (plain
``nn.Module``) is run whole, which is the reference the engine's maps are tested against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsitrain.report.cam import BlockSumAccumulator, CamAccumulator, ClassifierHead, find_head
from wsitrain.sft.ops.masked_pool import AMAX, AVG, masked_global_pool
from wsitrain.sft.ops.topk_pool import MaskedTopKMean, topk_mean
from wsitrain.sft.source import is_source


@dataclass
class SlideMaps:
    """One slide's maps. Map pixel (i, j) covers image pixels [i*stride, (i+1)*stride) (likewise saliency/block)."""

    cam: torch.Tensor  # (K, h, w), logit units
    logits: torch.Tensor  # (K,)
    probs: torch.Tensor  # (K,)
    stride: float  # image pixels per CAM pixel
    pool: str
    decisive: torch.Tensor | None = None  # (K, 2) (row, col) in CAM pixels; max-pooling heads only
    attention: torch.Tensor | None = None  # (branches, h, w) attention weights (each sums to 1); attention heads
    saliency: torch.Tensor | None = None  # (C, H/block, W/block) block-summed d logit_pred / d image
    block: int = 0

    @property
    def predicted(self) -> int:
        return int(self.probs.argmax())


def _has_hooks(model: nn.Module) -> bool:
    return hasattr(model, "observe_trunk") and hasattr(model, "input_gradient_sink")


def trunk_hw(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """The trunk output's (h, w) for input ``x``: the engine's plan knows it without running anything."""
    plan = model.plan_for(tuple(x.shape))  # type: ignore[operator]
    shape = plan.segments[-1].output_shape
    return int(shape[-2]), int(shape[-1])


def slide_maps(
    model: nn.Module,
    image: torch.Tensor,
    *,
    saliency_block: int | None = None,
    probabilities: Any = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> SlideMaps:
    """CAM of every class for one image (3, H, W) or (1, 3, H, W) (or a region source standing in for one, a slide
    read tile by tile), the logits, and optionally the saliency.

    ``model``: an SFT engine (tiled, hooks) or a plain model with a global pool -> Linear head. The image may be
    uint8 (the model normalises); for saliency a uint8 image is differentiated as the [0, 1] float image
    ``InputNormalization`` makes of it (so the gradient is per unit of that scale).
    ``probabilities``: logits (1, K) -> probabilities (1, K); softmax when None.
    ``saliency_block``: cell edge in image pixels of the block-summed gradient of the predicted class's logit.
    ``autocast``: the precision context predict runs the model in (the plan, and so the memory, depend on it).
    """
    head = find_head(model)
    x = image.unsqueeze(0) if image.dim() == 3 else image  # (1, 3, H, W)
    if x.shape[0] != 1:
        raise ValueError(f"one slide at a time; got a batch of {x.shape[0]}")
    hooks = _has_hooks(model)
    if is_source(x) and (saliency_block is not None or not hooks):
        # a slide read tile by tile (data.stream_tiles): the engine reads it region by region for the CAM, but the
        # saliency differentiates the image itself (a float copy of it, 4 bytes a pixel) and a plain model takes
        # it whole, so both get it whole
        x = x.materialize()  # type: ignore[attr-defined]
    if saliency_block is not None:
        if not x.is_floating_point():  # the same [0, 1] image InputNormalization makes of uint8, now differentiable
            x = x.to(head.weight.dtype) / 255
        x = x.detach().requires_grad_(True)
    if hooks:
        acc = CamAccumulator(head, 1, trunk_hw(model, x))
    grad_ctx: contextlib.AbstractContextManager[Any] = torch.enable_grad() if saliency_block else torch.no_grad()
    with grad_ctx, (autocast or contextlib.nullcontext)():
        if hooks:
            with model.observe_trunk(acc):  # type: ignore[operator]
                logits = model(x)
        else:
            f = head.trunk(x.to(head.weight.device))  # (1, C, h, w)
            acc = CamAccumulator(head, 1, tuple(f.shape[-2:]))  # type: ignore[arg-type]
            acc(f, (0, f.shape[-2]), (0, f.shape[-1]))
            logits = _plain_head(head, f)
    cam = acc.result()[0]
    probs = probabilities(logits.detach()) if probabilities is not None else torch.softmax(logits.detach(), dim=1)
    stride = x.shape[-2] / cam.shape[-2]
    out = SlideMaps(cam, logits.detach()[0].cpu(), probs[0].float().cpu(), stride, head.pool)
    if head.pool == "max":
        out.decisive = acc.decisive_positions()[0]
    if head.attention is not None:
        out.attention = acc.attention()[0]
    if saliency_block:
        out.saliency, out.block = _saliency(model, x, logits, out.predicted, saliency_block, hooks), saliency_block
    return out


def _plain_head(head: ClassifierHead, f: torch.Tensor) -> torch.Tensor:
    w, b = head.weight.to(f.device), head.bias.to(f.device)
    if head.attention is not None:
        pooled = head.attention(f)  # (B, branches, C + the instance scores it carries)
        if head.stream is not None:
            return head.stream(pooled)
        v = pooled[..., : w.shape[1]].to(w.dtype)  # (B, branches, C)
        return v[:, 0] @ w.T + b if v.shape[1] == 1 else (v * w).sum(-1) + b  # one branch per class: its own
    mask = head.masked.mask_at(f.shape[-2], f.shape[-1]) if head.masked is not None else None
    if isinstance(head.masked, MaskedTopKMean):
        return topk_mean(f, head.masked.k, mask).to(w.dtype) @ w.T + b
    v = masked_global_pool(AMAX if head.pool == "max" else AVG, f, mask)  # (B, C), over the tissue when masked
    return v.to(w.dtype) @ w.T + b


def _saliency(
    model: nn.Module, x: torch.Tensor, logits: torch.Tensor, k: int, block: int, hooks: bool
) -> torch.Tensor:
    acc = BlockSumAccumulator(tuple(x.shape), block, torch.float64 if x.dtype == torch.float64 else torch.float32)
    target = logits[:, k].sum()
    if hooks:
        with model.input_gradient_sink(acc):  # type: ignore[operator]
            target.backward()
    else:
        (grad,) = torch.autograd.grad(target, x)
        acc(grad, (0, x.shape[-2]), (0, x.shape[-1]))
    return acc.sum[0]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the maps, the model's previous mode restored after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
