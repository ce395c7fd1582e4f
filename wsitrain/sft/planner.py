"""The planner: choose checkpoints, tiled and plain segments and tile grids that fit a budget, cheaply.

Listing 3 of the SFT paper (segments between checkpoints, only at cut points) and Listing 4 (tile
sizes propagated backwards through a segment) made into a search: a dynamic program over the cut
points in execution order. Each segment runs either *plain* (ordinary autograd: activations kept,
never recomputed) or *tiled* (forward tile by tile without keeping activations, recompute and
back-propagate tile by tile). Among the plans whose estimated peak fits the budget it picks the one
with the fewest FLOPs (recomputation + halos + a per-tile overhead), so tiling is spent only where
activations are large and checkpoints sit where activations are small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.memory_model import SimOp, SimResult, simulate
from wsitrain.sft.ops import MERGE, SPATIAL_KINDS, WINDOW, OpSpec, node_parameters
from wsitrain.sft.ops_space import resolve_layouts, spatial_extent, tile_numel
from wsitrain.sft.plan_types import Plan, SegmentPlan
from wsitrain.sft.regions import AxisTile, axis_tile, representative_tiles, split_axis
from wsitrain.units import format_bytes

# Per tile, operator and pass, the fixed cost of running it, in FLOP-equivalents: launches on CUDA;
# on CPU, measured: VGG-16 at 1024 px with 16 tiles ran 1.72x plain against 1.18x with 4 tiles of
# the same layers, about 7 ms per tile, operator and pass beyond the FLOPs (oneDNN set-up per shape).
_TILE_OVERHEAD_FLOPS = {"cpu": 1.5e9, "cuda": 2e8}
# Bytes of optimizer state per parameter byte.
OPTIMIZER_STATE = {None: 0.0, "none": 0.0, "sgd": 1.0, "adam": 2.0, "adamw": 2.0}
_MAX_STATES = 6
# Allocators hand out more than tensors need: glibc's heap fragments under PyTorch's CPU allocation
# pattern (measured: DarkNet-19 plain training peaks 12% above the replayed tensors), and the CUDA
# caching allocator rounds and splits blocks. Activation memory is planned with this much slack.
ALLOCATOR_SLACK = 1.10
# Plans keep this share of the activation budget free for the memory model's own error (measured
# up to 4% under on CPU): the estimate stays a best guess, the plan a safe one.
HEADROOM = 0.03
# Memory a training step's kernels hold besides tensors: oneDNN scratchpads and reordered weight
# copies on CPU (measured: VGG-16 at 64 px, 30 MiB), cuDNN workspaces on CUDA. A base plus twice
# the largest weight, since a conv's weight and its gradient are reordered at once.
_RUNTIME_BASE = {"cpu": 12 * 2**20, "cuda": 64 * 2**20}


@dataclass(frozen=True)
class TileChoice:
    edge: int  # tile edge in segment-output pixels
    fwd_peak: int
    bwd_peak: int
    flops: float  # forward + recompute + backward FLOPs over all tiles (halos included)
    overhead: float  # per-tile launch cost in FLOP-equivalents (planning only)
    n_tiles: int
    tile_shape: tuple[int, int]
    halo: tuple[int, int]


@dataclass(frozen=True)
class _SegOption:
    start: int
    end: int
    mode: str
    tile: TileChoice | None
    local_fwd: int
    local_bwd: int
    retained_add: int
    flops: float
    cost: float  # what the planner minimizes: FLOPs plus launch overhead


class PlanContext:
    """Everything the planner knows about a model on one input shape."""

    def __init__(
        self,
        graph: ModelGraph,
        input_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        input_dtype: torch.dtype,
        device: str,
        input_on_host: bool,
        input_requires_grad: bool = False,
        optimizer: str | None = None,
    ) -> None:
        if len(input_shape) != 4 or min(input_shape) <= 0:
            raise PlanError(f"input shape {tuple(input_shape)} is not (B, C, H, W) with positive sizes")
        self.graph = graph
        self.input_shape = tuple(int(s) for s in input_shape)
        self.device = device
        self.input_on_host = input_on_host
        self.act_dtype = act_dtype
        self.input_dtype = input_dtype
        self.specs: list[OpSpec] = graph.specs()
        shape_dtype = torch.float32 if act_dtype in (torch.bfloat16, torch.float16) else act_dtype
        meta_in = input_dtype if not input_dtype.is_floating_point else shape_dtype
        self.shapes = [s for s, _ in graph.shapes(self.input_shape, meta_in)]
        # where H and W sit in every node's output (channels-last, ShuffleNet's 5-D view), from these shapes
        self.specs = resolve_layouts(graph.gm, [g.fx_node for g in graph.nodes], self.specs, self.shapes, self.name)
        self.cuts, self.trunk_end = graph.cut_points(self.specs, [(s, None) for s in self.shapes])  # type: ignore[misc]
        self.cands = graph.candidate_cuts(self.specs, self.cuts, self.trunk_end)
        self.inputs = {g.index: g.inputs for g in graph.nodes}
        self.n = len(graph.nodes)
        act = torch.empty((), dtype=act_dtype).element_size()
        inp = torch.empty((), dtype=input_dtype).element_size()
        self.act_size = act
        self.bytes = [math.prod(s) * (inp if i == 0 else act) if s else 0 for i, s in enumerate(self.shapes)]
        # requires_grad flows from the input (when it needs a gradient) and from parameters
        rg = [False] * self.n
        rg[0] = input_requires_grad
        self.param_bytes = [0] * self.n
        for g in graph.nodes[1:]:
            n = g.fx_node
            ps = [p for p in node_parameters(n, graph.gm) if p.requires_grad]  # module and get_attr parameters
            self.param_bytes[g.index] = sum(p.numel() * p.element_size() for p in ps)
            rg[g.index] = any(rg[v] for v in g.inputs) or self.param_bytes[g.index] > 0
        self.requires_grad = rg
        params = {id(p): p for p in graph.model.parameters()}
        pbytes = sum(p.numel() * p.element_size() for p in params.values())
        buffers = sum(b.numel() * b.element_size() for b in graph.model.buffers())
        self.model_bytes = pbytes + buffers
        self.optimizer_bytes = int(OPTIMIZER_STATE.get(optimizer, 2.0) * pbytes)
        largest = max((p.numel() * p.element_size() for p in params.values()), default=0)
        self.runtime_bytes = _RUNTIME_BASE["cuda" if device.startswith("cuda") else "cpu"] + 2 * largest
        self.fixed = self.model_bytes + self.optimizer_bytes + self.runtime_bytes
        self.grad_bytes_total = sum(p.numel() * p.element_size() for p in params.values() if p.requires_grad)
        # parameter gradients that exist once backward has passed node i (suffix sums)
        self.grads_after = [0] * (self.n + 1)
        for i in range(self.n - 1, -1, -1):
            self.grads_after[i] = self.grads_after[i + 1] + self.param_bytes[i]
        self.slack = ALLOCATOR_SLACK
        self.overhead_flops = _TILE_OVERHEAD_FLOPS["cuda" if device.startswith("cuda") else "cpu"]
        self._tile_cache: dict[tuple[int, int, int], TileChoice] = {}
        self._plain_cache: dict[tuple[int, int], tuple[SimResult, float]] = {}

    # ---- basic facts ---------------------------------------------------------------------------
    def scale_peak(self, replayed: float) -> int:
        """What the process will really hold: replayed tensor bytes plus allocator slack on activations."""
        return int(self.fixed + self.slack * max(0.0, replayed - self.fixed))

    def effective_budget(self, budget: float) -> float:
        """The replayed-bytes limit that keeps ``scale_peak`` within ``budget``, with headroom."""
        return self.fixed + (1.0 - HEADROOM) * (budget - self.fixed) / self.slack

    def name(self, i: int) -> str:
        return self.graph.nodes[i].name

    def device_bytes(self, i: int) -> int:
        """Bytes a value takes on the device (the image stays on the host when streamed)."""
        return 0 if i == 0 and self.input_on_host else self.bytes[i]

    def image_stride(self, i: int) -> int:
        """How many image pixels one pixel of node i spans (its cumulative stride)."""
        return max(1, round(self.input_shape[2] / max(1, self.shapes[i][2])))

    def node_flops(self, i: int, numel_out: float) -> tuple[float, float]:
        """Forward and backward FLOPs of node i producing ``numel_out`` output elements."""
        spec = self.specs[i]
        f = spec.flops_per_output * numel_out
        if not self.requires_grad[i]:
            return f, 0.0
        grads_in = any(self.requires_grad[v] for v in self.inputs[i])
        if spec.kind == WINDOW and spec.has_params:
            return f, f * (1.0 + (1.0 if grads_in else 0.0))
        return f, f

    # ---- the replay ops ------------------------------------------------------------------------
    def sim_op(self, i: int, out_bytes: int, in_bytes: dict[int, int] | None = None, grad: bool = True) -> SimOp:
        spec = self.specs[i]
        ins = self.inputs[i]
        rg = self.requires_grad[i] and grad
        saved: list[int] = []
        if spec.saves_input:
            saved += list(ins[:1]) if spec.kind != MERGE else list(ins)
        if spec.saves_output:
            saved.append(i)
        alias = ins[0] if (spec.inplace or spec.alias) and ins else None
        elem = out_bytes // max(1, self.act_size)
        return SimOp(
            out=i,
            out_bytes=out_bytes,
            inputs=ins,
            saved=tuple(saved) if rg else (),
            extra_saved=elem * spec.index_bytes if rg else 0,
            alias_of=alias,
            requires_grad=rg,
            grad_inputs=tuple(self.requires_grad[v] and grad for v in ins),
            param_grad_bytes=self.param_bytes[i] if grad else 0,
            label=self.name(i),
        )

    def plain_sim(self, start: int, end: int) -> tuple[SimResult, float]:
        """Replay of nodes start+1..end run with plain autograd, from the value at ``start``."""
        key = (start, end)
        if key not in self._plain_cache:
            ops = [self.sim_op(i, self.bytes[i]) for i in range(start + 1, end + 1)]
            res = simulate(ops, {start: self.device_bytes(start)})
            flops = 0.0
            for i in range(start + 1, end + 1):
                f, b = self.node_flops(i, self.bytes[i] / self.act_size)
                flops += f + b
            self._plain_cache[key] = (res, flops)
        return self._plain_cache[key]

    @cached_property
    def head_sim(self) -> tuple[SimResult, float]:
        return (
            self.plain_sim(self.trunk_end, self.n - 1) if self.trunk_end < self.n - 1 else (SimResult(0, 0, 0, ""), 0.0)
        )

    # ---- tiles ---------------------------------------------------------------------------------
    def axis_tiles(self, start: int, end: int, edge: int, axis: int) -> tuple[list[tuple[int, int]], list[AxisTile]]:
        """All tiles along one axis: output intervals and their regions."""
        length = self.shapes[end][2 + axis]
        outs = split_axis(length, edge)
        nodes = list(range(start + 1, end + 1))
        sizes = {i: spatial_extent(self.specs[i], self.shapes[i], axis) for i in range(start, end + 1)}
        tiles = [axis_tile(nodes, start, self.inputs, self.specs, sizes, axis, o) for o in outs]
        return outs, tiles

    def tile_choice(self, start: int, end: int, edge: int) -> TileChoice:
        """Memory and FLOPs of tiling segment (start, end] with square tiles of ``edge`` output pixels."""
        key = (start, end, edge)
        if key in self._tile_cache:
            return self._tile_cache[key]
        nodes = list(range(start + 1, end + 1))
        per_axis = []
        for axis in (0, 1):
            length = self.shapes[end][2 + axis]
            outs = split_axis(length, edge)
            sizes = {i: spatial_extent(self.specs[i], self.shapes[i], axis) for i in range(start, end + 1)}
            reps = representative_tiles(outs)
            tiles = [(axis_tile(nodes, start, self.inputs, self.specs, sizes, axis, outs[k]), m) for k, m in reps]
            per_axis.append((len(outs), tiles))
            if self.shapes[end][2] == self.shapes[end][3] and self.shapes[start][2] == self.shapes[start][3]:
                per_axis.append(per_axis[0])  # square: the W axis is the H axis
                break
        (nr, rows), (nc, cols) = per_axis

        def ext(t: AxisTile, i: int) -> int:
            lo, hi = t.computed[i]
            return hi - lo

        # the largest tile's working set: per node the largest extent along each axis
        mx_h = {i: max(ext(t, i) for t, _ in rows) for i in [start, *nodes]}
        mx_w = {i: max(ext(t, i) for t, _ in cols) for i in [start, *nodes]}

        def tile_bytes(i: int) -> int:
            elem = self.bytes[i] // max(1, math.prod(self.shapes[i]))
            return tile_numel(self.specs[i], self.shapes[i], mx_h[i], mx_w[i]) * elem

        crop = tile_bytes(start) if (start == 0 and self.input_on_host) else 0
        if start == 0 and not self.input_dtype.is_floating_point:
            crop = tile_bytes(start)  # an integer image is converted per tile

        def with_reorder(op: SimOp) -> SimOp:
            # oneDNN copies a strided crop into its blocked layout before a conv, in forward and backward
            if self.device != "cpu" or self.specs[op.out].kind != WINDOW or not self.specs[op.out].has_params:
                return op
            extra = tile_bytes(self.inputs[op.out][0])
            return replace(op, fwd_extra=op.fwd_extra + extra, bwd_extra=op.bwd_extra + extra)

        fwd_ops = [with_reorder(self.sim_op(i, tile_bytes(i), grad=False)) for i in nodes]
        fwd = simulate(fwd_ops, {start: crop}, backward=False).forward_peak
        bwd_ops = [with_reorder(self.sim_op(i, tile_bytes(i))) for i in nodes]
        bres = simulate(bwd_ops, {start: crop})
        bwd = max(bres.forward_peak, bres.backward_peak)
        flops = 0.0
        overhead = 0.0
        for i in nodes:
            sum_h = sum(ext(t, i) * m for t, m in rows)
            sum_w = sum(ext(t, i) * m for t, m in cols)
            numel = tile_numel(self.specs[i], self.shapes[i], sum_h, sum_w)
            f, bw = self.node_flops(i, numel)
            flops += 2 * f + bw  # forward, recompute, backward
            overhead += 2 * self.overhead_flops * nr * nc
        in_h, in_w = mx_h[start], mx_w[start]
        mid_r = rows[len(rows) // 2][0]
        mid_c = cols[len(cols) // 2][0]
        core_h = edge * self.shapes[start][2] // max(1, self.shapes[end][2])
        core_w = edge * self.shapes[start][3] // max(1, self.shapes[end][3])
        halo_h = max(0, (ext(mid_r, start) - min(core_h, self.shapes[start][2]) + 1) // 2)
        halo_w = max(0, (ext(mid_c, start) - min(core_w, self.shapes[start][3]) + 1) // 2)
        choice = TileChoice(edge, fwd, bwd, flops, overhead, nr * nc, (in_h, in_w), (halo_h, halo_w))
        self._tile_cache[key] = choice
        return choice

    def edge_candidates(self, end: int, forced_tile: int | None) -> list[int]:
        """Tile edges (segment-output pixels) to try, largest first: powers of two and the whole extent."""
        length = max(self.shapes[end][2], self.shapes[end][3])
        if forced_tile is not None:
            # the forced edge in this segment's output pixels, rounded, and at least 2 pixels: 1-pixel
            # tiles recompute their whole halo for a single output (and hit kernel corner cases)
            return [min(length, max(2, round(forced_tile / self.image_stride(end))))]
        edges = {length}
        e = 1
        while e < length:
            edges.add(e)
            e *= 2
        return sorted(edges, reverse=True)

    # ---- segment options -----------------------------------------------------------------------
    def tileable(self, start: int, end: int) -> str | None:
        """None if segment (start, end] can be tiled, else the first offending node's name."""
        for i in range(start + 1, end + 1):
            s = self.specs[i]
            if not s.tileable or s.kind not in SPATIAL_KINDS:
                return self.name(i)
        return None

    def plain_option(self, start: int, end: int) -> _SegOption:
        res, flops = self.plain_sim(start, end)
        # the segment's output is the next segment's input: it is counted there, not in what this one retains
        out_saved = self.bytes[end] if self._saves(start, end, end) else 0
        retained = max(0, res.saved_bytes - out_saved)
        return _SegOption(start, end, "plain", None, res.forward_peak, res.backward_peak, retained, flops, flops)

    def _saves(self, start: int, end: int, value: int) -> bool:
        for i in range(start + 1, end + 1):
            spec = self.specs[i]
            if not self.requires_grad[i]:
                continue
            if spec.saves_input and value in self.inputs[i]:
                return True
            if spec.saves_output and i == value:
                return True
        return False

    def tiled_floor(self, start: int, end: int) -> int:
        """Local peak of a tiled segment before any tile: no tile size can go below it."""
        in_dev = self.device_bytes(start)
        grad_in = self.bytes[start] if self.requires_grad[start] else 0
        grad_out = self.bytes[end] if self.requires_grad[end] else 0
        return max(in_dev + self.bytes[end], in_dev + grad_out + grad_in + self.grads_after[end + 1])

    def tiled_option(self, start: int, end: int, edge: int) -> _SegOption:
        t = self.tile_choice(start, end, edge)
        in_dev = self.device_bytes(start)
        grad_in = self.bytes[start] if self.requires_grad[start] else 0
        grad_out = self.bytes[end] if self.requires_grad[end] else 0
        seg_param_grads = sum(self.param_bytes[start + 1 : end + 1])
        local_fwd = in_dev + self.bytes[end] + t.fwd_peak
        local_bwd = in_dev + grad_out + grad_in + t.bwd_peak + seg_param_grads
        return _SegOption(start, end, "tiled", t, local_fwd, local_bwd, in_dev, t.flops, t.flops + t.overhead)


