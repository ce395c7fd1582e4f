"""Multi-pass tiled segments: exact tiling through layers that need a statistic of the whole map.

A tiled segment holding barriers (``wsitrain.sft.barriers``: train-mode BatchNorm, squeeze-excitation)
runs in sweeps over its tiles. Barriers are grouped in *levels*: a barrier's level is one more than the deepest
barrier its input depends on, so barriers of one level can be measured in the same sweep.

Forward, one sweep per level, then the output sweep:
  sweep L recomputes, per tile, only the layers its level's barrier inputs depend on, and adds the
  tile's OWNED part of each barrier input to per-channel (count, mean, M2) sums (Chan's parallel
  combination; for squeeze-excitation per-(sample, channel) sums). Owned parts partition the map
  exactly: no position counted twice, none missed. The statistic is then fixed: BatchNorm updates
  its running statistics as ``F.batch_norm`` does and later sweeps apply ``(x - m) * inv * w + b``
  with m, inv constants; squeeze-excitation runs its chain once on the pooled P (keeping that tiny
  autograd graph) and later sweeps multiply by the chain's result S as a constant.

Backward, one sweep per level from the deepest, then the parameter sweep. With m and inv leaves,
autograd through a tile gives the explicit part of every gradient; the part through the statistic
of barrier j at an input position i is (biased variance, N positions per channel)
    c_i = G_m / N - G_inv * inv^3 * (x_i - m) / N,
where G_m and G_inv are the gradients of the loss w.r.t. the leaves summed over ALL tiles; for
squeeze-excitation (S a leaf) G_P = d chain / dP applied to G_S (through the kept graph, which also
gives the chain's parameter gradients) and c_i = G_P[b, c] / (H * W). Sweep
L back-propagates each tile's share of the output gradient plus the corrections of deeper levels
(added at the positions the tile owns, as extra outputs of ``autograd.grad``) into the leaves of
level L; the last sweep adds every correction and returns parameter and input gradients. Each
position's correction enters once, so sums over tiles are the plain gradient.

The statistics computed in forward are kept for backward (per channel: tiny); nothing else is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsitrain.sft.barriers import BATCHNORM, SQUEEZE, Barrier, ancestors_in, barrier_kind, segment_barriers
from wsitrain.sft.costs import node_flops
from wsitrain.sft.executor import ExecHooks, TiledSegment, _AutocastState, run_segment
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops import WINDOW
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.regions import AxisTile, Interval, SegmentRegions, axis_tile
from wsitrain.sft.runner import NodeRunner
from wsitrain.sft.session import PlanSession
from wsitrain.sft.staging import HostStager

_C = (1, -1, 1, 1)  # per-channel vector to (1, C, 1, 1)


@dataclass(frozen=True)
class BNStat:
    """A BatchNorm's batch statistic: per channel mean and 1/sqrt(biased var + eps), over ``count`` positions."""

    mean: torch.Tensor  # (C,)
    inv: torch.Tensor  # (C,)
    count: int


@dataclass(frozen=True)
class SEStat:
    """A squeeze-excitation's pooled map and its chain's results (with the chain's graph when kept)."""

    pooled: torch.Tensor  # (B, C, 1, 1), a leaf that requires grad when the graph is kept
    exits: dict[int, torch.Tensor]  # exit node -> (B, C', 1, 1) computed from ``pooled``
    count: int  # H * W positions averaged


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Statistics accumulate in at least float32."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


