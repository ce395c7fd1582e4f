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

from wsitrain.sft.planning.conv_limit import edges_within_limit, plain_breaks_limit
from wsitrain.sft.planning.forward import forward_may_widen, widest_fitting
from wsitrain.sft.planning.one_pass import may_run_one_pass, one_pass_option
from wsitrain.sft.planning.options import (
    TILED,
    SegOption,
    host_placement_allowed,
    plain_option,
    replay_path,
    segment_blocker,
    tiled_floor,
    tiled_option,
)
from wsitrain.sft.planning.session import PlanSession
from wsitrain.sft.planning.tile_memory import edge_candidates, tile_geometry
from wsitrain.units import round_up_printed

# States kept per cut point after pruning dominated ones: more never changed a plan of the
# built-in models (vgg16, resnet50, darknet19 from 1024 to 100000 px) and costs planning time.
_MAX_STATES = 6
# A plan that computes more than this above plain training (four times plain's work) is not offered as
# fitting: at that cost the honest answer is a coarser resolution or more memory. Forced tile sizes
# (engine.tile_size) are exempt. Multi-pass nets at tight budgets come close: RegNetY-800MF at 240 x 272 px
# within 45% of plain's activation memory plans at +274%.
MAX_EXTRA_COMPUTE = 3.0
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
            # convolutions above 2^31 elements per sample where the target's cuDNN cannot run them (conv_limit.py)
            plain = plain_option(sess, a, b) if forced_tile is None and not plain_breaks_limit(sess, a, b) else None
            edges = edge_candidates(sess, b, forced_tile) if can_tile(a, b) else []
            edges = edges if forced_tile is not None else edges_within_limit(sess, a, b, edges)
            if objective.smallest_edge_only and edges:
                # the smallest tile still worth running (not smaller than its halo), and not below a floor
                ok = [e for e in edges if e * sess.image_stride(b) >= _MIN_TILE_IMAGE_PX] or edges[-1:]
                if forced_tile is None:  # from the smallest up: the first tile not smaller than its halo
                    ok = [next((e for e in reversed(ok) if tile_geometry(sess, a, b, e).worth_running), ok[0])]
                edges = ok[-1:]
            for st in here:
                # the checkpoint at a may live on the host when the segment before wrote it tile by tile
                prev_tiled = bool(st.path) and st.path[-1].mode == TILED
                placements = [False]
                if prev_tiled and edges and host_placement_allowed(sess, a, budget):
                    placements = [True] if sess.host_checkpoints == "always" else [False, True]
                for in_host in placements:
                    opts = _options(sess, st, a, b, None if in_host else plain, edges, budget, objective,
                                    forced_tile is None, in_host)  # fmt: skip
                    for opt, peak in opts:
                        states.setdefault(b, []).append(
                            State(st.cost + opt.cost, st.retained + opt.retained_add, peak, (*st.path, opt))
                        )
    head_peak = {fused: sess.head_sim(fused)[0].peak for fused in (False, True)}
    finals = []
    for st in states.get(cands[-1], []):
        peak = max(st.peak, fixed + st.retained + head_peak[bool(st.path) and st.path[-1].fused])
        if objective.within_budget and peak > budget:
            continue
        finals.append(State(st.cost, st.retained, peak, st.path))
    return min(finals, key=objective.final_key, default=None)


