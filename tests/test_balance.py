"""distributed.balance: which slides each rank trains per step, and the waiting share it is judged by."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from script_module import load_script
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.train.balance.deal import Balance, balanced, rank_slides, round_robin
from wsitrain.train.balance.waiting import WaitTally
from wsitrain.train.data import epoch_order
from wsitrain.train.distributed import DistInfo, shard


def _skewed_costs(n: int, seed: int = 0) -> list[float]:
    """Areas that vary 4x (uniform in [1, 4]), as tissue-cropped slides of one cohort do."""
    return np.random.default_rng(seed).uniform(1.0, 4.0, n).tolist()


def _steps(ranks: list[list[int]], accumulate: int) -> list[list[list[int]]]:
    """Per step, each rank's slides (the loop's windows: ``accumulate`` slides, the last one shorter)."""
    per_rank = len(ranks[0])
    return [[r[s : s + accumulate] for r in ranks] for s in range(0, per_rank, accumulate)]


def _wait_share(ranks: list[list[int]], costs: list[float], accumulate: int) -> float:
    """The waiting share (wsitrain.train.balance.waiting) if every slide took exactly its cost."""
    per_step = torch.tensor([[sum(costs[i] for i in mine) for mine in step] for step in _steps(ranks, accumulate)])
    tally = WaitTally(len(ranks))
    tally.add(per_step.T.double())
    assert tally.share is not None
    return tally.share


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 64, 101])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_coverage_is_round_robins(n: int, world: int, accumulate: int) -> None:
    """Every slide once per epoch, the same few twice as round robin pads, and the same count on every rank."""
    order = epoch_order(n, seed=3, epoch=1)
    costs = _skewed_costs(n)
    ranks = balanced(order, costs, world, accumulate)
    rr = round_robin(order, world)
    assert [len(r) for r in ranks] == [len(r) for r in rr] == [-(-n // world)] * world
    assert Counter(i for r in ranks for i in r) == Counter(i for r in rr for i in r)
    assert set(i for r in ranks for i in r) == set(range(n))
    assert [shard(order, DistInfo(r, world, r)) for r in range(world)] == rr  # one rule for both


def test_the_same_everywhere_for_a_seed_and_epoch_and_new_each_epoch() -> None:
    n, costs, world = 40, _skewed_costs(40), 2
    b = Balance("time", seed=5, world_size=world, accumulate=2, costs=tuple(costs))
    first = [b.rank_slides(n, epoch=0, rank=r) for r in range(world)]
    again = [Balance("time", 5, world, 2, tuple(costs)).rank_slides(n, 0, r) for r in range(world)]
    assert first == again  # each rank computes every rank's share alike: no communication needed
    later = [b.rank_slides(n, epoch=1, rank=r) for r in range(world)]
    other_seed = [Balance("time", 6, world, 2, tuple(costs)).rank_slides(n, 0, r) for r in range(world)]
    assert later != first and other_seed != first
    assert sorted(sum(later, [])) == sorted(sum(first, [])) == list(range(n))


def test_balanced_steps_wait_less_than_round_robin_on_a_skewed_cohort() -> None:
    n = 512
    costs = _skewed_costs(n)
    for world, accumulate in ((2, 1), (4, 1), (2, 4)):
        shares = {}
        for seed in range(3):
            order = epoch_order(n, seed, 0)
            shares[seed] = (_wait_share(round_robin(order, world), costs, accumulate),
                            _wait_share(balanced(order, costs, world, accumulate), costs, accumulate))  # fmt: skip
        rr = np.mean([s[0] for s in shares.values()])
        bal = np.mean([s[1] for s in shares.values()])
        assert rr > 0.05, (world, accumulate, rr)  # the skew alone makes ranks wait
        assert bal < rr / 3, (world, accumulate, rr, bal)


def test_equal_costs_keep_round_robins_steps() -> None:
    """Nothing to balance: every step trains round robin's slides, in its order (the distributed fit's equality
    with one process accumulating relies on it); only which rank takes which slide turns with the step."""
    order = epoch_order(30, 2, 0)
    for world in (2, 3):
        for accumulate in (1, 2, 4):
            got = _steps(balanced(order, [1.0] * 30, world, accumulate), accumulate)
            want = _steps(round_robin(order, world), accumulate)
            assert [sorted(sum(s, [])) for s in got] == [sorted(sum(s, [])) for s in want], (world, accumulate)
    firsts = [step[0][0] for step in _steps(balanced(order, [1.0] * 30, 2, 1), 1)]
    assert firsts[:4] == [order[0], order[3], order[4], order[7]]  # the step's first slide: rank 0, 1, 0, 1


def test_the_dearest_slide_of_a_step_turns_among_the_ranks() -> None:
    """Rank 0 also writes logs and checkpoints: it must not always draw the step's dearest slide."""
    n = 64
    costs = _skewed_costs(n, seed=2)
    ranks = balanced(epoch_order(n, 0, 0), costs, 2, 1)
    dearest_on = Counter(max(range(2), key=lambda r: costs[step[r][0]]) for step in _steps(ranks, 1))
    assert dearest_on[0] == dearest_on[1] == 16


