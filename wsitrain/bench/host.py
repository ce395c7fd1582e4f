"""The host's share of an SFT step in ``bench``: host time and launches per step of the CUDA plan, no GPU needed.

``wsitrain.sft.simulate.host_time`` runs the real executor on the meta device for the plan a GPU with the bench's
budget would run (bf16 plans as under autocast); ``bench`` adds the figures to its SFT planner rows.
"""

from __future__ import annotations

from typing import Any

import torch

from wsitrain.gpus import Budget
from wsitrain.models import build
from wsitrain.precision import activation_dtype
from wsitrain.sft.simulate.host_time import HostTime, measure_host_time


def host_share(model: str, size: int, budget: Budget, precision: str) -> HostTime | None:
    """The host's work per step of ``model`` at ``size`` px planned for CUDA within ``budget``; None on a CPU
    budget (no launches to issue ahead) or when no plan fits."""
    if budget.device != "cuda":
        return None
    with torch.device("meta"):
        net = build(model, 2)
    try:
        return measure_host_time(
            net, (1, 3, size, size), budget.bytes, dtype=activation_dtype(precision), target=budget.target
        )
    except Exception:  # no plan for this shape: the row says what ran; the host's share stays unknown
        return None


def host_columns(h: HostTime | None) -> dict[str, Any]:
    """The row's host columns: milliseconds and launches per step (None when not measured)."""
    return {
        "host_ms_per_step": None if h is None else round(h.seconds * 1e3, 3),
        "launches_per_step": None if h is None else h.launches,
        "syncs_per_step": None if h is None else h.syncs,
    }
