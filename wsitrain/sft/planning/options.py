"""Ways to run one segment (plain or tiled with an edge), and the replay of a whole step under a path of them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from wsitrain.sft.ops.registry import SPATIAL_KINDS
from wsitrain.sft.planning.memory_model import SimOp, SimResult, simulate
from wsitrain.sft.planning.session import PlanSession
from wsitrain.sft.planning.sweeps import sweep_flops_factor
from wsitrain.sft.planning.tile_memory import ForwardTile, TileChoice, forward_tile, tile_choice
from wsitrain.sft.trail import at_segment

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
    cost: float  # what the planner minimizes: the time model's FLOP-equivalents (costs.Work.time)
    fused: bool = False  # the global pool after the trunk folds this segment's tiles (its output never exists whole)
    in_host: bool = False  # the input checkpoint (and its gradient buffer) live in pinned host memory
    # the forward sweep's own, larger tiles (forward.py); None: it runs on ``tile``'s
    fwd_tile: ForwardTile | None = None
    # each tile's forward and backward together, in forward (one_pass.py): no forward sweep, no recompute
    one_pass: bool = False

    @property
    def sweep_tile(self) -> ForwardTile | None:
        """The tiles the forward sweep runs on."""
        if self.fwd_tile is not None:
            return self.fwd_tile
        return self.tile.forward if self.tile is not None else None

    def fwd_peak_extra(self, to_host: bool) -> int:
        """The forward sweep's working set above the segment's input and output: one tile, and with a host
        output up to two output tiles in flight down."""
        t = self.sweep_tile
        assert t is not None
        return t.fwd_peak + (2 * t.out_tile_bytes if to_host else 0)


def held_sums(sess: PlanSession, opt: SegOption) -> int:
    """What a one-pass segment (one_pass.py) holds from its forward to its backward: the gradient sums it scales
    then (its input's, when that is on the device and wants one, and its parameters')."""
    grad_in = 0 if opt.in_host else sess.grad_bytes(opt.start)
    return grad_in + sess.param_bytes_between(opt.start, opt.end)


def one_pass_forward_extra(sess: PlanSession, opt: SegOption) -> int:
    """A one-pass segment's forward (one_pass.py) above its input and output: the tile's recompute-and-backward
    working set, the gradient sums it holds, and a background entry's output tile (execution/reuse.py)."""
    assert opt.tile is not None
    return opt.tile.bwd_peak + held_sums(sess, opt) + (opt.tile.out_tile_bytes if sess.reuse_tiles else 0)


def segment_blocker(sess: PlanSession, start: int, end: int) -> int | None:
    """The first node of (start, end] that cannot run on a tile, or None."""
    for i in range(start + 1, end + 1):
        spec = sess.facts.nodes[i].spec
        if not spec.tileable or spec.kind not in SPATIAL_KINDS:
            return i
    return None


def plain_option(sess: PlanSession, start: int, end: int) -> SegOption:
    at_segment(start, end)
    res, flops = sess.plain_sim(start, end)
    # the segment's output is the next segment's input: it is counted there, not in what this one retains
    out_saved = sess.nbytes(end) if sess.saves(start, end, end) else 0
    retained = max(0, res.saved_bytes - out_saved)
    cost = sess.plain_work(start, end).time
    return SegOption(start, end, PLAIN, None, res.forward_peak, res.backward_peak, retained, flops, cost)


def fuses_pool(sess: PlanSession, start: int, end: int) -> bool:
    """A tiled segment ending the trunk folds the global pool when the model has one right after it.

    Multi-pass segments too: their output sweep folds the tiles (``MultiPassSegment.forward_sweeps``).
    """
    return end == sess.facts.trunk_end and sess.facts.fusion is not None


def output_node(sess: PlanSession, start: int, end: int) -> int:
    """The node whose value a tiled segment (start, end] leaves behind (the pool's, when fused)."""
    fusion = sess.facts.fusion
    return fusion.node if fuses_pool(sess, start, end) and fusion is not None else end


def tiled_floor(sess: PlanSession, start: int, end: int, in_host: bool = False) -> int:
    """Local peak of a tiled segment before any tile: no tile size can go below it."""
    in_dev, out = (0 if in_host else sess.device_bytes(start)), output_node(sess, start, end)
    grad_in = 0 if in_host else sess.grad_bytes(start)
    return max(in_dev + sess.nbytes(out), in_dev + sess.grad_bytes(out) + grad_in + sess.grads_after[end + 1])


# A byte moved between host and device costs the target's FLOP rate over its link rate in FLOP-equivalents
# (``TargetDevice.host_byte_flops``: 1117 for a 2080 Ti on PCIe 3.0, 812 for an A100 on PCIe 4.0): copies
# overlap compute on a side stream only as far as the compute lasts, so the planner counts them whole.


# The planner weighs host placement only for checkpoints at least this share of the budget: smaller ones
# free too little to change a plan, and every candidate doubles the search (ResNet-50 at 8192 px planned in
# 26 s with all cuts as candidates, about 5 s with this filter).
HOST_MIN_SHARE = 1 / 16


