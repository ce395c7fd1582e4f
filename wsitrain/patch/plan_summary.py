"""What a plan means for a patch-encoder model: patches, chunk sizes, memory by part, time against training every
patch plainly, frozen blocks. ``wsitrain plan`` prints it under the engine's plan (plan/command.py).

Every figure is *planned*: read off the engine's plan (shapes only) and the encoder's per-patch cost measured on
fake tensors (cost.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from wsitrain.patch.cost import PatchCost
from wsitrain.sft.ops.patch_grid import cost_memo, is_patch_module
from wsitrain.sft.plan_types import Plan
from wsitrain.units import format_bytes


@dataclass(frozen=True)
class PatchPlanSummary:
    patch: int  # px
    dim: int
    grid: tuple[int, int]  # patches along H and W
    patches: int  # per sample
    chunk: int  # patches per chunk recomputed under autograd (per sample)
    sweep_chunk: int  # patches per chunk of the forward sweep (no autograd)
    one_pass: bool  # the chunks back-propagate in forward along the head's gradient (no sweep, no recompute)
    per_patch: PatchCost
    chunk_bytes: int  # one chunk's saved activations and backward's gradients in flight
    sweep_chunk_bytes: int  # one forward-sweep chunk's working set
    embedding_map_bytes: int  # the (B, D, gh, gw) map the head reads; its gradient is as large
    weights_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    slowdown: float  # planned step time over forward + backward of every patch with plain autograd
    trainable: int  # encoder parameters trained
    frozen: int  # encoder parameters frozen
    backward_share: float  # the encoder's backward FLOPs over a fully trained encoder's (frozen blocks skipped)
    # the frozen stem and leading blocks' output for every patch (the first trainable block's input): its bytes, and
    # whether the plan keeps it from the forward sweep for the recompute (sft/planning/kept_prefix.py); 0: no such
    # prefix (nothing frozen, or an encoder the engine cannot split: wsitrain/patch/prefix.py)
    prefix_bytes: int = 0
    prefix_kept: bool = False
    prefix_blocks: int = 0
    prefix_why: str = ""  # why it is recomputed (the plan's reason)
    plain: bool = False  # the whole grid runs with plain autograd (no tiled segment): nothing is recomputed

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_patch"] = asdict(self.per_patch)
        return d

    def text(self, tissue: float | None = None) -> str:
        gh, gw = self.grid
        lines = [
            f"patch encoder: {self.patch} px patches, {self.dim}-wide embeddings; {gh} x {gw} = {self.patches:,} "
            f"patches per slide" + (f", {math.ceil(tissue * self.patches):,} with tissue at {tissue:.0%} (background "
                                    "patches masked: not pooled, not encoded but one per chunk)" if tissue else ""),
            f"  chunk: {self.chunk} patches recomputed and back-propagated at once"
            + (" in forward (one pass: no forward sweep, no recompute)" if self.one_pass
               else f"; forward sweep {self.sweep_chunk} patches at once without autograd"),
            f"  per patch (measured on fake tensors): {format_bytes(self.per_patch.saved)} kept for backward, "
            f"{format_bytes(self.per_patch.forward_nograd)} forward working set, "
            f"{self.per_patch.flops_forward / 1e9:.1f} GFLOP forward, "
            f"{self.per_patch.flops_backward / 1e9:.1f} backward",
            f"  memory by part (planned): weights {format_bytes(self.weights_bytes)}, gradients "
            f"{format_bytes(self.gradient_bytes)}, optimizer {format_bytes(self.optimizer_bytes)}, one chunk's "
            f"activations {format_bytes(self.chunk_bytes)}"
            + ("" if self.one_pass else f" (a forward-sweep chunk {format_bytes(self.sweep_chunk_bytes)})")
            + f", embedding map {format_bytes(self.embedding_map_bytes)} and its gradient "
            f"{format_bytes(self.embedding_map_bytes)}",
            f"  planned step time: {self.slowdown:.2f}x forward + backward of all patches with plain autograd",
        ]  # fmt: skip
        if self.frozen:
            if self.plain:
                how = "not recomputed (the patch grid runs with plain autograd at this size)"
            elif self.prefix_kept:
                how = (f"kept ({format_bytes(self.prefix_bytes)}, planned): the stem and {self.prefix_blocks} frozen "
                       "blocks run forward once per step, the recompute starts after them")
            elif self.prefix_bytes:
                how = (f"recomputed (would need {format_bytes(self.prefix_bytes)}, planned; {self.prefix_why}): the "
                       f"stem and {self.prefix_blocks} frozen blocks run forward again in each chunk, keeping nothing")
            else:
                how = ("recomputed: the frozen layers run forward again in each chunk, keeping nothing (kept only "
                       "for a timm ViT whose stem and leading blocks are frozen)")
            lines.append(
                f"  frozen: {self.frozen:,} of {self.trainable + self.frozen:,} encoder parameters; backward runs "
                f"{self.backward_share:.0%} of a fully trained encoder's; the first trainable block's input: {how}"
            )
        return "\n".join(lines)


def patch_trunk(model: nn.Module) -> nn.Module | None:
    """The model's patch trunk (an SFT wrapper looked through), or None for a whole-slide CNN."""
    return next((m for m in model.modules() if is_patch_module(m)), None)


