"""Statistics of barrier layers (``wsitrain.sft.ops.barriers``) accumulated over tiles, and what they apply.

BatchNorm: per-channel (count, mean, M2) combined tile by tile with Chan's parallel update, then the
normalization the layer applies and the running-statistics update ``F.batch_norm`` does.
Squeeze-excitation: the pooled map and its chain's results, run once per step outside the tiles, and the
gradient back through that chain (see ``wsitrain.sft.execution.multipass``).
Global response normalization (``wsitrain.sft.ops.grn``): per-(sample, channel) sums of squares, the
normalizer computed once from them, and the gradient back to the sums.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsitrain.sft.execution.fold_slots import any_folded, leaves, segment_slots
from wsitrain.sft.execution.runner import NodeRunner
from wsitrain.sft.ops.barriers import Barrier
from wsitrain.sft.ops.grn import grn_normalizer

C_SHAPE = (1, -1, 1, 1)  # per-channel vector to (1, C, 1, 1)


@dataclass(frozen=True)
class BNStat:
    """A BatchNorm's batch statistic: per channel mean and 1/sqrt(biased var + eps), over ``count`` positions."""

    mean: torch.Tensor  # (C,)
    inv: torch.Tensor  # (C,)
    count: int


@dataclass(frozen=True)
class SEStat:
    """A squeeze-excitation's pooled map and its chain's results (with the chain's graph when kept)."""

    pooled: torch.Tensor  # (B, C, 1, 1) or (B, C) as the pool gives it; a leaf, requiring grad when the graph is kept
    exits: dict[int, torch.Tensor]  # exit node -> (B, C', 1, 1) computed from ``pooled``
    count: int  # H * W positions averaged


@dataclass(frozen=True)
class GRNStat:
    """A GRN's sums of squares over the image axes (keepdim) and the normalizer ``n`` computed from them."""

    sq: torch.Tensor  # (B, 1, 1, C) channels-last or (B, C, 1, 1), in at least float32
    x_n: torch.Tensor  # same shape
    dims: tuple[int, int]  # the image axes of the GRN's input

    @staticmethod
    def of(m: nn.Module, sq: torch.Tensor, dims: tuple[int, int]) -> GRNStat:
        with torch.no_grad():
            return GRNStat(sq, grn_normalizer(m, sq), dims)

    def sq_grad(self, m: nn.Module, g_n: torch.Tensor) -> torch.Tensor:
        """G_s from the gradient of ``n`` summed over all tiles (through the tiny per-channel formula again)."""
        with torch.enable_grad():
            leaf = self.sq.detach().requires_grad_()
            (g,) = torch.autograd.grad(grn_normalizer(m, leaf), leaf, g_n.to(leaf.dtype))
        return g


def wide(t: torch.Tensor) -> torch.Tensor:
    """Statistics accumulate in at least float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@dataclass
class Moments:
    """Running (count, mean, M2) per channel, combined tile by tile."""

    count: int
    mean: torch.Tensor  # (C,)
    m2: torch.Tensor  # (C,)

    @staticmethod
    def of(part: torch.Tensor) -> Moments:
        """Moments of a (B, C, h, w) block, in at least float32."""
        xs = wide(part)
        mean = xs.mean(dim=(0, 2, 3))
        m2 = ((xs - mean.view(C_SHAPE)) ** 2).sum(dim=(0, 2, 3))
        return Moments(part.numel() // part.shape[1], mean, m2)

    def add(self, o: Moments) -> Moments:
        """Chan et al.'s pairwise update: stable where a sum of squares would cancel."""
        n = self.count + o.count
        d = o.mean - self.mean
        return Moments(n, self.mean + d * (o.count / n), self.m2 + o.m2 + d * d * (self.count * o.count / n))


def finish_batchnorm(m: nn.BatchNorm2d, mom: Moments) -> BNStat:
    """The statistic a train-mode BatchNorm normalizes with; updates its running statistics as PyTorch does."""
    var = mom.m2 / mom.count  # biased: what the layer normalizes with
    if m.training and m.track_running_stats and m.running_mean is not None and m.running_var is not None:
        with torch.no_grad():
            factor = 0.0 if m.momentum is None else float(m.momentum)
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(1)
                if m.momentum is None:  # cumulative moving average
                    factor = 1.0 / float(m.num_batches_tracked)
            unbiased = mom.m2 / max(1, mom.count - 1)
            m.running_mean.mul_(1.0 - factor).add_(mom.mean.to(m.running_mean.dtype), alpha=factor)
            m.running_var.mul_(1.0 - factor).add_(unbiased.to(m.running_var.dtype), alpha=factor)
    return BNStat(mom.mean, torch.rsqrt(var + m.eps), mom.count)


