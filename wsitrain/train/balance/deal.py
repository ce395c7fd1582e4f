"""Which slides each rank trains at each optimizer step (``distributed.balance``).

Every step ends in the gradient all_reduce, so a step lasts as long as its slowest rank. ``round_robin`` deals the
epoch's order out (rank r takes every world_size-th slide) and ignores what each slide costs: a rank that draws a
slide ten times the area of its neighbour's sets the pace while the others wait. ``time`` uses each slide's
predicted step cost (``wsitrain.train.balance.cost``) to put slides of similar cost into the same step:

1. The epoch's order (``epoch_order``: seed and epoch) is padded by wrapping around to a whole number of slides per
   rank (``padded_order``), as ``round_robin`` pads it, so coverage is the same: every slide once, the first few
   twice when the count does not divide.
2. Consecutive steps are taken in windows of ``WINDOW_STEPS``. Inside a window the slides are sorted by predicted
   cost (dearest first, ties by their place in the order) and cut into steps of world_size x accumulate slides:
   the dearest slides share a step, the cheapest another.
3. Inside a step each slide, dearest first, goes to the rank with the least predicted work that still has room
   (longest processing time first, with every rank taking ``accumulate`` slides).
4. The window's steps then run in the order of their earliest slide in the epoch's order, and a rank's slides in a
   step run grouped by shape bucket (the preflight's groups, planned together). Sorting by cost already puts slides
   of one bucket into the same steps, as their costs are alike.

Nothing is communicated: every rank computes the same assignment from the same costs, seed and epoch. One process
has no one to wait for and keeps the epoch's order as it is.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from wsitrain.train.data import epoch_order
from wsitrain.train.distributed import padded_order

# Steps sorted together. Larger windows pair slides of closer cost (less waiting) but regroup the epoch's order over a
# longer stretch. Simulated (`python benchmarks/bench_balance.py --simulate`: costs uniform in [1, 4], 4096 slides,
# every slide taking exactly its cost): 2 ranks wait 16.5% of their time with round_robin, and 10.6%, 6.1%, 3.4%, 1.8%
# with windows of 2, 4, 8, 16 steps (4 ranks: 26.4% and 5.2% at 8; accumulate 4: 8.6% and 0.2% at 8). 8 takes most of
# the gain (a fifth of round robin's waiting) while regrouping only 8 steps at a time, so steps still mix slides
# differently each epoch. Measured (docs/benchmarks/bench_balance.md, 2 CPU ranks, 24 slides): 16.6% -> 7.1%.
WINDOW_STEPS = 8


def round_robin(order: Sequence[int], world_size: int) -> list[list[int]]:
    """Each rank's slides: every world_size-th of the padded ``order`` (``distributed.shard``'s rule)."""
    padded = padded_order(order, world_size)
    return [padded[r::world_size] for r in range(world_size)]


def balanced(
    order: Sequence[int],
    costs: Sequence[float],
    world_size: int,
    accumulate: int = 1,
    buckets: Sequence[Hashable] | None = None,
    window_steps: int = WINDOW_STEPS,
) -> list[list[int]]:
    """Each rank's slides, steps of similar predicted cost (see the module's steps 1-4).

    ``costs[i]`` and ``buckets[i]`` belong to slide i (the values ``order`` holds); ``accumulate``: slides per rank
    per optimizer step. Every rank gets the same count as under ``round_robin``, in steps of ``accumulate`` (the last
    step shorter when the count does not divide, as the training loop's last window is).
    """
    if world_size < 1 or accumulate < 1 or window_steps < 1:
        raise ValueError(f"world_size {world_size}, accumulate {accumulate}, window_steps {window_steps}: need >= 1")
    padded = padded_order(order, world_size)
    if world_size == 1:
        return [padded]
    per_rank = len(padded) // world_size
    sizes = [accumulate] * (per_rank // accumulate) + ([per_rank % accumulate] if per_rank % accumulate else [])
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    pos, k = 0, 0
    while k < len(sizes):
        size = sizes[k]
        n_steps = 1
        while n_steps < window_steps and k + n_steps < len(sizes) and sizes[k + n_steps] == size:
            n_steps += 1
        span = n_steps * size * world_size
        steps = _window(list(range(pos, pos + span)), padded, costs, buckets, world_size, size, k)
        for step in steps:
            for r in range(world_size):
                ranks[r].extend(padded[p] for p in step[r])
        pos, k = pos + span, k + n_steps
    return ranks


def _window(
    places: list[int], padded: list[int], costs: Sequence[float], buckets: Sequence[Hashable] | None,
    world_size: int, size: int, first_step: int,
) -> list[list[list[int]]]:
    """The window's steps, each a list of per-rank places (indices into ``padded``), in running order.

    Ties in load go to the ranks in an order that turns with the step (``first_step`` counts the epoch's steps
    before the window): the dearest slide of each step would otherwise always go to rank 0, which also writes the
    run's logs and checkpoints."""
    dearest = sorted(places, key=lambda p: (-float(costs[padded[p]]), p))
    per_step = world_size * size
    steps = []
    for s in range(0, len(dearest), per_step):
        turn = first_step + s // per_step
        load = [0.0] * world_size
        mine: list[list[int]] = [[] for _ in range(world_size)]
        for p in dearest[s : s + per_step]:  # dearest first, to the least-loaded rank with room
            r = min((r for r in range(world_size) if len(mine[r]) < size),
                    key=lambda r: (load[r], (r - turn) % world_size))
            mine[r].append(p)
            load[r] += float(costs[padded[p]])
        steps.append([_by_bucket(sorted(m), padded, buckets) for m in mine])
    return sorted(steps, key=lambda step: min(p for m in step for p in m))


def _by_bucket(places: list[int], padded: list[int], buckets: Sequence[Hashable] | None) -> list[int]:
    """``places`` (in order) regrouped so slides of one bucket run one after another, each bucket where its first
    slide stood."""
    if buckets is None:
        return places
    first: dict[Hashable, int] = {}
    for p in places:
        first.setdefault(buckets[padded[p]], p)
    return sorted(places, key=lambda p: (first[buckets[padded[p]]], p))


def rank_slides(
    mode: str,
    n: int,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    *,
    accumulate: int = 1,
    costs: Sequence[float] | None = None,
    buckets: Sequence[Hashable] | None = None,
) -> list[int]:
    """This rank's training slides (indices) for ``epoch``, in running order: ``mode`` is ``distributed.balance``
    ("time" needs ``costs``, one per slide)."""
    order = epoch_order(n, seed, epoch)
    if mode == "round_robin" or world_size == 1:
        return round_robin(order, world_size)[rank]
    if costs is None or len(costs) != n:
        raise ValueError(f"balance 'time' needs one cost per slide ({n}), got {None if costs is None else len(costs)}")
    return balanced(order, costs, world_size, accumulate, buckets)[rank]


@dataclass(frozen=True)
class Balance:
    """A run's ``distributed.balance``: the mode and what it needs, the same on every rank. ``costs`` and ``buckets``
    (one per training slide) are kept in checkpoints, so a resume deals the same slides as the run it continues."""

    mode: str  # "time" or "round_robin" (one process: "round_robin", which keeps the epoch's order)
    seed: int
    world_size: int
    accumulate: int = 1
    costs: tuple[float, ...] | None = None
    buckets: tuple[Hashable, ...] | None = None

    def rank_slides(self, n: int, epoch: int, rank: int) -> list[int]:
        return rank_slides(self.mode, n, self.seed, epoch, rank, self.world_size, accumulate=self.accumulate,
                           costs=self.costs, buckets=self.buckets)  # fmt: skip

    def state(self) -> dict[str, Any]:
        return {"mode": self.mode, "costs": list(self.costs or ()), "buckets": list(self.buckets or ())}
