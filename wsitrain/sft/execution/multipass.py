"""Multi-pass tiled segments: exact tiling through layers that need a statistic of the whole map.

A tiled segment holding barriers (``wsitrain.sft.ops.barriers``: train-mode BatchNorm, squeeze-excitation)
runs in sweeps over its tiles. Barriers are grouped in *levels*: a barrier's level is one more than the deepest
barrier its input depends on, so barriers of one level can be measured in the same sweep.

Forward, one sweep per level, then the output sweep:
  sweep L recomputes, per tile, only the layers its level's barrier inputs depend on, and adds the
  tile's OWNED part of each barrier input to per-channel (count, mean, M2) sums (Chan's parallel
  combination; for squeeze-excitation per-(sample, channel) sums). Owned parts partition the map
  exactly: no position counted twice, none missed. The statistic is then fixed: BatchNorm updates
  its running statistics as ``F.batch_norm`` does and later sweeps apply ``(x - m) * inv * w + b``
  with m, inv constants (then timm's BatchNormAct2d's activation, ``wsitrain.sft.ops.norm_act``);
  squeeze-excitation runs its chain once on the pooled P (keeping that tiny autograd graph) and later
  sweeps multiply by the chain's result S as a constant.

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

A segment that ends the trunk may fold the global pool after it (``seg.fused_pool``), as a plain tiled
segment does: the output sweep adds each tile to a ``PoolAccumulator`` instead of joining a map, and
every backward sweep gives each recomputed tile its share of the pooled gradient (``acc.tile_grad``).

The statistics computed in forward are kept for backward (per channel: tiny); nothing else is.
Under autocast, statistics and leaf gradients are summed in float32, and BatchNorm's correction
joins its explicit gradient on a float32 copy of the layer's input, as BatchNorm's own backward
combines them in float32: in bf16 the two nearly cancel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from wsitrain.sft.execution.autocast import AutocastState
from wsitrain.sft.execution.barrier_stats import (
    BNStat,
    GRNStat,
    Leaves,
    Moments,
    SEStat,
    SqueezeChain,
    Stats,
    Totals,
    bn_apply,
    correction,
    finish_batchnorm,
    wide,
)
from wsitrain.sft.execution.hooks import ExecHooks
from wsitrain.sft.execution.owned_regions import multipass_regions, owned_interval
from wsitrain.sft.execution.runner import NodeRunner
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.execution.tiled import TiledSegment
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.barriers import BATCHNORM, GRN, SQUEEZE, Barrier, ancestors_in, segment_barriers
from wsitrain.sft.ops.fused_pool import PoolAccumulator
from wsitrain.sft.ops.grn import grn_apply
from wsitrain.sft.ops.norm_act import act_after_norm
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.ops.space import crop, spatial_extent
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.regions import AxisTile


def _wide_key(bn: int) -> int:
    """Where a tile's environment keeps a BatchNorm's widened input (node indices are never negative)."""
    return -1 - bn


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
        reuse: bool = True,
    ) -> None:
        super().__init__(facts, seg, runner, device, stager, hooks, reuse)
        self.barriers = segment_barriers(self.specs, self.inputs, self.start, self.end)
        assert self.barriers, "a multi-pass segment holds at least one barrier"
        self.levels = sorted({b.level for b in self.barriers})
        self.bn: dict[int, nn.BatchNorm2d] = {}
        self.act: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}  # BatchNorm node -> what follows it
        self.grn: dict[int, nn.Module] = {}  # global response normalizations (ops/grn.py)
        for b in self.barriers:
            m = runner.graph.module(b.node)
            if b.kind == BATCHNORM:
                assert isinstance(m, nn.BatchNorm2d)
                self.bn[b.node] = m
                self.act[b.node] = act_after_norm(m) or nn.Identity()  # BatchNormAct2d: its act after the norm
            elif b.kind == GRN:
                assert m is not None
                self.grn[b.node] = m
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
        shapes = {v: facts.nodes[v].shape for v in [self.start, *self.nodes]}
        # (H, W) of the feature maps, wherever their layout holds them (GRN may read a channels-last map)
        self.sizes = {v: (spatial_extent(self.specs[v], s, 0), spatial_extent(self.specs[v], s, 1))
                      for v, s in shapes.items()}  # fmt: skip
        self.se = {b.node: SqueezeChain(runner, b, shapes) for b in self.barriers if b.kind == SQUEEZE}

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
                return crop(env[v], self.specs[v].spatial_dims, (rl - nr, rh - nr), (cl - nc, ch - nc))

            if u in self.bn:
                st = stats[u]
                assert isinstance(st, BNStat)
                mean, inv = leaves[u] if u in leaves else (st.mean, st.inv)
                v = self.inputs[u][0]
                # the layer's input in at least float32, kept: the statistic's gradient correction joins
                # the explicit gradient there, as BatchNorm's own backward combines them in float32
                env[_wide_key(u)] = wide(env[v])
                (rl, rh), (cl, ch) = rt.req[(u, v)], ct.req[(u, v)]
                nr, nc = rt.need[v][0], ct.need[v][0]
                x_in = env[_wide_key(u)][:, :, rl - nr : rh - nr, cl - nc : ch - nc]
                out = self.act[u](bn_apply(self.bn[u], mean, inv, x_in).to(env[v].dtype))
            elif u in self.grn:
                st = stats[u]
                assert isinstance(st, GRNStat)
                out = grn_apply(self.grn[u], fetch(self.inputs[u][0]), leaves[u][0] if u in leaves else st.x_n)
            else:
                out = self.runner.run(u, env, out_of_place=True, fetch=fetch, call=self.stand_in(u, rt, ct))
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
        """The part of node v's tile value that tile (r, c) owns. (B, C, oh, ow) in v's layout, a view."""
        reg = self.regions
        rt, ct = reg.rows[r], reg.cols[c]
        h, w = self.sizes[v]
        r0, r1 = owned_interval(reg.rows_out[r], self.sizes[self.end][0], h)
        c0, c1 = owned_interval(reg.cols_out[c], self.sizes[self.end][1], w)
        nr, nc = rt.need[v][0], ct.need[v][0]
        return crop(value, self.specs[v].spatial_dims, (r0 - nr, r1 - nr), (c0 - nc, c1 - nc))

    def _outputs(
        self,
        env: dict[int, torch.Tensor],
        r: int,
        c: int,
        grad_out: torch.Tensor,
        stats: Stats,
        totals: Totals,
        acc: PoolAccumulator | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What a tile back-propagates: its output with its share of grad_out (of the pooled gradient (B, C) with
        a fused pool), and owned barrier inputs with the statistic's part of their gradient (for the barriers in
        ``totals``)."""
        reg = self.regions
        (r0, r1), (c0, c1) = reg.rows_out[r], reg.cols_out[c]
        outs, gouts = [], []
        y = env[self.end]
        if y.requires_grad:
            outs.append(y)
            if acc is not None:
                gouts.append(acc.tile_grad(grad_out, y.detach(), (r0, r1), (c0, c1)))
            else:
                gouts.append(self.grad_tile(grad_out, r, c))  # staged up when the output lives in host memory
        for b in self.barriers:
            if b.node not in totals:
                continue
            xo = self._owned(env.get(_wide_key(b.node), env[b.source]), b.source, r, c)
            if xo.numel() == 0 or not xo.requires_grad:
                continue
            corr = correction(stats[b.node], totals[b.node], xo.detach())
            outs.append(xo)
            gouts.append(corr)
        return outs, gouts

    # ---- forward -------------------------------------------------------------------------------
    def forward_sweeps(self, x: torch.Tensor, keep_graph: bool) -> tuple[torch.Tensor, Stats, PoolAccumulator | None]:
        """Statistics level by level, then the output sweep. Returns the output (B, C, Ho, Wo), or with a fused
        pool the pooled (B, C) and the accumulator backward needs, and the statistics.

        ``keep_graph``: keep the squeeze-excitation chains' autograd graphs for backward.
        """
        reg = self.regions
        stats: Stats = {}
        for lv in self.levels:
            here = self.at(lv)
            sources = {b.source for b in here}
            moments: dict[int, Moments] = {}
            sums: dict[int, torch.Tensor] = {}  # squeeze-excitation: (B, C, 1, 1) sums over owned positions
            dtypes: dict[int, torch.dtype] = {}  # the pooled map's dtype: its input's
            for r, c in self.tiles():
                t0 = self._tick(r, c, f"statistics sweep {lv}")
                rt, ct = reg.rows[r], reg.cols[c]
                env = self._run_nodes(self.input_region(x, rt, ct), rt, ct, self.sweep_nodes[lv], stats, {}, sources)
                for b in here:
                    part = self._owned(env[b.source], b.source, r, c)
                    if part.numel() == 0:
                        continue
                    if b.kind == BATCHNORM:
                        mom = Moments.of(part)
                        moments[b.node] = moments[b.node].add(mom) if b.node in moments else mom
                    elif b.kind == GRN:  # per-(sample, channel) sums of squares over the owned positions
                        dims = self.specs[b.source].spatial_dims
                        ps = wide(part).square().sum(dim=dims, keepdim=True)
                        sums[b.node] = sums[b.node] + ps if b.node in sums else ps
                    else:
                        ps = wide(part).sum(dim=(2, 3), keepdim=True)
                        dtypes[b.node] = part.dtype
                        sums[b.node] = sums[b.node] + ps if b.node in sums else ps
                del env
                self._tock(t0, r, c, "forward")
            for b in here:
                if b.kind == BATCHNORM:
                    stats[b.node] = finish_batchnorm(self.bn[b.node], moments[b.node])
                elif b.kind == GRN:
                    dims = self.specs[b.source].spatial_dims
                    assert dims is not None
                    stats[b.node] = GRNStat.of(self.grn[b.node], sums[b.node], dims)
                else:
                    stats[b.node] = self.se[b.node].run(sums[b.node], dtypes[b.node], keep_graph)

        def produce(r: int, c: int) -> torch.Tensor:
            rt, ct = reg.rows[r], reg.cols[c]
            return self._run_nodes(self.input_region(x, rt, ct), rt, ct, self.tile_nodes, stats, {}, set())[self.end]

        out, acc = self.join_tiles(produce, x.dtype)
        return out, stats, acc

    # ---- backward ------------------------------------------------------------------------------
    def backward_sweeps(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        stats: Stats,
        need_x: bool,
        autocast: AutocastState,
        acc: PoolAccumulator | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Leaf gradients level by level from the deepest, then parameter and input gradients.

        ``grad_out`` is the gradient of the joined output, or of the pooled value when ``acc`` (fused) is given.
        """
        reg = self.regions
        if acc is not None:
            grad_out = grad_out.reshape(grad_out.shape[0], grad_out.shape[1])  # (B, C)
        totals: Totals = {}
        sources = {b.source for b in self.barriers}
        chain_grads: dict[int, torch.Tensor] = {}  # id(parameter) -> gradient, of squeeze-excitation chains
        for lv in reversed(self.levels):
            here = self.at(lv)
            leaves: Leaves = {b.node: self._leaves(b, stats[b.node]) for b in here}
            flat = [t for b in here for t in leaves[b.node]]
            # sums over tiles in at least float32: bf16 leaves (SE exits under autocast) would round each add
            sums: list[torch.Tensor] = [torch.zeros_like(wide(t)) for t in flat]
            for r, c in self.tiles():
                t0 = self._tick(r, c, f"statistics backward {lv}")
                rt, ct = reg.rows[r], reg.cols[c]
                with torch.enable_grad(), autocast.context():
                    env = self._run_nodes(
                        self.input_region(x, rt, ct).detach(), rt, ct, self.tile_nodes, stats, leaves, sources
                    )
                    outs, gouts = self._outputs(env, r, c, grad_out, stats, totals, acc)
                if outs:
                    res = torch.autograd.grad(outs, flat, gouts, allow_unused=True)
                    for k, g in enumerate(res):
                        if g is not None:
                            sums[k] += g
                    res = g = None  # summed: not held into the next tile's recompute
                del env, outs, gouts
                self._tock(t0, r, c, "backward")
            k = 0
            for b in here:
                n = len(leaves[b.node])
                st = stats[b.node]
                if isinstance(st, SEStat):
                    totals[b.node] = (self.se[b.node].backward(st, sums[k : k + n], chain_grads),)
                elif isinstance(st, GRNStat):
                    totals[b.node] = (st.sq_grad(self.grn[b.node], sums[k]),)
                else:
                    totals[b.node] = tuple(sums[k : k + n])
                k += n
        grad_x, grads = self._final_backward(x, grad_out, stats, totals, need_x, autocast, acc)
        for i, p in enumerate(self.params):
            g = chain_grads.get(id(p))
            if g is not None:
                grads[i] = g if grads[i] is None else grads[i] + g
        return grad_x, grads

    def _leaves(self, b: Barrier, st: BNStat | SEStat | GRNStat) -> list[torch.Tensor]:
        """Fresh leaves for a barrier's fixed values: a backward sweep collects their gradients."""
        if isinstance(st, BNStat):
            return [st.mean.detach().requires_grad_(), st.inv.detach().requires_grad_()]
        if isinstance(st, GRNStat):
            return [st.x_n.detach().requires_grad_()]
        return [wide(st.exits[e].detach()).requires_grad_() for e in b.exits]

    def _final_backward(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        stats: Stats,
        totals: Totals,
        need_x: bool,
        autocast: AutocastState,
        acc: PoolAccumulator | None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        reg = self.regions
        sink = self.hooks.input_grad_sink if self.start == 0 else None
        grad_x = torch.zeros_like(x) if need_x and sink is None else None
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        sources = {b.source for b in self.barriers}
        for r, c in self.tiles():
            t0 = self._tick(r, c, "backward")
            rt, ct = reg.rows[r], reg.cols[c]
            region = self.input_region(x, rt, ct).detach().requires_grad_(need_x)
            with torch.enable_grad(), autocast.context():
                env = self._run_nodes(region, rt, ct, self.tile_nodes, stats, {}, sources)
                outs, gouts = self._outputs(env, r, c, grad_out, stats, totals, acc)  # slices must be in the graph
            targets = ([region] if need_x else []) + self.params
            if outs and targets:
                res = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
                self.add_tile_grads(res, need_x, rt, ct, sink, grad_x, grads)
                del res  # summed: not held into the next tile's recompute
            del env, outs, gouts, region, targets
            self._tock(t0, r, c, "backward")
            if self.hooks.stats is not None:
                self.hooks.stats.stats.recomputed_tiles += 1
        self.stager.drain()  # every input-gradient tile is added into a host grad_x before it is returned
        return grad_x, grads