@dataclass
class _State:
    cost: float
    retained: int
    peak: int
    path: tuple[_SegOption, ...]

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.path)


def _search(
    ctx: PlanContext,
    budget: float,
    forced_tile: int | None,
    forced_cuts: list[int] | None,
    ignore_tileability: bool = False,
    minimize_peak: bool = False,
) -> _State | None:
    """Dynamic program over cut points: the cheapest segmentation whose every local peak fits ``budget``.

    With ``minimize_peak`` the budget is ignored and the plan with the smallest peak is returned.
    """
    cands = forced_cuts if forced_cuts is not None else ctx.cands
    states: dict[int, list[_State]] = {cands[0]: [_State(0.0, 0, ctx.fixed + ctx.device_bytes(0), ())]}
    for ai, a in enumerate(cands[:-1]):
        here = _prune(states.get(a, []), minimize_peak)
        if not here:
            continue
        for b in cands[ai + 1 : ai + 2] if forced_cuts is not None else cands[ai + 1 :]:
            plain = ctx.plain_option(a, b) if forced_tile is None else None
            can_tile = ignore_tileability or ctx.tileable(a, b) is None
            edges = ctx.edge_candidates(b, forced_tile) if can_tile else []
            if minimize_peak and edges:
                small = [e for e in edges if e * ctx.image_stride(b) >= 64] or edges[-1:]
                edges = small[-1:]
            for st in here:
                best: tuple[float, _SegOption, int] | None = None

                def consider(opt: _SegOption, st: _State = st, b: int = b) -> bool:
                    nonlocal best
                    fwd = ctx.fixed + st.retained + opt.local_fwd
                    bwd = ctx.fixed + st.retained + ctx.grads_after[b + 1] + opt.local_bwd
                    peak = max(st.peak, fwd, bwd)
                    if not minimize_peak and peak > budget:
                        return False
                    key = peak if minimize_peak else opt.cost
                    if best is None or key < best[0]:
                        best = (key, opt, peak)
                    return True

                if plain is not None:
                    consider(plain)
                if edges and (minimize_peak or ctx.fixed + st.retained + ctx.tiled_floor(a, b) <= budget):
                    # larger tiles cost less (less halo, fewer launches): take the largest that fits
                    for e in edges:
                        if consider(ctx.tiled_option(a, b, e)):
                            break
                if best is None:
                    continue
                _, opt, peak = best
                new = _State(st.cost + opt.cost, st.retained + opt.retained_add, peak, (*st.path, opt))
                states.setdefault(b, []).append(new)
    final = states.get(cands[-1], [])
    head_res, _ = ctx.head_sim
    best_state: _State | None = None
    for st in final:
        peak = max(st.peak, ctx.fixed + st.retained + head_res.peak)
        if not minimize_peak and peak > budget:
            continue
        cand = _State(st.cost, st.retained, peak, st.path)
        key = (cand.peak, cand.cost) if minimize_peak else (cand.cost, cand.peak)
        if best_state is None or key < (
            (best_state.peak, best_state.cost) if minimize_peak else (best_state.cost, best_state.peak)
        ):
            best_state = cand
    return best_state


