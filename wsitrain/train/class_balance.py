"""``train.class_balance``: imbalanced training classes, by loss weights or by the epoch's draw of slides.

Both use the same per-class weight ``n / (K * n_k)`` (n training slides, K classes that have slides, n_k of class k),
so each class contributes as if the classes were equally frequent:

- ``weights``: each slide's loss (and gradient) is scaled by its class's weight;
- ``sampling``: each epoch draws n slides with replacement, slide i with probability proportional to its class's
  weight; the draw depends only on (seed, epoch), so a resume redraws the same epoch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

CLASS_BALANCE = ("none", "weights", "sampling")


def class_weights(labels: Sequence[int]) -> dict[int, float]:
    """``{class: n / (K * n_k)}`` over the classes present in ``labels``."""
    counts = Counter(int(y) for y in labels)
    n, k = len(labels), len(counts)
    return {c: n / (k * m) for c, m in sorted(counts.items())}


def loss_weight(mode: str, weights: dict[int, float], label: int) -> float:
    """The factor on one slide's loss: its class weight under ``weights``, else 1."""
    return weights[int(label)] if mode == "weights" else 1.0


def sampled_slides(labels: Sequence[int], seed: int, epoch: int) -> list[int]:
    """The epoch's slides under ``sampling``: n indices drawn with replacement, class-balanced in expectation."""
    w = class_weights(labels)
    p = torch.tensor([w[int(y)] for y in labels], dtype=torch.float64)
    # its own stream: the epoch's order (train.data.epoch_order) keeps its draws whatever this takes
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch) + 7_919 * 1_000_003)
    return torch.multinomial(p, len(labels), replacement=True, generator=g).tolist()


def describe(mode: str, labels: Sequence[int], class_names: Sequence[object]) -> dict[str, object]:
    """What the run folder records (class_balance.json): the mode, the training counts and the weights used."""
    counts = Counter(int(y) for y in labels)
    w = class_weights(labels) if mode != "none" else {c: 1.0 for c in counts}
    return {
        "mode": mode,
        "train_counts": {str(class_names[c]): counts[c] for c in sorted(counts)},
        "weights": {str(class_names[c]): round(w[c], 6) for c in sorted(w)},
    }