def host_placement_allowed(sess: PlanSession, start: int, budget: float) -> bool:
    """May the checkpoint at ``start`` live in host memory? Not the image (it has its own placement)."""
    if start == 0 or sess.host_checkpoints == "never":
        return False
    if sess.host_checkpoints == "always":
        return True
    return sess.device.startswith("cuda") and sess.nbytes(start) >= HOST_MIN_SHARE * budget


def tiled_option(
    sess: PlanSession, start: int, end: int, edge: int, in_host: bool = False, fwd_edge: int | None = None
) -> SegOption:
    """Tile (start, end] with ``edge``; with ``in_host`` its input checkpoint and that checkpoint's gradient
    buffer live in host memory (tiles are staged in, gradient tiles added back on the host). ``fwd_edge``: the
    forward sweep's own edge (forward.py; a segment ``forward_may_widen`` allows), else it runs on ``edge``'s.
    Memoized in the session: the search asks again for every state that reaches ``start``."""
    key = ("option", start, end, edge, in_host, fwd_edge)
    memo = sess._tiles.get(key)
    if isinstance(memo, SegOption):
        return memo
    t = tile_choice(sess, start, end, edge, staged=in_host)
    tf = forward_tile(sess, start, end, fwd_edge, staged=in_host) if fwd_edge not in (None, edge) else None
    in_dev, out = (0 if in_host else sess.device_bytes(start)), output_node(sess, start, end)
    grad_in = 0 if in_host else sess.grad_bytes(start)
    seg_param_grads = sess.param_bytes_between(start, end)
    local_fwd = in_dev + sess.nbytes(out) + (tf or t).fwd_peak
    local_bwd = in_dev + sess.grad_bytes(out) + grad_in + t.bwd_peak + seg_param_grads
    moved = 5 * sess.nbytes(start) if in_host else 0  # out and grad down, tiles up twice, grad tiles up
    sweeps = 1.0 + sweep_flops_factor(sess, start, end)  # barriers add sweeps over the tiles
    flops, time = t.flops, t.time
    if tf is not None:  # the forward sweep on its own tiles instead of the recompute's
        flops += tf.sweep_alone.flops - t.sweep.flops
        time += tf.sweep_alone.time - t.sweep.time
    cost = sweeps * time + sess.target.host_byte_flops * moved
    fused = fuses_pool(sess, start, end)
    opt = SegOption(start, end, TILED, t, local_fwd, local_bwd, in_dev, sweeps * flops, cost, fused, in_host, tf)
    sess._tiles[key] = opt
    return opt


def path_ops(sess: PlanSession, path: tuple[SegOption, ...]) -> list[SimOp]:
    """The replay of a whole step under a path: plain nodes as themselves, tiled segments as macro ops."""
    f = sess.facts
    ops: list[SimOp] = []
    for k, opt in enumerate(path):
        to_host = k + 1 < len(path) and path[k + 1].in_host  # written tile by tile into host memory
        if opt.mode == PLAIN:
            ops.extend(sess.sim_op(i, sess.nbytes(i)) for i in range(opt.start + 1, opt.end + 1))
            continue
        assert opt.tile is not None
        out = output_node(sess, opt.start, opt.end) if opt.fused else opt.end
        held = held_sums(sess, opt) if opt.one_pass else 0
        ops.append(
            SimOp(
                out=out,
                out_bytes=0 if to_host else sess.nbytes(out),
                inputs=(opt.start,),
                saved=(opt.start,),
                # a host output: up to two output tiles in flight down (forward), and in backward the gradient
                # tile in use and the next one being uploaded
                # one pass (one_pass.py): the tile's backward working set in forward, and the gradient sums held
                # from there into backward. Its backward only scales them; off the head's direction it frees them
                # and recomputes, building the input and parameter gradients the replay counts anew (so the
                # working set above them is the tile's less the sums)
                extra_saved=held,
                fwd_extra=one_pass_forward_extra(sess, opt) if opt.one_pass else opt.fwd_peak_extra(to_host),
                bwd_extra=max(0, opt.tile.bwd_peak - held) if opt.one_pass
                else opt.tile.bwd_peak + (2 * opt.tile.out_tile_bytes if to_host else 0),
                requires_grad=f.nodes[opt.end].requires_grad,
                grad_inputs=(f.nodes[opt.start].requires_grad,),
                param_grad_bytes=sess.param_bytes_between(opt.start, opt.end),
                label=f"segment {f.name(opt.start + 1)}..{f.name(opt.end)}",
            )
        )
    ops.extend(sess.head_ops(bool(path) and path[-1].fused))
    return ops


def replay_path(sess: PlanSession, path: tuple[SegOption, ...]) -> SimResult:
    """The step's replay: forward and backward along the path, then the optimizer step (gradients, temporaries)."""
    res = simulate(path_ops(sess, path), {0: sess.device_bytes(0)}, fixed=sess.terms.fixed)
    step = sess.terms.fixed + sess.terms.step
    if step > res.backward_peak and step > res.forward_peak:
        return replace(res, backward_peak=step, peak_label="optimizer step")
    return res
