"""One tile of a multi-pass segment: barriers applied with fixed statistics, owned parts, what a tile adds.

The sweeps that drive these (and the method behind them) are in ``multipass.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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
    wide,
)
from wsitrain.sft.execution.hooks import ExecHooks
from wsitrain.sft.execution.owned_regions import multipass_regions, owned_interval
from wsitrain.sft.execution.reuse import Key
from wsitrain.sft.execution.runner import NodeRunner
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.execution.tiled import TiledSegment
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.barriers import BATCHNORM, GRN, SQUEEZE, Barrier, ancestors_in, segment_barriers
from wsitrain.sft.ops.fused_pool import Accumulator
from wsitrain.sft.ops.grn import grn_apply
from wsitrain.sft.ops.norm_act import act_after_norm
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.ops.space import crop
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.regions import AxisTile


def _wide_key(bn: int) -> int:
    """Where a tile's environment keeps a BatchNorm's widened input (node indices are never negative)."""
    return -1 - bn


class MultiPassTiles(TiledSegment):
    """A tiled segment with barriers: its setup and what one tile computes; ``MultiPassSegment`` sweeps the tiles."""

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
        self.se = {b.node: SqueezeChain(runner, b, shapes) for b in self.barriers if b.kind == SQUEEZE}
        self._in_dtype: dict[int, torch.dtype] = {}  # a barrier input's dtype, as a statistics sweep found it

    def tile_key(self, r: int, c: int) -> Key | None:
        """The geometry key with the parts of barrier inputs the tile owns (its statistics and corrections)."""
        reg, extra = self.regions, []
        for b in self.barriers:
            v = b.source
            h, w = self.sizes[v]
            r0, r1 = owned_interval(reg.rows_out[r], self.sizes[self.end][0], h)
            c0, c1 = owned_interval(reg.cols_out[c], self.sizes[self.end][1], w)
            nr, nc = reg.rows[r].need[v][0], reg.cols[c].need[v][0]
            extra.append((r0 - nr, r1 - nr, c0 - nc, c1 - nc))
        return self._keys.key(reg, r, c, tuple(extra))

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
        one_pad = self.hooks.copy_free
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
                return crop(env[v], self.specs[v].spatial_dims, (rl - nr, rh - nr), (cl - nc, ch - nc), one_pad)

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
                if one_pad:  # a crop: its gradient goes back as one pad, not two slice_backward buffers
                    out = crop(out, (2, 3), (a - g0r, b - g0r), (c - g0c, d - g0c))
                else:
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
        acc: Accumulator | None,
        g: torch.Tensor | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What a tile back-propagates: its output with its share of grad_out (of the pooled gradient (B, C) with
        a fused pool; without, ``g``, fetched before the tile ran), and owned barrier inputs with the statistic's
        part of their gradient (for the barriers in ``totals``)."""
        reg = self.regions
        (r0, r1), (c0, c1) = reg.rows_out[r], reg.cols_out[c]
        outs, gouts = [], []
        y = env[self.end]
        if y.requires_grad:
            outs.append(y)
            if acc is not None:
                gouts.append(acc.tile_grad(grad_out, y.detach(), (r0, r1), (c0, c1)))
            else:
                assert g is not None, "the output-gradient tile is fetched before the tile runs"
                gouts.append(g)
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

    def _stat_parts(
        self, env: dict[int, torch.Tensor], here: list[Barrier], r: int, c: int
    ) -> dict[int, Moments | torch.Tensor]:
        """What tile (r, c) adds to each barrier's statistic: BatchNorm's moments, GRN's per-(sample, channel) sums
        of squares, squeeze-excitation's sums (B, C, 1, 1), over the positions it owns (none: no entry)."""
        parts: dict[int, Moments | torch.Tensor] = {}
        for b in here:
            part = self._owned(env[b.source], b.source, r, c)
            self._in_dtype[b.node] = part.dtype
            if part.numel() == 0:
                continue
            if b.kind == BATCHNORM:
                parts[b.node] = Moments.of(part)
            elif b.kind == GRN:
                parts[b.node] = wide(part).square().sum(dim=self.specs[b.source].spatial_dims, keepdim=True)
            else:
                parts[b.node] = wide(part).sum(dim=(2, 3), keepdim=True)
        return parts
