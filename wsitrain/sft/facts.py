"""The annotating pass: frozen facts per node for one (model, input shape, dtype).

Like torch.fx's ``passes/shape_prop.py``, it runs the traced graph once on meta tensors (nothing
allocated, the user's module untouched) and records per node what planning needs: shape, dtype and
bytes, whether it requires grad, the bytes of its trainable parameters, its operator spec, its users,
and whether a checkpoint may sit after it (a *cut point*: every later node depends on it alone, so
never inside a residual block). Errors name the node's module path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from wsitrain.errors import PlanError
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.in_place import may_run_in_place
from wsitrain.sft.ops.barriers import mark_barriers
from wsitrain.sft.ops.fused_pool import PoolFusion, pool_kind
from wsitrain.sft.ops.linear_head import linear_head
from wsitrain.sft.ops.masked_pool import AVG
from wsitrain.sft.ops.pointwise_conv import is_pointwise_conv
from wsitrain.sft.ops.registry import POINTWISE, OpSpec
from wsitrain.sft.ops.space import can_checkpoint, ends_trunk, resolve_layouts


@dataclass(frozen=True)
class NodeFacts:
    """What one operator is and produces on one input shape."""

    index: int
    name: str  # module path users know
    spec: OpSpec
    inputs: tuple[int, ...]
    users: tuple[int, ...]
    shape: tuple[int, ...]  # () for non-tensor values
    dtype: torch.dtype
    nbytes: int  # output bytes at the planned activation dtype (the image at its own dtype)
    requires_grad: bool
    param_bytes: int  # trainable parameter bytes of this operator
    is_cut: bool  # a checkpoint may sit after this node
    # an activation a tile may run in place, overwriting its input (in_place.py); a segment's plan says where it does
    in_place_in_tile: bool = False
    # a plain 1x1 convolution a tile may run as a matrix product (ops/pointwise_conv.py); a segment's plan says where
    pointwise_conv: bool = False

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "-"
        flags = ("cut " if self.is_cut else "") + ("grad" if self.requires_grad else "")
        return f"{self.index:4d} {self.name:<40s} {self.spec.kind:<9s} {shape:<22s} {self.nbytes:>14d} {flags}"


@dataclass(frozen=True)
class GraphFacts:
    """Facts of every node, the cut points and the model-wide byte counts for one input shape."""

    nodes: tuple[NodeFacts, ...]
    input_shape: tuple[int, ...]
    act_dtype: torch.dtype
    input_dtype: torch.dtype
    cuts: tuple[int, ...]  # valid checkpoint positions in the trunk, 0 and trunk_end included
    candidates: tuple[int, ...]  # the cuts worth a checkpoint
    trunk_end: int  # last node of the spatial trunk; the head runs plain after it
    model_bytes: int  # parameters and buffers
    trainable_bytes: int  # parameters that receive gradients
    largest_param_bytes: int
    fusion: PoolFusion | None = None  # the global pool after the trunk, when it can fold tiles (see fused_pool)
    # the Linear ending the model after a fused global mean whose pooled gradient has a direction known in forward
    # (ops/linear_head.py): the last tiled segment may back-propagate in its forward pass (execution/one_pass.py)
    one_pass_head: int | None = None

    @property
    def n(self) -> int:
        return len(self.nodes)

    @property
    def act_size(self) -> int:
        return self.act_dtype.itemsize

    def name(self, i: int) -> str:
        return self.nodes[i].name

    def __str__(self) -> str:
        head = f"{'#':>4s} {'layer':<40s} {'kind':<9s} {'shape':<22s} {'bytes':>14s} flags"
        return "\n".join([head, *(str(f) for f in self.nodes)])


def annotate(
    graph: ModelGraph,
    input_shape: tuple[int, ...],
    act_dtype: torch.dtype,
    input_dtype: torch.dtype,
    input_requires_grad: bool = False,
) -> GraphFacts:
    """Annotate every node of ``graph`` for an input of ``input_shape`` (shapes only, on meta tensors)."""
    if len(input_shape) != 4 or min(input_shape) <= 0:
        raise PlanError(f"input shape {tuple(input_shape)} is not (B, C, H, W) with positive sizes")
    shape_dtype = torch.float32 if act_dtype in (torch.bfloat16, torch.float16) else act_dtype
    meta_in = input_dtype if not input_dtype.is_floating_point else shape_dtype
    shapes = _propagate(graph, tuple(input_shape), meta_in)
    # each spec learns where H and W sit in its output (channels-last, 5-D channel shuffles, constants)
    names = [g.name for g in graph.nodes]
    specs = resolve_layouts(graph.gm, [g.fx_node for g in graph.nodes], graph.specs(), [s for s, _ in shapes],
                            names.__getitem__)
    # whole-map statistics inside the trunk (train BatchNorm, squeeze-excitation) run tiled in sweeps
    specs = mark_barriers(graph, specs, [s for s, _ in shapes])
    act = torch.empty((), dtype=act_dtype).element_size()
    wide = _float32_nodes(graph) if act < 4 else set()  # float32 under autocast: 4 bytes, whatever act_dtype says
    inp = torch.empty((), dtype=input_dtype).element_size()
    n = len(graph.nodes)
    rg = [False] * n
    rg[0] = input_requires_grad
    param_bytes = [0] * n
    for g in graph.nodes[1:]:
        param_bytes[g.index] = sum(p.numel() * p.element_size() for p in graph.trainable_params(g.index))
        rg[g.index] = any(rg[v] for v in g.inputs) or param_bytes[g.index] > 0
    cuts, trunk_end = _cut_points(graph, specs, [s for s, _ in shapes])
    cut_set = set(cuts)
    nodes = tuple(
        NodeFacts(
            index=g.index,
            name=g.name,
            spec=specs[g.index],
            inputs=g.inputs,
            users=g.users,
            shape=shapes[g.index][0],
            dtype=shapes[g.index][1],
            nbytes=math.prod(shapes[g.index][0]) * (inp if g.index == 0 else 4 if g.index in wide else act)
            if shapes[g.index][0]
            else 0,
            requires_grad=rg[g.index],
            param_bytes=param_bytes[g.index],
            is_cut=g.index in cut_set,
            in_place_in_tile=_in_place_in_tile(graph, specs, g.index),
            pointwise_conv=is_pointwise_conv(graph.module(g.index)),
        )
        for g in graph.nodes
    )
    params = {id(p): p for p in graph.model.parameters()}.values()
    fusion = _fusion(graph, trunk_end, nodes)
    return GraphFacts(
        nodes=nodes,
        input_shape=tuple(int(s) for s in input_shape),
        act_dtype=act_dtype,
        input_dtype=input_dtype,
        cuts=tuple(cuts),
        candidates=tuple(_candidate_cuts(graph, specs, cuts, trunk_end)),
        trunk_end=trunk_end,
        model_bytes=sum(p.numel() * p.element_size() for p in params)
        + sum(b.numel() * b.element_size() for b in graph.model.buffers())
        + _folded_bytes(graph),
        trainable_bytes=sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        largest_param_bytes=max((p.numel() * p.element_size() for p in params), default=0),
        fusion=fusion,
        one_pass_head=linear_head(graph, fusion.node, input_shape[0]) if fusion and fusion.kind == AVG else None,
    )


def _folded_bytes(graph: ModelGraph) -> int:
    """What the BatchNorm fold holds beside the parameters (execution/folds.py): every folded convolution's weight
    and bias for the whole step, and while the fold back-propagates, their gradients beside the parameters' own."""
    total = 0
    for c in graph.fold_pairs():
        conv = graph.module(c)
        assert isinstance(conv, nn.Conv2d)
        w = conv.weight
        size = (w.numel() + w.shape[0]) * w.element_size()
        total += size * (2 if w.requires_grad else 1)
    return total