@dataclass
class _Moments:
    """Running (count, mean, M2) per channel, combined tile by tile."""

    count: int
    mean: torch.Tensor  # (C,)
    m2: torch.Tensor  # (C,)

    @staticmethod
    def of(part: torch.Tensor) -> _Moments:
        """Moments of a (B, C, h, w) block, in at least float32."""
        xs = _wide(part)
        mean = xs.mean(dim=(0, 2, 3))
        m2 = ((xs - mean.view(_C)) ** 2).sum(dim=(0, 2, 3))
        return _Moments(part.numel() // part.shape[1], mean, m2)

    def add(self, o: _Moments) -> _Moments:
        """Chan et al.'s pairwise update: stable where a sum of squares would cancel."""
        n = self.count + o.count
        d = o.mean - self.mean
        return _Moments(n, self.mean + d * (o.count / n), self.m2 + o.m2 + d * d * (self.count * o.count / n))


def finish_batchnorm(m: nn.BatchNorm2d, mom: _Moments) -> BNStat:
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


def _bn_apply(m: nn.BatchNorm2d, mean: torch.Tensor, inv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = (x - mean.view(_C)) * inv.view(_C)
    if m.weight is not None:
        y = y * m.weight.view(_C)
    if m.bias is not None:
        y = y + m.bias.view(_C)
    return y.to(x.dtype)


def owned_interval(out: Interval, size_out: int, size_v: int) -> Interval:
    """The part of a node's axis [0, size_v) a tile owns, from its output interval on [0, size_out).

    Boundaries scale monotonically and the last one is size_v, so the tiles' parts partition the axis.
    """
    return out[0] * size_v // size_out, out[1] * size_v // size_out


def multipass_regions(facts: GraphFacts, seg: SegmentPlan, sources: set[int], chain: set[int]) -> SegmentRegions:
    """The plan's tile grid with every tile's regions grown to cover its owned part of each barrier input.

    Squeeze-excitation pools and chains (``chain``) run outside the tiles: a tile reads their exits whole.
    """
    assert seg.regions is not None
    nodes = [i for i in range(seg.start + 1, seg.end + 1) if i not in chain]
    specs = {i: facts.nodes[i].spec for i in nodes}
    inputs = {i: tuple(v for v in facts.nodes[i].inputs if v not in chain) for i in nodes}
    per_axis: list[tuple[AxisTile, ...]] = []
    for axis, outs in ((0, seg.regions.rows_out), (1, seg.regions.cols_out)):
        sizes = {i: facts.nodes[i].shape[2 + axis] for i in [seg.start, *nodes]}
        size_out = sizes[seg.end]
        per_axis.append(
            tuple(
                axis_tile(
                    nodes,
                    seg.start,
                    inputs,
                    specs,
                    sizes,
                    axis,
                    o,
                    owned={v: owned_interval(o, size_out, sizes[v]) for v in sources},
                )
                for o in outs
            )
        )
    return SegmentRegions(seg.regions.rows_out, per_axis[0], seg.regions.cols_out, per_axis[1])


Stats = dict[int, BNStat | SEStat]  # barrier node -> its statistic
# barrier node -> the tensors a sweep differentiates: (mean, inv) of a BatchNorm, the exits of an SE
Leaves = dict[int, list[torch.Tensor]]
# barrier node -> gradients summed over tiles: (G_m, G_inv) of a BatchNorm, (G_P,) of an SE
Totals = dict[int, tuple[torch.Tensor, ...]]


class MultiPassSegment(TiledSegment):
    """A tiled segment with barriers: forward and backward in sweeps over the tiles (see the module doc)."""

    def __init__(
        self,
        facts: GraphFacts,
        seg: SegmentPlan,
        runner: NodeRunner,
        device: torch.device,
        stager: HostStager,
        hooks: ExecHooks,
    ) -> None:
        super().__init__(facts, seg, runner, device, stager, hooks)
        self.barriers = segment_barriers(self.specs, self.inputs, self.start, self.end)
        assert self.barriers, "a multi-pass segment holds at least one barrier"
        self.levels = sorted({b.level for b in self.barriers})
        self.bn: dict[int, nn.BatchNorm2d] = {}
        for b in self.barriers:
            m = runner.graph.module(b.node)
            if b.kind == BATCHNORM:
                assert isinstance(m, nn.BatchNorm2d)
                self.bn[b.node] = m
        # squeeze-excitation chains run once per step, outside the tiles; tiles read their exits
        self.chain = {i for b in self.barriers for i in b.chain} | {b.node for b in self.barriers if b.kind == SQUEEZE}
        self.tile_nodes = [i for i in self.nodes if i not in self.chain]
        sources = {b.source for b in self.barriers}
        self.regions = multipass_regions(facts, seg, sources, self.chain)
        anc = ancestors_in(self.inputs, self.start, self.end)
        # per level: the layers its barrier inputs depend on (a stats sweep computes nothing else)
        self.sweep_nodes = {
            lv: sorted(set().union(*(anc.get(b.source, frozenset()) for b in self.at(lv))) - self.chain)
            for lv in self.levels
        }
        self.sizes = {v: (facts.nodes[v].shape[2], facts.nodes[v].shape[3]) for v in [self.start, *self.nodes]}
        self.chain_params: dict[int, list[nn.Parameter]] = {}
        for b in self.barriers:
            ps: dict[int, nn.Parameter] = {}
            for i in b.chain:
                for p in runner.graph.trainable_params(i):
                    ps.setdefault(id(p), p)
            self.chain_params[b.node] = list(ps.values())

    def at(self, level: int) -> list[Barrier]:
        return [b for b in self.barriers if b.level == level]

    # ---- one tile ------------------------------------------------------------------------------
    def _run_nodes(
        self,
        region: torch.Tensor,
        rt: AxisTile,
        ct: AxisTile,
        nodes: list[int],
        stats: Stats,
        leaves: Leaves,
        keep: set[int],
    ) -> dict[int, torch.Tensor]:
        """Run ``nodes`` (in order) on one tile, barriers applied with their fixed statistics."""
        env: dict[int, torch.Tensor] = {self.start: region}
        exits = self._exit_values(stats, leaves)
        last: dict[int, int] = {}
        for u in nodes:
            for v in self.inputs[u]:
                last[v] = u
        for u in nodes:

            def fetch(v: int, u: int = u) -> torch.Tensor:
                if v in exits:  # a squeeze-excitation result: (B, C, 1, 1), broadcast over the tile
                    return exits[v]
                (rl, rh), (cl, ch) = rt.req[(u, v)], ct.req[(u, v)]
                nr, nc = rt.need[v][0], ct.need[v][0]
                return env[v][:, :, rl - nr : rh - nr, cl - nc : ch - nc]

            if u in self.bn:
                st = stats[u]
                assert isinstance(st, BNStat)
                mean, inv = leaves[u] if u in leaves else (st.mean, st.inv)
                out = _bn_apply(self.bn[u], mean, inv, fetch(self.inputs[u][0]))
            else:
                out = self.runner.run(u, env, out_of_place=True, fetch=fetch)
            spec = self.specs[u]
            if spec.kind == WINDOW:  # the layer produced outputs from its crop's first aligned position
                assert spec.windows is not None
                v = self.inputs[u][0]
                g0r = spec.windows[0].first_output(rt.req[(u, v)][0])
                g0c = spec.windows[1].first_output(ct.req[(u, v)][0])
                (a, b), (c, d) = rt.need[u], ct.need[u]
                out = out[:, :, a - g0r : b - g0r, c - g0c : d - g0c]
            env[u] = out
            for v in self.inputs[u]:
                if last.get(v) == u and v not in keep:
                    env.pop(v, None)
        return env

    def _exit_values(self, stats: Stats, leaves: Leaves) -> dict[int, torch.Tensor]:
        """What tiles read for each squeeze-excitation exit: the sweep's leaf, else a detached constant."""
        out: dict[int, torch.Tensor] = {}
        for b in self.barriers:
            st = stats.get(b.node)
            if b.kind != SQUEEZE or st is None:
                continue
            assert isinstance(st, SEStat)
            for k, e in enumerate(b.exits):
                out[e] = leaves[b.node][k] if b.node in leaves else st.exits[e].detach()
        return out

    def _owned(self, value: torch.Tensor, v: int, r: int, c: int) -> torch.Tensor:
        """The part of node v's tile value that tile (r, c) owns. (B, C, oh, ow), a view."""
        reg = self.regions
        rt, ct = reg.rows[r], reg.cols[c]
        h, w = self.sizes[v]
        r0, r1 = owned_interval(reg.rows_out[r], self.sizes[self.end][0], h)
        c0, c1 = owned_interval(reg.cols_out[c], self.sizes[self.end][1], w)
        nr, nc = rt.need[v][0], ct.need[v][0]
        return value[:, :, r0 - nr : r1 - nr, c0 - nc : c1 - nc]

    def _outputs(
        self, env: dict[int, torch.Tensor], r: int, c: int, grad_out: torch.Tensor, stats: Stats, totals: Totals
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What a tile back-propagates: its output with its share of grad_out, and owned barrier inputs with
        the statistic's part of their gradient (for the barriers in ``totals``)."""
        reg = self.regions
        (r0, r1), (c0, c1) = reg.rows_out[r], reg.cols_out[c]
        outs, gouts = [], []
        y = env[self.end]
        if y.requires_grad:
            outs.append(y)
            gouts.append(grad_out[:, :, r0:r1, c0:c1])
        for b in self.barriers:
            if b.node not in totals:
                continue
            xo = self._owned(env[b.source], b.source, r, c)
            if xo.numel() == 0 or not xo.requires_grad:
                continue
            st = stats[b.node]
            if isinstance(st, BNStat):
                g_m, g_inv = totals[b.node]
                xd = xo.detach()
                corr = g_m.view(_C) / st.count - (g_inv * st.inv**3).view(_C) * (xd - st.mean.view(_C)) / st.count
            else:
                (g_p,) = totals[b.node]  # (B, C, 1, 1): every averaged position gets its 1 / (H * W) share
                corr = (g_p / st.count).expand(xo.shape)
            outs.append(xo)
            gouts.append(corr.to(xo.dtype))
        return outs, gouts

    # ---- forward -------------------------------------------------------------------------------
    def forward_sweeps(self, x: torch.Tensor, keep_graph: bool) -> tuple[torch.Tensor, Stats]:
        """Statistics level by level, then the output sweep. Returns the output (B, C, Ho, Wo) and statistics.

        ``keep_graph``: keep the squeeze-excitation chains' autograd graphs for backward.
        """
        reg = self.regions
        stats: Stats = {}
        for lv in self.levels:
            here = self.at(lv)
            sources = {b.source for b in here}
            moments: dict[int, _Moments] = {}
            sums: dict[int, torch.Tensor] = {}  # squeeze-excitation: (B, C, 1, 1) sums over owned positions
            dtypes: dict[int, torch.dtype] = {}  # the pooled map's dtype: its input's
            for r, c in self.tiles():
                t0 = self._tick()
                rt, ct = reg.rows[r], reg.cols[c]
                env = self._run_nodes(self.input_region(x, rt, ct), rt, ct, self.sweep_nodes[lv], stats, {}, sources)
                for b in here:
                    part = self._owned(env[b.source], b.source, r, c)
                    if part.numel() == 0:
                        continue
                    if b.kind == BATCHNORM:
                        mom = _Moments.of(part)
                        moments[b.node] = moments[b.node].add(mom) if b.node in moments else mom
                    else:
                        ps = _wide(part).sum(dim=(2, 3), keepdim=True)
                        dtypes[b.node] = part.dtype
                        sums[b.node] = sums[b.node] + ps if b.node in sums else ps
                del env
                self._tock(t0, r, c, "forward")
            for b in here:
                if b.kind == BATCHNORM:
                    stats[b.node] = finish_batchnorm(self.bn[b.node], moments[b.node])
                else:
                    stats[b.node] = self._squeeze(b, sums[b.node], dtypes[b.node], keep_graph)
        observer = self.hooks.trunk_observer if self.is_trunk_end else None
        out: torch.Tensor | None = None
        for r, c in self.tiles():
            t0 = self._tick()
            rt, ct = reg.rows[r], reg.cols[c]
            y = self._run_nodes(self.input_region(x, rt, ct), rt, ct, self.tile_nodes, stats, {}, set())[self.end]
            if out is None:
                out = y.new_empty((y.shape[0], y.shape[1], reg.rows_out[-1][1], reg.cols_out[-1][1]))
            (r0, r1), (c0, c1) = reg.rows_out[r], reg.cols_out[c]
            out[:, :, r0:r1, c0:c1] = y
            if observer is not None:
                observer(y.detach(), (r0, r1), (c0, c1))
            del y
            self._tock(t0, r, c, "forward")
        assert out is not None
        return out, stats

    def _squeeze(self, b: Barrier, total: torch.Tensor, dtype: torch.dtype, keep_graph: bool) -> SEStat:
        """The pooled map from its sum, and the chain run on it once (with its graph when kept)."""
        h, w = self.sizes[b.source]
        pooled = (total / (h * w)).to(dtype)  # (B, C, 1, 1)
        with torch.set_grad_enabled(keep_graph):
            leaf = pooled.detach().requires_grad_(keep_graph)
            env: dict[int, torch.Tensor] = {b.node: leaf}
            for i in b.chain:  # in execution order; they read only the pool and one another
                env[i] = self.runner.run(i, env, out_of_place=True)
        return SEStat(leaf, {e: env[e] for e in b.exits}, h * w)

    # ---- backward ------------------------------------------------------------------------------
    def backward_sweeps(
        self, x: torch.Tensor, grad_out: torch.Tensor, stats: Stats, need_x: bool, autocast: _AutocastState
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Leaf gradients level by level from the deepest, then parameter and input gradients."""
        reg = self.regions
        totals: Totals = {}
        sources = {b.source for b in self.barriers}
        chain_grads: dict[int, torch.Tensor] = {}  # id(parameter) -> gradient, of squeeze-excitation chains
        for lv in reversed(self.levels):
            here = self.at(lv)
            leaves: Leaves = {b.node: self._leaves(b, stats[b.node]) for b in here}
            flat = [t for b in here for t in leaves[b.node]]
            sums: list[torch.Tensor] = [torch.zeros_like(t) for t in flat]
            for r, c in self.tiles():
                t0 = self._tick()
                rt, ct = reg.rows[r], reg.cols[c]
                with torch.enable_grad(), autocast.context():
                    env = self._run_nodes(
                        self.input_region(x, rt, ct).detach(), rt, ct, self.tile_nodes, stats, leaves, sources
                    )
                    outs, gouts = self._outputs(env, r, c, grad_out, stats, totals)
                if outs:
                    res = torch.autograd.grad(outs, flat, gouts, allow_unused=True)
                    for k, g in enumerate(res):
                        if g is not None:
                            sums[k] += g
                del env, outs, gouts
                self._tock(t0, r, c, "backward")
            k = 0
            for b in here:
                n = len(leaves[b.node])
                st = stats[b.node]
                if isinstance(st, SEStat):
                    totals[b.node] = (self._through_chain(b, st, sums[k : k + n], chain_grads),)
                else:
                    totals[b.node] = tuple(sums[k : k + n])
                k += n
        grad_x, grads = self._final_backward(x, grad_out, stats, totals, need_x, autocast)
        for i, p in enumerate(self.params):
            g = chain_grads.get(id(p))
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g
        return grad_x, grads

    def _leaves(self, b: Barrier, st: BNStat | SEStat) -> list[torch.Tensor]:
        """Fresh leaves for a barrier's fixed values: a backward sweep collects their gradients."""
        if isinstance(st, BNStat):
            return [st.mean.detach().requires_grad_(), st.inv.detach().requires_grad_()]
        return [st.exits[e].detach().requires_grad_() for e in b.exits]

    def _through_chain(
        self, b: Barrier, st: SEStat, g_exits: list[torch.Tensor], chain_grads: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """G_P: the exits' total gradients through the kept chain graph; adds the chain's parameter gradients."""
        params = self.chain_params[b.node]
        outs = [st.exits[e] for e in b.exits]
        res = torch.autograd.grad(outs, [st.pooled, *params], g_exits, allow_unused=True)
        for p, g in zip(params, res[1:], strict=True):
            if g is not None:
                chain_grads[id(p)] = chain_grads[id(p)] + g if id(p) in chain_grads else g
        return res[0] if res[0] is not None else torch.zeros_like(st.pooled)

    def _final_backward(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        stats: Stats,
        totals: Totals,
        need_x: bool,
        autocast: _AutocastState,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        reg = self.regions
        sink = self.hooks.input_grad_sink if self.start == 0 else None
        grad_x = torch.zeros_like(x) if need_x and sink is None else None
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        sources = {b.source for b in self.barriers}
        for r, c in self.tiles():
            t0 = self._tick()
            rt, ct = reg.rows[r], reg.cols[c]
            region = self.input_region(x, rt, ct).detach().requires_grad_(need_x)
            with torch.enable_grad(), autocast.context():
                env = self._run_nodes(region, rt, ct, self.tile_nodes, stats, {}, sources)
                outs, gouts = self._outputs(env, r, c, grad_out, stats, totals)  # slices must be in the graph
            targets = ([region] if need_x else []) + self.params
            if outs and targets:
                res = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
                if need_x:
                    gx = res[0]
                    if gx is not None:
                        rows, cols = rt.need[self.start], ct.need[self.start]
                        if sink is not None:
                            sink(gx, rows, cols)
                        else:
                            assert grad_x is not None
                            grad_x[:, :, rows[0] : rows[1], cols[0] : cols[1]] += gx.to(grad_x.device)
                    res = res[1:]
                for k, gp in enumerate(res):
                    if gp is not None:
                        grads[k] = gp.clone() if grads[k] is None else grads[k].add_(gp)
            del env, outs, gouts
            self._tock(t0, r, c, "backward")
            if self.hooks.stats is not None:
                self.hooks.stats.stats.recomputed_tiles += 1
        return grad_x, grads


class MultiPassFunction(torch.autograd.Function):
    """Autograd node of a multi-pass segment: saves the segment input and the barriers' statistics."""

    @staticmethod
    def forward(ctx: Any, seg: MultiPassSegment, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.seg = seg
        ctx.autocast = _AutocastState.capture(seg.device.type)
        ctx.save_for_backward(x)
        with torch.no_grad(), ctx.autocast.context():
            out, ctx.stats = seg.forward_sweeps(x, keep_graph=True)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        grad_x, grads = ctx.seg.backward_sweeps(x, grad_out, ctx.stats, ctx.needs_input_grad[1], ctx.autocast)
        return (None, grad_x, *grads)


def run_tiled(seg: TiledSegment, x: torch.Tensor) -> torch.Tensor:
    """Forward one tiled segment, in sweeps when it holds barriers, through autograd when gradients are wanted."""
    if not isinstance(seg, MultiPassSegment):
        return run_segment(seg, x)
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in seg.params)):
        return MultiPassFunction.apply(seg, x, *seg.params)
    with torch.no_grad(), _AutocastState.capture(seg.device.type).context():
        return seg.forward_sweeps(x, keep_graph=False)[0]


def tiled_segment(
    facts: GraphFacts,
    seg: SegmentPlan,
    runner: NodeRunner,
    device: torch.device,
    stager: HostStager,
    hooks: ExecHooks,
) -> TiledSegment:
    """The executor for a tiled segment of a plan: multi-pass when it holds barriers."""
    specs = {i: facts.nodes[i].spec for i in range(seg.start + 1, seg.end + 1)}
    inputs = {i: facts.nodes[i].inputs for i in specs}
    cls = MultiPassSegment if segment_barriers(specs, inputs, seg.start, seg.end) else TiledSegment
    return cls(facts, seg, runner, device, stager, hooks)


def sweep_flops_factor(sess: PlanSession, start: int, end: int) -> float:
    """Extra FLOPs of a segment's barrier sweeps, as a fraction of its one-sweep cost (0 without barriers).

    One-sweep cost: forward, recompute and backward. Each level adds a forward up to its last barrier
    input (every node before it: an upper bound on the ancestors the sweep runs) and a recompute plus
    backward of the whole segment. Memoized per segment in the session (it does not depend on the tile).
    """
    key = (start, end)
    if key not in sess._sweeps:
        sess._sweeps[key] = _sweep_factor(sess.facts, start, end)
    return sess._sweeps[key]


def _sweep_factor(facts: GraphFacts, start: int, end: int) -> float:
    nodes = range(start + 1, end + 1)
    if not any(barrier_kind(facts.nodes[i].spec) for i in nodes):
        return 0.0
    specs = {i: facts.nodes[i].spec for i in nodes}
    inputs = {i: facts.nodes[i].inputs for i in nodes}
    bars = segment_barriers(specs, inputs, start, end)
    fw_upto = [0.0]  # forward FLOPs of (start, i], i = start + k
    bw_all = 0.0
    for i in nodes:
        f, b = node_flops(facts, i, float(math.prod(facts.nodes[i].shape)))
        fw_upto.append(fw_upto[-1] + f)
        bw_all += b
    fw_all = fw_upto[-1]
    extra = 0.0
    for lv in sorted({b.level for b in bars}):
        last_src = max(b.source for b in bars if b.level == lv)
        extra += fw_upto[last_src - start] + fw_all + bw_all
    return extra / max(1.0, 2 * fw_all + bw_all)
