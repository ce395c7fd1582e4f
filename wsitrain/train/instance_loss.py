"""The MIL instance loss on an attention head's scores (``model.attention.instance_loss``).

Multiple-instance learning's standard assumption: a slide is positive when any of its cells is, so every cell of a
negative slide is negative. The attention score of the positive class's branch is read as each cell's instance
logit, and beside the slide's own loss the head is asked for what that assumption says:

    negative slide:  BCE(s, 0) averaged over its k highest scores (k = ``model.attention.instance_cells``)
    positive slide:  BCE(s, 1) averaged over its j highest (j = ``model.attention.instance_positive_cells``)

A softmax ignores its scores' level, so this changes what the attention pool computes only through the scores'
order: a cell that is also on negative slides (a look-alike) is pushed below 0, and a cell found only on positive
slides (the lesion) above it, which is what the map's pointing game reads.

The two sides are means over different counts, so a structure of n < k cells that every slide has settles above 0: where
(1 - sigmoid(s)) = (n / k) sigmoid(s) for j <= n, at sigmoid(s) = k / (j + k) for fewer than j. The map's outer ring,
computed against the trunk's zero padding, is such a structure, and it held the positive branch's peak on 5 of 9 seeds
(an edge row scoring 3.4-4.9 above the inside on a blank image, docs/research/plateau.md section 11). With the loss on,
the attention pool leaves that ring out (``model.attention.border_cells``, 1 by default with the loss:
``AttentionPool(border)``).

Why (docs/research/plateau.md sections 9-10, *measured*): one attention branch for all classes learnt to find the
negative class's evidence, a look-alike, and put its peak there on every positive slide that also carried one (0 of 21
over six seeds, 1,440 steps). With one branch per class and this loss (16 cells up, 64 down), the positive branch put
its peak in a lesion on 11 of the 14 held-out positives beside a look-alike over the learning benchmark's six seeds
(docs/benchmarks/bench_learning/mil_before_ring.md); its pointing game over all positives was 1.0 on seeds 0-2 and 0.36
on seeds 3-5, and 0.45 over nine seeds before the border ring was left out (docs/benchmarks/bench_learning/mil.md: with
it).

The scores come from the pool's output (``AttentionPool(instance_k)``: each branch's highest scores follow its
pooled vector, plain and fused alike), read on the input of the ``InstanceSplit`` module after it by a forward
pre-hook that lives only while ``captured()`` runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models.heads import DEFAULT_INSTANCE_POSITIVE_CELLS, positive_index
from wsitrain.sft.ops.attention_pool import InstanceSplit, instance_scores


@dataclass(frozen=True)
class InstanceLossSpec:
    """What the loss reads: its weight beside the slide's loss, the class index the MIL assumption calls positive,
    the attention branch whose scores are its instance logits, and a negative slide's cells it pushes down."""

    weight: float
    positive: int
    branch: int
    negative_cells: int
    positive_cells: int = DEFAULT_INSTANCE_POSITIVE_CELLS


class Capture:
    """The pooled output (B, K, C + k) of the last forward run inside ``InstanceLoss.captured()``."""

    def __init__(self) -> None:
        self.pooled: torch.Tensor | None = None


class InstanceLoss:
    """The instance loss of ``model`` (or the SFT wrapper around it), whose attention pool carries its scores."""

    def __init__(self, model: nn.Module, spec: InstanceLossSpec) -> None:
        split = next((m for m in model.modules() if isinstance(m, InstanceSplit)), None)
        if split is None:
            raise WsiTrainError(
                "model.attention.instance_loss needs the attention pool to carry its scores, and this model's does not",
                hint="build the model with wsitrain.models.build and model.attention.instance_loss set",
            )
        if max(spec.negative_cells, spec.positive_cells) > split.instance_k:
            raise ValueError(f"the pool carries {split.instance_k} scores, the loss reads "
                             f"{max(spec.negative_cells, spec.positive_cells)}")  # fmt: skip
        self.split, self.spec = split, spec

    @contextmanager
    def captured(self) -> Iterator[Capture]:
        """Forwards inside the block leave their pooled output in the yielded ``Capture``."""
        cap = Capture()

        def keep(_: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            cap.pooled = args[0]

        handle = self.split.register_forward_pre_hook(keep)
        try:
            yield cap
        finally:
            handle.remove()

    def __call__(self, cap: Capture, label: int) -> torch.Tensor:
        """The loss of one slide (batch 1) of class ``label`` from the captured forward; 0-dim, float32 or wider."""
        if cap.pooled is None:
            raise RuntimeError("no forward ran inside InstanceLoss.captured()")
        scores = instance_scores(cap.pooled, self.split.instance_k)[0, self.spec.branch]  # (k,), largest first
        scores = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        positive = label == self.spec.positive
        top = scores[: self.spec.positive_cells if positive else self.spec.negative_cells]
        kept = torch.isfinite(top)  # -inf past the cells a small tissue mask keeps: not cells at all
        target = torch.full_like(top, float(positive))
        each = F.binary_cross_entropy_with_logits(torch.where(kept, top, 0.0), target, reduction="none")
        return (each * kept).sum() / kept.sum().clamp(min=1)  # no host read: a mask keeps at least one cell


def instance_loss_spec(weight: float, cells: int, positive_class: str | None, per_class: bool,
                       class_names: list[str] | None, positive_cells: int = DEFAULT_INSTANCE_POSITIVE_CELLS
                       ) -> InstanceLossSpec:  # fmt: skip
    """The loss's spec for a run's classes (``class_names``; None: the task is not a classification), checked
    before anything is written: exit 2 naming the key."""
    if class_names is None:
        raise WsiTrainError("model.attention.instance_loss assumes a classification (a slide is positive when any "
                            "cell is), but the run's task is not one",
                            hint="remove model.attention.instance_loss (or set it to 0) for this task")  # fmt: skip
    if len(class_names) != 2:
        raise WsiTrainError(f"model.attention.instance_loss needs two classes (a positive and a negative one); the "
                            f"labels have {len(class_names)}: {', '.join(map(str, class_names))}",
                            hint="remove model.attention.instance_loss (or set it to 0)")  # fmt: skip
    names = [str(c) for c in class_names]
    if positive_class is not None and positive_class not in names:
        raise WsiTrainError(f"model.attention.positive_class is {positive_class!r}, not one of the classes",
                            hint=f"choose one of: {', '.join(names)}")  # fmt: skip
    positive = positive_index(positive_class, names)  # the class the instance stream, if on, adds to as well
    return InstanceLossSpec(weight, positive, positive if per_class else 0, cells, positive_cells)
