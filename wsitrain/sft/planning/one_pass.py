"""The last tiled segment in one pass: each tile's forward and backward together (execution/one_pass.py).

A tiled segment normally costs a forward sweep, then in backward a recompute of every tile with autograd and its
backward. When it ends the trunk in a fused global mean followed by a linear head whose pooled gradient has a
direction known in forward (ops/linear_head.py: one output, or two under a softmax loss), the segment runs each
tile once with autograd in forward and back-propagates it along that direction at once; backward only scales the
sums. No forward sweep and no recompute: at 100,000 px on the 2080 Ti preset, where the whole trunk is one tiled
segment, ResNet-50's planned extra compute falls from +69% to +32% (scripts: ``wsitrain plan``, planned).

Memory: the tile's recompute-and-backward working set is reached in forward instead of backward, and the
segment's parameter-gradient sums (and its input gradient, when the input wants one) are held from forward until
backward scales them.
"""

from __future__ import annotations

from dataclasses import replace

from wsitrain.sft.planning.forward import forward_may_widen
from wsitrain.sft.planning.options import SegOption, fuses_pool, held_sums, one_pass_forward_extra, output_node
from wsitrain.sft.planning.session import PlanSession


def may_run_one_pass(sess: PlanSession, start: int, end: int) -> bool:
    """May tiled segment (start, end] run in one pass? It must end the trunk in a fused mean whose linear head
    gives the pooled gradient's direction (``GraphFacts.one_pass_head``), without barriers (multi-pass)."""
    return (
        sess.one_pass
        and sess.facts.one_pass_head is not None
        # an image that wants its gradient may hand it to a sink tile by tile (SFT.input_gradient_sink): a share
        # of the direction's sums is not yet that gradient
        and not (start == 0 and sess.facts.nodes[0].requires_grad)
        and fuses_pool(sess, start, end)
        and forward_may_widen(sess, start, end)
    )


def one_pass_option(sess: PlanSession, opt: SegOption) -> SegOption:
    """The tiled option ``opt`` (on its recompute's tiles) run in one pass: without its forward sweep's work, with
    the tile's backward working set and the gradient sums in forward."""
    t = opt.tile
    assert t is not None and opt.fwd_tile is None, "one pass replaces a forward sweep on the recompute's tiles"
    # the segment's input and pooled output, and the forward's working set above them. Backward keeps the usual
    # segment's working set: a pooled gradient off the head's direction frees the sums and recomputes.
    out = output_node(sess, opt.start, opt.end)
    return replace(
        opt,
        local_fwd=opt.retained_add + sess.nbytes(out) + one_pass_forward_extra(sess, opt),
        retained_add=opt.retained_add + held_sums(sess, opt),
        flops=opt.flops - t.sweep.flops,
        cost=opt.cost - t.sweep.time,
        one_pass=True,
    )
