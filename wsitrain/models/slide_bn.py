"""``model.bn_stats``: which statistics a trainable BatchNorm normalises with outside training.

- ``running`` (PyTorch's default): the batch's statistics in training, the running averages in prediction.
- ``slide``: the batch's own statistics in training and prediction alike (no running statistics are kept). With one
  slide per step that is each slide's own, so the model predicts with the normalisation it was trained with.

Why ``slide`` exists: with ``model.freeze_bn: false`` and one slide per step, every training step normalises with
that slide's statistics, and the running averages are a different normalisation. On the learning benchmark's cohort
(tiny_bn, 12 epochs, seed 47, *measured* on the 2-core CPU, 2026-11-29) the same trained model ranked the held-out
slides at ROC AUC 0.40 with the running averages and 0.94 with each slide's own statistics (docs/research/plateau.md
section 14). The engine runs such a BatchNorm exactly, in extra sweeps over the tiles, in training and prediction.

Torch-free at import: config validation reads the vocabulary here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

RUNNING = "running"
SLIDE = "slide"
BN_STATS: tuple[str, ...] = (RUNNING, SLIDE)


def slide_batchnorm(model: nn.Module) -> int:
    """Make every BatchNorm of ``model`` normalise with its batch's own statistics, in training and in eval mode:
    its running statistics are dropped (``track_running_stats=False``, as a BatchNorm built that way). Returns how
    many layers changed. Their affine weights are kept."""
    from torch.nn.modules.batchnorm import _BatchNorm

    n = 0
    for m in model.modules():
        if isinstance(m, _BatchNorm) and m.track_running_stats:
            m.track_running_stats = False
            m.running_mean = None  # (C,) buffers become None: state_dict leaves them out, forward uses batch stats
            m.running_var = None
            m.num_batches_tracked = None
            n += 1
    return n
