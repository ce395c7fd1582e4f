"""Autocast as the forward found it, replayed for tiles and their recomputation.

A sweep of tiles casts each weight once (``forward_sweep``, ``backward_sweep``), not once per tile: autocast's cache
holds the low-precision copy of every weight the sweep's layers cast, and is cleared when the sweep ends. Per tile
(autocast's cache off) ResNet-50 at 8192 px capped cast 490 weights per step for 94 distinct (segment, sweep, weight)
triples (simulated, ``plan --simulate``: docs/research/simulated-clock.md). Results are bitwise the per-tile casts': a
cast is deterministic, and in the recompute each tile's weight gradient still goes back through the cached copy's own
``ToCopyBackward`` (the bf16 gradient of this tile cast to float32, then summed in float32 as before). A weight two
layers of one segment share would have its two bf16 gradients summed before that cast instead of after; such a segment
keeps per-tile casts (``cast_once`` False).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

TileContext = Callable[[], contextlib.AbstractContextManager[object]]


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
        """Autocast for one tile, casting every weight anew."""
        if not self.enabled:
            return contextlib.nullcontext()
        # Autocast caches the low-precision copy of each weight for the whole outer autocast region.
        # A copy cast under no_grad (a tile's forward) has no path to the weight, and reusing it in the
        # recompute would lose that weight's gradient; a single tile therefore never uses or fills the cache.
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=False)

    def _cached(self) -> contextlib.AbstractContextManager[object]:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=True, cache_enabled=True)

    @contextlib.contextmanager
    def forward_sweep(self, cast_once: bool) -> Iterator[None]:
        """Autocast for a forward sweep (under no_grad) that casts each weight once; the copies, which have no path
        to their weights, are dropped when it ends, so no later layer that needs a gradient finds them."""
        if not (self.enabled and cast_once):
            with self.context():
                yield
            return
        try:
            with self._cached():
                yield
        finally:
            torch.clear_autocast_cache()

    @contextlib.contextmanager
    def backward_sweep(self, cast_once: bool) -> Iterator[TileContext]:
        """A backward sweep: yields the context each tile's recompute runs in. Between recomputes (autograd's
        backward, gradient sums) autocast is as it was outside; the casts are kept across tiles and dropped at the
        end."""
        if not (self.enabled and cast_once):
            yield self.context
            return
        dt = self.device_type
        outer = torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt), torch.is_autocast_cache_enabled()
        try:
            # the first context keeps autocast's nesting above zero between tiles (leaving the outermost autocast
            # clears the cache); the second restores the state outside for everything but the recomputes
            with self._cached(), torch.autocast(dt, dtype=outer[1], enabled=outer[0], cache_enabled=outer[2]):
                yield self._cached
        finally:
            torch.clear_autocast_cache()