def summarize(model: nn.Module, plan: Plan, act_dtype: torch.dtype, optimizer_state: float) -> PatchPlanSummary | None:
    """The patch-model view of ``plan`` for ``model``; None when the model has no patch trunk.
    ``optimizer_state``: optimizer bytes per trainable parameter byte (costs.OPTIMIZER_STATE)."""
    trunk = patch_trunk(model)
    if trunk is None:
        return None
    cost = cost_memo(trunk)(act_dtype)
    b, _, h, w = plan.input_shape
    p, dim = int(trunk.patch), int(trunk.dim)
    grid = (h // p, w // p)
    seg = next((s for s in plan.segments if s.mode == "tiled" and len(s.output_shape) == 4
                and tuple(s.output_shape[2:]) == grid), None)  # fmt: skip
    if seg is None:  # the whole grid at once (a small image): one chunk
        chunk = sweep = grid[0] * grid[1]
        one_pass = False
    else:
        chunk = min(seg.tile_edge, grid[0]) * min(seg.tile_edge, grid[1])
        fe = seg.forward_tile_edge or seg.tile_edge
        sweep = min(fe, grid[0]) * min(fe, grid[1])
        one_pass = seg.one_pass
    enc_params = list(trunk.encoder.parameters())
    trainable = sum(q.numel() for q in enc_params if q.requires_grad)
    frozen = sum(q.numel() for q in enc_params if not q.requires_grad)
    train_bytes = sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)
    share = 1.0
    if frozen:  # the same encoder with every parameter trained, measured as such (memoized per trainable set)
        flags = [q.requires_grad for q in enc_params]
        try:
            trunk.encoder.requires_grad_(True)
            whole = cost_memo(trunk)(act_dtype).flops_backward
        finally:
            for q, f in zip(enc_params, flags, strict=True):
                q.requires_grad_(f)
        share = cost.flops_backward / whole if whole else 0.0
    return PatchPlanSummary(
        patch=p, dim=dim, grid=grid, patches=grid[0] * grid[1], chunk=chunk, sweep_chunk=sweep, one_pass=one_pass,
        per_patch=cost, chunk_bytes=b * chunk * (cost.saved + cost.backward),
        sweep_chunk_bytes=b * sweep * cost.forward_nograd,
        embedding_map_bytes=b * dim * grid[0] * grid[1] * act_dtype.itemsize,
        weights_bytes=sum(q.numel() * q.element_size() for q in model.parameters()), gradient_bytes=train_bytes,
        optimizer_bytes=int(optimizer_state * train_bytes), slowdown=plan.slowdown, trainable=trainable, frozen=frozen,
        backward_share=share, prefix_bytes=seg.prefix_bytes if seg is not None else 0,
        prefix_kept=seg is not None and seg.kept_prefix, prefix_blocks=seg.prefix_blocks if seg is not None else 0,
        plain=seg is None, prefix_why=seg.prefix_why if seg is not None else "",
    )  # fmt: skip
