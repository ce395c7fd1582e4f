"""The planner's shortcuts give what the long way gives: the memory replay's running total of live bytes against the
replay's definition, a forward sweep's tiles without the backward replay, and the session's memo of tiled options."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import wsitrain.sft.planning.tile_memory as tile_memory
from wsitrain.models import build
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.planning.memory_model import SimOp, simulate
from wsitrain.sft.planning.options import tiled_option
from wsitrain.sft.planning.planner import new_session
from wsitrain.sft.planning.tile_memory import edge_candidates, forward_tile, tile_choice


def random_ops(rng: random.Random, n: int) -> tuple[list[SimOp], dict[int, int], tuple[int, ...]]:
    """A step of ``n`` operators in topological order: one or two inputs each (skips included), some in place,
    some saving their input or output for backward, extra saved bytes (indices), transient bytes."""
    initial = {0: rng.choice([0, rng.randrange(1, 500)])}
    ops = []
    for i in range(1, n + 1):
        ins = tuple(sorted({rng.randrange(0, i) for _ in range(rng.choice([1, 1, 2]))}))
        inplace = rng.random() < 0.2
        saved = tuple(v for v in (*ins, i) if rng.random() < 0.4)
        ops.append(SimOp(
            out=i, out_bytes=0 if inplace else rng.randrange(1, 1000), inputs=ins, saved=saved,
            extra_saved=rng.choice([0, 0, rng.randrange(1, 100)]), alias_of=ins[0] if inplace else None,
            fwd_extra=rng.choice([0, rng.randrange(1, 300)]), requires_grad=rng.random() < 0.8,
            grad_inputs=tuple(rng.random() < 0.8 for _ in ins), label=f"op{i}",
        ))  # fmt: skip
    keep = (n,) if rng.random() < 0.5 else ()
    return ops, initial, keep


def replay_by_definition(ops: list[SimOp], initial: dict[int, int], fixed: int, keep: tuple[int, ...]
                         ) -> tuple[int, str, int]:  # fmt: skip
    """Forward peak, its label and the bytes saved for backward, from what "live" means at each operator, summed
    from scratch there: a storage exists from its producer on and is gone after its last reader, unless autograd
    saved it, it is kept, or nobody reads it (the result)."""
    n = len(ops)
    root = {v: v for v in initial}
    size, born = dict(initial), dict.fromkeys(initial, -1)
    for i, op in enumerate(ops):
        root[op.out] = op.out if op.alias_of is None else root[op.alias_of]
        if op.alias_of is None:
            size[op.out], born[op.out] = op.out_bytes, i
    saved = {root[v] for op in ops if op.requires_grad for v in op.saved}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.inputs:
            last[root[v]] = i
    last.update({root[v]: n for v in keep})
    for op in ops:
        last.setdefault(root[op.out], n)
    gone_after = {s: k for s, k in last.items() if s not in saved and k < n}

    def live(i: int) -> int:
        return sum(b for s, b in size.items() if born[s] <= i and gone_after.get(s, n) >= i)

    peak, label, extras = fixed + live(-1), "input", 0
    for i, op in enumerate(ops):
        cur = fixed + live(i) + extras + op.fwd_extra
        if cur > peak:
            peak, label = cur, op.label
        if op.requires_grad:
            extras += op.extra_saved
    return peak, label, sum(size[s] for s in saved) + extras


@pytest.mark.parametrize("seed", range(40))
def test_replay_running_total_matches_the_definition(seed: int) -> None:
    rng = random.Random(seed)
    ops, initial, keep = random_ops(rng, rng.randrange(1, 60))
    fixed = rng.randrange(0, 50)
    fwd = simulate(ops, initial, fixed=fixed, keep=keep, backward=False)
    assert (fwd.forward_peak, fwd.peak_label, fwd.saved_bytes) == replay_by_definition(ops, initial, fixed, keep)
    assert simulate(ops, initial, fixed=fixed, keep=keep).forward_peak == fwd.forward_peak


def _session(name: str, size: int):  # noqa: ANN202 - a planning session (internal type)
    with torch.device("meta"):
        model: nn.Module = build(name, 2)
    return new_session(ModelGraph(model), (1, 3, size, size), torch.float32, torch.uint8, "cuda", True)


def test_forward_tiles_skip_the_backward_replay_and_agree_with_the_full_choice(monkeypatch) -> None:  # noqa: ANN001
    replays: list[bool] = []
    real = tile_memory.simulate

    def counting(ops, initial, **kw):  # noqa: ANN001, ANN202
        replays.append(bool(kw.get("result_held")))
        return real(ops, initial, **kw)

    monkeypatch.setattr(tile_memory, "simulate", counting)
    sess, fresh = _session("resnet18", 2048), _session("resnet18", 2048)
    cands = list(sess.facts.candidates)
    cases = [(cands[0], cands[2]), (cands[1], cands[4]), (cands[3], sess.facts.trunk_end)]
    for start, end in cases:
        for edge in edge_candidates(sess, end, None)[:3]:
            before = len(replays)
            fwd = forward_tile(sess, start, end, edge)
            assert replays[before:] == [False]  # the forward replay alone
            full = tile_choice(sess, start, end, edge)
            assert replays[before + 1:] == [True]  # then only the backward replay
            assert forward_tile(sess, start, end, edge) == fwd and len(replays) == before + 2  # both memoized
            assert full.forward == fwd
            assert full == tile_choice(fresh, start, end, edge)  # as a session that never asked for the forward


def test_tiled_options_are_memoized_per_session() -> None:
    sess, fresh = _session("resnet18", 2048), _session("resnet18", 2048)
    start, end = list(sess.facts.candidates)[1], sess.facts.trunk_end
    edges = edge_candidates(sess, end, None)
    for fwd_edge in (None, edges[0]):
        opt = tiled_option(sess, start, end, edges[2], fwd_edge=fwd_edge)
        assert tiled_option(sess, start, end, edges[2], fwd_edge=fwd_edge) is opt
        assert opt == tiled_option(fresh, start, end, edges[2], fwd_edge=fwd_edge)
    assert tiled_option(sess, start, end, edges[2], fwd_edge=edges[0]).fwd_tile == forward_tile(
        sess, start, end, edges[0])  # fmt: skip
