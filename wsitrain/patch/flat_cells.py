"""Flat patches encoded once: a chunk's patches that are one colour (a masked slide's background) share one row.

With ``data.mask_background`` every pixel outside the tissue has the slide's background colour, so every background
patch is the same input and the encoder gives it the same embedding. The engine already skips a chunk that is all
background (``execution/reuse.py``: the first such chunk's work is reused), but a chunk with some tissue used to encode
every one of its patches. Here the patches of a chunk are split by content: those that are not one colour (tissue)
are encoded each, and the flat ones once per distinct colour (one row for a masked slide's background); each flat
cell of the embedding map is that colour's row (``index_select``).

Exact for every head, masked or not: a flat cell's value is the encoder's output for its own input (identical
inputs, a per-patch encoder), and in backward ``index_select`` sums the flat cells' embedding gradients into their
row, which the encoder back-propagates once: the parameter gradient is the sum over the flat cells, as when each was
encoded (under a masked pool those gradients are zero anyway). Not done, and every patch encoded, where it would
not be exact:
- the input needs a gradient: a flat patch's own input gradient would be lost (only its colour's first patch gets
  the summed one); a slide image never needs one;
- an encoder whose output for a patch depends on the other patches of its batch: BatchNorm using batch statistics
  (training mode, or without running statistics), or random layers in training mode (dropout, stochastic depth),
  whose draws would change with the rows the encoder sees;
- tensors without content (the simulated device, the meta device): nothing to read, so the worst case is computed.

Cost: one comparison of the chunk's pixels with each patch's first pixel, and one host read of the flat count (a
synchronization on a GPU, as the reuse cache's checks; ``ExecHooks.on_sync`` does not see it).
"""

from __future__ import annotations

import torch
from torch import nn

from wsitrain.sft.execution.reuse import has_content


def couples_patches(encoder: nn.Module) -> bool:
    """Does ``encoder``'s output for one patch depend on the other patches of its batch (or on random draws)?"""
    for m in encoder.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
            return True
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if (
            type(m).__name__ in ("DropPath", "StochasticDepth")
            and float(getattr(m, "drop_prob", getattr(m, "p", 0.0)) or 0.0) > 0
        ):
            return True
    return False


def encode_distinct(encoder: nn.Module, cells: torch.Tensor) -> torch.Tensor:
    """``encoder`` on (N, C, p, p) ``cells``, a flat patch encoded once per colour: (N, D), as ``encoder(cells)``."""
    if cells.requires_grad or not has_content(cells) or cells.shape[0] < 2 or couples_patches(encoder):
        return encoder(cells)
    n, c = cells.shape[:2]
    flat_rows = cells.detach().reshape(n, c, -1)  # (N, C, p * p)
    flat = (flat_rows == flat_rows[:, :, :1]).all(dim=2).all(dim=1)  # (N,) one colour per channel
    flat_idx = flat.nonzero().squeeze(1)  # (F,) the one host read
    if flat_idx.numel() < 2:  # nothing to share
        return encoder(cells)
    tissue_idx = (~flat).nonzero().squeeze(1)  # (T,)
    colours, inverse = torch.unique(flat_rows[flat_idx, :, 0], dim=0, return_inverse=True)  # (U, C), (F,)
    order = torch.arange(flat_idx.numel(), device=cells.device)
    first = torch.full((colours.shape[0],), flat_idx.numel(), device=cells.device, dtype=order.dtype)
    first.scatter_reduce_(0, inverse, order, "amin")  # (U,) each colour's first flat patch
    rows = torch.cat([tissue_idx, flat_idx[first]])  # (T + U,) the patches encoded
    emb = encoder(cells.index_select(0, rows))  # (T + U, D)
    where = torch.empty(n, dtype=torch.long, device=cells.device)  # (N,) each cell's row of emb
    where[tissue_idx] = torch.arange(tissue_idx.numel(), device=cells.device)
    where[flat_idx] = tissue_idx.numel() + inverse
    return emb.index_select(0, where) if emb.dim() == 2 else emb  # a wrong shape: the trunk names it