def _options(
    sess: PlanSession,
    st: State,
    a: int,
    b: int,
    plain: SegOption | None,
    edges: list[int],
    budget: float,
    objective: Objective,
    judge_worth: bool = True,
    in_host: bool = False,
) -> list[tuple[SegOption, int]]:
    """Ways to run segment (a, b] after state ``st`` with the peak each reaches: the best under the objective,
    and (within a budget) the next few smaller tiles, whose lower peaks may let later segments use larger ones.
    Tiles smaller than their halo are not offered unless forced (``judge_worth`` False: engine.tile_size).
    """
    fixed = sess.terms.fixed

    def peak_of(opt: SegOption) -> int:
        fwd = fixed + st.retained + opt.local_fwd
        bwd = fixed + st.retained + sess.grads_after[b + 1] + opt.local_bwd
        return max(st.peak, fwd, bwd)

    found: list[tuple[SegOption, int]] = []
    if plain is not None and (not objective.within_budget or peak_of(plain) <= budget):
        found.append((plain, peak_of(plain)))
    if edges and (not objective.within_budget or fixed + st.retained + tiled_floor(sess, a, b, in_host) <= budget):
        if not objective.within_budget:
            opt = tiled_option(sess, a, b, edges[0], in_host)
            found.append((opt, peak_of(opt)))
        else:
            # larger tiles cost less (less halo, fewer launches). A tile's memory grows with its edge, so
            # bisect for the largest edge that fits rather than trying each one.
            def fits(k: int) -> bool:
                return peak_of(tiled_option(sess, a, b, edges[k], in_host)) <= budget

            def worth(k: int) -> bool:
                return tile_geometry(sess, a, b, edges[k]).worth_running

            w_lo, w_hi = -1, len(edges)  # worth(k) holds for a prefix (larger tiles): find its end
            while judge_worth and w_hi - w_lo > 1:
                mid = (w_lo + w_hi) // 2
                w_lo, w_hi = (mid, w_hi) if worth(mid) else (w_lo, mid)
            edges = edges[:w_hi]

            lo, hi = -1, len(edges)  # edges[hi] fits (hi == len: none does); edges[lo] does not (-1: none tried)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid, hi)
            # memory is monotone in the edge only roughly (a ragged last tile merged into its neighbour can
            # make a smaller edge's largest tile bigger): also look at the next few larger edges
            for k in range(hi - 1, max(-1, hi - 5), -1):
                if fits(k):
                    hi = k
            widen = forward_may_widen(sess, a, b)
            to_host = b < sess.facts.trunk_end and host_placement_allowed(sess, b, budget)

            def down(o: SegOption) -> int:
                """The forward's output tiles in flight to the next checkpoint, where that may live on the host."""
                return o.fwd_peak_extra(True) - o.fwd_peak_extra(False) if to_host else 0

            one_pass = may_run_one_pass(sess, a, b)
            for k in (hi, hi + 2):
                if k < len(edges):
                    opt = tiled_option(sess, a, b, edges[k], in_host)
                    if peak_of(opt) <= budget:
                        single = one_pass_option(sess, opt) if one_pass else None
                        if widen:
                            opt = _widened(sess, opt, edges, in_host, lambda o: peak_of(o) + down(o) <= budget)
                        if single is not None and single.cost < opt.cost and peak_of(single) <= budget:
                            opt = single
                        found.append((opt, peak_of(opt)))
    if not found:
        return []
    best = min(found, key=lambda op: objective.option_key(op[1], op[0]))
    if not objective.within_budget:
        return [best]
    # keep the best, and any option with a lower peak (the Pareto front in cost and peak)
    return [best] + [op for op in found if op is not best and op[1] < best[1]]


def _widened(
    sess: PlanSession, opt: SegOption, edges: list[int], in_host: bool, fits: Callable[[SegOption], bool]
) -> SegOption:
    """``opt`` with its forward sweep on the largest tiles that fit (forward.py), when that costs less."""
    assert opt.tile is not None
    edge = opt.tile.edge

    def option(e: int) -> SegOption:
        return tiled_option(sess, opt.start, opt.end, edge, in_host, fwd_edge=e)

    best = widest_fitting(edges, edge, lambda e: fits(option(e)))
    if best is None:
        return opt
    wide = option(best)
    return wide if wide.cost < opt.cost else opt


def prune(states: list[State], objective: Objective) -> list[State]:
    """Keep states not dominated in (cost, retained, peak), best first under the objective."""
    out: list[State] = []
    for s in sorted(states, key=objective.state_key):
        if any(o.cost <= s.cost and o.retained <= s.retained and o.peak <= s.peak for o in out):
            continue
        out.append(s)
    kept = out[:_MAX_STATES]
    # the front's extremes always survive: the state retaining least (and the one peaking lowest) may be the
    # only one whose later segments still fit, though cheaper states crowd it out of the first few
    for extreme in (
        min(out, key=lambda s: (s.retained, s.peak), default=None),
        min(out, key=lambda s: s.peak, default=None),
    ):
        if extreme is not None and extreme not in kept:
            kept.append(extreme)
    return kept


def fitting_plan(
    sess: PlanSession, budget: float, tile_size: int | None = None, forced_cuts: list[int] | None = None
) -> State | None:
    """The cheapest plan whose replayed peak fits ``budget`` (with slack and headroom), or None.

    Whether it is worth running is ``worth_running(sess, state, tile_size)``'s question."""
    limit = sess.terms.effective_budget(budget)
    if tile_size is None and forced_cuts is None and not plain_breaks_limit(sess, 0, sess.facts.trunk_end):
        # plain PyTorch when it fits: one plain segment has no recompute and no tiles, so it is the cheapest
        # plan there is, and the search need not look at every segmentation of a large graph
        plain = plain_option(sess, 0, sess.facts.trunk_end)
        path = (plain,)
        peak = replay_path(sess, path).peak
        if peak <= limit:
            return State(plain.cost, plain.retained_add, peak, path)
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


