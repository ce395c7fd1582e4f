"""Barrier nodes: operators inside the trunk whose output needs a statistic of their WHOLE input.

Train-mode BatchNorm normalizes with the batch's per-channel mean and variance over (B, H, W); no
tile sees them. It is still spatially pointwise once the statistic is known, so a tiled segment can
hold it when it runs in sweeps (``wsitrain.sft.multipass``): first the statistic over all tiles, then
the layers after it with the statistic as a constant. This module finds such nodes and describes
them; the sweeps themselves live in ``multipass``.

Barrier nodes get a tileable POINTWISE spec (their regions map an interval to itself) tagged with
``extra["barrier"]``; every other pass treats them like a frozen BatchNorm of the same shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops import POINTWISE, OpSpec

BATCHNORM = "batchnorm"  # per-channel mean and biased variance over (B, H, W)


def is_batch_stat_bn(m: nn.Module) -> bool:
    """A BatchNorm2d that normalizes with batch statistics: training mode, or no running statistics.

    Only torch's own forward: a subclass that overrides it (FrozenBatchNorm2d, SyncBatchNorm's
    process-group reduction) means something else.
    """
    return (
        isinstance(m, nn.BatchNorm2d)
        and type(m).forward is _BatchNorm.forward
        and (m.training or m.running_mean is None)
    )


def mark_barriers(graph: ModelGraph, specs: list[OpSpec]) -> list[OpSpec]:
    """``specs`` with every barrier node made tileable and tagged (the annotating pass calls this)."""
    out = list(specs)
    for g in graph.nodes[1:]:
        m = graph.module(g.index)
        if m is not None and is_batch_stat_bn(m):
            out[g.index] = replace(
                specs[g.index],
                kind=POINTWISE,
                tileable=True,
                why_not="",
                saves_input=True,
                # statistics (2 per element) plus normalize and affine (2), as autograd does it
                flops_per_output=4.0,
                has_params=m.affine,
                extra={"barrier": BATCHNORM},
            )
    return out


@dataclass(frozen=True)
class Barrier:
    """One barrier inside a segment."""

    node: int  # the barrier node (the BatchNorm)
    kind: str  # BATCHNORM
    source: int  # the node whose whole map the statistic reads (the BatchNorm's input)
    level: int  # sweep it is computed in: 1 + the deepest barrier among its source's ancestors


def barrier_kind(spec: OpSpec) -> str | None:
    return spec.extra.get("barrier") if spec.extra else None


def segment_barriers(
    specs: Mapping[int, OpSpec] | Sequence[OpSpec],
    inputs: Mapping[int, tuple[int, ...]],
    start: int,
    end: int,
) -> list[Barrier]:
    """The barriers of segment (start, end] in execution order, each with its sweep level.

    Barriers whose statistics do not depend on one another (a block's main-branch BatchNorm and its
    downsample BatchNorm) share a level, so they share a sweep.
    """
    anc = ancestors_in(inputs, start, end)
    out: list[Barrier] = []
    level_of: dict[int, int] = {}
    for i in range(start + 1, end + 1):
        kind = barrier_kind(specs[i])
        if kind is None:
            continue
        src = inputs[i][0]
        level = 1 + max((level_of[b] for b in level_of if b in anc.get(src, ())), default=0)
        level_of[i] = level
        out.append(Barrier(i, kind, src, level))
    return out


def ancestors_in(inputs: Mapping[int, tuple[int, ...]], start: int, end: int) -> dict[int, frozenset[int]]:
    """Per node of (start, end]: the nodes of (start, end] it depends on, itself included."""
    anc: dict[int, frozenset[int]] = {}
    for i in range(start + 1, end + 1):
        s = {i}
        for v in inputs[i]:
            s |= anc.get(v, frozenset())
        anc[i] = frozenset(s)
    return anc