def bn_apply(m: nn.BatchNorm2d, mean: torch.Tensor, inv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``m`` applied with fixed statistics to a tile ``x`` (B, C, h, w): (x - mean) * (inv * weight) + bias.

    The scale is folded to one (C,) vector before it meets the tile, so autograd keeps one tile-sized map for the
    statistics' and the weight's gradients (the centred input), not two: ((x - mean) * inv) * weight also kept the
    normalised map for the weight's gradient (the planner's replay counts the one, ``PlanSession.sim_op``)."""
    scale = inv if m.weight is None else inv * m.weight  # (C,)
    y = (x - mean.view(C_SHAPE)) * scale.view(C_SHAPE)
    if m.bias is not None:
        y = y + m.bias.view(C_SHAPE)
    return y.to(x.dtype)


def correction(st: BNStat | SEStat | GRNStat, total: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
    """The statistic's part of the gradient at input positions ``x`` (B, C, h, w), detached.

    GRN (s = sum of x^2 over the map): 2 x G_s, G_s broadcast over the image axes of ``x`` (its own layout).

    BatchNorm (biased variance over N positions): G_m / N - G_inv * inv^3 * (x - m) / N.
    Squeeze-excitation: every averaged position gets its 1 / (H * W) share of G_P ((B, C, 1, 1) or (B, C)).
    """
    if isinstance(st, GRNStat):
        (g_s,) = total
        return (2.0 * wide(x) * g_s).to(x.dtype)
    if isinstance(st, BNStat):
        g_m, g_inv = total
        corr = g_m.view(C_SHAPE) / st.count - (g_inv * st.inv**3).view(C_SHAPE) * (x - st.mean.view(C_SHAPE)) / st.count
    else:
        (g_p,) = total
        corr = (g_p.reshape(x.shape[0], x.shape[1], 1, 1) / st.count).expand(x.shape)
    return corr.to(x.dtype)


Stats = dict[int, BNStat | SEStat | GRNStat]  # barrier node -> its statistic
# barrier node -> the tensors a sweep differentiates: (mean, inv) of a BatchNorm, the exits of an SE, n of a GRN
Leaves = dict[int, list[torch.Tensor]]
# barrier node -> gradients summed over tiles: (G_m, G_inv) of a BatchNorm, (G_P,) of an SE, (G_s,) of a GRN
Totals = dict[int, tuple[torch.Tensor, ...]]


class SqueezeChain:
    """A squeeze-excitation's chain, run once per step on the pooled value of the whole map."""

    def __init__(self, runner: NodeRunner, b: Barrier, shapes: Mapping[int, tuple[int, ...]]) -> None:
        self.runner, self.b, self.shapes = runner, b, shapes
        self.nodes = sorted(b.chain + b.shapes)  # execution order; they read the pool, shapes and one another
        # a folded convolution of the chain runs on the step's leaves, as in a tile (execution/fold_slots.py)
        self.slots, _ = segment_slots(runner.graph, runner.folds, b.chain)
        self._folded = any_folded(self.slots)

    @property
    def params(self) -> list[torch.Tensor]:
        """What the chain differentiates against: the segment's tensors (``TiledSegment.params``) of its layers."""
        return leaves(self.runner.folds, self.slots) if self._folded else list(self.slots)  # type: ignore[arg-type]

    def run(self, total: torch.Tensor, dtype: torch.dtype, keep_graph: bool) -> SEStat:
        """The pooled map from its sum (B, C, 1, 1) over the map, and the chain on it (with its graph when kept)."""
        h, w = self.shapes[self.b.source][2:]
        pooled = (total / (h * w)).to(dtype).reshape(self.shapes[self.b.node])  # (B, C, 1, 1) or (B, C): the pool's
        with torch.set_grad_enabled(keep_graph):
            leaf = pooled.detach().requires_grad_(keep_graph)
            env: dict[int, Any] = {self.b.node: leaf}

            def fetch(v: int) -> Any:  # shape reads (x.size()) see the untiled map, as in plain PyTorch
                return env[v] if v in env else torch.empty(self.shapes[v], device="meta")

            for i in self.nodes:
                call = self.runner.folds.tile_call(i, False) if self._folded else None
                env[i] = self.runner.run(i, env, out_of_place=True, fetch=fetch, call=call)
        return SEStat(leaf, {e: env[e] for e in self.b.exits}, h * w)

    def backward(self, st: SEStat, g_exits: list[torch.Tensor], chain_grads: dict[int, torch.Tensor]) -> torch.Tensor:
        """G_P: the exits' total gradients through the kept chain graph; adds the chain's parameter gradients."""
        outs = [st.exits[e] for e in self.b.exits]
        g_out = [g.to(o.dtype) for g, o in zip(g_exits, outs, strict=True)]
        params = self.params
        res = torch.autograd.grad(outs, [st.pooled, *params], g_out, allow_unused=True)
        for p, g in zip(params, res[1:], strict=True):
            if g is not None:
                chain_grads[id(p)] = chain_grads[id(p)] + g if id(p) in chain_grads else g
        return res[0] if res[0] is not None else torch.zeros_like(st.pooled)
