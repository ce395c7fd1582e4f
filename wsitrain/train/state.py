"""Where a fit stands: the counters a checkpoint saves and a resume restores."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class FitState:
    """Epoch and slide to continue from, optimizer steps done, best loss so far, and per-epoch history."""

    epoch: int = 0  # epochs completed
    next_index: int = 0  # the next slide of epoch ``epoch`` (0-based, in that epoch's order)
    global_step: int = 0  # optimizer steps done
    best: float = math.inf  # best validation loss (training loss when there are no validation slides)
    history: list[dict[str, Any]] = field(default_factory=list)  # one entry per epoch: losses and metrics

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_checkpoint(cls, ckpt: dict[str, Any]) -> FitState:
        return cls(int(ckpt["epoch"]), int(ckpt["next_index"]), int(ckpt["global_step"]), float(ckpt["best"]),
                   list(ckpt["history"]))  # fmt: skip
