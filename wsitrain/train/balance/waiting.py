"""How long ranks wait for each other: the share of rank-time spent idle at the gradient all_reduce.

Each rank times its compute per optimizer step: from the end of the previous step (its collectives done) to the
moment it enters the gradient all_reduce, reading, forward, backward and logging included. Every ``log.every``
steps and at the epoch's end the ranks exchange those times in one small all_reduce (world_size x steps floats),
and each step's waiting is the slowest rank's compute minus each rank's own:

    waiting share = sum over steps and ranks of (slowest - own) / (world_size * sum over steps of slowest)

0 when every rank computes as long as the slowest; (world_size - 1) / world_size when one rank does all the work.
One process has no one to wait for: nothing is measured and the share is absent from the logs and the summary.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from wsitrain.train.distributed import DistInfo


@dataclass
class WaitTally:
    """Steps measured, rank-seconds spent waiting, seconds of the slowest rank's compute, each rank's compute."""

    world_size: int
    steps: int = 0
    waited_s: float = 0.0
    slowest_s: float = 0.0
    compute_s: list[float] = field(default_factory=list)

    def add(self, per_step: torch.Tensor) -> None:
        """``per_step`` (world_size, steps): each rank's compute seconds per step."""
        slowest = per_step.max(dim=0).values
        self.steps += int(per_step.shape[1])
        self.waited_s += float((slowest - per_step).sum())
        self.slowest_s += float(slowest.sum())
        totals = per_step.sum(dim=1).tolist()
        self.compute_s = [a + b for a, b in zip(self.compute_s or [0.0] * len(totals), totals, strict=True)]

    @property
    def share(self) -> float | None:
        """The waiting share (module docstring); None before any step was measured."""
        if not self.steps or self.slowest_s <= 0:
            return None
        return self.waited_s / (self.world_size * self.slowest_s)

    def row(self) -> dict[str, object]:
        """The fields of a metrics.jsonl "ranks" row."""
        return {"steps": self.steps, "wait_share": self.share, "waited_s": self.waited_s,
                "slowest_s": self.slowest_s, "compute_s": list(self.compute_s)}  # fmt: skip


class RankWaits:
    """Per-step compute times of this rank, exchanged with the others at ``gather``; the epoch's and the run's
    tallies. Every method is a no-op in one process (``gather`` returns None)."""

    def __init__(self, dist: DistInfo, device: torch.device) -> None:
        self.dist = dist
        self.device = device
        self._t0 = time.perf_counter()
        self._pending: list[float] = []
        self.epoch = WaitTally(dist.world_size)
        self.run = WaitTally(dist.world_size)

    def start_epoch(self) -> None:
        self.epoch = WaitTally(self.dist.world_size)
        self._pending = []
        self.start()

    def start(self) -> None:
        """A step's compute begins: the previous step's collectives are done."""
        self._t0 = time.perf_counter()

    def ready(self) -> None:
        """This rank is about to enter the gradient all_reduce."""
        if self.dist.enabled:
            self._pending.append(time.perf_counter() - self._t0)

    def gather(self) -> WaitTally | None:
        """A collective (every rank calls it after the same step): the steps since the last gather, added to the
        epoch's and the run's tallies. None in one process or when no step is pending (on every rank alike: all run
        the same steps)."""
        if not self.dist.enabled or not self._pending:
            return None
        import torch.distributed as dist

        times = torch.zeros((self.dist.world_size, len(self._pending)), dtype=torch.float64)
        times[self.dist.rank] = torch.tensor(self._pending, dtype=torch.float64)
        if dist.get_backend() == "nccl":
            times = times.to(self.device)
        dist.all_reduce(times, op=dist.ReduceOp.SUM)
        times = times.cpu()
        self._pending = []
        tally = WaitTally(self.dist.world_size)
        for t in (tally, self.epoch, self.run):
            t.add(times)
        return tally
