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
segment does: the output sweep adds each tile to a pool accumulator (fused_pool.py) instead of joining a map, and
every backward sweep gives each recomputed tile its share of the pooled gradient (``acc.tile_grad``).

The statistics computed in forward are kept for backward (per channel: tiny); nothing else is.
Under autocast, statistics and leaf gradients are summed in float32, and BatchNorm's correction
joins its explicit gradient on a float32 copy of the layer's input, as BatchNorm's own backward
combines them in float32: in bf16 the two nearly cancel.
"""

from __future__ import annotations

import torch

from wsitrain.sft.execution.autocast import AutocastState
from wsitrain.sft.execution.barrier_stats import (
    BNStat,
    GRNStat,
    Leaves,
    Moments,
    SEStat,
    Stats,
    Totals,
    finish_batchnorm,
    wide,
)
from wsitrain.sft.execution.multipass_tile import MultiPassTiles
from wsitrain.sft.execution.reuse import BackwardValue, ReuseCache, backward_hit, keep_backward, through
from wsitrain.sft.ops.barriers import BATCHNORM, GRN, Barrier
from wsitrain.sft.ops.fused_pool import Accumulator


class MultiPassSegment(MultiPassTiles):
    """A tiled segment with barriers: forward and backward in sweeps over the tiles (see the module doc)."""

    # ---- forward -------------------------------------------------------------------------------
    def forward_sweeps(self, x: torch.Tensor, keep_graph: bool) -> tuple[torch.Tensor, Stats, Accumulator | None]:
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
            cache: ReuseCache[dict[int, Moments | torch.Tensor]] = self.reuse_cache()
            for r, c in self.tiles():
                t0 = self._tick(r, c, f"statistics sweep {lv}")
                rt, ct = reg.rows[r], reg.cols[c]
                region = self.input_region(x, rt, ct)
                key = self.tile_key(r, c)
                hit = cache.find(key, region)
                if hit is not None:
                    parts = hit.value
                    self.count("reused_forward")
                else:
                    parts = self._stat_parts(self._run_nodes(region, rt, ct, self.sweep_nodes[lv], stats, {}, sources),
                                             here, r, c)  # fmt: skip
                    if key is not None and cache.wants(key, region):
                        cache.keep(key, region, None, parts, self.staged(x))
                for b in here:
                    part = parts.get(b.node)
                    if isinstance(part, Moments):
                        moments[b.node] = moments[b.node].add(part) if b.node in moments else part
                    elif part is not None:
                        dtypes[b.node] = self._in_dtype[b.node]
                        sums[b.node] = sums[b.node] + part if b.node in sums else part
                del parts
                self._tock(t0, r, c, "forward")
            cache.clear()
            for b in here:
                if b.kind == BATCHNORM:
                    stats[b.node] = finish_batchnorm(self.bn[b.node], moments[b.node])
                elif b.kind == GRN:
                    dims = self.specs[b.source].spatial_dims
                    assert dims is not None
                    stats[b.node] = GRNStat.of(self.grn[b.node], sums[b.node], dims)
                else:
                    stats[b.node] = self.se[b.node].run(sums[b.node], dtypes[b.node], keep_graph)

        cache: ReuseCache[torch.Tensor] = self.reuse_cache()

        def produce(r: int, c: int) -> torch.Tensor:
            rt, ct = reg.rows[r], reg.cols[c]
            region = self.input_region(x, rt, ct)
            y, reused = through(cache, self.tile_key(r, c), region,
                                lambda: self._run_nodes(region, rt, ct, self.tile_nodes, stats, {}, set())[self.end],
                                self.staged(x))  # fmt: skip
            if reused:
                self.count("reused_forward")
            return y

        try:
            out, acc = self.join_tiles(produce, x.dtype)
        finally:
            cache.clear()
        return out, stats, acc

    # ---- backward ------------------------------------------------------------------------------
    def backward_sweeps(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        stats: Stats,
        need_x: bool,
        autocast: AutocastState,
        acc: Accumulator | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Leaf gradients level by level from the deepest, then parameter and input gradients.

        ``grad_out`` is the gradient of the joined output, or of the pooled value when ``acc`` (fused) is given.
        """
        reg = self.regions
        if acc is not None:
            grad_out = acc.grad_view(grad_out)  # (B, C); attention (B, K, C)
        totals: Totals = {}
        sources = {b.source for b in self.barriers}
        chain_grads: dict[int, torch.Tensor] = {}  # id(parameter) -> gradient, of squeeze-excitation chains
        for lv in reversed(self.levels):
            here = self.at(lv)
            leaves: Leaves = {b.node: self._leaves(b, stats[b.node]) for b in here}
            flat = [t for b in here for t in leaves[b.node]]
            # sums over tiles in at least float32: bf16 leaves (SE exits under autocast) would round each add
            sums: list[torch.Tensor] = [torch.zeros_like(wide(t)) for t in flat]
            cache: ReuseCache[BackwardValue] = self.reuse_cache()
            for r, c in self.tiles():
                t0 = self._tick(r, c, f"statistics backward {lv}")
                rt, ct = reg.rows[r], reg.cols[c]
                g = None if acc is not None else self.grad_tile(grad_out, r, c)  # staged when the output is on host
                region = self.input_region(x, rt, ct).detach()
                key = self.tile_key(r, c)
                hit = backward_hit(cache, key, region, g, acc, grad_out, reg.rows_out[r], reg.cols_out[c])
                if hit is not None:
                    res: tuple[torch.Tensor | None, ...] = hit.value[1]
                    self.count("reused_backward")
                else:
                    with torch.enable_grad(), autocast.context():
                        env = self._run_nodes(region, rt, ct, self.tile_nodes, stats, leaves, sources)
                        outs, gouts = self._outputs(env, r, c, grad_out, stats, totals, acc, g)
                    res = torch.autograd.grad(outs, flat, gouts, allow_unused=True) if outs else ()
                    if key is not None and cache.wants(key, region):
                        y_out = env[self.end] if env[self.end].requires_grad else None
                        gy = gouts[0] if y_out is not None else None
                        keep_backward(cache, key, region, gy, y_out, res, acc, self.grad_staged(acc, g), self.staged(x))
                    del env, outs, gouts
                for k, gk in enumerate(res):
                    if gk is not None:
                        sums[k] += gk
                res = ()  # summed: not held into the next tile's recompute
                del g, region
                self._tock(t0, r, c, "backward")
            cache.clear()
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
        acc: Accumulator | None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        reg = self.regions
        sink = self.hooks.input_grad_sink if self.start == 0 else None
        grad_x = self.new_input_grad(x) if need_x and sink is None else None
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        sources = {b.source for b in self.barriers}
        cache: ReuseCache[BackwardValue] = self.reuse_cache()
        for r, c in self.tiles():
            t0 = self._tick(r, c, "backward")
            rt, ct = reg.rows[r], reg.cols[c]
            g = None if acc is not None else self.grad_tile(grad_out, r, c)  # staged when the output is on host
            region = self.input_region(x, rt, ct).detach()
            key = self.tile_key(r, c)
            if self.add_cached(cache, key, region, g, acc, grad_out, r, c, need_x, sink, grad_x, grads):
                self._tock(t0, r, c, "backward")
                continue
            region.requires_grad_(need_x)
            with torch.enable_grad(), autocast.context():
                env = self._run_nodes(region, rt, ct, self.tile_nodes, stats, {}, sources)
                outs, gouts = self._outputs(env, r, c, grad_out, stats, totals, acc, g)  # slices must be in the graph
            targets = ([region] if need_x else []) + self.params
            if outs and targets:
                res = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
                self.add_tile_grads(res, need_x, rt, ct, sink, grad_x, grads)
                if key is not None and cache.wants(key, region):
                    y_out = env[self.end] if env[self.end].requires_grad else None
                    gy = gouts[0] if y_out is not None else None
                    keep_backward(cache, key, region, gy, y_out, res, acc, self.grad_staged(acc, g), self.staged(x))
                del res  # summed: not held into the next tile's recompute
            del env, outs, gouts, region, targets, g
            self._tock(t0, r, c, "backward")
            if self.hooks.stats is not None:
                self.hooks.stats.stats.recomputed_tiles += 1
        cache.clear()
        self.stager.drain()  # every input-gradient tile is added into a host grad_x before it is returned
        return grad_x, grads