def _in_place_in_tile(graph: ModelGraph, specs: list[OpSpec], i: int) -> bool:
    g = graph.nodes[i]
    if len(g.inputs) != 1:
        return False
    p = g.inputs[0]
    return may_run_in_place(g.fx_node, graph.module(i), p, specs[p], graph.module(p), graph.nodes[p].users, i)


def _float32_nodes(graph: ModelGraph) -> set[int]:
    """Nodes whose output stays float32 under autocast: modules that say so (``sft_float32``, e.g. the attention
    head's score layers) and the functions applied to them (tanh, a product, the concatenation after them)."""
    wide: set[int] = set()
    for g in graph.nodes[1:]:
        mod = graph.module(g.index)
        if bool(getattr(mod, "sft_float32", False)) or (mod is None and any(v in wide for v in g.inputs)):
            wide.add(g.index)
    return wide


def _fusion(graph: ModelGraph, trunk_end: int, nodes: tuple[NodeFacts, ...]) -> PoolFusion | None:
    """The global pooling node right after the trunk, when it alone reads the trunk's last feature map."""
    p = trunk_end + 1
    if p >= len(nodes) or graph.nodes[trunk_end].users != (p,) or graph.nodes[p].inputs != (trunk_end,):
        return None
    kind = pool_kind(graph.nodes[p].fx_node, graph.module(p))
    return PoolFusion(p, kind, nodes[p].shape) if kind is not None else None


