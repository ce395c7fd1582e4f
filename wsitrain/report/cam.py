"""Class activation maps and block-summed input gradients, accumulated tile by tile.

A global-pool -> linear head scores ``logit_k = sum_c W[k, c] pool(f)[c] + b_k``. Its class activation map is the
head applied at every trunk-output position, ``cam_k(h, w) = sum_c W[k, c] f[c, h, w] + b_k``: with average
pooling the logit is exactly the CAM's mean. Both accumulators below are fed one tile at a time by the engine's
hooks (or once with the whole map by a plain model) and hold only their small output arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models.attention import BranchClassifier, InstanceStream
from wsitrain.models.heads import ATTENTION, AVG, MAX, TOPK
from wsitrain.sft.ops.attention_pool import AttentionPool, InstanceSplit
from wsitrain.sft.ops.pool_mask import MaskedPool
from wsitrain.sft.ops.topk_pool import MaskedTopKMean

# Global poolings a CAM can be read through; each maps (B, C, h, w) -> (B, C, 1, 1) (attention: (B, K, C), each
# branch's attention-weighted mean, so the logit is the CAM's attention-weighted sum).
_POOLS: dict[type[nn.Module], str] = {
    nn.AdaptiveAvgPool2d: AVG, nn.AdaptiveMaxPool2d: MAX, AttentionPool: ATTENTION, MaskedTopKMean: TOPK,
}
# Modules between the pooling and the classifier that do not change a feature vector at inference.
_PASS_THROUGH = (nn.Flatten, nn.Dropout, nn.Identity, InstanceSplit)


@dataclass(frozen=True)
class ClassifierHead:
    """Where a model's trunk ends and how its head scores: ``pool`` "avg", "max" or "attention", then
    ``weight @ v + bias`` (attention with one branch per class: class k scores branch k's ``v``)."""

    trunk: nn.Sequential  # every module before the global pooling (for the plain reference computation)
    pool: str
    weight: torch.Tensor  # (K, C)
    bias: torch.Tensor  # (K,)
    linear_path: str  # the Linear's module path, for messages
    attention: AttentionPool | None = None  # the attention pool: the trunk's map ends in its branches' scores
    masked: MaskedPool | None = None  # a max / average pool that reads the tissue mask set on it (masked_pool.py)
    stream: InstanceStream | None = None  # attention with an instance stream: the logits' own head

    @property
    def branches(self) -> int:
        """Attention score channels at the end of the trunk's map (0 without an attention pool)."""
        return self.attention.branches if self.attention is not None else 0


def find_head(model: nn.Module) -> ClassifierHead:
    """The global pooling and the Linear after it in a Sequential model (an SFT wrapper is looked through).

    Raises a WsiTrainError naming the module when the model does not end in global pool -> [flatten] -> Linear,
    since then no class activation map exists.
    """
    inner = getattr(model, "model", model) if not isinstance(model, nn.Sequential) else model
    if not isinstance(inner, nn.Sequential):
        raise WsiTrainError(
            f"heatmaps need a Sequential model ending in a global pooling and a Linear; got {type(inner).__name__}",
            hint="build the model with wsitrain.models.build (normalize -> features -> pool -> flatten -> classifier)",
        )
    names = [n for n, _ in inner.named_children()]
    mods = [m for _, m in inner.named_children()]
    pools = [i for i, m in enumerate(mods) if _pool_name(m) is not None and _output_is_one(m)]
    if not pools:
        raise WsiTrainError(
            "heatmaps need a global pooling (AdaptiveAvgPool2d(1) or AdaptiveMaxPool2d(1)) before the classifier; "
            f"the model's top-level modules are: {', '.join(names)}",
            hint="use a model with pool: avg or pool: max (every wsitrain model has one)",
        )
    i = pools[-1]
    rest = [(n, _inner_linear(m)) for n, m in zip(names[i + 1 :], mods[i + 1 :], strict=True)]
    linears = [(n, m) for n, m in rest if isinstance(m, nn.Linear)]
    others = [n for n, m in rest if not isinstance(m, (nn.Linear, *_PASS_THROUGH))]
    if len(linears) != 1 or others:
        raise WsiTrainError(
            f"heatmaps need exactly one Linear after the pooling module {names[i]!r}; found "
            f"{[n for n, _ in linears] or 'none'}" + (f" and other modules {others}" if others else ""),
            hint="a class activation map exists only for global pool -> Linear heads",
        )
    name, lin = linears[0]
    bias = lin.bias if lin.bias is not None else torch.zeros(lin.out_features, device=lin.weight.device)
    pool = mods[i] if isinstance(mods[i], AttentionPool) else None
    masked = mods[i] if isinstance(mods[i], MaskedPool) and pool is None else None
    name_ = _pool_name(mods[i])
    assert name_ is not None
    stream = next((m for m in mods[i + 1 :] if isinstance(m, InstanceStream)), None)
    return ClassifierHead(inner[:i], name_, lin.weight.detach(), bias.detach(), name, pool, masked, stream)


def _pool_name(m: nn.Module) -> str | None:
    """"avg", "max" or "attention" for a pooling module (their masked subclasses too), else None."""
    return next((name for kind, name in _POOLS.items() if isinstance(m, kind)), None)


def _inner_linear(m: nn.Module) -> nn.Module:
    """CLAM-MB's ``BranchClassifier`` around a Linear scores as that Linear does (class k of branch k); an
    ``InstanceStream`` around one scores the map as its bag classifier does (its stream adds to the logit only)."""
    if isinstance(m, InstanceStream):
        m = m.bag
    return m.classifier if isinstance(m, BranchClassifier) else m


def _output_is_one(m: nn.Module) -> bool:
    if isinstance(m, (AttentionPool, MaskedTopKMean)):
        return True
    size = m.output_size  # type: ignore[attr-defined]
    return size == 1 or tuple(size) == (1, 1)


def cam_of_features(head: ClassifierHead, f: torch.Tensor) -> torch.Tensor:
    """The CAM of a feature map: (B, C, h, w) -> (B, K, h, w), in the head's dtype."""
    w = head.weight.to(f.device)
    b = head.bias.to(f.device)
    return torch.einsum("kc,bchw->bkhw", w, f.to(w.dtype)) + b[None, :, None, None]


class CamAccumulator:
    """Fills a (B, K, h, w) CAM from trunk-output tiles; ``fn(tile, rows, cols)`` as the engine's observe_trunk.

    For a max-pooling head it also tracks, per channel, the maximum and where it sits: the logit then splits
    exactly into per-position parts, ``logit_k - b_k = sum_p sum_{c: argmax_c = p} W[k, c] max_c``, and the
    position with the largest part is the one that decided the score.
    """

    def __init__(self, head: ClassifierHead, batch: int, out_hw: tuple[int, int]) -> None:
        self.head = head
        self.hw = (int(out_hw[0]), int(out_hw[1]))
        k, c = head.weight.shape
        dtype = head.weight.dtype
        self.cam = torch.zeros((batch, k, *self.hw), dtype=dtype)  # (B, K, h, w) on the host
        self.covered = torch.zeros(self.hw, dtype=torch.bool)
        self.max_value = torch.full((batch, c), -torch.inf, dtype=dtype)  # (B, C)
        self.max_index = torch.zeros((batch, c), dtype=torch.long)  # (B, C) flat index into (h, w)
        # attention: each branch's score at every position (B, branches, h, w), made weights by ``attention()``
        # max: the tissue mask the pool holds now (the forward that feeds this one reads it): off it, no maximum
        self.mask = head.masked.mask_at(*self.hw) if head.masked is not None and head.pool == "max" else None
        self.scores = torch.zeros((batch, head.branches, *self.hw), dtype=dtype) if head.branches else None

    def __call__(self, tile: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        (r0, r1), (c0, c1) = rows, cols
        t = tile.detach().to(self.head.weight.dtype)  # (B, C, th, tw); autocast tiles come in bf16/fp16
        if t.shape[-2:] != (r1 - r0, c1 - c0):
            raise ValueError(f"tile {tuple(t.shape)} does not match rows {rows} cols {cols}")
        nb = self.head.branches
        if t.shape[1] != self.head.weight.shape[1] + nb:
            # The engine's trunk must end where the pooling starts, or this is some other feature map.
            raise ValueError(f"the observed map has {t.shape[1]} channels but {self.head.linear_path} expects "
                             f"{self.head.weight.shape[1]}" + (f" and {nb} attention scores" if nb else ""))
        if self.scores is not None:
            self.scores[:, :, r0:r1, c0:c1] = t[:, -nb:].cpu()
            t = t[:, :-nb]  # (B, C, th, tw): the features the pool weights
        self.cam[:, :, r0:r1, c0:c1] = cam_of_features(self.head, t).cpu()
        self.covered[r0:r1, c0:c1] = True
        if self.head.pool == "max":
            if self.mask is not None:  # as the masked pool reads the map: off-tissue positions never win
                t = t.masked_fill(~self.mask[:, :, r0:r1, c0:c1].to(t.device), float("-inf"))
            flat = t.flatten(2)  # (B, C, th * tw)
            value, idx = flat.max(dim=2)  # (B, C)
            tw = c1 - c0
            global_idx = (r0 + idx // tw) * self.hw[1] + c0 + idx % tw
            better = value.cpu() > self.max_value
            self.max_value = torch.where(better, value.cpu(), self.max_value)
            self.max_index = torch.where(better, global_idx.cpu(), self.max_index)

    def result(self) -> torch.Tensor:
        """The (B, K, h, w) map; every position must have been seen exactly by some tile."""
        if not bool(self.covered.all()):
            missing = int((~self.covered).sum())
            raise RuntimeError(f"the trunk hook left {missing} of {self.covered.numel()} map positions unseen")
        return self.cam

    def attention(self) -> torch.Tensor:
        """Attention heads: (B, branches, h, w) weights, each branch's softmax over the map (0 outside the mask its
        pool holds while this is called, as in the forward that filled the scores)."""
        assert self.head.attention is not None and self.scores is not None, "not an attention head"
        self.result()  # every position seen
        h, w = self.hw
        s = self.scores
        mask = self.head.attention.mask_at(h, w)
        if mask is not None:
            s = s.masked_fill(~mask.cpu(), float("-inf"))
        return torch.softmax(s.flatten(2), dim=-1).view_as(s)

    def max_contributions(self) -> torch.Tensor:
        """Max head only: (B, K, h*w) per-position parts of ``logit - bias`` (they sum to it exactly)."""
        if self.head.pool != "max":
            raise ValueError("per-position contributions exist for a max-pooling head only")
        w = self.head.weight.cpu()  # (K, C)
        b, _ = self.max_value.shape
        k = w.shape[0]
        parts = w[None] * self.max_value[:, None, :]  # (B, K, C)
        out = torch.zeros((b, k, self.hw[0] * self.hw[1]), dtype=parts.dtype)
        return out.scatter_add_(2, self.max_index[:, None, :].expand(b, k, -1), parts)

    def decisive_positions(self) -> torch.Tensor:
        """Max head only: (B, K, 2) (row, col) in map pixels of the largest per-position part of each logit, among
        the positions holding some channel's maximum. A position holding none takes no part (its part is 0, not a
        decision): a class whose parts are all negative was otherwise "decided" at the first such cell, (0, 0),
        measured on the demo's negative slides with the pool masked to tissue."""
        parts = self.max_contributions()  # (B, K, h*w)
        held = torch.zeros(parts.shape[0], parts.shape[2], dtype=torch.bool)  # (B, h*w)
        held.scatter_(1, self.max_index, True)
        parts = parts.masked_fill(~held[:, None, :], float("-inf"))
        flat = parts.argmax(dim=2)  # (B, K)
        return torch.stack((flat // self.hw[1], flat % self.hw[1]), dim=-1)


class BlockSumAccumulator:
    """Sums an image-sized gradient over ``block`` x ``block`` cells of a grid anchored at pixel (0, 0).

    The block sum is linear, so summing each tile's share into the cells it touches gives exactly the block sum
    of the full input gradient, which is never built: ``fn(grad, rows, cols)`` as the engine's gradient sink.
    """

    def __init__(self, shape: tuple[int, int, int, int], block: int, dtype: torch.dtype = torch.float32) -> None:
        b, c, h, w = shape
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.block = int(block)
        self.shape = (b, c, h, w)
        self.sum = torch.zeros((b, c, -(-h // block), -(-w // block)), dtype=dtype)  # (B, C, H/s, W/s)

    def __call__(self, grad: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        (r0, r1), (c0, c1) = rows, cols
        s = self.block
        br0, bc0 = r0 // s, c0 // s
        br1, bc1 = -(-r1 // s), -(-c1 // s)
        # Pad the tile out to whole cells of the global grid, then sum within each cell.
        g = F.pad(grad.detach().to(self.sum.dtype), (c0 - bc0 * s, bc1 * s - c1, r0 - br0 * s, br1 * s - r1))
        b, c = g.shape[:2]
        cells = g.reshape(b, c, br1 - br0, s, bc1 - bc0, s).sum(dim=(3, 5))
        self.sum[:, :, br0:br1, bc0:bc1] += cells.cpu()

    def magnitude(self) -> torch.Tensor:
        """(B, H/s, W/s) per-cell L2 norm over the colour channels of the block-summed gradient."""
        return self.sum.norm(dim=1)


def block_sum(x: torch.Tensor, block: int) -> torch.Tensor:
    """Reference: block sums of a whole (B, C, H, W) tensor on the same grid (zero-padded at the far edges)."""
    acc = BlockSumAccumulator(tuple(x.shape), block, x.dtype)  # type: ignore[arg-type]
    acc(x, (0, x.shape[-2]), (0, x.shape[-1]))
    return acc.sum
