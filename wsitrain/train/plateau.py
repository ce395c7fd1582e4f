"""The plateau of near-constant outputs, seen from a validation: every slide gets about the same answer.

A whole-slide run first sits on a plateau: the model answers about the training set's class prior for every slide,
the training loss stays near that of a constant answer, and the ROC AUC already ranks tiny differences between the
outputs, so it can look like learning (issue 32, docs/research/plateau.md). The validation's ``output_spread``
(wsitrain.train.metrics) tells the two apart, and fit says so when it is below ``FLAT_SPREAD``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

# Measured on the learning benchmark's 88 distinct whole-slide runs whose held-out outputs were kept (CPU, 12 epochs,
# round 4; docs/research/plateau.md section 13). Of the 18 runs with a held-out spread below 0.02, 17 ended at accuracy
# 0.50, all 18 at a training loss of 0.689-0.702 (a constant answer's is ln 2 = 0.693). No run fell between 0.013 and
# 0.026. Of the 70 runs at 0.026 or more, 64 had left the plateau.
FLAT_SPREAD = 0.02
# Fewer validation slides than this say too little about a spread.
MIN_SLIDES = 4


def flat_outputs_note(metrics: Mapping[str, float], epoch: int, epochs: int, random_trunk: bool = False) -> str | None:
    """One warning line when a classification validation's outputs are near-constant; None otherwise (a task's
    metrics, too few slides, or a spread at ``FLAT_SPREAD`` or above). ``random_trunk``: the run's trunk started from
    random weights (no ``model.weights``), which the line names as the measured cause of a long plateau."""
    spread, n = metrics.get("output_spread", math.nan), int(metrics.get("n", 0))
    if math.isnan(spread) or n < MIN_SLIDES or spread >= FLAT_SPREAD:
        return None
    note = (f"epoch {epoch}/{epochs}: the model gives the {n} validation slides about the same output (class "
            f"probabilities vary by {spread:.4f}, standard deviation; below {FLAT_SPREAD}, 17 of 18 benchmark runs "
            "ended at accuracy 0.50): it is still on the plateau of near-constant outputs, and its ROC AUC ranks tiny "
            "differences; train longer, or see docs/research/plateau.md for what shortened the plateau "
            "there")  # fmt: skip
    if random_trunk:
        # measured on the learning benchmark (docs/research/plateau.md sections 15-16): random tiny_ln trunks waited 220
        # to more than 576 steps, a trunk pretrained on other slides' patch labels left within one epoch
        note += ("; its trunk started from random weights, where the benchmark's plateau lasted 220 to more than 576 "
                 "steps and a pretrained trunk's one epoch or none: start from pretrained weights where you have "
                 "them (model.weights: imagenet, a run's checkpoint, or a trunk's state dict)")  # fmt: skip
    return note
