"""Ways to run one segment (plain or tiled with an edge), and the replay of a whole step under a path of them."""

from __future__ import annotations

from dataclasses import dataclass

from wsitrain.sft.memory_model import SimOp, SimResult, simulate
from wsitrain.sft.ops import SPATIAL_KINDS
from wsitrain.sft.session import PlanSession
from wsitrain.sft.sweep_plan import sweep_flops_factor
from wsitrain.sft.tile_memory import TileChoice, tile_choice

PLAIN = "plain"
TILED = "tiled"


@dataclass(frozen=True)
class SegOption:
    start: int
    end: int
    mode: str  # PLAIN | TILED
    tile: TileChoice | None
    local_fwd: int  # peak above what earlier segments retain, in forward
    local_bwd: int  # the same in backward (parameter gradients of later segments excluded)
    retained_add: int  # bytes this segment keeps for backward
    flops: float
    cost: float  # what the planner minimizes: FLOPs plus launch overhead


def segment_blocker(sess: PlanSession, start: int, end: int) -> int | None:
    """The first node of (start, end] that cannot run on a tile, or None."""
    for i in range(start + 1, end + 1):
        spec = sess.facts.nodes[i].spec
        if not spec.tileable or spec.kind not in SPATIAL_KINDS:
            return i
    return None


def plain_option(sess: PlanSession, start: int, end: int) -> SegOption:
    res, flops = sess.plain_sim(start, end)
    # the segment's output is the next segment's input: it is counted there, not in what this one retains
    out_saved = sess.nbytes(end) if sess.saves(start, end, end) else 0
    retained = max(0, res.saved_bytes - out_saved)
    return SegOption(start, end, PLAIN, None, res.forward_peak, res.backward_peak, retained, flops, flops)


def tiled_floor(sess: PlanSession, start: int, end: int) -> int:
    """Local peak of a tiled segment before any tile: no tile size can go below it."""
    in_dev = sess.device_bytes(start)
    return max(
        in_dev + sess.nbytes(end),
        in_dev + sess.grad_bytes(end) + sess.grad_bytes(start) + sess.grads_after[end + 1],
    )


def tiled_option(sess: PlanSession, start: int, end: int, edge: int) -> SegOption:
    t = tile_choice(sess, start, end, edge)
    sweeps = 1.0 + sweep_flops_factor(sess, start, end)  # barriers add sweeps over the tiles
    in_dev = sess.device_bytes(start)
    seg_param_grads = sum(sess.facts.nodes[i].param_bytes for i in range(start + 1, end + 1))
    local_fwd = in_dev + sess.nbytes(end) + t.fwd_peak
    local_bwd = in_dev + sess.grad_bytes(end) + sess.grad_bytes(start) + t.bwd_peak + seg_param_grads
    return SegOption(
        start, end, TILED, t, local_fwd, local_bwd, in_dev, sweeps * t.flops, sweeps * (t.flops + t.overhead)
    )


def path_ops(sess: PlanSession, path: tuple[SegOption, ...]) -> list[SimOp]:
    """The replay of a whole step under a path: plain nodes as themselves, tiled segments as macro ops."""
    f = sess.facts
    ops: list[SimOp] = []
    for opt in path:
        if opt.mode == PLAIN:
            ops.extend(sess.sim_op(i, sess.nbytes(i)) for i in range(opt.start + 1, opt.end + 1))
            continue
        assert opt.tile is not None
        ops.append(
            SimOp(
                out=opt.end,
                out_bytes=sess.nbytes(opt.end),
                inputs=(opt.start,),
                saved=(opt.start,),
                fwd_extra=opt.tile.fwd_peak,
                bwd_extra=opt.tile.bwd_peak,
                requires_grad=f.nodes[opt.end].requires_grad,
                grad_inputs=(f.nodes[opt.start].requires_grad,),
                param_grad_bytes=sum(f.nodes[i].param_bytes for i in range(opt.start + 1, opt.end + 1)),
                label=f"segment {f.name(opt.start + 1)}..{f.name(opt.end)}",
            )
        )
    ops.extend(sess.head_ops())
    return ops


def replay_path(sess: PlanSession, path: tuple[SegOption, ...]) -> SimResult:
    return simulate(path_ops(sess, path), {0: sess.device_bytes(0)}, fixed=sess.terms.fixed)
