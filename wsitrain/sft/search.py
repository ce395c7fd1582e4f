"""The search: a dynamic program over cut points, choosing per segment plain or tiled and a tile edge.

Listing 3 of the SFT paper (segments between checkpoints, only at cut points) and Listing 4 (tile
sizes propagated backwards through a segment) made into one search whose objective is an argument:
``CHEAPEST`` (fewest FLOPs among plans within the budget) or ``SMALLEST_PEAK`` (the least memory,
budget ignored, for "how much would it need").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from wsitrain.sft.options import SegOption, plain_option, replay_path, segment_blocker, tiled_floor, tiled_option
from wsitrain.sft.session import PlanSession
from wsitrain.sft.tile_memory import edge_candidates

# States kept per cut point after pruning dominated ones: more never changed a plan of the
# built-in models (vgg16, resnet50, darknet19 from 1024 to 100000 px) and costs planning time.
_MAX_STATES = 6
# The smallest-peak objective uses the smallest tile whose image footprint is at least this many
# pixels: smaller tiles save nothing measurable and multiply launches.
_MIN_TILE_IMAGE_PX = 64


@dataclass(frozen=True)
class State:
    cost: float
    retained: int
    peak: int
    path: tuple[SegOption, ...]

    @property
    def flops(self) -> float:
        return sum(o.flops for o in self.path)


@dataclass(frozen=True)
class Objective:
    """What the search minimizes, and whether plans must fit the budget."""

    name: str
    within_budget: bool
    option_key: Callable[[int, SegOption], float]  # (peak so far, option) -> key; the least wins
    state_key: Callable[[State], tuple[float, ...]]  # ordering of states while pruning, least first
    final_key: Callable[[State], tuple[float, ...]]  # ordering of complete plans, least first
    smallest_edge_only: bool  # try one small tile edge instead of the largest edge that fits


CHEAPEST = Objective(
    "cheapest",
    within_budget=True,
    option_key=lambda peak, opt: opt.cost,
    state_key=lambda s: (s.cost, s.retained, s.peak),
    final_key=lambda s: (s.cost, s.peak),
    smallest_edge_only=False,
)
SMALLEST_PEAK = Objective(
    "smallest peak",
    within_budget=False,
    option_key=lambda peak, opt: peak,
    state_key=lambda s: (s.peak, s.retained, s.cost),
    final_key=lambda s: (s.peak, s.cost),
    smallest_edge_only=True,
)


def search(
    sess: PlanSession,
    budget: float,
    objective: Objective,
    forced_tile: int | None = None,
    forced_cuts: list[int] | None = None,
    tileable: Callable[[int, int], bool] | None = None,
) -> State | None:
    """The best segmentation under ``objective`` whose every local peak fits ``budget`` (when it must).

    ``tileable(a, b)`` says whether segment (a, b] may be tiled (default: every operator in it can).
    """
    can_tile = tileable or (lambda a, b: segment_blocker(sess, a, b) is None)
    fixed = sess.terms.fixed
    cands = forced_cuts if forced_cuts is not None else list(sess.facts.candidates)
    states: dict[int, list[State]] = {cands[0]: [State(0.0, 0, fixed + sess.device_bytes(0), ())]}
    for ai, a in enumerate(cands[:-1]):
        here = prune(states.get(a, []), objective)
        if not here:
            continue
        for b in cands[ai + 1 : ai + 2] if forced_cuts is not None else cands[ai + 1 :]:
            plain = plain_option(sess, a, b) if forced_tile is None else None
            edges = edge_candidates(sess, b, forced_tile) if can_tile(a, b) else []
            if objective.smallest_edge_only and edges:
                edges = ([e for e in edges if e * sess.image_stride(b) >= _MIN_TILE_IMAGE_PX] or edges)[-1:]
            for st in here:
                best = _best_option(sess, st, a, b, plain, edges, budget, objective)
                if best is not None:
                    opt, peak = best
                    states.setdefault(b, []).append(
                        State(st.cost + opt.cost, st.retained + opt.retained_add, peak, (*st.path, opt))
                    )
    head_peak = sess.head_sim()[0].peak
    finals = []
    for st in states.get(cands[-1], []):
        peak = max(st.peak, fixed + st.retained + head_peak)
        if objective.within_budget and peak > budget:
            continue
        finals.append(State(st.cost, st.retained, peak, st.path))
    return min(finals, key=objective.final_key, default=None)


def _best_option(
    sess: PlanSession,
    st: State,
    a: int,
    b: int,
    plain: SegOption | None,
    edges: list[int],
    budget: float,
    objective: Objective,
) -> tuple[SegOption, int] | None:
    """The best way to run segment (a, b] after state ``st``, with the peak it reaches."""
    fixed = sess.terms.fixed
    best: tuple[float, SegOption, int] | None = None

    def consider(opt: SegOption) -> bool:
        nonlocal best
        fwd = fixed + st.retained + opt.local_fwd
        bwd = fixed + st.retained + sess.grads_after[b + 1] + opt.local_bwd
        peak = max(st.peak, fwd, bwd)
        if objective.within_budget and peak > budget:
            return False
        key = objective.option_key(peak, opt)
        if best is None or key < best[0]:
            best = (key, opt, peak)
        return True

    if plain is not None:
        consider(plain)
    if edges and (not objective.within_budget or fixed + st.retained + tiled_floor(sess, a, b) <= budget):
        for e in edges:  # larger tiles cost less (less halo, fewer launches): take the largest that fits
            if consider(tiled_option(sess, a, b, e)):
                break
    return None if best is None else (best[1], best[2])


def prune(states: list[State], objective: Objective) -> list[State]:
    """Keep states not dominated in (cost, retained, peak), best first under the objective."""
    out: list[State] = []
    for s in sorted(states, key=objective.state_key):
        if any(o.cost <= s.cost and o.retained <= s.retained and o.peak <= s.peak for o in out):
            continue
        out.append(s)
    return out[:_MAX_STATES]


def fitting_plan(
    sess: PlanSession, budget: float, tile_size: int | None = None, forced_cuts: list[int] | None = None
) -> State | None:
    """The cheapest plan whose replayed peak fits ``budget`` (with slack and headroom), or None."""
    limit = sess.terms.effective_budget(budget)
    target = limit
    for _ in range(4):  # the search's local peaks approximate the replay; tighten until the replay fits
        state = search(sess, target, CHEAPEST, tile_size, forced_cuts)
        if state is None:
            return None
        peak = replay_path(sess, state.path).peak
        if peak <= limit:
            return state
        target -= (peak - limit) + 1
    return None


def smallest_plan(sess: PlanSession, tile_size: int | None, forced_cuts: list[int] | None) -> State | None:
    return search(sess, math.inf, SMALLEST_PEAK, tile_size, forced_cuts)
