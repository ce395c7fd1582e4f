"""Barrier nodes: operators inside the trunk whose output needs a statistic of their WHOLE input.

Three kinds, all spatially pointwise once the statistic is known:
- train-mode BatchNorm normalizes with the batch's per-channel mean and variance over (B, H, W);
- squeeze-excitation: a global average pool (B, C, 1, 1) or (B, C) whose result goes through a *chain*
  of layers on per-(sample, channel) values (1x1 convs or ``nn.Linear`` on (B, C), activations, sigmoid,
  and the ``view`` / ``flatten`` / ``unsqueeze`` / ``[:, :, None, None]`` between them) and comes back into
  the spatial graph only through broadcast multiplies (``x * s``, or ``x * s.expand_as(x)``). Its *exits*
  are the (B, C', 1, 1) chain nodes those multiplies (or ``expand_as``) read. ResNeSt's split attention is one:
  its chain holds the radix softmax's (B, card, radix, C'') values and its exit (B, radix, C, 1, 1) scales the
  5-D radix map (B, radix, C, H, W). The chain may read shapes (``b, c, _, _ = x.size()``): it recomputes
  them on the untiled map, as plain PyTorch sees it;
- ConvNeXt V2's global response normalization (GRN, ``wsitrain.sft.ops.grn``): a per-(sample, channel) sum of
  squares over the map.
No tile sees the statistic, so a tiled segment holding a barrier runs in sweeps
(``wsitrain.sft.execution.multipass``): first the statistic over all tiles, then the layers after it with the
statistic (BatchNorm) or the chain's result (squeeze-excitation) as a constant. This module finds
such nodes and describes them; the sweeps live in ``multipass``.

Barrier nodes get a tileable POINTWISE spec (their regions map an interval to itself) tagged with
``extra["barrier"]``; chain nodes are tagged ``extra["chain_of"]`` and cost nothing per tile (they
run once per step on (B, C, 1, 1) tensors). A global pool whose result never returns into a spatial
tensor is not a barrier: it starts the head, as before.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.fused_pool import AVG, pool_kind
from wsitrain.sft.ops.grn import grn_spatial_dims, is_grn_module
from wsitrain.sft.ops.norm_act import is_batchnorm_act, norm_act_refusal, uses_batch_stats
from wsitrain.sft.ops.registry import MERGE, POINTWISE, SHAPE, OpSpec, batchnorm_spec
from wsitrain.sft.trail import WHERE

BATCHNORM = "batchnorm"  # per-channel mean and biased variance over (B, H, W)
SQUEEZE = "squeeze"  # per-(sample, channel) mean over (H, W), fed through a chain back into a multiply
GRN = "grn"  # ConvNeXt V2's global response normalization: per-(sample, channel) sum of squares (ops/grn.py)


def is_batch_stat_bn(m: nn.Module) -> bool:
    """A BatchNorm2d that normalizes with batch statistics: training mode, or no running statistics.

    Only torch's own forward, or timm's BatchNormAct2d (the same normalization, then its activation; see
    ``wsitrain.sft.ops.norm_act``) with a drop and activation that tile: a subclass that overrides the forward
    (FrozenBatchNorm2d, SyncBatchNorm's process-group reduction) means something else.
    """
    own = type(m).forward is _BatchNorm.forward or (is_batchnorm_act(m) and norm_act_refusal(m) is None)
    return isinstance(m, nn.BatchNorm2d) and own and uses_batch_stats(m)


def mark_barriers(graph: ModelGraph, specs: list[OpSpec], shapes: Sequence[tuple[int, ...]]) -> list[OpSpec]:
    """``specs`` with every barrier node made tileable and tagged (the annotating pass calls this)."""
    out = list(specs)
    in_chain: set[int] = set()
    for g in graph.nodes[1:]:
        WHERE.node = g.index
        found = squeeze_excitation(graph, g.index, shapes, specs)
        if found is None:
            continue
        chain, exits, shared = found
        in_chain |= set(chain)
        extra = {"barrier": SQUEEZE, "chain": chain, "exits": exits, "shapes": shared}
        out[g.index] = _barrier_spec(specs[g.index], extra)
        for i in chain:
            if specs[i].kind == SHAPE:  # a shape read only the chain uses: it keeps its spec, runs with the chain
                out[i] = replace(specs[i], extra={"chain_of": g.index})
                continue
            out[i] = replace(_barrier_spec(specs[i], {"chain_of": g.index}), flops_per_output=0.0)
        for e in exits:  # its readers multiply a feature map by tile constants: pointwise in space
            for u in graph.nodes[e].users:
                if u not in chain and u != g.index and not out[u].tileable:
                    # in the layout of the map it scales: (2, 3), or (3, 4) in split attention's 5-D map
                    dims = next((specs[v].spatial_dims for v in graph.nodes[u].inputs if v not in chain
                                 and specs[v].spatial_dims is not None), (2, 3))  # fmt: skip
                    out[u] = replace(out[u], kind=MERGE, tileable=True, why_not="", spatial_dims=dims)
    WHERE.node = None
    for g in graph.nodes[1:]:
        m = graph.module(g.index)
        if m is not None and is_batch_stat_bn(m) and g.index not in in_chain:
            # statistics (2 per element) plus normalize and affine (2), as autograd does it; timm's activation after
            bn = batchnorm_spec(m, "", 4.0)
            out[g.index] = replace(
                _barrier_spec(specs[g.index], {"barrier": BATCHNORM}),
                saves_input=True,
                saves_output=bn.saves_output,
                flops_per_output=bn.flops_per_output,
                has_params=bn.has_params,
            )
        elif m is not None and is_grn_module(m) and g.index not in in_chain:
            dims = specs[g.index].spatial_dims
            if dims is not None and dims == grn_spatial_dims(m, len(shapes[g.index])):
                out[g.index] = replace(_barrier_spec(specs[g.index], {"barrier": GRN}), spatial_dims=dims)
    return out


def _barrier_spec(spec: OpSpec, extra: dict[str, object]) -> OpSpec:
    # (B, C, H, W) layout: the layout pass took the pool's (B, C, 1, 1) result for a whole-image value; in sweeps
    # it is a constant of every tile
    return replace(
        spec, kind=POINTWISE, windows=None, tileable=True, why_not="", inplace=False, alias=False, extra=extra,
        spatial_dims=(2, 3),
    )


def _is_mul(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in ("mul", "mul_")
    return node.op == "call_function" and node.target in (operator.mul, operator.imul, torch.mul)


def _per_sample(shape: tuple[int, ...], batch: int) -> bool:
    """A value per sample computed from the pool alone: (B, C', 1, 1), or the (B, card, radix, C'') of ResNeSt's
    radix softmax. It cannot vary over the image plane (it derives from a pooled value); how it returns into the
    map is checked at the chain's exits."""
    return len(shape) >= 2 and shape[0] == batch


def _scales(
    graph: ModelGraph,
    u: int,
    group: set[int],
    shapes: Sequence[tuple[int, ...]],
    specs: Sequence[OpSpec],
    expanded: int | None = None,
) -> bool:
    """Node u multiplies a feature map outside ``group`` by chain values of the map's rank with size 1 on its image
    axes: (B, C, H, W) * (B, C, 1, 1), or split attention's (B, radix, C, H, W) * (B, radix, C, 1, 1).
    ``expanded``: a chain value already expanded to the map's shape (``expand_as``), exempt from the size check."""
    un = graph.nodes[u]
    spatial = [v for v in un.inputs if v not in group]
    if not (_is_mul(un.fx_node) and spatial and shapes[u] == shapes[spatial[0]]):
        return False
    dims = specs[spatial[0]].spatial_dims
    if dims is None or any(len(shapes[v]) < 4 or specs[v].spatial_dims != dims for v in spatial):
        return False
    rank = len(shapes[u])
    return all(
        len(shapes[e]) == rank and all(shapes[e][d] == 1 for d in dims)
        for e in un.inputs
        if e in group and e != expanded
    )


def _expands_for_scale(
    graph: ModelGraph, u: int, group: set[int], shapes: Sequence[tuple[int, ...]], specs: Sequence[OpSpec]
) -> bool:
    """Node u is ``s.expand_as(x)`` of a chain value s to a feature map x, read only by multiplies with maps."""
    un = graph.nodes[u]
    n = un.fx_node
    if not (n.op == "call_method" and n.target == "expand_as" and len(n.args) == 2):
        return False
    other = n.args[1]
    if not isinstance(other, fx.Node) or other not in graph.index or graph.index[other] in group:
        return False
    x = graph.index[other]
    return (
        len(shapes[x]) == 4
        and shapes[u] == shapes[x]
        and bool(un.users)
        and all(_scales(graph, w, group | {u}, shapes, specs, expanded=u) for w in un.users)
    )


def _shape_reads(
    graph: ModelGraph, group: set[int], p: int, specs: Sequence[OpSpec]
) -> tuple[set[int], set[int]] | None:
    """The shape reads (``x.size()`` and ints from it) the chain reads, split into those only the chain uses
    and those tiles use as well; None when a chain node reads anything else from outside the chain."""
    reads: set[int] = set()
    todo = [v for i in group - {p} for v in graph.nodes[i].inputs if v not in group]
    while todo:
        v = todo.pop()
        if v in reads:
            continue
        if specs[v].kind != SHAPE:
            return None
        reads.add(v)
        todo.extend(w for w in graph.nodes[v].inputs if specs[w].kind == SHAPE)
    own: set[int] = set()
    for v in sorted(reads, reverse=True):  # users come later: decide them first
        if all(u in group or u in own for u in graph.nodes[v].users):
            own.add(v)
    return own, reads - own


def squeeze_excitation(
    graph: ModelGraph, p: int, shapes: Sequence[tuple[int, ...]], specs: Sequence[OpSpec]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """(chain, exits, shared shape reads) when node p is a squeeze-excitation pool, else None.

    The chain is every later node computed from the pool alone (shape reads aside) on per-(sample, channel)
    values, plus the shape reads only it uses; its exits are the chain nodes read by a node outside it. It is
    squeeze-excitation when every such reader is a multiply with a spatial operand outside the chain (directly,
    or through ``expand_as`` to that operand), every exit is (B, C', 1, 1), and the model returns no chain value.
    """
    g = graph.nodes[p]
    if len(g.inputs) != 1 or pool_kind(g.fx_node, graph.module(p)) != AVG:
        return None
    src, out = shapes[g.inputs[0]], shapes[p]
    if len(src) != 4 or out not in ((src[0], src[1], 1, 1), (src[0], src[1])):
        return None
    group = {p}
    for i in range(p + 1, len(graph.nodes)):
        data = [v for v in graph.nodes[i].inputs if specs[v].kind != SHAPE]
        # a chain value, or a non-tensor read from one (``y.size(0)``)
        if data and all(v in group for v in data) and (_per_sample(shapes[i], src[0]) or shapes[i] == ()):
            group.add(i)
    returned = {graph.index[a] for a in graph.output_fx.all_input_nodes if a in graph.index}
    reads = _shape_reads(graph, group, p, specs)
    if group & returned or reads is None:
        return None
    own, shared = reads
    exits = []
    for i in sorted(group):
        outside = [u for u in graph.nodes[i].users if u not in group]
        for u in outside:
            # a multiply by the map (its rank, 1 on the image axes: (B, C) would broadcast over the wrong dims)
            if not (_scales(graph, u, group, shapes, specs) or _expands_for_scale(graph, u, group, shapes, specs)):
                return None
        if outside:
            exits.append(i)
    if not exits:
        return None
    return tuple(sorted((group - {p}) | own)), tuple(exits), tuple(sorted(shared))


@dataclass(frozen=True)
class Barrier:
    """One barrier inside a segment."""

    node: int  # the barrier node (the BatchNorm, or the squeeze-excitation pool)
    kind: str  # BATCHNORM | SQUEEZE
    source: int  # the node whose whole map the statistic reads (the barrier's input)
    level: int  # sweep it is computed in: 1 + the deepest barrier among its source's ancestors
    chain: tuple[int, ...] = ()  # SQUEEZE: nodes computed from the pool alone, run once per step
    exits: tuple[int, ...] = ()  # SQUEEZE: chain nodes the spatial graph reads (a multiply's operand)
    shapes: tuple[int, ...] = ()  # SQUEEZE: shape reads the chain needs that tiles use too (run again for it)


def barrier_kind(spec: OpSpec) -> str | None:
    return spec.extra.get("barrier") if spec.extra else None


def in_chain(spec: OpSpec) -> bool:
    """A node of a squeeze-excitation chain: it runs once per step, outside the tiles."""
    return bool(spec.extra) and "chain_of" in spec.extra


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
    out: list[Barrier] = []
    depth: dict[int, int] = {}  # node -> deepest level among the barriers it depends on (itself included)
    for i in range(start + 1, end + 1):
        d = max((depth.get(v, 0) for v in inputs[i]), default=0)
        kind = barrier_kind(specs[i])
        if kind is not None:
            src = inputs[i][0]
            level = 1 + depth.get(src, 0)
            d = max(d, level)
            extra = specs[i].extra
            chain, exits, shared = (tuple(extra.get(k, ())) for k in ("chain", "exits", "shapes"))
            out.append(Barrier(i, kind, src, level, chain, exits, shared))
        depth[i] = d
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