def _prune(states: list[_State], minimize_peak: bool) -> list[_State]:
    """Keep states not dominated in (cost, retained, peak)."""
    key = (lambda s: (s.peak, s.retained, s.cost)) if minimize_peak else (lambda s: (s.cost, s.retained, s.peak))
    out: list[_State] = []
    for s in sorted(states, key=key):
        if any(o.cost <= s.cost and o.retained <= s.retained and o.peak <= s.peak for o in out):
            continue
        out.append(s)
    return out[:_MAX_STATES]


# ---- assembling the plan --------------------------------------------------------------------------
def _macro_ops(ctx: PlanContext, path: tuple[_SegOption, ...]) -> list[SimOp]:
    """The replay of a whole step under a plan: plain nodes as themselves, tiled segments as macro ops."""
    ops: list[SimOp] = []
    for opt in path:
        if opt.mode == "plain":
            ops.extend(ctx.sim_op(i, ctx.bytes[i]) for i in range(opt.start + 1, opt.end + 1))
        else:
            assert opt.tile is not None
            rg_in = ctx.requires_grad[opt.start]
            ops.append(
                SimOp(
                    out=opt.end,
                    out_bytes=ctx.bytes[opt.end],
                    inputs=(opt.start,),
                    saved=(opt.start,),
                    fwd_extra=opt.tile.fwd_peak,
                    bwd_extra=opt.tile.bwd_peak,
                    requires_grad=ctx.requires_grad[opt.end],
                    grad_inputs=(rg_in,),
                    param_grad_bytes=sum(ctx.param_bytes[opt.start + 1 : opt.end + 1]),
                    label=f"segment {ctx.name(opt.start + 1)}..{ctx.name(opt.end)}",
                )
            )
    ops.extend(ctx.sim_op(i, ctx.bytes[i]) for i in range(ctx.trunk_end + 1, ctx.n))
    return ops