def worth_running(sess: PlanSession, state: State, tile_size: int | None) -> bool:
    """At most ``MAX_EXTRA_COMPUTE`` above plain training (a forced ``engine.tile_size`` is the user's call)."""
    return tile_size is not None or extra_compute(sess, state) <= MAX_EXTRA_COMPUTE


def extra_compute(sess: PlanSession, state: State) -> float:
    """FLOPs of the plan over plain training's, minus one (0.4 = +40%)."""
    fused = bool(state.path) and state.path[-1].fused
    plain = sess.plain_sim(0, sess.facts.trunk_end)[1] + sess.head_sim()[1]
    return (state.flops + sess.head_sim(fused)[1]) / plain - 1.0 if plain else 0.0


def plain_time(sess: PlanSession) -> float:
    """Plain training's step in the time model (FLOP-equivalents)."""
    return (sess.plain_work(0, sess.facts.trunk_end) + sess.head_work()).time


def plan_time(sess: PlanSession, state: State) -> float:
    """The plan's step in the time model: its segments' costs and the head after them."""
    fused = bool(state.path) and state.path[-1].fused
    return state.cost + sess.head_work(fused).time


def smallest_plan(sess: PlanSession, tile_size: int | None, forced_cuts: list[int] | None) -> State | None:
    return search(sess, math.inf, SMALLEST_PEAK, tile_size, forced_cuts)


def fits_budget(sess: PlanSession, budget: float, tile_size: int | None, forced_cuts: list[int] | None) -> bool:
    """Would ``build_plan`` call a plan within ``budget`` fitting: one fits the memory and is worth running."""
    state = fitting_plan(sess, budget, tile_size, forced_cuts)
    return state is not None and worth_running(sess, state, tile_size)


# The least-budget search when the closed form falls short (below): at most this many doublings of the activation
# allowance to find a budget that fits, then at most this many bisection steps, each one planning call (0.05 s to
# 1 s on the built-in models), stopping once the bracket is within LEAST_BUDGET_TOLERANCE of the answer: close
# enough that a budget a few percent below it does not fit where the search is monotone in the budget.
_LEAST_BUDGET_DOUBLINGS = 16
_LEAST_BUDGET_BISECTIONS = 12
LEAST_BUDGET_TOLERANCE = 0.005


def least_budget(
    sess: PlanSession, smallest: State, tile_size: int | None, forced_cuts: list[int] | None, short: int = 0
) -> tuple[int, bool]:
    """The least budget, as printed (``round_up_printed``), at which this step plans as fitting; and whether it is
    that (False: none up to the returned budget fits, which then is a budget known too small).

    Called only on the paths that do not fit. ``smallest``: the smallest-peak plan; ``short``: a budget known not
    to fit. First the closed form: the budget whose effective budget (``MemoryTerms.effective_budget``, the fit
    condition: headroom and allocator slack on what lies above the fixed part) admits the smallest plan's replayed
    peak; no smaller budget admits that plan. It is checked by planning there, since the cheapest search at that
    budget must find a plan that fits and is worth running: the smallest plan's tiles may be too small to be worth
    it (more than MAX_EXTRA_COMPUTE), and then the least budget with a plan worth running is searched for.
    """
    first = round_up_printed(sess.terms.budget_for(replay_path(sess, smallest.path).peak))
    lo: int
    hi: int | None
    if fits_budget(sess, first, tile_size, forced_cuts):
        # Smaller tiles than the smallest-peak search tries can still be worth running where their forward sweep
        # runs on larger tiles (forward.py: less extra compute): then a budget below ``first`` fits too.
        below = round_up_printed(int(first * (1.0 - 2 * LEAST_BUDGET_TOLERANCE)))
        if below >= first or short >= below or not fits_budget(sess, below, tile_size, forced_cuts):
            return first, True
        lo, hi = max(short, sess.terms.fixed), below
    else:
        lo, hi = max(first, short), None  # lo does not fit; hi fits
        step = max(1, lo - sess.terms.fixed)
        for _ in range(_LEAST_BUDGET_DOUBLINGS):
            budget = round_up_printed(lo + step)
            if fits_budget(sess, budget, tile_size, forced_cuts):
                hi = budget
                break
            lo, step = budget, 2 * step
        if hi is None:
            return lo, False
    for _ in range(_LEAST_BUDGET_BISECTIONS):
        if hi - lo <= LEAST_BUDGET_TOLERANCE * hi:
            break
        mid = round_up_printed((lo + hi) // 2)
        if mid >= hi:
            break
        lo, hi = (lo, mid) if fits_budget(sess, mid, tile_size, forced_cuts) else (mid, hi)
    return hi, True
