"""What a multi-pass segment (``wsitrain.sft.execution.multipass``) costs: the FLOPs of its extra sweeps."""

from __future__ import annotations

import math

from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.barriers import barrier_kind, segment_barriers
from wsitrain.sft.planning.costs import node_flops
from wsitrain.sft.planning.session import PlanSession


def sweep_flops_factor(sess: PlanSession, start: int, end: int) -> float:
    """Extra FLOPs of a segment's barrier sweeps, as a fraction of its one-sweep cost (0 without barriers).

    One-sweep cost: forward, recompute and backward. Each level adds a forward up to its last barrier
    input (every node before it: an upper bound on the ancestors the sweep runs) and a recompute plus
    backward of the whole segment. Memoized per segment in the session (it does not depend on the tile).
    """
    key = (start, end)
    if key not in sess._sweeps:
        sess._sweeps[key] = _sweep_factor(sess.facts, start, end)
    return sess._sweeps[key]


def _sweep_factor(facts: GraphFacts, start: int, end: int) -> float:
    nodes = range(start + 1, end + 1)
    if not any(barrier_kind(facts.nodes[i].spec) for i in nodes):
        return 0.0
    specs = {i: facts.nodes[i].spec for i in nodes}
    inputs = {i: facts.nodes[i].inputs for i in nodes}
    bars = segment_barriers(specs, inputs, start, end)
    fw_upto = [0.0]  # forward FLOPs of (start, i], i = start + k
    bw_all = 0.0
    for i in nodes:
        f, b = node_flops(facts, i, float(math.prod(facts.nodes[i].shape)))
        fw_upto.append(fw_upto[-1] + f)
        bw_all += b
    fw_all = fw_upto[-1]
    extra = 0.0
    for lv in sorted({b.level for b in bars}):
        last_src = max(b.source for b in bars if b.level == lv)
        extra += fw_upto[last_src - start] + fw_all + bw_all
    return extra / max(1.0, 2 * fw_all + bw_all)
