"""What plain PyTorch and ``torch.utils.checkpoint.checkpoint_sequential`` would need, for comparison in plans."""

from __future__ import annotations

from wsitrain.sft.planning.memory_model import SimOp, simulate
from wsitrain.sft.planning.options import plain_option, replay_path
from wsitrain.sft.planning.session import PlanSession


def baseline_peak(sess: PlanSession) -> int:
    """Plain PyTorch: every activation kept (the paper's PyTorch-Base)."""
    path = (plain_option(sess, 0, sess.facts.trunk_end),)
    return sess.terms.scale_peak(replay_path(sess, path).peak)


def checkpoint_sequential_peak(sess: PlanSession) -> tuple[int, int]:
    """Best ``checkpoint_sequential`` over the chain of blocks between cuts: (peak, number of segments).

    Like PyTorch, the last segment runs without checkpointing.
    """
    f = sess.facts
    cuts = f.cuts
    n_blocks = len(cuts) - 1
    best = (baseline_peak(sess), 1)
    for s in range(2, max(2, n_blocks) + 1):
        size = max(1, n_blocks // s)
        bounds = sorted({*(cuts[min(k * size, n_blocks)] for k in range(s)), cuts[-1]})
        ops: list[SimOp] = []
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if k == len(bounds) - 2:
                ops.extend(sess.sim_op(i, sess.nbytes(i)) for i in range(a + 1, b + 1))
                continue
            res, _ = sess.plain_sim(a, b)
            fwd_only = simulate(
                [sess.sim_op(i, sess.nbytes(i), grad=False) for i in range(a + 1, b + 1)], {a: 0}, backward=False
            )
            ops.append(
                SimOp(
                    out=b,
                    out_bytes=sess.nbytes(b),
                    inputs=(a,),
                    saved=(a,),
                    fwd_extra=fwd_only.forward_peak,
                    bwd_extra=res.peak,
                    requires_grad=f.nodes[b].requires_grad,
                    grad_inputs=(f.nodes[a].requires_grad,),
                    label=f"ckpt {k}",
                )
            )
        ops.extend(sess.head_ops())
        peak = sess.terms.scale_peak(simulate(ops, {0: sess.device_bytes(0)}, fixed=sess.terms.fixed).peak)
        if peak < best[0]:
            best = (peak, s)
    return best
