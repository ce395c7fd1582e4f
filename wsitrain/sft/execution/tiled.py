"""Run a tiled segment of a plan: forward tile by tile, recompute and back-propagate tile by tile.

A tiled segment is one autograd Function. Forward runs the segment's original layers on each tile's
input region under no_grad and joins the output tiles into the next checkpoint; only the segment
input is saved. Backward recomputes each tile with grad, back-propagates exactly its share of the
output gradient, sums parameter gradients over tiles and overlap-adds each tile's input gradient
into the segment's input-gradient buffer. Backward uses the same regions as forward.

The executor reads plans (``SegmentPlan`` with its ``regions``) and frozen facts; it never plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler import record_function

from wsitrain.sft.execution.autocast import AutocastState, TileContext
from wsitrain.sft.execution.fold_slots import any_folded, leaves, segment_slots, values
from wsitrain.sft.execution.hooks import ExecHooks
from wsitrain.sft.execution.kept_prefix import PrefixKeeper, Store
from wsitrain.sft.execution.reuse import (
    BackwardValue,
    Key,
    ReuseCache,
    TileKeys,
    all_zero,
    keep_backward,
    through,
    zero_tiles,
)
from wsitrain.sft.execution.runner import NodeRunner
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.execution.tile_grads import TileGradSums
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.fused_pool import Accumulator, PoolFusion, new_accumulator
from wsitrain.sft.ops.patch_grid import PATCH_PREFIX
from wsitrain.sft.ops.pointwise_conv import PointwiseMatmul
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.ops.space import check_tile_extent, crop, spatial_extent
from wsitrain.sft.ops.types import TILE_CALL, tile_call
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.regions import AxisTile

# Profiler ranges (``torch.profiler``; free when no profiler runs): what benchmarks/gpu_session.py breaks a step into.
JOIN = "sft.join"  # output tiles stored into the next checkpoint or folded into a fused pool
RECOMPUTE = "sft.recompute"  # a tile's forward again, with autograd, in backward
TILE_BACKWARD = "sft.tile_backward"  # autograd through one recomputed tile
OVERLAP_ADD = "sft.overlap_add"  # a tile's input gradient added into the segment's, parameter gradients summed


class TiledSegment(TileGradSums):
    """Executes one tiled segment of a plan; holds its regions and layer list (no tensors)."""

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
        super().__init__(seg, device, stager, hooks)
        self.runner = runner
        self.is_trunk_end = seg.end == facts.trunk_end
        self.fusion: PoolFusion | None = facts.fusion if seg.fused_pool else None
        # the linear head whose gradient direction a one-pass segment back-propagates in forward (one_pass.py)
        self.head = facts.one_pass_head if seg.one_pass else None
        self.nodes = list(range(seg.start + 1, seg.end + 1))
        self.specs = {i: facts.nodes[i].spec for i in [seg.start, *self.nodes]}
        self.inputs = {i: facts.nodes[i].inputs for i in self.nodes}
        # the few nodes a tile runs a stand-in for, looked up once: stand_in() is asked per node per tile
        self._stand_ins = {i for i in self.nodes if TILE_CALL in self.specs[i].extra}
        # 1x1 layers a tile runs as matrix products on unaligned maps (ops/pointwise_conv.py): decided by the tile's
        # own shape, so tiles of one geometry decide alike and background reuse holds
        self._pointwise = {u: PointwiseMatmul(runner.graph.module(u)) for u in seg.pointwise_matmul}
        # activations the plan runs in place: their input is this tile's own fresh map, read by them alone
        self.in_place = frozenset(seg.in_place)
        self._borrowed_for = 0  # add_tile_grads' borrowed sums (tile_grads.py)
        self._borrowed = set()
        self.names = {i: facts.nodes[i].name for i in self.nodes}
        # folded convolutions (ops/fold_bn.py): their folded weight and bias stand for their own and their
        # BatchNorm's parameters; the step's values are looked up per step (execution/fold_slots.py)
        self.slots, uses = segment_slots(runner.graph, runner.folds, self.nodes)
        self._folded = any_folded(self.slots)
        # under autocast a sweep casts each weight once (autocast.py), unless two layers share one
        self.cast_once = uses == len(self.slots)
        self.last_user = {
            i: max((u for u in facts.nodes[i].users if u <= seg.end), default=i) for i in [seg.start, *self.nodes]
        }
        shapes = {v: facts.nodes[v].shape for v in [self.start, *self.nodes]}
        # (H, W) of the feature maps, wherever their layout holds them (GRN may read a channels-last map)
        self.sizes = {v: (spatial_extent(self.specs[v], s, 0), spatial_extent(self.specs[v], s, 1))
                      for v, s in shapes.items() if self.specs[v].spatial_dims is not None}  # fmt: skip
        # background tiles computed once (reuse.py); a resize placed by position computes differently per tile
        self.reuse = reuse and not self._stand_ins
        self.skip_zero = reuse  # tiles with a zero output gradient skip recompute and backward (exact anywhere)
        self._keys = TileKeys(self.start, self.nodes, self.inputs, self.specs, self.sizes)
        # the forward sweep's own tiles' keys (tile_io.sweeping), kept apart so neither sweep recomputes the other's
        self._sweep_keys = TileKeys(self.start, self.nodes, self.inputs, self.specs, self.sizes)
        # a patch trunk's frozen prefix kept from the sweep for the recompute, where the plan says so (kept_prefix.py)
        self.prefix = next((PrefixKeeper(u, runner.graph.module(u), seg.prefix_blocks) for u in self.nodes
                            if seg.kept_prefix and PATCH_PREFIX in self.specs[u].extra), None)  # fmt: skip

    def keeping(self, store: Store | None) -> contextlib.AbstractContextManager[None]:
        """Chunks run in this context keep (sweep) or read (recompute) their frozen prefix in ``store``."""
        return self.prefix.active(store) if self.prefix is not None else contextlib.nullcontext()

    @property
    def params(self) -> list[torch.Tensor]:
        """The tensors a tile's backward differentiates against: the parameters, and this step's folded weights as
        detached leaves (``execution/folds.py``)."""
        return leaves(self.runner.folds, self.slots) if self._folded else list(self.slots)  # type: ignore[arg-type]

    @property
    def step_params(self) -> list[torch.Tensor]:
        """The tensors the segment's autograd node takes as inputs, in ``params``' order: the parameters, and this
        step's folded weights through autograd (their gradients then flow back through the fold)."""
        return values(self.runner.folds, self.slots) if self._folded else list(self.slots)  # type: ignore[arg-type]

    # ---- one tile ------------------------------------------------------------------------------
    def stand_in(self, u: int, rt: AxisTile, ct: AxisTile) -> Callable[..., torch.Tensor] | None:
        """What this tile runs in node ``u``'s place (``OpSpec.extra[TILE_CALL]``, or a 1x1 layer's matrix product
        where the plan allows it), or None for the layer itself; a stand-in placed on the tile reads where the crop of
        the node's first input lies in the map."""
        if self.prefix is not None and u == self.prefix.node:
            v = self.inputs[u][0]
            kept = self.prefix.call((rt.req[(u, v)], ct.req[(u, v)]))  # keyed by the image pixels the chunk reads
            if kept is not None:
                return kept
        if u not in self._stand_ins:
            folded = self.runner.folds.tile_call(u, u in self._pointwise) if self._folded else None
            return folded or self._pointwise.get(u)
        key = (u, self.inputs[u][0]) if self.inputs[u] else (u, u)
        return tile_call(self.specs[u], lambda: (rt.req[key], ct.req[key]))

    def new_accumulator(self) -> Accumulator:
        """The fused pool's accumulator for one forward (attention reads the mask its pool holds now)."""
        assert self.fusion is not None
        reg = self.regions
        pool = self.runner.graph.module(self.fusion.node)
        return new_accumulator(self.fusion, pool, reg.rows_out[-1][1], reg.cols_out[-1][1])

    def tile_key(self, r: int, c: int) -> Key | None:
        """Tile (r, c)'s geometry key (``reuse.TileKeys``), None when it touches a map border."""
        keys = self._keys if self.regions is self.seg.regions else self._sweep_keys
        return keys.key(self.regions, r, c)

    def reuse_cache(self) -> ReuseCache[Any]:
        """A sweep's background-tile cache (off when this segment does not reuse)."""
        return ReuseCache(self.reuse, self.specs[self.start].spatial_dims, self.hooks.on_sync)

    def run_tile(self, region: torch.Tensor, rt: AxisTile, ct: AxisTile) -> torch.Tensor:
        """Run the segment's layers on one tile; returns the tile's exact output. (B, C, th, tw)."""
        env: dict[int, torch.Tensor] = {self.start: region}
        one_pad = self.hooks.copy_free
        for u in self.nodes:

            def fetch(v: int, u: int = u) -> torch.Tensor:
                (rl, rh), (cl, ch) = rt.req[(u, v)], ct.req[(u, v)]
                nr, nc = rt.need[v][0], ct.need[v][0]
                return crop(env[v], self.specs[v].spatial_dims, (rl - nr, rh - nr), (cl - nc, ch - nc), one_pad)

            if u in self.in_place:
                out = self.runner.run(u, env, out_of_place=True, fetch=self.whole(env, u, fetch), in_place=True)
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
            (a, b), (c, d) = rt.need[u], ct.need[u]
            check_tile_extent(out, spec, b - a, d - c, self.names[u])
            env[u] = out
            for v in self.inputs[u]:
                if self.last_user.get(v, u) <= u:
                    env.pop(v, None)
        return env[self.end]

    def whole(self, env: dict[int, torch.Tensor], u: int, fetch: Callable[[int], torch.Tensor]) -> Callable[[int], Any]:
        """``fetch`` for an activation run in place: its input must be the map itself, not a crop (a view)."""

        def get(v: int) -> torch.Tensor:
            x = fetch(v)
            if x is not env[v]:  # the planner's rule (in_place.py) guarantees it; never write into a view
                raise RuntimeError(f"{self.names[u]}: planned in place but its tile input is cropped")
            return x

        return get

    # ---- the whole segment ---------------------------------------------------------------------
    def forward_all(self, x: torch.Tensor) -> tuple[torch.Tensor, Accumulator | None]:
        """Forward tile by tile without keeping activations.

        Joins tiles into the output (B, C, Ho, Wo); with a fused pool, folds them into the pooled value
        instead and also returns the accumulator backward needs.
        """
        with self.sweeping():  # on the forward sweep's own tiles where the plan gives it some
            reg = self.regions
            cache: ReuseCache[torch.Tensor] = self.reuse_cache()

            def produce(r: int, c: int) -> torch.Tensor:
                rt, ct = reg.rows[r], reg.cols[c]
                region = self.input_region(x, rt, ct)
                y, reused = through(
                    cache, self.tile_key(r, c), region, lambda: self.run_tile(region, rt, ct), self.staged(x)
                )
                if reused:
                    self.count("reused_forward")
                return y

            try:
                return self.join_tiles(produce, x.dtype)
            finally:
                cache.clear()

    def join_tiles(
        self, produce: Callable[[int, int], torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, Accumulator | None]:
        """The output sweep (plain and multi-pass segments): tile (r, c)'s output ``produce(r, c)`` is folded into
        the fused pool, or stored into the joined output (B, C, Ho, Wo); the trunk observer sees every tile.

        Returns the joined output, or the pooled value and the accumulator backward needs. ``dtype``: the pooled
        value's when no tile ran.
        """
        reg = self.regions
        observer = self.hooks.trunk_observer if self.is_trunk_end else None
        acc = self.new_accumulator() if self.fusion else None
        out: torch.Tensor | None = None
        for r, c in self.tiles():
            t0 = self._tick(r, c, "forward")
            y = produce(r, c)  # (B, C, th, tw)
            with record_function(JOIN):
                if acc is not None:
                    dtype = y.dtype
                    acc.add(y, reg.rows_out[r], reg.cols_out[c])
                elif out is None and self._whole(y):
                    out = y  # the one tile is the whole output: it is the checkpoint, no join copy
                else:
                    if out is None:
                        out = self.new_output(y)  # in host memory when the next checkpoint lives there
                    self.store_tile(out, y, reg.rows_out[r], reg.cols_out[c])
            if observer is not None:
                observer(y.detach(), reg.rows_out[r], reg.cols_out[c])
            del y  # a tile still being copied down stays allocated until its copy is done (record_stream)
            self._tock(t0, r, c, "forward")
        self.stager.drain()  # the host output is complete before anyone reads it
        if acc is not None:
            assert acc.value is not None
            return acc.result(dtype), acc
        assert out is not None
        return out, None

    def _whole(self, y: torch.Tensor) -> bool:
        """Is the tile ``y`` the whole joined output, a tensor of its own on the device (``ExecHooks.copy_free``)?
        Then it stands for the output as it is. (A view, of the segment's input for one, is still copied.)"""
        reg = self.regions
        return (
            self.hooks.copy_free
            and reg.grid == (1, 1)
            and not self.out_on_host
            and y.device == self.device
            and y._base is None
            and y.is_contiguous()
            and (y.shape[2], y.shape[3]) == (reg.rows_out[-1][1], reg.cols_out[-1][1])
        )

    def backward_all(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        need_x: bool,
        autocast: AutocastState,
        acc: Accumulator | None = None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Recompute and back-propagate tile by tile; returns the input gradient and parameter gradients.

        ``grad_out`` is the gradient of the joined output, or of the pooled value when ``acc`` (fused) is given.
        """
        with autocast.backward_sweep(self.cast_once) as tile_autocast:
            grad_x, grads = self._backward_tiles(x, grad_out, need_x, tile_autocast, acc)
        self.stager.drain()  # every input-gradient tile is added into a host grad_x before it is returned
        return grad_x, grads

    def _backward_tiles(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        need_x: bool,
        tile_autocast: TileContext,
        acc: Accumulator | None,
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """``backward_all``'s sweep; ``tile_autocast()``: the context of a tile's recompute."""
        reg = self.regions
        pooled_grad = acc.grad_view(grad_out) if acc is not None else None  # (B, C); attention (B, K, C)
        sink = self.hooks.input_grad_sink if self.start == 0 else None
        grad_x = self.new_input_grad(x) if need_x and sink is None else None
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        # entry value: (the tile's output, kept only when its gradient share depends on it; autograd's results)
        cache: ReuseCache[BackwardValue] = self.reuse_cache()
        computed = 0
        # tiles with an all-zero output gradient: read once for the whole sweep where the gradient is on the device
        # (one synchronization, not one a tile); a gradient in host memory is checked per staged tile (scanning it
        # on the host before the first tile would leave the GPU idle longer than the per-tile reads do)
        staged_grad = self.out_on_host or grad_out.device != self.device
        together = self.skip_zero and acc is None and not staged_grad
        zero = zero_tiles(grad_out, self.tiles(), reg.rows_out, reg.cols_out, self.hooks.on_sync) if together else set()
        for r, c in self.tiles():
            t0 = self._tick(r, c, "backward")
            rt, ct = reg.rows[r], reg.cols[c]
            (r0, r1), (c0, c1) = reg.rows_out[r], reg.cols_out[c]
            g: torch.Tensor | None = None if acc is not None else self.grad_tile(grad_out, r, c)  # staged from host
            if self.skip_zero and (
                (acc is not None and not acc.holds_gradient((r0, r1), (c0, c1)))
                or (r, c) in zero
                or (g is not None and staged_grad and all_zero(g, self.hooks.on_sync))
            ):
                self.count("skipped_backward")  # a zero output gradient: nothing flows back (max pooling's losers)
                self._tock(t0, r, c, "backward")
                continue
            region = self.input_region(x, rt, ct).detach()
            key = self.tile_key(r, c)
            if self.add_cached(cache, key, region, g, acc, pooled_grad, r, c, need_x, sink, grad_x, grads):
                self._tock(t0, r, c, "backward")
                continue
            region.requires_grad_(need_x)
            with torch.enable_grad(), tile_autocast(), record_function(RECOMPUTE):
                y = self.run_tile(region, rt, ct)
            if acc is not None:
                assert pooled_grad is not None
                g = acc.tile_grad(pooled_grad, y.detach(), (r0, r1), (c0, c1))  # this tile's share of the pool's
            assert g is not None
            targets = ([region] if need_x else []) + self.params
            if y.requires_grad and targets:
                with record_function(TILE_BACKWARD):
                    res = torch.autograd.grad(y, targets, g, allow_unused=True)
                with record_function(OVERLAP_ADD):
                    self.add_tile_grads(res, need_x, rt, ct, sink, grad_x, grads)
                if key is not None and cache.wants(key, region):
                    keep_backward(cache, key, region, g, y, res, acc, self.grad_staged(acc, g), self.staged(x))
                del res  # this tile's gradients are summed: holding them into the next tile's recompute costs a tile
            del y, g, region, targets
            computed += 1
            self._tock(t0, r, c, "backward")
            if self.hooks.stats is not None:
                self.hooks.stats.stats.recomputed_tiles += 1
        cache.clear()
        if computed == 0:  # every tile skipped: plain autograd's gradients would be zeros, not missing
            grads = [torch.zeros_like(p) if p.requires_grad else None for p in self.params]
        return grad_x, grads

    def _tick(self, r: int, c: int, phase: str) -> float:
        if self.hooks.on_tile is not None:
            self.hooks.on_tile(self.seg.index, r, c, phase)
        return self.hooks.stats.tick() if self.hooks.stats is not None else 0.0

    def _tock(self, t0: float, r: int, c: int, phase: str) -> None:
        if self.hooks.stats is not None:
            self.hooks.stats.tock(t0, self.seg.index, r, c, phase)
