"""Where the image axes sit in every tensor of a traced model, and what that means for tiling.

Operators such as ConvNeXt's ``permute`` to channels-last, ``LayerNorm`` and ``Linear`` over the
channels, ShuffleNet's channel shuffle (``view`` / ``transpose`` with sizes from ``x.size()``) and
arithmetic with per-channel tensors are pointwise in space: run on a tile, they give the tile of
the untiled result. What changes is *where* H and W sit: (2, 3) in (B, C, H, W), (1, 2) in
channels-last (B, H, W, C), (3, 4) in ShuffleNet's (B, groups, C/groups, H, W). ``resolve_layouts``
walks the graph once, on the shapes of the untiled input, and gives every node's spec the dims of
H and W in its output (``OpSpec.spatial_dims``), or makes it untileable with the reason.

Values that do not vary over the image plane are not cropped: ints measured with ``size()`` (kind
SHAPE: run on the tile, so a ``view`` built from them fits the tile) and values computed from
parameters and constants only (kind CONST).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx

from wsitrain.errors import PlanError
from wsitrain.sft.ops.crop import crop as crop  # re-exported: the executor's tile cut
from wsitrain.sft.ops.registry import (
    CAT,
    CONCAT,
    CONST,
    ELEMENTWISE,
    GETITEM,
    HEAD,
    INPUT,
    MERGE,
    NCHW,
    OPAQUE,
    PERMUTE,
    POINTWISE,
    REDUCE,
    RESHAPE,
    SHAPE,
    SIZE,
    SPLIT,
    TRAILING,
    TRANSPOSE,
    WINDOW,
    OpSpec,
    attribute,
)
from wsitrain.sft.ops.resample import RESIZE, resize_spec
from wsitrain.sft.trail import WHERE

Dims = tuple[int, int]
_NOT_SPATIAL = (SHAPE, CONST)


def _norm(d: Any, ndim: int) -> int:
    return int(d) % ndim if ndim else int(d)


def _untileable(spec: OpSpec, why: str, dims: Dims | None) -> OpSpec:
    return replace(spec, kind=OPAQUE, tileable=False, why_not=why, spatial_dims=dims)


def _global(spec: OpSpec, why: str) -> OpSpec:
    """A value computed from the whole image (pooling, flatten): ends the tiled part."""
    return replace(spec, kind=HEAD, tileable=False, why_not=spec.why_not or why, spatial_dims=None)


def _pointwise(spec: OpSpec, dims: Dims, kind: str = POINTWISE) -> OpSpec:
    return replace(spec, kind=kind, tileable=True, why_not="", spatial_dims=dims)


def _reshape_dims(s_in: Sequence[int], dims: Dims, s_out: Sequence[int]) -> Dims | None:
    """Dims of H and W after a reshape, if it regroups only the dims before, between and after them.

    Row-major reshapes keep element (pre, h, mid, w, post) at (pre', h, mid', w, post') exactly when
    the products of the dims before H, between H and W and after W are unchanged.
    """
    h, w = dims
    if h > w:
        return None
    blocks = (math.prod(s_in[:h]), math.prod(s_in[h + 1 : w]), math.prod(s_in[w + 1 :]))
    for h2 in range(len(s_out)):
        for w2 in range(h2 + 1, len(s_out)):
            if (s_out[h2], s_out[w2]) != (s_in[h], s_in[w]):
                continue
            if (math.prod(s_out[:h2]), math.prod(s_out[h2 + 1 : w2]), math.prod(s_out[w2 + 1 :])) == blocks:
                return h2, w2
    return None


def _permutation(node: fx.Node) -> list[int]:
    if node.op == "call_method":
        rest = list(node.args[1:]) or [node.kwargs.get("dims")]
    else:
        rest = [node.args[1] if len(node.args) > 1 else node.kwargs["dims"]]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = list(rest[0])
    return [int(d) for d in rest]


def _arg(node: fx.Node, pos: int, key: str, default: Any = None) -> Any:
    if key in node.kwargs:
        return node.kwargs[key]
    return node.args[pos] if len(node.args) > pos else default


def _reduced_dims(node: fx.Node, ndim: int) -> list[int] | None:
    d = _arg(node, 1, "dim")
    if d is None:
        return None
    ds = list(d) if isinstance(d, (tuple, list)) else [d]
    return [_norm(x, ndim) for x in ds]


class _Resolver:
    """One pass over the nodes in execution order; each spec is resolved from its inputs' resolved specs."""

    def __init__(
        self,
        gm: fx.GraphModule,
        nodes: Sequence[fx.Node],
        shapes: Sequence[tuple[int, ...]],
        name: Callable[[int], str],
    ) -> None:
        self.gm = gm
        self.index = {n: i for i, n in enumerate(nodes)}
        self.shapes = shapes
        self.out: list[OpSpec] = []
        self.name = name

    def shape_of(self, a: Any) -> tuple[int, ...] | None:
        if isinstance(a, fx.Node):
            if a.op == "get_attr":
                obj = attribute(self.gm, str(a.target))
                return tuple(obj.shape) if isinstance(obj, torch.Tensor) else None
            return self.shapes[self.index[a]]
        return tuple(a.shape) if isinstance(a, torch.Tensor) else None

    def spec_of(self, a: fx.Node) -> OpSpec | None:
        """None for get_attr (a parameter or buffer: constant)."""
        return None if a.op == "get_attr" else self.out[self.index[a]]

    def resolve(self, i: int, node: fx.Node, spec: OpSpec) -> OpSpec:
        if spec.kind == INPUT:
            return replace(spec, spatial_dims=(2, 3))
        specs = [(a, self.spec_of(a)) for a in node.all_input_nodes]
        spatial = [(a, s) for a, s in specs if s is not None and s.spatial_dims is not None]
        global_ = [a for a, s in specs if s is not None and s.spatial_dims is None and s.kind not in _NOT_SPATIAL]
        if not spatial and not global_:
            shape_like = any(s is not None and s.kind == SHAPE for _, s in specs)
            return OpSpec(
                SHAPE if shape_like else CONST, spec.type_name, spatial_dims=None, layout_rule=spec.layout_rule
            )
        if global_:
            if spatial and spec.kind != HEAD:
                why = (
                    f"it combines the feature map with '{self.name(self.index[global_[0]])}', a value computed from "
                    "the whole image (global pooling inside the trunk, as in squeeze-excitation), which no tile sees"
                )
                # the map keeps its layout (a barrier pass may make this tileable): (2, 3), or (3, 4) in 5-D maps
                src, src_spec = spatial[0]
                same = self.shapes[i] == self.shapes[self.index[src]]
                keep = src_spec.spatial_dims if same else (2, 3) if len(self.shapes[i]) == 4 else None
                return _untileable(spec, why, keep)
            return _global(spec, "global operations end the tiled part")
        dims_all = {s.spatial_dims for _, s in spatial}
        out_shape = self.shapes[i]
        if len(dims_all) != 1:
            return _untileable(spec, "its inputs hold the image axes at different positions", None)
        dims = dims_all.pop()
        assert dims is not None
        src = spatial[0][0]
        s_in = self.shapes[self.index[src]]
        if RESIZE in spec.extra:  # a resize to a size: a whole-number upscaling on these shapes, or refused
            spec = resize_spec(spec, s_in, out_shape)
        resolved = self._by_rule(node, spec, dims, s_in, out_shape, spatial, src)
        resolved = self._check_extents(resolved, s_in, dims, out_shape)
        if not resolved.tileable and resolved.kind == OPAQUE and resolved.spatial_dims is None:
            # an operator that cannot be tiled runs plain inside the trunk; what follows it stays spatial when
            # it keeps its input's shape, or is (B, C, H, W) by the old contract for 4-D outputs
            keep = dims if out_shape == s_in else (2, 3) if len(out_shape) == 4 else None
            resolved = replace(resolved, spatial_dims=keep)
        return resolved

    def _check_extents(self, spec: OpSpec, s_in: tuple[int, ...], dims: Dims, out: tuple[int, ...]) -> OpSpec:
        """A pointwise-in-space op keeps the image extents; anything else is a bug in a rule, caught here."""
        if spec.kind in (WINDOW, HEAD) or not spec.tileable or spec.spatial_dims is None or not out or not s_in:
            return spec
        h2, w2 = spec.spatial_dims
        if max(h2, w2) >= len(out) or (out[h2], out[w2]) != (s_in[dims[0]], s_in[dims[1]]):
            return _untileable(spec, f"its output {out} does not keep the image axes of its input {s_in}", None)
        return spec

    def _by_rule(
        self,
        node: fx.Node,
        spec: OpSpec,
        dims: Dims,
        s_in: tuple[int, ...],
        out: tuple[int, ...],
        spatial: list[tuple[fx.Node, OpSpec]],
        src: fx.Node,
    ) -> OpSpec:
        rule = spec.layout_rule
        ndim = len(s_in)
        if rule == NCHW:
            if spec.kind == HEAD:
                return _global(spec, "global operations end the tiled part")
            if dims != (2, 3) or ndim != 4:
                if not spec.tileable:
                    return replace(spec, spatial_dims=(2, 3) if len(out) == 4 else None)
                return _untileable(
                    spec, f"it expects (B, C, H, W) but gets a tensor with the image axes at dims {dims}", None
                )
            if spec.kind == OPAQUE or not spec.tileable:
                # unknown operators keep the old contract: a 4-D output is a (B, C, H, W) feature map
                return replace(spec, spatial_dims=(2, 3) if len(out) == 4 else None)
            return replace(spec, spatial_dims=(2, 3))
        if rule == SIZE:
            return OpSpec(SHAPE, spec.type_name, spatial_dims=None, layout_rule=SIZE)
        if rule == ELEMENTWISE:
            return self._elementwise(node, spec, dims, out, spatial)
        if rule == TRAILING:
            k = int(spec.extra.get("trailing", 1))
            if all(d < ndim - k for d in dims):
                return _pointwise(spec, dims)
            if spec.kind == HEAD:
                return _global(spec, "global operations end the tiled part")
            return _untileable(spec, f"it normalizes or mixes over the image axes (its last {k} dims)", None)
        if rule == PERMUTE:
            perm = [_norm(d, ndim) for d in _permutation(node)]
            return _pointwise(spec, (perm.index(dims[0]), perm.index(dims[1])))
        if rule == TRANSPOSE:
            a, b = _norm(_arg(node, 1, "dim0"), ndim), _norm(_arg(node, 2, "dim1"), ndim)
            swap = {a: b, b: a}
            return _pointwise(spec, (swap.get(dims[0], dims[0]), swap.get(dims[1], dims[1])))
        if rule == RESHAPE:
            new = _reshape_dims(s_in, dims, out) if out else None
            if new is None:
                return _global(spec, "reshapes that merge the image axes end the tiled part")
            return _pointwise(spec, new)
        if rule == SPLIT:
            d = _norm(_arg(node, 2, "dim", 0), ndim)
            if d in dims:
                return _untileable(spec, "it splits along an image axis", None)
            return _pointwise(spec, dims)
        if rule == GETITEM:
            return self._getitem(node, spec, dims, src)
        if rule == CAT:
            d = _norm(_arg(node, 1, "dim", 0), len(out))
            if d in dims or any(not isinstance(a, fx.Node) or a not in {s for s, _ in spatial} for a in node.args[0]):
                return _untileable(spec, f"torch.cat along dim {d}: only concatenation off the image axes tiles", None)
            return _pointwise(spec, dims, kind=CONCAT)
        if rule == REDUCE:
            red = _reduced_dims(node, ndim)
            if red is None or set(red) & set(dims):
                return _global(spec, "global operations end the tiled part")
            keep = bool(_arg(node, 2, "keepdim", False))
            shift = (lambda d: d) if keep else (lambda d: d - sum(1 for r in red if r < d))
            return _pointwise(spec, (shift(dims[0]), shift(dims[1])))
        return _untileable(spec, spec.why_not or "unknown layout rule", None)

    def _elementwise(
        self, node: fx.Node, spec: OpSpec, dims: Dims, out: tuple[int, ...], spatial: list[tuple[fx.Node, OpSpec]]
    ) -> OpSpec:
        """Feature maps of the same layout, with scalars or tensors that are constant over the image plane."""
        if not spec.tileable:
            return replace(spec, spatial_dims=dims if len(out) >= 2 else None)
        sp_nodes = {a for a, _ in spatial}
        for a in sp_nodes:
            if len(self.shapes[self.index[a]]) != len(out):
                return _untileable(spec, "it broadcasts a feature map to more dims", None)
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, (fx.Node, torch.Tensor))]
        for a in operands:
            if a in sp_nodes:
                continue
            shape = self.shape_of(a)
            if not shape:
                continue  # ints and 0-d tensors broadcast everywhere
            lead = len(out) - len(shape)
            if any(d - lead >= 0 and shape[d - lead] != 1 for d in dims):
                return _untileable(
                    spec,
                    f"it combines the feature map with a tensor of shape {shape} that varies over the image axes "
                    "(e.g. a positional embedding); only scalars and per-channel tensors tile",
                    None,
                )
        kind = MERGE if len(sp_nodes) >= 2 else POINTWISE
        return _pointwise(spec, dims, kind=kind)

    def _getitem(self, node: fx.Node, spec: OpSpec, dims: Dims, src: fx.Node) -> OpSpec:
        src_spec = self.spec_of(src)
        if src_spec is not None and src_spec.layout_rule == SPLIT:
            return _pointwise(spec, dims)  # one tensor of a chunk / split: the input's layout
        idx = node.args[1]
        items = idx if isinstance(idx, tuple) else (idx,)
        if not all(isinstance(it, (slice, int)) and not isinstance(it, bool) for it in items):
            return _untileable(spec, f"indexing with {idx!r}: only ints and slices off the image axes tile", None)
        for d in dims:
            if d < len(items) and items[d] != slice(None):
                return _untileable(spec, f"indexing with {idx!r} cuts an image axis", None)
        # x[:, 0] drops dim 1: the image axes move left by the ints before them
        shift = [sum(1 for it in items[:d] if isinstance(it, int)) for d in dims]
        return _pointwise(spec, (dims[0] - shift[0], dims[1] - shift[1]))


