"""Attention-MIL heads (ABMIL, CLAM-SB gated, CLAM-MB one branch per class) as layers the SFT engine tiles and fuses.

``features -> attention -> pool -> flatten -> classifier``:

* ``attention`` (``AttentionScores``): per position, an optional 1x1 projection ``h = relu(P f)``, then the scores
  ``s = w^T tanh(V h)`` (ABMIL) or ``s = w^T (tanh(V h) * sigmoid(U h))`` (gated, as CLAM), one per branch, returned
  as ``cat([h, s])`` (B, C + K, H, W). Only 1x1 convolutions and pointwise layers: it tiles like the trunk. The
  score layers compute in float32 under autocast (``Float32Conv1x1``).
* ``pool`` (``wsitrain.sft.ops.attention_pool.AttentionPool``): softmax over the whole map, weighted mean, (B, K, C);
  the engine folds it into the last tiled segment (an online softmax), so the map never exists whole.
* ``classifier``: the model's own head on the pooled vector; with one branch per class (CLAM-MB,
  ``BranchClassifier``) class k's logit is the head's class k on branch k's vector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.models.heads import ATTENTION_NORMS, CELL_NORM, NO_NORM, SLIDE_NORM
from wsitrain.sft.ops.attention_pool import AttentionPool, InstanceSplit, without_autocast

# ABMIL / CLAM's attention width (CLAM "small": 512 -> 256); with a projection the hidden width follows it.
DEFAULT_HIDDEN = 256


class Float32Conv1x1(nn.Conv2d):
    """A 1x1 convolution that computes in its weight's dtype under autocast too (``sft_float32``: the planner counts
    its output, and what follows it, at 4 bytes).

    Why: a softmax's score gradients sum to zero over the map, so the attention layers' weight gradients are sums
    that nearly cancel, and bf16 loses them. Measured on the gated head of tests/test_sft_attention.py (seed 2):
    plain bf16's gradient of ``v``'s bias was 0.24 (relative) from float64's, 0.0035 with these layers in float32
    (the tiled step: 0.011 and 0.0028). Their maps are narrow (``hidden`` channels), so the cost is small.
    """

    sft_float32 = True

    def __init__(self, cin: int, cout: int, bias: bool = True) -> None:
        super().__init__(cin, cout, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with without_autocast(x):
            return super().forward(x.to(self.weight.dtype))


def slide_norm(channels: int) -> nn.BatchNorm2d:
    """Each channel standardised over the slide's map: a BatchNorm without affine parameters or running statistics,
    so batch statistics in training and prediction alike (``model.map_norm`` and ``model.attention.norm: slide``;
    the engine tiles it exactly in two sweeps, as train-mode BatchNorm)."""
    return nn.BatchNorm2d(channels, affine=False, track_running_stats=False)


class CellNorm(nn.LayerNorm):
    """(B, C, H, W) -> each position's C values standardised (a LayerNorm over channels, pointwise in space; the engine
    traces it as permute, layer_norm, permute, as ConvNeXt's LayerNorm2d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class AttentionScores(nn.Module):
    """(B, C, H, W) -> (B, D + K, H, W): projected features ``h`` (D = ``dim`` or C) and K attention scores."""

    def __init__(self, channels: int, branches: int = 1, dim: int | None = None, hidden: int | None = None,
                 gated: bool = False, norm: str = NO_NORM) -> None:  # fmt: skip
        super().__init__()
        self.project = nn.Conv2d(channels, dim, 1) if dim is not None else None
        width = dim if dim is not None else channels
        # ``norm`` (heads.ATTENTION_NORMS): what the scores read. SLIDE_NORM: each channel standardised over the map
        # (batch statistics always: no running ones, so training and prediction alike; the engine tiles it exactly in
        # two sweeps, as train-mode BN); CELL_NORM: each cell's vector over its channels. Only the scores read it; the
        # pooled vector stays the trunk's. Why: docs/research/plateau.md section 12.
        self.norm: nn.Module | None = None
        if norm == SLIDE_NORM:
            self.norm = slide_norm(width)
        elif norm == CELL_NORM:
            self.norm = CellNorm(width, elementwise_affine=False)
        elif norm != NO_NORM:
            raise ValueError(f"unknown norm {norm!r}: choose one of {', '.join(ATTENTION_NORMS)}")
        hidden = hidden or min(DEFAULT_HIDDEN, width)
        self.v = Float32Conv1x1(width, hidden)
        self.u = Float32Conv1x1(width, hidden) if gated else None
        # no bias: a softmax is shift-invariant, so a score bias changes nothing and its gradient is pure round-off
        self.w = Float32Conv1x1(hidden, branches, bias=False)
        self.out_channels = width

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.project(f)) if self.project is not None else f  # (B, D, H, W)
        z = self.norm(h) if self.norm is not None else h  # (B, D, H, W)
        a = torch.tanh(self.v(z))
        if self.u is not None:
            a = a * torch.sigmoid(self.u(z))
        return torch.cat([h, self.w(a)], 1)  # (B, D + K, H, W); float32 under autocast (the scores are)


