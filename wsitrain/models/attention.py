"""Attention-MIL heads (ABMIL, CLAM-SB gated, CLAM-MB one branch per class) as layers the SFT engine tiles and fuses.

``features -> attention -> pool -> flatten -> classifier``:

* ``attention`` (``AttentionScores``): per position, an optional 1x1 projection ``h = relu(P f)``, then the scores
  ``s = w^T tanh(V h)`` (ABMIL) or ``s = w^T (tanh(V h) * sigmoid(U h))`` (gated, as CLAM), one per branch, returned
  as ``cat([h, s])`` (B, C + K, H, W). Only 1x1 convolutions and pointwise layers: it tiles like the trunk.
* ``pool`` (``wsitrain.sft.ops.attention_pool.AttentionPool``): softmax over the whole map, weighted mean, (B, K, C);
  the engine folds it into the last tiled segment (an online softmax), so the map never exists whole.
* ``classifier``: the model's own head on each branch's pooled vector; with one branch per class (CLAM-MB) it
  scores every branch with every class and ``BranchDiagonal`` keeps class k of branch k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.sft.ops.attention_pool import AttentionPool

# ABMIL / CLAM's attention width (CLAM "small": 512 -> 256); with a projection the hidden width follows it.
DEFAULT_HIDDEN = 256


class AttentionScores(nn.Module):
    """(B, C, H, W) -> (B, D + K, H, W): projected features ``h`` (D = ``dim`` or C) and K attention scores."""

    def __init__(self, channels: int, branches: int = 1, dim: int | None = None, hidden: int | None = None,
                 gated: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.project = nn.Conv2d(channels, dim, 1) if dim is not None else None
        width = dim if dim is not None else channels
        hidden = hidden or min(DEFAULT_HIDDEN, width)
        self.v = nn.Conv2d(width, hidden, 1)
        self.u = nn.Conv2d(width, hidden, 1) if gated else None
        self.w = nn.Conv2d(hidden, branches, 1)
        self.out_channels = width

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.project(f)) if self.project is not None else f  # (B, D, H, W)
        a = torch.tanh(self.v(h))
        if self.u is not None:
            a = a * torch.sigmoid(self.u(h))
        return torch.cat([h, self.w(a)], 1)  # (B, D + K, H, W)


class BranchDiagonal(nn.Module):
    """(B, K, K) class scores of every branch -> (B, K): branch k's score for class k (CLAM-MB)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.diagonal(x, dim1=1, dim2=2)


def feature_mask(tissue: torch.Tensor, out_hw: tuple[int, int], stride: int) -> torch.Tensor:
    """Tissue mask (B, 1, H, W) or (H, W) at image resolution -> (B, 1, h, w) bool at the map's: a map position
    attends when any pixel of its ``stride`` x ``stride`` cell is tissue (cells past the image edge count as none)."""
    t = tissue if tissue.dim() == 4 else tissue[None, None]
    h, w = out_hw
    t = t.bool()[:, :, : h * stride, : w * stride].float()
    pad = (0, w * stride - t.shape[3], 0, h * stride - t.shape[2])
    t = F.pad(t, pad)
    return F.max_pool2d(t, stride, stride) > 0


__all__ = ["AttentionPool", "AttentionScores", "BranchDiagonal", "feature_mask"]