def load_meta_kernels() -> None:
    """Run one element-wise operator on meta tensors: PyTorch's meta kernels import what they need at their first use.

    In torch 2.14 that is ``torch._dynamo`` (with sympy and the inductor): 151 MiB resident in a fresh process,
    measured on the 2-core CPU. It is the library's code, paid once per process; ``SFT`` pays it when it is built, with
    the model, so that the first step holds only what its plan counts (tests/test_sft_cpu_budget.py).
    """
    _ = torch.empty(1, device="meta") + 1


def _propagate(
    graph: ModelGraph, input_shape: tuple[int, ...], input_dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every node's output, run on the graph's meta copy."""
    gm = graph.meta_gm
    result: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    current = ["input"]
    names = {g.fx_node.name: g.name for g in graph.nodes}

    class _Interp(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            current[0] = names.get(n.name, n.name)
            out = super().run_node(n)
            result[n.name] = (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else ((), torch.float32)
            return out

    x = torch.empty(input_shape, dtype=input_dtype, device="meta")
    try:
        _Interp(gm).run(x)
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(
            f"shape propagation failed at layer {current[0]!r} for input shape {tuple(input_shape)}: {exc}",
            hint="check that the image is large enough for the model's strides and has the channels it expects",
        ) from exc
    return [result[g.fx_node.name] for g in graph.nodes]


def _cut_points(graph: ModelGraph, specs: list[OpSpec], shapes: list[tuple[int, ...]]) -> tuple[list[int], int]:
    """Valid checkpoint positions in the trunk, and the index of the trunk's last node.

    A cut after node i is valid when no later node reads a node before i: the whole future depends
    on node i alone (the dominator/post-dominator condition for a DAG laid out in execution order).
    The trunk ends at the last cut before the first head operator or non-4-D value.
    """
    n = len(graph.nodes)
    min_input_after = [n] * (n + 1)  # min over nodes j > i of their smallest input index
    for i in range(n - 1, -1, -1):
        ins = graph.nodes[i].inputs
        min_input_after[i] = min(min_input_after[i + 1], min(ins) if ins else i)
    returned = set(graph.output_fx.all_input_nodes)
    first_returned = min((graph.index[a] for a in returned if a in graph.index), default=n)
    valid = [
        i
        for i in range(n)
        if min_input_after[i + 1] >= i and i <= first_returned and can_checkpoint(specs[i], shapes[i])
    ]
    first_head = next((i for i, s in enumerate(specs) if ends_trunk(s)), n)
    trunk = [i for i in valid if i < first_head]
    if not trunk:
        raise PlanError("the model has no spatial trunk to tile")
    dead = [g for g in graph.nodes[1 : trunk[-1]] if not g.users and g.fx_node not in returned]
    if dead:  # graph.prune_dead_nodes kept it: running it changes state (a BatchNorm's running statistics)
        raise PlanError(
            f"layer {dead[0].name!r} runs but nothing reads its output; SFT cannot tile a layer without readers",
            hint="remove the unused call from the model's forward (running it only changes state: BatchNorm "
            "running statistics, random numbers drawn)",
        )
    return trunk, trunk[-1]


def _candidate_cuts(graph: ModelGraph, specs: list[OpSpec], cuts: list[int], trunk_end: int) -> list[int]:
    """Cuts worth a checkpoint: after an activation chain, not between a conv and its activation."""
    out = []
    for i in cuts:
        if i in (0, trunk_end):
            out.append(i)
            continue
        us = graph.nodes[i].users
        nxt = specs[us[0]] if len(us) == 1 else None
        if nxt is not None and nxt.kind == POINTWISE and not nxt.alias:
            continue  # storing the pre-activation costs the same and forces an extra recompute step
        out.append(i)
    return out
