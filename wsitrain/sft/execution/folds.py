"""One step's folded convolution weights (``ops/fold_bn.py``): computed once per step, read by every layer call.

``SFT.forward`` starts a step with ``folds.new_step(pairs)``: each folded pair's ``w'`` and ``b'`` are computed from
the original parameters under the step's grad mode, so in a plain segment autograd carries their gradients back to
the convolution's and the BatchNorm's parameters as it does for any layer. A tiled segment's tiles run on detached
leaves of the same values (``leaf``): they are what a tile's backward differentiates against and what autocast casts
once per sweep, exactly as it does a parameter; the segment's autograd node takes the non-leaf values as inputs and
returns the leaves' summed gradients for them, so the fold's own backward runs once per step, after the tiles.
A tiled segment's autograd node keeps its step's folds and its backward recomputes under ``replaying`` (so two
forwards before one backward work, as with the drop masks of ``ops/drop.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops import pointwise_conv
from wsitrain.sft.ops.fold_bn import after_fold, folded_conv, folded_weights

WEIGHT, BIAS = 0, 1


@dataclass(frozen=True)
class FoldSlot:
    """A tiled segment's parameter that is a folded convolution's weight (``WEIGHT``) or bias (``BIAS``)."""

    conv: int  # the convolution's node
    which: int


@dataclass(frozen=True)
class Folded:
    """A folded convolution's weight (Cout, Cin/g, kh, kw) and bias (Cout,) for one step."""

    values: tuple[torch.Tensor, torch.Tensor]  # through autograd from the original parameters (when grad is on)
    leaves: tuple[torch.Tensor, torch.Tensor]  # the same values detached: what tiles run and differentiate against


class StepFolds:
    """One step's folded pairs: convolution node -> its folded weights; BatchNorm node -> what runs in its place."""

    def __init__(self, convs: dict[int, Folded], bns: dict[int, Callable[[torch.Tensor], torch.Tensor]]) -> None:
        self.convs = convs
        self.bns = bns


def _needs_grad(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[bool, bool]:
    """Whether the folded weight and the folded bias depend on a parameter that trains."""

    def rg(p: torch.Tensor | None) -> bool:
        return p is not None and p.requires_grad

    return rg(conv.weight) or rg(bn.weight), rg(conv.bias) or rg(bn.weight) or rg(bn.bias)


class FoldReplay:
    """Where the layers of one traced model find the current step's folded weights (no global state)."""

    def __init__(self, graph: ModelGraph) -> None:
        self.graph = graph
        self.current: StepFolds | None = None

    def _pair(self, conv: int, bn: int) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
        c, b = self.graph.module(conv), self.graph.module(bn)
        assert isinstance(c, nn.Conv2d) and isinstance(b, nn.BatchNorm2d)
        return c, b

    def new_step(self, pairs: dict[int, int]) -> StepFolds:
        """Fold every pair (convolution node -> BatchNorm node) from the parameters as they are now."""
        convs: dict[int, Folded] = {}
        bns: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        for ci, bi in pairs.items():
            conv, bn = self._pair(ci, bi)
            w, b = folded_weights(conv, bn)
            gw, gb = _needs_grad(conv, bn)
            convs[ci] = Folded((w, b), (w.detach().requires_grad_(gw), b.detach().requires_grad_(gb)))
            bns[bi] = after_fold(bn)
        self.current = StepFolds(convs, bns)
        return self.current

    @contextmanager
    def replaying(self, folds: StepFolds | None) -> Iterator[None]:
        """Run with ``folds`` (a tiled segment's backward recomputes with its forward's)."""
        previous, self.current = self.current, folds
        try:
            yield
        finally:
            self.current = previous

    def slots(self, conv: int, bn: int) -> list[FoldSlot]:
        """A folded convolution's parameters as a tiled segment lists them: those that train."""
        gw, gb = _needs_grad(*self._pair(conv, bn))
        return [FoldSlot(conv, k) for k, g in ((WEIGHT, gw), (BIAS, gb)) if g]

    def _folded(self, conv: int) -> Folded:
        assert self.current is not None, "a folded layer ran outside an SFT step"
        return self.current.convs[conv]

    def value(self, slot: FoldSlot) -> torch.Tensor:
        """The slot's tensor through autograd (a tiled segment's autograd node takes it as an input)."""
        return self._folded(slot.conv).values[slot.which]

    def leaf(self, slot: FoldSlot) -> torch.Tensor:
        """The slot's detached tensor (what the segment's tiles run and differentiate against)."""
        return self._folded(slot.conv).leaves[slot.which]

    def plain_call(self, i: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What node ``i`` runs in a plain segment this step: the folded convolution (through autograd), what
        replaces a folded BatchNorm, or None (the layer itself)."""
        cur = self.current
        if cur is None:
            return None
        if i in cur.bns:
            return cur.bns[i]
        if i in cur.convs:
            w, b = cur.convs[i].values
            conv = self.graph.module(i)
            assert isinstance(conv, nn.Conv2d)
            return folded_conv(conv, w, b)
        return None

    def tile_call(self, i: int, pointwise: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What node ``i`` runs in a tile this step: the folded convolution on the leaves (as a matrix product on
        unaligned maps when ``pointwise``: ``ops/pointwise_conv.py``), what replaces a folded BatchNorm, or None."""
        cur = self.current
        if cur is None or i not in cur.convs:
            return self.plain_call(i)
        w, b = cur.convs[i].leaves
        conv = self.graph.module(i)
        assert isinstance(conv, nn.Conv2d)
        run = folded_conv(conv, w, b)
        if not pointwise:
            return run

        def matmul_where_unaligned(x: torch.Tensor) -> torch.Tensor:
            # through the module, as PointwiseMatmul calls them (one definition of the product and its rule)
            return pointwise_conv.pointwise_matmul(x, w, b) if pointwise_conv.unaligned(x) else run(x)

        return matmul_where_unaligned
