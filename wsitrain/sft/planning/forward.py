"""A tiled segment's forward sweep on tiles of its own, coarser than its recompute's.

The forward sweep of a tiled segment runs without autograd: a tile holds its input region, the few maps alive at
once and its output, not the segment's saved activations. Its working set is several times smaller than the
recompute's at the same edge (ResNet-50 at 100,000 px, float32, tiles of 60 output px (2346 px with halo): 1.0 GiB
forward against 8.6 GiB recompute and backward, planned), so the budget that sets the recompute's tile admits much
larger forward tiles, up to the whole map: there 176 output px (6058 px with halo), whose forward computes 1.10x
a whole map's FLOPs against 1.32x on the recompute's tiles. Larger tiles compute less halo and launch fewer, larger
kernels.

Only where the forward's tiles need not match the recompute's bit for bit: a recomputed tile must reproduce the
forward's values exactly where backward compares them (``amax`` pools find the tied maxima by equality, top-k
pools their k largest); a tile of another shape may round differently (another convolution algorithm). Multi-pass
segments keep one grid: their barrier statistics are summed over the owned parts of that grid's tiles.
"""

from __future__ import annotations

from collections.abc import Callable

from wsitrain.sft.ops.fused_pool import AMAX
from wsitrain.sft.ops.topk_pool import TOPK
from wsitrain.sft.planning.session import PlanSession
from wsitrain.sft.planning.sweeps import sweep_flops_factor

# Fused pools whose backward reads a recomputed tile's values against what forward folded (see the module doc).
_VALUE_MATCHED_POOLS = (AMAX, TOPK)


def forward_may_widen(sess: PlanSession, start: int, end: int) -> bool:
    """May segment (start, end]'s forward sweep run on tiles other than its recompute's?"""
    if sweep_flops_factor(sess, start, end) > 0.0:  # barriers: a multi-pass segment
        return False
    fusion = sess.facts.fusion
    fused = end == sess.facts.trunk_end and fusion is not None
    return not (fused and fusion is not None and fusion.kind in _VALUE_MATCHED_POOLS)


def widest_fitting(edges: list[int], edge: int, fits: Callable[[int], bool]) -> int | None:
    """The largest edge of ``edges`` (largest first) above ``edge`` whose forward sweep ``fits``; None if none.

    A forward tile's memory grows with its edge, but only roughly monotonically (a ragged last tile merged into its
    neighbour): bisect, then look at the next few larger edges as the tile search does.
    """
    wider = [e for e in edges if e > edge]
    lo, hi = -1, len(wider)  # wider[hi] fits (hi == len: none does); wider[lo] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(wider[mid]) else (mid, hi)
    for k in range(hi - 1, max(-1, hi - 5), -1):
        if fits(wider[k]):
            hi = k
    return wider[hi] if hi < len(wider) else None
