"""The global poolings a model can end in, defined once (config, CLI, build, plan and the report read them here).

Torch-free at import: config validation imports this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

AVG, MAX, ATTENTION, GATED_ATTENTION, TOPK = "avg", "max", "attention", "gated_attention", "topk"
POOLS = (AVG, MAX, ATTENTION, GATED_ATTENTION, TOPK)
# ``pool: topk``: each channel's mean of its k largest positions (wsitrain.sft.ops.topk_pool). k = 16 is a lesion of ~64
# x 64 px at a stride of 16 (the synthetic small-lesion cohort's boxes are 80 px): measured in docs/research/plateau.md.
DEFAULT_TOPK = 16
# model.attention.instance_loss: a negative slide's this many highest attention scores pushed below 0. 64 cells hold
# about two of the synthetic cohort's look-alikes (boxes of 88 px, 6 x 6 cells at a stride of 16); a negative slide's
# top cell alone was worse on every seed (docs/benchmarks/bench_learning/mil_before_ring.md, measured)
DEFAULT_INSTANCE_CELLS = 64
# ... and a positive slide's this many highest pushed above 0 (their mean). With one (the max), the loss kept whatever
# the initialisation ranked first when every slide shares it (the image border, the tissue's edge) on 2 of 3 seeds;
# with 16 (about half a lesion's cells) CLAM-MB pointed at a lesion on all 36 held-out positives of seeds 0-2, but on
# 13 of 36 of seeds 3-5, run afterwards (docs/benchmarks/bench_learning/mil_before_ring.md, measured)
DEFAULT_INSTANCE_POSITIVE_CELLS = 16
# ... and the map's outer ring of cells left out of the attention pool while it is on. The ring is computed against the
# trunk's zero padding, so it looks the same on every slide; the loss pushes a positive slide's 16 cells up and a
# negative slide's 64 down, each side's mean, so a structure of n < 64 cells found on every slide settles above 0, and
# the ring held the peak on 5 of 9 seeds (an edge row 3.4-4.9 above the inside on a blank image;
# docs/research/plateau.md section 11, measured). Left out, no run kept an edge more than 0.6 above the inside.
DEFAULT_INSTANCE_BORDER_CELLS = 1
# ``model.attention.norm``: the scores' input as the trunk gives it, or each channel standardised over the slide's map
# (an instance normalisation: BatchNorm without running statistics, one slide per batch), or each cell's vector over
# its channels (a LayerNorm). Why: on 6 of 7 attention runs probed, tiny's features grew from a level of 0.03-0.05 at
# initialisation to 2.4-136 while training and 41-100% of the scores' tanh inputs lay beyond +-2, so the scores were
# flat; standardised, the level does not reach them (docs/research/plateau.md section 12, measured).
NO_NORM, SLIDE_NORM, CELL_NORM = "none", "slide", "cell"
ATTENTION_NORMS = (NO_NORM, SLIDE_NORM, CELL_NORM)
# ``model.map_norm``: what the whole head reads, the trunk's map as it is (NO_NORM) or standardised per channel over
# the slide (SLIDE_NORM; docs/research/plateau.md section 13)
MAP_NORMS = (NO_NORM, SLIDE_NORM)
# Attention-MIL pooling: ABMIL (``w^T tanh(V h)``) and CLAM's gated form (``w^T (tanh(V h) * sigmoid(U h))``).
ATTENTION_POOLS = (ATTENTION, GATED_ATTENTION)


@dataclass(frozen=True)
class AttentionSpec:
    """How an attention pool is built (``model.attention`` in the config)."""

    dim: int | None = None  # a 1x1 projection (+ ReLU) to this width before attention; None: the trunk's channels
    hidden: int | None = None  # width of V (and U); None: min(256, the attended width)
    per_class: bool = False  # one attention branch per class (CLAM-MB) instead of one for all (ABMIL, CLAM-SB)
    # each branch's this many highest scores follow its pooled vector, for the instance loss (0: none)
    instance_k: int = 0
    # the map's outer rings of cells the pool leaves out (wsitrain.sft.ops.attention_pool: zero padding's border)
    border: int = 0
    # what the scores read: the trunk's map (NO_NORM), or it standardised per channel over the slide (SLIDE_NORM) or
    # per cell over its channels (CELL_NORM): ``model.attention.norm``
    norm: str = NO_NORM
    # the class whose logit adds the mean of its branch's this many highest scores (``instance_stream``); None: off
    stream_class: int | None = None
    stream_cells: int = DEFAULT_INSTANCE_POSITIVE_CELLS

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, class_names: Sequence[str] | None = None) -> AttentionSpec:
        """From a checkpoint's saved config section (``model.attention``) and its class names; missing keys take
        their defaults."""
        d = d or {}
        loss = float(d.get("instance_loss") or 0)
        positive_cells = int(d.get("instance_positive_cells") or DEFAULT_INSTANCE_POSITIVE_CELLS)
        k = carried_scores(loss, int(d.get("instance_cells") or DEFAULT_INSTANCE_CELLS), positive_cells)
        cells = d.get("border_cells")
        stream = positive_index(d.get("positive_class"), class_names) if d.get("instance_stream") else None
        return cls(d.get("dim"), d.get("hidden"), d.get("branches", "single") == "per_class", k,
                   attention_border(loss, None if cells is None else int(cells)), d.get("norm") or NO_NORM, stream,
                   positive_cells)  # fmt: skip


def positive_index(positive_class: str | None, class_names: Sequence[str] | None) -> int:
    """The class the MIL assumption calls positive (``model.attention.positive_class``): its index among the run's
    two classes, the second of them when None. Without the class names (planning on shapes) the second."""
    if positive_class is None or class_names is None:
        return 1
    names = [str(c) for c in class_names]
    return names.index(positive_class) if positive_class in names else 1


def attention_border(instance_loss: float, cells: int | None) -> int:
    """The rings of map cells an attention pool leaves out (``model.attention.border_cells``); None: 1 with the
    instance loss (whose peak the ring held on 5 of 9 seeds without it), else 0 (the heads measured before it)."""
    if cells is not None:
        return cells
    return DEFAULT_INSTANCE_BORDER_CELLS if instance_loss > 0 else 0


def carried_scores(instance_loss: float, negative_cells: int, positive_cells: int) -> int:
    """How many scores per branch the attention pool carries for ``model.attention.instance_loss``: enough for both
    sides of the loss, 0 when it is off."""
    return max(negative_cells, positive_cells) if instance_loss > 0 else 0
