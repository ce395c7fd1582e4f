"""One pass through the last tiled segment: each tile's forward and backward together, in forward.

The plan says where (``SegmentPlan.one_pass``, planning/one_pass.py): the segment ends the trunk in a fused
global mean, and the linear head after it gives the pooled gradient a direction ``u`` known in forward
(ops/linear_head.py). Forward runs each tile once with autograd, folds its output into the pool, and
back-propagates the tile's share of ``u`` at once, summing parameter gradients and overlap-adding the input
gradient. Backward receives the pooled gradient, finds its multiple ``a`` of ``u`` and scales the sums by it:
by linearity of backward that is the gradient plain autograd gives, up to rounding (float64 tests:
tests/test_sft_one_pass.py). A pooled gradient off the direction (another loss on two logits, a dropout in the head)
drops the sums and runs the segment's usual recompute, so a gradient is never wrong, only slower.

``u`` is scaled by a power of two near the map's positions before its share is spread over them, so a half-precision
tile's gradients sit where the format resolves them (a mean over 10^7 positions would put each share near 10^-9,
below float16's smallest); dividing the sums by it again is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from wsitrain.sft.execution.autocast import AutocastState
from wsitrain.sft.execution.reuse import ReuseCache, has_content
from wsitrain.sft.execution.tiled import JOIN, OVERLAP_ADD, TILE_BACKWARD, TiledSegment
from wsitrain.sft.ops.fused_pool import Accumulator
from wsitrain.sft.ops.linear_head import RESIDUAL_SHARE, coefficient, head_direction, residual_share
from wsitrain.sft.ops.masked_pool import AVG

# a cached background tile: its output (B, C, th, tw) and autograd's results for its share (none off the mask)
OnePassValue = tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]


@dataclass
class HeldSums:
    """What a one-pass forward leaves for backward: the gradient sums along ``direction`` times ``scale``."""

    direction: torch.Tensor  # (C,) the pooled gradient's direction, before ``scale``
    scale: float  # a power of two
    grad_x: torch.Tensor | None  # the segment input's gradient sum (None: the input wants none)
    grads: list[torch.Tensor | None]  # per parameter of the segment (None: no tile reached it)
    tolerance: float = RESIDUAL_SHARE  # the share off the direction still taken as on it (linear_head.residual_share)

    def scaled(
        self, pooled_grad: torch.Tensor, on_sync: Callable[[str], None] | None = None
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]] | None:
        """The sums scaled to the gradient of ``pooled_grad`` (1, C), in place; None when it is off the direction
        (then the caller recomputes). ``on_sync``: told of the one host read of a device value this costs a step."""
        a, left = coefficient(pooled_grad, self.direction)
        sums = [t for t in [self.grad_x, *self.grads] if t is not None]
        if on_sync is not None and left.device.type != "cpu":
            on_sync("one pass's coefficient")
        if not has_content(left):  # the simulated or the meta device: nothing to read; the same launches as a GPU's
            _scale_all(sums, 1.0 / self.scale)
            return self.grad_x, self.grads
        share, k = torch.stack([left, a]).tolist()  # one read of the device for both
        if not share <= self.tolerance:
            return None
        _scale_all(sums, k / self.scale)
        return self.grad_x, self.grads


def _scale_all(tensors: list[torch.Tensor], k: float) -> None:
    """Multiply in place: one multi-tensor launch per device (an input-gradient sum may live in host memory). A
    Python float is cast to each tensor's dtype as a 0-d tensor of that dtype would be."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for group in by_device.values():
        torch._foreach_mul_(group, k)


def forward_one_pass(
    seg: TiledSegment, x: torch.Tensor, need_x: bool, autocast: AutocastState
) -> tuple[torch.Tensor, Accumulator, HeldSums]:
    """Forward and backward of every tile along the head's direction; returns the pooled value (B, C), its
    accumulator and the sums backward scales."""
    assert seg.fusion is not None and seg.fusion.kind == AVG and seg.head is not None
    reg = seg.regions
    acc = seg.new_accumulator()
    head = seg.runner.graph.module(seg.head)
    assert head is not None
    direction = head_direction(head.weight)  # (C,)
    # the share of each position is (u * scale) / positions: scale ~ positions keeps it near u's own size
    scale = 2.0 ** round(math.log2(max(1, acc.h * acc.w)))
    pooled_grad = (direction * scale).reshape(1, -1)  # (1, C)
    grad_x = seg.new_input_grad(x) if need_x else None
    grads: list[torch.Tensor | None] = [None] * len(seg.params)
    observer = seg.hooks.trunk_observer if seg.is_trunk_end else None
    dtype = x.dtype
    # a background tile's output, its gradient share and autograd's results, computed once (reuse.py): a later flat
    # tile with the same key, an equal region and an equal share adds them at its own turn, bitwise the same step
    cache: ReuseCache[OnePassValue] = seg.reuse_cache()
    with autocast.backward_sweep(seg.cast_once) as tile_autocast:
        for r, c in seg.tiles():
            t0 = seg._tick(r, c, "forward")
            rt, ct = reg.rows[r], reg.cols[c]
            rows, cols = reg.rows_out[r], reg.cols_out[c]
            region = seg.input_region(x, rt, ct).detach()
            key = seg.tile_key(r, c)
            grad_on = acc.holds_gradient(rows, cols)  # a tile wholly off the pool's mask only adds its zeros
            hit = cache.find(key, region)
            g: torch.Tensor | None = None
            if hit is not None:
                g = acc.tile_grad(pooled_grad, hit.value[0], rows, cols) if grad_on else None
                if not cache.same_grad(hit, g):
                    hit = None
            if hit is not None:
                y, res = hit.value
                seg.count("reused_forward")
            else:
                region.requires_grad_(need_x and grad_on)
                with torch.set_grad_enabled(grad_on), tile_autocast():
                    y = seg.run_tile(region, rt, ct)  # (B, C, th, tw)
                res = None
            with record_function(JOIN):
                dtype = y.dtype
                acc.add(y.detach(), rows, cols)
            if observer is not None:
                observer(y.detach(), rows, cols)
            targets = ([region] if need_x else []) + seg.params
            if res is None and grad_on and y.requires_grad and targets:
                g = acc.tile_grad(pooled_grad, y.detach(), rows, cols)
                with record_function(TILE_BACKWARD):
                    res = torch.autograd.grad(y, targets, g, allow_unused=True)
                if key is not None and cache.wants(key, region):
                    # owned copies: autograd may reuse a returned tensor's memory for later tiles (add_tile_grads)
                    owned = tuple(t.clone() if t is not None else None for t in res)
                    cache.keep(key, region, g, (y.detach(), owned), seg.staged(x))
            elif res is None and key is not None and cache.wants(key, region):
                cache.keep(key, region, None, (y.detach(), ()), seg.staged(x))
            if res:
                with record_function(OVERLAP_ADD):
                    seg.add_tile_grads(res, need_x, rt, ct, None, grad_x, grads)
            del y, g, res, region, targets
            seg._tock(t0, r, c, "forward")
    cache.clear()
    seg.stager.drain()  # every input-gradient tile is added into a host grad_x before it is scaled
    if not any(g is not None for g in grads):  # no tile held gradient: plain autograd's would be zeros
        grads = [torch.zeros_like(p) if p.requires_grad else None for p in seg.params]
    # the dtype the head multiplies in: autocast's where it is on, else its weight's
    head_dtype = autocast.dtype if autocast.enabled else head.weight.dtype
    return acc.result(dtype), acc, HeldSums(direction, scale, grad_x, grads, residual_share(head_dtype))
