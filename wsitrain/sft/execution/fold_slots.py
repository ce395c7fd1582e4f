"""The tensors a tiled segment differentiates when BatchNorm folds (``ops/fold_bn.py``, ``execution/folds.py``).

A folded convolution's weight and bias (``FoldSlot``) stand for its own and its BatchNorm's parameters; a folded
BatchNorm keeps only its activation's (PReLU). Everything a segment computes inside its autograd node (its tiles,
and a squeeze-excitation chain run once per step on the pooled map) runs and differentiates against this step's
detached leaves (``leaves``); the node takes the values through the fold as inputs (``values``) and returns the
leaves' summed gradients for them, so the fold's own graph is back-propagated once per step, by the outer backward.
(A chain run on the values instead back-propagated the fold inside the node and freed its graph: "Trying to backward
through the graph a second time" at the outer backward, and the chain's gradients never reached the node's.)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from wsitrain.sft.execution.folds import FoldReplay, FoldSlot
from wsitrain.sft.graph import ModelGraph

Slot = nn.Parameter | FoldSlot


def _bn_param(m: nn.Module | None, p: nn.Parameter) -> bool:
    """Is ``p`` a BatchNorm's own weight or bias (folded into its convolution), not its activation's?"""
    return isinstance(m, nn.BatchNorm2d) and (p is m.weight or p is m.bias)


def segment_slots(graph: ModelGraph, folds: FoldReplay, nodes: Iterable[int]) -> tuple[list[Slot], int]:
    """The trainable tensors of ``nodes``, each once, in first-use order, and how many uses they have in all (a
    parameter shared by two layers counts twice)."""
    pairs = graph.fold_pairs()
    folded_bns = set(pairs.values())
    slots: dict[object, Slot] = {}
    uses = 0
    for i in nodes:
        if i in pairs:
            own: list[Slot] = list(folds.slots(i, pairs[i]))
        elif i in folded_bns:  # a BatchNormAct's activation may have parameters (PReLU)
            own = [p for p in graph.trainable_params(i) if not _bn_param(graph.module(i), p)]
        else:
            own = list(graph.trainable_params(i))
        for p in own:
            slots.setdefault(p if isinstance(p, FoldSlot) else id(p), p)
            uses += 1
    return list(slots.values()), uses


def leaves(folds: FoldReplay, slots: list[Slot]) -> list[torch.Tensor]:
    """What a tile or a chain differentiates against: the parameters, and this step's folded weights as detached
    leaves."""
    return [folds.leaf(p) if isinstance(p, FoldSlot) else p for p in slots]


def values(folds: FoldReplay, slots: list[Slot]) -> list[torch.Tensor]:
    """What the segment's autograd node takes as inputs, in ``leaves``' order: the parameters, and this step's
    folded weights through autograd (their gradients then flow back through the fold)."""
    return [folds.value(p) if isinstance(p, FoldSlot) else p for p in slots]


def any_folded(slots: list[Slot]) -> bool:
    return any(isinstance(p, FoldSlot) for p in slots)
