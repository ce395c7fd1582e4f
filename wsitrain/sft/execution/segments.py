"""The autograd nodes of tiled and multi-pass segments, and the choice of executor for a tiled segment."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from wsitrain.sft.execution.autocast import AutocastState
from wsitrain.sft.execution.hooks import ExecHooks
from wsitrain.sft.execution.multipass import MultiPassSegment
from wsitrain.sft.execution.one_pass import forward_one_pass
from wsitrain.sft.execution.runner import NodeRunner
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.execution.tiled import TiledSegment
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.barriers import segment_barriers
from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.source import is_source
from wsitrain.sft.trail import at_segment


@contextlib.contextmanager
def abandon_on_error(seg: TiledSegment) -> Iterator[None]:
    """An error inside a segment leaves no copy in flight or prefetched tile behind for the next step."""
    try:
        yield
    except BaseException:
        seg.stager.abandon()
        raise


def _save_input(ctx: Any, x: Any) -> None:
    """Keep the segment input for backward: a tensor through autograd, a region source (sft/source.py) as it is."""
    if is_source(x):
        ctx.source = x  # re-read region by region by the recompute; never a gradient
    else:
        ctx.source = None
        ctx.save_for_backward(x)


def _saved_input(ctx: Any) -> Any:
    return ctx.source if ctx.source is not None else ctx.saved_tensors[0]


class TiledFunction(torch.autograd.Function):
    """Autograd node of one tiled segment: saves only the segment input (the checkpoint)."""

    @staticmethod
    def forward(ctx: Any, seg: TiledSegment, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.seg = seg
        ctx.autocast = AutocastState.capture(seg.device.type)
        _save_input(ctx, x)
        ctx.masks = seg.runner.masks.current  # the recompute replays this step's drop masks
        ctx.folds = seg.runner.folds.current  # and this step's folded weights (execution/folds.py)
        ctx.held = None
        ctx.kept = None
        if seg.head is not None:  # one pass: every tile's backward along the head's direction, now (one_pass.py)
            need_x = isinstance(x, torch.Tensor) and x.requires_grad
            with abandon_on_error(seg):
                out, ctx.pool, ctx.held = forward_one_pass(seg, x, need_x, ctx.autocast)
            return out
        ctx.kept = {} if seg.prefix is not None else None  # this step's frozen prefix per chunk (kept_prefix.py)
        with torch.no_grad(), ctx.autocast.forward_sweep(seg.cast_once), abandon_on_error(seg), seg.keeping(ctx.kept):
            out, ctx.pool = seg.forward_all(x)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        held, ctx.held = ctx.held, None
        if held is not None:
            hooks = ctx.seg.hooks
            done = None if hooks.one_pass_falls_back else held.scaled(ctx.pool.grad_view(grad_out), hooks.on_sync)
            if done is not None:
                return (None, done[0], *done[1])
            del held  # off the head's direction: the sums go before the recompute's own are built
            ctx.seg.count("one_pass_fallbacks")
        x = _saved_input(ctx)
        runner = ctx.seg.runner
        kept, ctx.kept = ctx.kept, None  # read by the recompute, freed with it
        with runner.masks.replaying(ctx.masks), runner.folds.replaying(ctx.folds), abandon_on_error(ctx.seg), \
                ctx.seg.keeping(kept):
            grad_x, grads = ctx.seg.backward_all(x, grad_out, ctx.needs_input_grad[1], ctx.autocast, ctx.pool)
        del kept
        return (None, grad_x, *grads)


def run_segment(seg: TiledSegment, x: torch.Tensor) -> torch.Tensor:
    """Forward one tiled segment, through autograd when gradients are wanted."""
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in seg.params)):
        return TiledFunction.apply(seg, x, *seg.step_params)
    with torch.no_grad(), AutocastState.capture(seg.device.type).forward_sweep(seg.cast_once), abandon_on_error(seg):
        return seg.forward_all(x)[0]


class MultiPassFunction(torch.autograd.Function):
    """Autograd node of a multi-pass segment: saves the segment input, the barriers' statistics and, with a fused
    pool, its accumulator (per (sample, channel): tiny)."""

    @staticmethod
    def forward(ctx: Any, seg: MultiPassSegment, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.seg = seg
        ctx.autocast = AutocastState.capture(seg.device.type)
        ctx.folds = seg.runner.folds.current  # the backward sweeps run with this step's folded weights
        _save_input(ctx, x)
        with torch.no_grad(), ctx.autocast.context(), abandon_on_error(seg):
            out, ctx.stats, ctx.pool = seg.forward_sweeps(x, keep_graph=True)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x = _saved_input(ctx)
        with ctx.seg.runner.folds.replaying(ctx.folds), abandon_on_error(ctx.seg):
            grad_x, grads = ctx.seg.backward_sweeps(
                x, grad_out, ctx.stats, ctx.needs_input_grad[1], ctx.autocast, ctx.pool
            )
        return (None, grad_x, *grads)


def run_tiled(seg: TiledSegment, x: torch.Tensor) -> torch.Tensor:
    """Forward one tiled segment, in sweeps when it holds barriers, through autograd when gradients are wanted."""
    if not isinstance(seg, MultiPassSegment):
        return run_segment(seg, x)
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in seg.params)):
        return MultiPassFunction.apply(seg, x, *seg.step_params)
    with torch.no_grad(), AutocastState.capture(seg.device.type).context(), abandon_on_error(seg):
        return seg.forward_sweeps(x, keep_graph=False)[0]


def tiled_segment(
    facts: GraphFacts,
    seg: SegmentPlan,
    runner: NodeRunner,
    device: torch.device,
    stager: HostStager,
    hooks: ExecHooks,
    reuse: bool = True,
) -> TiledSegment:
    """The executor for a tiled segment of a plan: multi-pass when it holds barriers."""
    at_segment(seg.start, seg.end)
    specs = {i: facts.nodes[i].spec for i in range(seg.start + 1, seg.end + 1)}
    inputs = {i: facts.nodes[i].inputs for i in specs}
    cls = MultiPassSegment if segment_barriers(specs, inputs, seg.start, seg.end) else TiledSegment
    return cls(facts, seg, runner, device, stager, hooks, reuse)
