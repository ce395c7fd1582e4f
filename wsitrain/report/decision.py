"""Where a max-pooling head decides: per slide and class, whether the deciding map cell lies on the slide's tissue.

A max-pooled logit splits exactly into per-position parts (``CamAccumulator.max_contributions``); the cell with the
largest part decided the class's score (the circle on the heatmap). On tissue is the read's tissue mask at the map's
resolution (``ReadResult.map_mask``, moved with the augmentation). Unmasked max pooling decided the demo's negative
class at the image's corner cell (0, 0) on every validation slide (issue 33): this record is how a run shows it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.report.cam import CamAccumulator, ClassifierHead, find_head
from wsitrain.report.heatmap import trunk_hw


def decided_on_tissue(decisive: torch.Tensor, mask: torch.Tensor | None) -> list[bool] | None:
    """Per class: is its deciding cell ``decisive`` (K, 2) (row, col) inside ``mask`` (1, 1, h, w)? None without a
    tissue mask (``data.mask_background`` off, or no tissue found)."""
    if mask is None:
        return None
    m = mask[0, 0].cpu()
    return [bool(m[int(r), int(c)]) for r, c in decisive.tolist()]


def on_tissue_share(records: list[list[bool] | None], k: int) -> float | None:
    """Class ``k``'s share of slides decided on tissue, over the slides that have a record (None when none has)."""
    known = [r[k] for r in records if r is not None]
    return sum(known) / len(known) if known else None


class DecisionWatch:
    """Records, for each forward inside ``slide()``, where a max-pooling head decided each class (``last``).

    Observes the engine's trunk tiles (the map is never built); a model without a max-pooling head, or without the
    engine's hooks, records nothing (``last`` stays None)."""

    def __init__(self, engine: nn.Module) -> None:
        self.engine = engine
        self.head: ClassifierHead | None = None
        if hasattr(engine, "observe_trunk") and hasattr(engine, "plan_for"):
            try:
                head = find_head(engine)
            except WsiTrainError:
                head = None
            if head is not None and head.pool == "max":
                self.head = head
        self.last: list[bool] | None = None
        self.cells: list[tuple[int, int]] | None = None

    @property
    def active(self) -> bool:
        return self.head is not None

    @contextmanager
    def slide(self, image: torch.Tensor, read: Any) -> Iterator[None]:
        """Forwards of ``image`` (3, H, W) inside the block; ``read``: its ``ReadResult`` (the tissue mask). Enter it
        inside ``tissue_masked`` so a masked pool's mask is the one the decision is tracked under."""
        self.last, self.cells = None, None
        if self.head is None:
            yield
            return
        x = image.unsqueeze(0) if image.dim() == 3 else image
        hw = trunk_hw(self.engine, x)
        acc = CamAccumulator(self.head, 1, hw)
        with self.engine.observe_trunk(acc):  # type: ignore[operator]
            yield
        decisive = acc.decisive_positions()[0]  # (K, 2)
        self.cells = [(int(r), int(c)) for r, c in decisive.tolist()]
        mask = read.map_mask(*hw) if read is not None else None
        self.last = decided_on_tissue(decisive, mask)

