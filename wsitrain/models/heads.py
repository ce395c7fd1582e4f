"""The global poolings a model can end in, defined once (config, CLI, build, plan and the report read them here).

Torch-free at import: config validation imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AVG, MAX, ATTENTION, GATED_ATTENTION, TOPK = "avg", "max", "attention", "gated_attention", "topk"
POOLS = (AVG, MAX, ATTENTION, GATED_ATTENTION, TOPK)
# ``pool: topk``: each channel's mean of its k largest positions (wsitrain.sft.ops.topk_pool). k = 16 is a lesion of
# ~64 x 64 px at a stride of 16 (the synthetic small-lesion cohort's boxes are 80 px): measured in docs/plateau.md.
DEFAULT_TOPK = 16
# Attention-MIL pooling: ABMIL (``w^T tanh(V h)``) and CLAM's gated form (``w^T (tanh(V h) * sigmoid(U h))``).
ATTENTION_POOLS = (ATTENTION, GATED_ATTENTION)


@dataclass(frozen=True)
class AttentionSpec:
    """How an attention pool is built (``model.attention`` in the config)."""

    dim: int | None = None  # a 1x1 projection (+ ReLU) to this width before attention; None: the trunk's channels
    hidden: int | None = None  # width of V (and U); None: min(256, the attended width)
    per_class: bool = False  # one attention branch per class (CLAM-MB) instead of one for all (ABMIL, CLAM-SB)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> AttentionSpec:
        """From a checkpoint's saved config section (``model.attention``); missing keys take their defaults."""
        d = d or {}
        return cls(d.get("dim"), d.get("hidden"), d.get("branches", "single") == "per_class")
