"""Run a plan: plain segments with ordinary autograd, tiled segments tile by tile.

A tiled segment is one autograd Function. Forward runs the segment's original layers on each
tile's input region under no_grad and joins the output tiles into the next checkpoint (the join
operator); only the segment input is saved. Backward recomputes each tile with grad, back-propagates
exactly its share of the output gradient, sums parameter gradients over tiles and overlap-adds each
tile's input gradient into the segment's input-gradient buffer (the split operator in reverse).
Backward uses the same regions as forward: no wider backward halo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import map_arg

from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops import WINDOW, node_parameters, out_of_place_callable
from wsitrain.sft.ops_drop import MaskReplay, replay_callable
from wsitrain.sft.ops_space import check_tile_extent, crop
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.planner import PlanContext
from wsitrain.sft.regions import AxisTile
from wsitrain.sft.stats import StatsRecorder


@dataclass(frozen=True)
class _AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype

    @staticmethod
    def capture(device_type: str) -> _AutocastState:
        return _AutocastState(
            device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        )

    def context(self) -> torch.autocast:
        # Autocast caches the low-precision copy of each weight for the whole outer autocast region.
        # A copy cast under no_grad (a tile's forward) has no path to the weight, and reusing it in the
        # recompute would lose that weight's gradient; tiles therefore never use or fill the cache.
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=False)


def _call(node: fx.Node, fn: Any, kwargs: dict[str, Any], args: tuple[Any, ...]) -> Any:
    if node.op == "call_method":
        return getattr(args[0], fn)(*args[1:], **kwargs)
    return fn(*args, **kwargs)


class NodeRunner:
    """Calls the traced nodes of a graph on tensors, as plain autograd or out of place."""

    def __init__(self, graph: ModelGraph) -> None:
        self.graph = graph
        self.index = {g.fx_node: g.index for g in graph.nodes}
        self.original: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.safe: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.masks = MaskReplay()  # per-sample drop masks of the current step (ops_drop.py)
        for g in graph.nodes[1:]:
            n = g.fx_node
            module = graph.gm.get_submodule(str(n.target)) if n.op == "call_module" else None
            fn = module if module is not None else n.target
            drop = replay_callable(module, g.index, self.masks)
            self.original[g.index] = (drop or fn, dict(n.kwargs))
            self.safe[g.index] = (drop, dict(n.kwargs)) if drop else out_of_place_callable(n, module)
        # users in execution order, to free values after their last reader
        self.last_user = {g.index: max(g.users, default=g.index) for g in graph.nodes}

    def get_attr(self, n: fx.Node) -> Any:
        obj: Any = self.graph.gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        return obj

    def run(self, i: int, env: dict[int, Any], out_of_place: bool, fetch: Callable[[int], Any] | None = None) -> Any:
        n = self.graph.nodes[i].fx_node
        fn, kwargs = (self.safe if out_of_place else self.original)[i]

        def arg(a: fx.Node) -> Any:
            if a.op == "get_attr":
                return self.get_attr(a)
            j = self.index[a]
            return fetch(j) if fetch is not None else env[j]

        args = map_arg(n.args, arg)
        kw = map_arg(kwargs, arg)
        return _call(n, fn, kw, args)

    def run_plain(self, start: int, end: int, env: dict[int, Any]) -> None:
        """Nodes start+1..end with ordinary autograd; values are dropped after their last reader."""
        for i in range(start + 1, end + 1):
            # never write into the segment input: it may be a checkpoint or the caller's tensor
            reads_start = start in self.graph.nodes[i].inputs
            env[i] = self.run(i, env, out_of_place=reads_start)
            for j in self.graph.nodes[i].inputs:
                if self.last_user[j] <= i and j != end:
                    env.pop(j, None)


class HostStager:
    """Copies tile regions from host memory to the GPU through reused pinned buffers.

    A region cut from the image is a strided view; copying it to the device directly would go through
    a pageable temporary and block. Two pinned buffers per tile shape alternate, so the host-side copy
    of the next tile overlaps the transfer and compute of the current one; an event guards reuse.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.events: dict[tuple[Any, ...], torch.cuda.Event] = {}
        self.turn = 0

    def to_device(self, region: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return region.to(device)
        key = (tuple(region.shape), region.dtype, self.turn % 2)
        self.turn += 1
        buf = self.buffers.get(key)
        if buf is None:
            buf = self.buffers[key] = torch.empty(region.shape, dtype=region.dtype, pin_memory=True)
        if key in self.events:
            self.events[key].synchronize()  # the previous transfer out of this buffer is done
        buf.copy_(region)
        out = buf.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[key] = event
        return out


class TiledSegment:
    """Executes one tiled segment of a plan; holds its tile regions (no tensors)."""

    def __init__(self, ctx: PlanContext, seg: SegmentPlan, runner: NodeRunner, device: torch.device) -> None:
        self.seg = seg
        self.runner = runner
        self.device = device
        self.start, self.end = seg.start, seg.end
        self.nodes = list(range(seg.start + 1, seg.end + 1))
        self.specs = ctx.specs
        self.inputs = ctx.inputs
        self.rows_out, self.rows = ctx.axis_tiles(seg.start, seg.end, seg.tile_edge, 0)
        self.cols_out, self.cols = ctx.axis_tiles(seg.start, seg.end, seg.tile_edge, 1)
        params: dict[int, nn.Parameter] = {}
        for i in self.nodes:
            for p in node_parameters(ctx.graph.nodes[i].fx_node, ctx.graph.gm):  # get_attr ones too (layer scale)
                if p.requires_grad:
                    params.setdefault(id(p), p)
        self.params = list(params.values())
        self.last_user = {
            i: max((u for u in ctx.graph.nodes[i].users if u <= seg.end), default=i) for i in [seg.start, *self.nodes]
        }
        self.stats: StatsRecorder | None = None
        self.stager = HostStager()

    # ---- one tile ------------------------------------------------------------------------------
    def input_region(self, x: torch.Tensor, rt: AxisTile, ct: AxisTile) -> torch.Tensor:
        """The tile's input with its halo, cut from the checkpoint (on the host for the image)."""
        (r0, r1), (c0, c1) = rt.need[self.start], ct.need[self.start]
        region = x[:, :, r0:r1, c0:c1]  # (B, C, th + halo, tw + halo), a view
        if region.device != self.device:
            region = self.stager.to_device(region, self.device)
        return region

    def run_tile(self, region: torch.Tensor, rt: AxisTile, ct: AxisTile) -> torch.Tensor:
        """Run the segment's layers on one tile; returns the tile's exact output. Shapes: (B, C, th, tw)."""
        env: dict[int, torch.Tensor] = {self.start: region}
        for u in self.nodes:

            def fetch(v: int, u: int = u) -> torch.Tensor:
                (rl, rh), (cl, ch) = rt.req[(u, v)], ct.req[(u, v)]
                nr, nc = rt.need[v][0], ct.need[v][0]
                # on the dims where v holds H and W; ints from size() and constants whole
                return crop(env[v], self.specs[v].spatial_dims, (rl - nr, rh - nr), (cl - nc, ch - nc))

            out = self.runner.run(u, env, out_of_place=True, fetch=fetch)
            spec = self.specs[u]
            if spec.kind == WINDOW:  # the layer produced outputs from its crop's first aligned position
                assert spec.windows is not None
                v = self.inputs[u][0]
                g0r = spec.windows[0].first_output(rt.req[(u, v)][0])
                g0c = spec.windows[1].first_output(ct.req[(u, v)][0])
                (a, b), (c, d) = rt.need[u], ct.need[u]
                out = out[:, :, a - g0r : b - g0r, c - g0c : d - g0c]
            (a, b), (c, d) = rt.need[u], ct.need[u]
            check_tile_extent(out, spec, b - a, d - c, self.runner.graph.nodes[u].name)
            env[u] = out
            for v in self.inputs[u]:
                if self.last_user.get(v, u) <= u:
                    env.pop(v, None)
        return env[self.end]

    def tiles(self) -> list[tuple[int, int]]:
        return [(r, c) for r in range(len(self.rows)) for c in range(len(self.cols))]

    # ---- the whole segment -------------------------------------------------------------------------
    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """Forward tile by tile without keeping activations; join tiles into the output. (B, C, Ho, Wo)."""
        out: torch.Tensor | None = None
        for r, c in self.tiles():
            t0 = self._tick()
            y = self.run_tile(self.input_region(x, self.rows[r], self.cols[c]), self.rows[r], self.cols[c])
            if out is None:
                shape = (y.shape[0], y.shape[1], self.rows_out[-1][1], self.cols_out[-1][1])
                out = torch.empty(shape, dtype=y.dtype, device=y.device)
            (r0, r1), (c0, c1) = self.rows_out[r], self.cols_out[c]
            out[:, :, r0:r1, c0:c1] = y
            del y
            self._tock(t0, r, c, "forward")
        assert out is not None
        return out

    def backward_all(
        self, x: torch.Tensor, grad_out: torch.Tensor, need_x: bool, autocast: _AutocastState
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Recompute and back-propagate tile by tile; returns the input gradient and parameter gradients."""
        grad_x = torch.zeros_like(x) if need_x else None
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for r, c in self.tiles():
            t0 = self._tick()
            rt, ct = self.rows[r], self.cols[c]
            region = self.input_region(x, rt, ct).detach().requires_grad_(need_x)
            with torch.enable_grad(), autocast.context():
                y = self.run_tile(region, rt, ct)
            (r0, r1), (c0, c1) = self.rows_out[r], self.cols_out[c]
            g = grad_out[:, :, r0:r1, c0:c1]
            targets = ([region] if need_x else []) + self.params
            if y.requires_grad and targets:
                res = torch.autograd.grad(y, targets, g, allow_unused=True)
                if need_x:
                    (a, b), (cc, d) = rt.need[self.start], ct.need[self.start]
                    gx = res[0]
                    if gx is not None:
                        assert grad_x is not None
                        grad_x[:, :, a:b, cc:d] += gx.to(grad_x.device)
                    res = res[1:]
                for k, gp in enumerate(res):
                    if gp is not None:
                        # own the sum: a returned gradient may share memory autograd reuses for the next
                        # tile (seen as NaNs in bf16 weight gradients); summing into it in place corrupted it
                        grads[k] = gp.clone() if grads[k] is None else grads[k].add_(gp)
            del y
            self._tock(t0, r, c, "backward")
            if self.stats is not None:
                self.stats.recomputed_tiles += 1
        return grad_x, grads

    def _tick(self) -> float:
        if self.stats is not None:
            return self.stats.tick()
        return 0.0

    def _tock(self, t0: float, r: int, c: int, phase: str) -> None:
        if self.stats is not None:
            self.stats.tock(t0, self.seg.index, r, c, phase)


class TiledFunction(torch.autograd.Function):
    """Autograd node of one tiled segment: saves only the segment input (the checkpoint)."""

    @staticmethod
    def forward(ctx: Any, seg: TiledSegment, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.seg = seg
        ctx.masks = seg.runner.masks.current  # the recompute replays this step's drop masks
        ctx.autocast = _AutocastState.capture(seg.device.type)
        ctx.save_for_backward(x)
        with torch.no_grad(), ctx.autocast.context():
            return seg.forward_all(x)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        with ctx.seg.runner.masks.replaying(ctx.masks):
            grad_x, grads = ctx.seg.backward_all(x, grad_out, ctx.needs_input_grad[1], ctx.autocast)
        return (None, grad_x, *grads)


def run_segment(seg: TiledSegment, x: torch.Tensor) -> torch.Tensor:
    """Forward one tiled segment, through autograd when gradients are wanted."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in seg.params)):
        return TiledFunction.apply(seg, x, *seg.params)
    with torch.no_grad(), _AutocastState.capture(seg.device.type).context():
        return seg.forward_all(x)