def resolve_layouts(
    gm: fx.GraphModule,
    nodes: Sequence[fx.Node],
    specs: Sequence[OpSpec],
    shapes: Sequence[tuple[int, ...]],
    name: Callable[[int], str] | None = None,
) -> list[OpSpec]:
    """Each node's spec with the dims of H and W in its output, for the untiled shapes ``shapes``.

    ``nodes`` are the graph's non-get_attr nodes in execution order (the placeholder first), ``specs``
    their specs from ``module_spec`` / ``function_spec``, ``shapes`` their output shapes (``()`` for
    values that are not tensors). ``name(i)`` names node i in messages.
    """
    r = _Resolver(gm, nodes, shapes, name or (lambda i: nodes[i].name))
    for i, (n, s) in enumerate(zip(nodes, specs, strict=True)):
        WHERE.node = i
        r.out.append(r.resolve(i, n, s))
    WHERE.node = None
    return r.out


# ---- facts the planner and the executor read from a resolved spec --------------------------------------
def ends_trunk(spec: OpSpec) -> bool:
    """A value computed from the whole image: the tiled trunk ends before it."""
    return spec.kind == HEAD or (spec.spatial_dims is None and spec.kind not in _NOT_SPATIAL)


def can_checkpoint(spec: OpSpec, shape: tuple[int, ...]) -> bool:
    """Checkpoints and segment outputs are (B, C, H, W) tensors: tiles are cut and joined on dims 2 and 3."""
    return spec.spatial_dims == (2, 3) and len(shape) == 4 and spec.kind not in _NOT_SPATIAL


