"""Autocast as the forward found it, replayed for tiles and their recomputation."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype

    @staticmethod
    def capture(device_type: str) -> AutocastState:
        try:
            return AutocastState(
                device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
            )
        except RuntimeError:  # a device type without autocast (the simulated device runs on ``meta``)
            return AutocastState(device_type, False, torch.float32)

    def context(self) -> contextlib.AbstractContextManager[object]:
        if not self.enabled:
            return contextlib.nullcontext()
        # Autocast caches the low-precision copy of each weight for the whole outer autocast region.
        # A copy cast under no_grad (a tile's forward) has no path to the weight, and reusing it in the
        # recompute would lose that weight's gradient; tiles therefore never use or fill the cache.
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=False)