def test_a_step_is_a_window_of_the_loop_with_accumulation() -> None:
    """With accumulate 3, each rank's slides come in steps of 3 (the last shorter); within a step the load is
    dealt longest-first, so the ranks' sums are close."""
    n, world, accumulate = 50, 2, 3
    costs = _skewed_costs(n, seed=4)
    ranks = balanced(epoch_order(n, 1, 0), costs, world, accumulate)
    steps = _steps(ranks, accumulate)
    assert [len(s[0]) for s in steps] == [3] * 8 + [1]
    for step in steps:
        sums = [sum(costs[i] for i in mine) for mine in step]
        assert max(sums) - min(sums) <= max(costs[i] for mine in step for i in mine)  # LPT's bound


def test_one_process_keeps_the_epoch_order() -> None:
    costs = _skewed_costs(9)
    assert rank_slides("time", 9, 4, 2, 0, 1, costs=costs) == epoch_order(9, 4, 2)
    assert rank_slides("round_robin", 9, 4, 2, 1, 2) == shard(epoch_order(9, 4, 2), DistInfo(1, 2, 1))
    with pytest.raises(ValueError, match="one cost per slide"):
        rank_slides("time", 9, 4, 2, 0, 2, costs=costs[:5])


def test_shape_buckets_stay_together() -> None:
    """Slides of one bucket share a cost scale: balancing puts them in the same steps (fewer shapes per step than
    round robin), and a rank's slides within a step run bucket by bucket."""
    rng = np.random.default_rng(7)
    n, world, accumulate = 96, 2, 4
    buckets = [((1024, 1024), (2048, 2048), (1536, 2048))[int(k)] for k in rng.integers(0, 3, n)]
    area = {b: b[0] * b[1] / 1e6 for b in set(buckets)}
    costs = [area[b] * rng.uniform(0.8, 1.0) for b in buckets]
    order = epoch_order(n, 0, 0)
    per_step = {}
    for name, ranks in (("rr", round_robin(order, world)), ("time", balanced(order, costs, world, accumulate,
                                                                             buckets))):  # fmt: skip
        steps = _steps(ranks, accumulate)
        per_step[name] = np.mean([len({buckets[i] for mine in step for i in mine}) for step in steps])
        if name == "time":
            for step in steps:
                for mine in step:
                    runs = [buckets[i] for i in mine]
                    changes = sum(a != b for a, b in zip(runs, runs[1:], strict=False))
                    assert changes == len(set(runs)) - 1, runs  # each bucket in one run
    assert per_step["time"] < per_step["rr"] - 0.5, per_step


def test_waiting_share_arithmetic() -> None:
    tally = WaitTally(2)
    tally.add(torch.tensor([[1.0, 3.0], [1.0, 1.0]], dtype=torch.float64))  # step 2: rank 1 waits 2 s
    assert tally.steps == 2 and tally.waited_s == 2.0 and tally.slowest_s == 4.0
    assert tally.share == pytest.approx(2.0 / (2 * 4.0))
    assert tally.compute_s == [4.0, 2.0]
    assert WaitTally(2).share is None
    one_rank_works = WaitTally(4)
    one_rank_works.add(torch.tensor([[2.0], [0.0], [0.0], [0.0]], dtype=torch.float64))
    assert one_rank_works.share == pytest.approx(3 / 4)


def test_a_bad_balance_value_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("distributed: {balance: fastest}\n")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "distributed.balance: 'fastest' is not a valid choice; choose one of time, round_robin" in result.output


def test_the_benchmarks_simulation_runs_and_favours_time() -> None:
    """benchmarks/bench_balance.py --simulate (docs/benchmarks/bench_balance.md's simulated table), on fewer slides."""
    bench = load_script("bench_balance")
    rows = bench.simulate(n=512)
    share = {(r["world"], r["accumulate"], r["balance"]): r["wait_share"] for r in rows}
    for world, accumulate in ((2, 1), (4, 1), (2, 4)):
        rr = share[(world, accumulate, "round_robin")]
        assert share[(world, accumulate, "time, window 8")] < rr / 2 < rr
        assert share[(world, accumulate, "time, window 32")] <= share[(world, accumulate, "time, window 2")]