def spatial_extent(spec: OpSpec, shape: tuple[int, ...], axis: int) -> int:
    """Size of the image axis ``axis`` (0 = H, 1 = W) in a node's output; 1 for values constant over the plane."""
    if spec.spatial_dims is None or len(shape) <= max(spec.spatial_dims):
        return 1
    return int(shape[spec.spatial_dims[axis]])


def tile_numel(spec: OpSpec, shape: tuple[int, ...], h: int, w: int) -> int:
    """Elements of a node's output on a tile of ``h`` x ``w`` of its image axes (the whole value if constant)."""
    if not shape:
        return 0
    full = math.prod(shape)
    if spec.spatial_dims is None or len(shape) <= max(spec.spatial_dims):
        return full
    hd, wd = spec.spatial_dims
    return full // max(1, shape[hd] * shape[wd]) * h * w


def check_tile_extent(value: Any, spec: OpSpec, rows: int, cols: int, name: str) -> None:
    """Raise if a tile's output does not have the extents its region says (e.g. a hard-coded reshape)."""
    if spec.spatial_dims is None:
        return
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if not isinstance(v, torch.Tensor):
            continue
        hd, wd = spec.spatial_dims
        got = (v.shape[hd], v.shape[wd]) if v.dim() > max(hd, wd) else tuple(v.shape)
        if got != (rows, cols):
            raise PlanError(
                f"layer {name} produced a tile of {tuple(got)} pixels where {(rows, cols)} were expected",
                hint="shapes inside the tiled trunk must come from x.size() / x.shape, not from constants; "
                "or keep this layer out of the tiled part (engine.checkpoints)",
            )


def prune_unused_shape_reads(graph: fx.Graph) -> None:
    """Drop shape reads nobody uses (``n, c, h, w = x.shape`` with ``c`` unused): no tile region reaches them."""
    for node in reversed(list(graph.nodes)):
        unused_get = node.op == "call_function" and node.target in (operator.getitem, getattr)
        unused_size = node.op == "call_method" and node.target == "size"
        if not node.users and (unused_get or unused_size):
            graph.erase_node(node)
