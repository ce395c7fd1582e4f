"""The engine's budget and the facts about a user's model that planning starts from (dtype, name, device)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.memory import DeviceMemory, detect_budget
from wsitrain.units import parse_bytes

MemoryProbe = Callable[[torch.device | str], DeviceMemory]


def _device_str(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def resolve_budget_bytes(
    memory_budget: int | float | str | None, device: str | torch.device, probe: MemoryProbe | None = None
) -> int:
    """Bytes from an explicit budget, else detected on ``device`` (the model's: cuda:1, not the current one)."""
    if memory_budget is not None:
        return parse_bytes(memory_budget, what="memory_budget")
    if probe is not None:
        return detect_budget(device, probe)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise PlanError(
            "cannot detect the memory of a CUDA device on a machine without one",
            hint="pass memory_budget (e.g. '11GiB') or a GPU preset",
        )
    return detect_budget(device)


def _param_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _model_name(model: nn.Module) -> str:
    name = getattr(model, "name", None)
    return name if isinstance(name, str) else type(model).__name__