class BranchClassifier(nn.Module):
    """CLAM-MB's head: (B, K, C) pooled vectors of K = classes branches -> (B, K) logits, class k scored on branch
    k by the model's own classifier (run on each branch's vector as a batch of B * K, so a library head with a
    LayerNorm or an MLP before its Linear works unchanged)."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        b, k = z.shape[0], z.shape[1]
        scores = self.classifier(z.flatten(0, 1)).view(b, k, -1)  # (B, K, classes): every branch, every class
        return torch.diagonal(scores, dim1=1, dim2=2)  # (B, K)


class InstanceStream(InstanceSplit):
    """CLAM-MB's head with a max-instance stream (``model.attention.instance_stream``): (B, K, C + instance_k) ->
    (B, K) logits, branch k's vector scored by ``bag`` (a ``BranchClassifier``), and the positive class's logit
    plus the mean of its branch's ``cells`` highest scores (each kept cell's; -inf past a small mask's are none).

    Why (DSMIL's dual stream, read with the instance loss's logits): without it (and with ``norm: slide``), the instance
    loss made the positive branch's highest score rank one seed's held-out slides at AUC 0.99 while the attention-pooled
    classifier still gave every slide about 0.5 (docs/research/plateau.md section 12, measured). The stream lets those
    logits decide, and gives the trunk the top cells' gradient undiluted by the map's size, as max pooling does.

    An ``InstanceSplit``: the loss reads its input (the scores) as it reads the split's."""

    def __init__(self, bag: nn.Module, instance_k: int, positive: int, cells: int) -> None:
        super().__init__(instance_k, flatten=False)
        if not 0 < cells <= instance_k:
            raise ValueError(f"the stream reads {cells} scores of the {instance_k} the pool carries")
        self.bag, self.positive, self.cells = bag, positive, cells

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        c = z.shape[-1] - self.instance_k
        logits = self.bag(z[..., :c])  # (B, K)
        top = z[:, self.positive, c : c + self.cells]  # (B, cells), largest first
        kept = torch.isfinite(top)
        stream = torch.where(kept, top, 0.0).sum(-1) / kept.sum(-1).clamp(min=1)  # (B,)
        p = self.positive  # no one-hot tensor: it would be made on the CPU while the engine traces on meta
        bumped = logits[:, p : p + 1] + stream[:, None].to(logits.dtype)  # (B, 1)
        return torch.cat([logits[:, :p], bumped, logits[:, p + 1 :]], 1)

    def extra_repr(self) -> str:
        return f"instance_k={self.instance_k}, positive={self.positive}, cells={self.cells}"


def feature_mask(tissue: torch.Tensor, out_hw: tuple[int, int], stride: int) -> torch.Tensor:
    """Tissue mask (B, 1, H, W) or (H, W) at image resolution -> (B, 1, h, w) bool at the map's: a map position
    attends when any pixel of its ``stride`` x ``stride`` cell is tissue (cells past the image edge count as none)."""
    t = tissue if tissue.dim() == 4 else tissue[None, None]
    h, w = out_hw
    t = t.bool()[:, :, : h * stride, : w * stride].float()
    pad = (0, w * stride - t.shape[3], 0, h * stride - t.shape[2])
    t = F.pad(t, pad)
    return F.max_pool2d(t, stride, stride) > 0


__all__ = ["AttentionPool", "AttentionScores", "BranchClassifier", "InstanceSplit", "InstanceStream", "feature_mask"]