def fitting_plan(
    ctx: PlanContext, budget: float, tile_size: int | None = None, forced_cuts: list[int] | None = None
) -> _State | None:
    """The cheapest search result whose replayed peak fits ``budget`` (with slack and headroom), or None."""
    limit = ctx.effective_budget(budget)
    target = limit
    for _ in range(4):  # the search's local peaks approximate the replay; tighten until the replay fits
        state = _search(ctx, target, tile_size, forced_cuts)
        if state is None:
            return None
        peak = _replay(ctx, state.path).peak
        if peak <= limit:
            return state
        target -= (peak - limit) + 1
    return None


def _replay(ctx: PlanContext, path: tuple[_SegOption, ...]) -> SimResult:
    return simulate(_macro_ops(ctx, path), {0: ctx.device_bytes(0)}, fixed=ctx.fixed)


def baseline_peak(ctx: PlanContext) -> int:
    """Plain PyTorch: every activation kept (the paper's PyTorch-Base)."""
    path = (ctx.plain_option(0, ctx.trunk_end),)
    return ctx.scale_peak(_replay(ctx, path).peak)


def checkpoint_sequential_peak(ctx: PlanContext) -> tuple[int, int]:
    """Best ``torch.utils.checkpoint.checkpoint_sequential`` over the chain of blocks between cuts.

    Returns (peak, number of segments). Like PyTorch, the last segment runs without checkpointing.
    """
    blocks = list(zip(ctx.cuts[:-1], ctx.cuts[1:], strict=True))
    best = (baseline_peak(ctx), 1)
    n_blocks = len(blocks)
    for s in range(2, max(2, n_blocks) + 1):
        size = max(1, n_blocks // s)
        bounds = [ctx.cuts[min(k * size, n_blocks)] for k in range(s)] + [ctx.cuts[-1]]
        bounds = sorted(set(bounds))
        ops: list[SimOp] = []
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            res, _ = ctx.plain_sim(a, b)
            if k == len(bounds) - 2:
                ops.extend(ctx.sim_op(i, ctx.bytes[i]) for i in range(a + 1, b + 1))
                continue
            fwd_only = simulate(
                [ctx.sim_op(i, ctx.bytes[i], grad=False) for i in range(a + 1, b + 1)], {a: 0}, backward=False
            )
            ops.append(
                SimOp(
                    out=b,
                    out_bytes=ctx.bytes[b],
                    inputs=(a,),
                    saved=(a,),
                    fwd_extra=fwd_only.forward_peak,
                    bwd_extra=res.peak,
                    requires_grad=ctx.requires_grad[b],
                    grad_inputs=(ctx.requires_grad[a],),
                    label=f"ckpt {k}",
                )
            )
        ops.extend(ctx.sim_op(i, ctx.bytes[i]) for i in range(ctx.trunk_end + 1, ctx.n))
        peak = ctx.scale_peak(simulate(ops, {0: ctx.device_bytes(0)}, fixed=ctx.fixed).peak)
        if peak < best[0]:
            best = (peak, s)
    return best


def _segment_plans(ctx: PlanContext, path: tuple[_SegOption, ...], base_peak: int) -> tuple[SegmentPlan, ...]:
    segs = []
    retained = 0
    for k, opt in enumerate(path):
        layers = tuple(ctx.name(i) for i in range(opt.start + 1, opt.end + 1))
        t = opt.tile
        on_host = opt.start == 0 and ctx.input_on_host
        peak = ctx.scale_peak(ctx.fixed + retained + max(opt.local_fwd, opt.local_bwd + ctx.grads_after[opt.end + 1]))
        retained += opt.retained_add
        segs.append(
            SegmentPlan(
                index=k,
                layers=layers,
                mode=opt.mode,
                tile_grid=(
                    (len(split_axis(ctx.shapes[opt.end][2], t.edge)), len(split_axis(ctx.shapes[opt.end][3], t.edge)))
                    if t
                    else (1, 1)
                ),
                tile_edge=t.edge if t else max(ctx.shapes[opt.end][2:]),
                tile_shape=t.tile_shape if t else tuple(ctx.shapes[opt.start][2:4]),  # type: ignore[arg-type]
                halo=t.halo if t else (0, 0),
                input_shape=tuple(ctx.shapes[opt.start]),
                output_shape=tuple(ctx.shapes[opt.end]),
                checkpoint_bytes=ctx.bytes[opt.start] if opt.mode == "tiled" else 0,
                checkpoint_location="host" if on_host else "device",
                tile_activation_bytes=t.bwd_peak if t else 0,
                peak_bytes=min(peak, base_peak) if opt.mode == "plain" and len(path) == 1 else peak,
                flops=opt.flops,
                start=opt.start,
                end=opt.end,
            )
        )
    return tuple(segs)


def build_plan(
    model: nn.Module,
    graph: ModelGraph,
    input_shape: tuple[int, ...],
    budget: int,
    act_dtype: torch.dtype,
    input_dtype: torch.dtype,
    device: str,
    input_on_host: bool,
    input_requires_grad: bool = False,
    tile_size: int | None = None,
    checkpoints: list[str] | None = None,
    optimizer: str | None = None,
) -> tuple[Plan, PlanContext]:
    """Plan ``model`` on ``input_shape`` within ``budget`` bytes."""
    ctx = PlanContext(graph, input_shape, act_dtype, input_dtype, device, input_on_host, input_requires_grad, optimizer)
    forced_cuts = _resolve_checkpoints(ctx, checkpoints) if checkpoints is not None else None
    if tile_size is not None and tile_size <= 0:
        raise PlanError(f"tile_size {tile_size} must be a positive number of pixels")
    notes: list[str] = []
    base = baseline_peak(ctx)
    ck_peak, ck_s = checkpoint_sequential_peak(ctx)
    flops_plain = ctx.plain_sim(0, ctx.trunk_end)[1] + ctx.head_sim[1]

    state: _State | None = None
    limit = ctx.effective_budget(budget)
    state = fitting_plan(ctx, budget, tile_size, forced_cuts)
    fits = state is not None
    if state is None:
        blocker = None
        blocker = _first_blocker(ctx, limit, tile_size, forced_cuts)
        if blocker is not None:
            idx, spec = blocker
            raise PlanError(
                f"layer '{ctx.name(idx)}' ({spec.type_name}) sits where activations must be tiled to fit "
                f"{_fmt(budget)}, but it cannot be tiled: {spec.why_not}",
                hint="fix the layer as said, or give the engine more memory (engine.memory_budget)",
            )
        state = _search(ctx, math.inf, tile_size, forced_cuts, minimize_peak=True)
        if state is None:
            raise PlanError(
                f"no plan exists for input {tuple(input_shape)}: the layers that would need tiling cannot be tiled",
                hint="freeze BatchNorm layers and use eval-mode Dropout in the trunk",
            )
        notes.append(f"needs at least {_fmt(ctx.scale_peak(_replay(ctx, state.path).peak))}; budget is {_fmt(budget)}")
    assert state is not None
    replay = _replay(ctx, state.path)
    segments = _segment_plans(ctx, state.path, base)
    head_flops = ctx.head_sim[1]
    tiled = [s for s in segments if s.mode == "tiled"]
    breakdown = {
        "parameters": ctx.model_bytes,
        "gradients": ctx.grad_bytes_total,
        "optimizer": ctx.optimizer_bytes,
        "runtime": ctx.runtime_bytes,
        "checkpoints": sum(s.checkpoint_bytes for s in tiled if s.checkpoint_location == "device"),
        "gradient_buffers": max((_grad_buffers(ctx, s) for s in tiled), default=0),
        "tile_activations": max((s.tile_activation_bytes for s in tiled), default=0),
        "plain_activations": sum(o.retained_add for o in state.path if o.mode == "plain"),
        "head": ctx.head_sim[0].peak,
    }
    plan = Plan(
        model_name=getattr(model, "name", type(model).__name__),
        input_shape=ctx.input_shape,
        dtype=str(act_dtype).replace("torch.", ""),
        input_dtype=str(input_dtype).replace("torch.", ""),
        device=device,
        budget_bytes=int(budget),
        estimated_peak_bytes=ctx.scale_peak(replay.peak),
        fits=fits and ctx.scale_peak(replay.peak) <= budget,
        segments=segments,
        breakdown=breakdown,
        baseline_peak_bytes=int(base),
        checkpoint_peak_bytes=int(ck_peak),
        checkpoint_segments=ck_s,
        flops_plain=flops_plain,
        flops_sft=state.flops + head_flops,
        recomputed_tiles=sum(s.n_tiles for s in tiled),
        input_on_host=input_on_host,
        feature_map_bytes=int(
            sum(b for i, b in enumerate(ctx.bytes) if not (ctx.specs[i].inplace or ctx.specs[i].alias))
        ),
        notes=tuple(notes),
    )
    return plan, ctx


def _grad_buffers(ctx: PlanContext, s: SegmentPlan) -> int:
    gin = ctx.bytes[s.start] if ctx.requires_grad[s.start] else 0
    return gin + (ctx.bytes[s.end] if ctx.requires_grad[s.end] else 0)


def _first_blocker(
    ctx: PlanContext, budget: float, tile_size: int | None, forced_cuts: list[int] | None
) -> tuple[int, OpSpec] | None:
    st = _search(ctx, float(budget), tile_size, forced_cuts, ignore_tileability=True)
    if st is None:
        return None
    for opt in st.path:
        if opt.mode == "tiled":
            for i in range(opt.start + 1, opt.end + 1):
                if not ctx.specs[i].tileable or ctx.specs[i].kind not in SPATIAL_KINDS:
                    return i, ctx.specs[i]
    return None


def _resolve_checkpoints(ctx: PlanContext, names: list[str]) -> list[int]:
    by_name = {ctx.name(i): i for i in ctx.cuts}
    bad = [n for n in names if n not in by_name]
    if bad:
        valid = ", ".join(ctx.name(i) for i in ctx.cuts[1:-1])
        raise PlanError(
            f"checkpoints {bad} are not cut points of this model",
            hint=f"a checkpoint must be a layer every path passes through; valid: {valid}",
        )
    return sorted({0, ctx.trunk_end, *(by_name[n] for n in names)})


def _fmt(n: float) -> str:
    return format_bytes(n)
