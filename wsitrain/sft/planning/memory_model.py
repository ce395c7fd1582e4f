"""Memory model: replay a training step's allocations on shapes and report the peak.

The replay follows what PyTorch really keeps: each operator's output until its last reader, the
tensors autograd saves for backward (conv inputs, ReLU outputs, max-pool indices, ...), storage
shared by in-place operators counted once, and in backward the output-gradient and
input-gradient buffers of the operator being differentiated plus parameter gradients as they
appear. A tiled segment enters the replay as one macro operator that saves only its input (the
checkpoint) and adds one tile's working set while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimOp:
    """One step of the replay."""

    out: int  # value id of the output
    out_bytes: int
    inputs: tuple[int, ...]
    saved: tuple[int, ...] = ()  # value ids autograd keeps for this op's backward
    extra_saved: int = 0  # bytes kept for backward that are no value (max-pool indices)
    alias_of: int | None = None  # output shares storage with this input (in-place, Identity)
    fwd_extra: int = 0  # transient bytes while the op runs forward (a tile's working set)
    bwd_extra: int = 0  # transient bytes while the op runs backward
    requires_grad: bool = True  # does the output require grad
    grad_inputs: tuple[bool, ...] = ()  # per input: does it receive a gradient
    param_grad_bytes: int = 0  # parameter gradients this op's backward creates
    label: str = ""


@dataclass(frozen=True)
class SimResult:
    forward_peak: int
    backward_peak: int
    saved_bytes: int  # what autograd holds at the end of forward (incl. the extra saved bytes)
    peak_label: str  # the op at which the peak happens

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


def simulate(
    ops: list[SimOp],
    initial: dict[int, int],
    fixed: int = 0,
    backward: bool = True,
    keep: tuple[int, ...] = (),
    result_held: bool = False,
    grad_bytes: dict[int, int] | None = None,
) -> SimResult:
    """Replay forward (and backward) and return the peak bytes above zero.

    ``initial``: values alive before the first op (value id -> bytes; 0 for an image on the host).
    ``fixed``: bytes alive throughout (parameters, optimizer state). ``keep``: values never freed
    in forward (the step's output). ``result_held``: the caller holds the last op's output through backward
    (a tile's output is the root of the executor's ``autograd.grad``). ``grad_bytes``: gradient bytes of values
    whose gradient is larger than what they hold (a tile's input is a view of its checkpoint, 0 bytes, but its
    gradient is a new tile-sized buffer).
    """
    gsize = grad_bytes or {}
    root: dict[int, int] = {v: v for v in initial}
    size: dict[int, int] = dict(initial)
    last_use: dict[int, int] = {}
    saved_first: dict[int, int] = {}  # storage -> earliest op saving it (freed after that op's backward)
    for i, op in enumerate(ops):  # in topological order: an op's inputs and saved values have their roots already
        if op.alias_of is None:
            root[op.out] = op.out
            size[op.out] = op.out_bytes
        else:
            root[op.out] = root[op.alias_of]
        for v in op.inputs:
            last_use[root[v]] = i
        if op.requires_grad:
            for v in op.saved:
                saved_first.setdefault(root[v], i)
    n = len(ops)
    for v in keep:
        last_use[root[v]] = n
    for op in ops:  # an output nobody reads stays until the end (it is the result)
        last_use.setdefault(root[op.out], n)

    # a running total of the live bytes: a replay of a tile's segment keeps every saved value live, so summing the
    # live set per op made the replay quadratic in the segment's length (the planner replays tens of thousands)
    live: dict[int, int] = {root[v]: b for v, b in initial.items()}
    live_total = sum(live.values())
    extras = 0
    fpeak, flabel = fixed + live_total, "input"
    for i, op in enumerate(ops):
        r = root[op.out]
        if op.alias_of is None:
            live_total += op.out_bytes - live.get(r, 0)
            live[r] = op.out_bytes
        cur = fixed + live_total + extras + op.fwd_extra
        if cur > fpeak:
            fpeak, flabel = cur, op.label
        if op.requires_grad:
            extras += op.extra_saved
        for v in (*op.inputs, op.out):  # a storage read twice is freed once: it is no longer live the second time
            s = root[v]
            if s in live and last_use.get(s, -1) <= i and s not in saved_first:
                live_total -= live.pop(s)
    saved_bytes = sum(b for s, b in live.items() if s in saved_first) + extras
    if not backward:
        return SimResult(fpeak, 0, saved_bytes, flabel)

    # Backward: what survives forward is saved storages plus the result.
    grads: dict[int, int] = {}
    last = ops[-1]
    if last.requires_grad:
        grads[last.out] = last.out_bytes if last.alias_of is None else size[root[last.out]]
    param_grads = 0
    extras_left = extras
    bpeak, blabel = 0, ""
    freed_at: dict[int, list[int]] = {}
    for st, first in saved_first.items():
        freed_at.setdefault(first, []).append(st)
    grad_total = sum(grads.values())  # live_total carries on from forward: the saved storages and the result
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if op.requires_grad and op.out in grads:
            ins = zip(op.inputs, op.grad_inputs, strict=False)
            new_in = sum(gsize.get(v, size[root[v]]) for v, g in ins if g and v not in grads)
            cur = fixed + param_grads + op.param_grad_bytes + live_total + extras_left + grad_total
            cur += new_in + op.bwd_extra
            if cur > bpeak:
                bpeak, blabel = cur, op.label
            param_grads += op.param_grad_bytes
            gout = grads.pop(op.out)
            grad_total -= gout
            for v, g in zip(op.inputs, op.grad_inputs, strict=False):
                if g and v not in grads:
                    grads[v] = gsize.get(v, size[root[v]]) if op.alias_of is None else gout
                    grad_total += grads[v]
        if op.requires_grad:
            extras_left -= op.extra_saved
        for s in freed_at.get(i, ()):
            if not (result_held and s == root[last.out]):
                live_total -= live.pop(s, 0)
        if root[op.out] not in saved_first and not (result_held and root[op.out] == root[last.out]):
            live_total -= live.pop(root[op.out], 0)
    return SimResult(fpeak, bpeak, saved_bytes, flabel if fpeak >= bpeak else blabel)
