"""Stochastic depth inside tiled segments: one drop decision per sample, drawn once per step, replayed.

torchvision's ``StochasticDepth`` and timm's ``DropPath`` multiply a residual branch by a per-sample
mask of shape (B, 1, ..., 1). A tiled segment runs the branch once per tile in forward and again
per tile in backward; drawing a mask on every call would give each tile and the recomputation
different decisions. Instead the mask is drawn the first time a node runs in a step, by the
module itself on a tensor of ones of the mask's shape (the same random calls, in the same order,
as plain PyTorch makes), and every later call of that node in the step, in any tile, forward or
recompute, multiplies by that mask. For the same random state the step therefore equals plain
PyTorch exactly, gradients included.

Execution wires it as: ``NodeRunner`` calls such modules through ``SampleDropReplay``; ``SFT.forward``
starts a step with ``masks.new_step()``; a tiled segment's autograd node keeps the step's masks and
its backward recomputes under ``masks.replaying(saved)`` (so two forwards before one backward work).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from wsitrain.sft.ops.registry import drop_rate, is_sample_drop


class StepMasks:
    """One step's per-sample masks, by graph node; each drawn on first use."""

    def __init__(self) -> None:
        self._masks: dict[int, torch.Tensor] = {}

    def mask(self, key: int, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The mask of node ``key`` for this step, shaped (B, 1, ..., 1) like the module draws it."""
        m = self._masks.get(key)
        if m is None:
            ones = torch.ones((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device)
            with torch.no_grad():
                m = module(ones)  # ones * mask: the module's own draw, scaling included
            self._masks[key] = m
        return m

    def drawn(self) -> list[torch.Tensor]:
        """The masks drawn so far in this step, in drawing order."""
        return list(self._masks.values())


class MaskReplay:
    """Where the drop wrappers of one traced model find the current step's masks (no global state)."""

    def __init__(self) -> None:
        self.current: StepMasks | None = None

    def new_step(self) -> StepMasks:
        self.current = StepMasks()
        return self.current

    @contextmanager
    def replaying(self, masks: StepMasks | None) -> Iterator[None]:
        """Run with ``masks`` (a tiled segment's backward recomputes with its forward's masks)."""
        previous, self.current = self.current, masks
        try:
            yield
        finally:
            self.current = previous


class SampleDropReplay:
    """Callable standing in for a per-sample drop module: ``x * mask`` with the step's mask for this node."""

    def __init__(self, module: nn.Module, key: int, replay: MaskReplay) -> None:
        self.module = module
        self.key = key
        self.replay = replay

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.module.training or drop_rate(self.module) == 0.0 or self.replay.current is None:
            return self.module(x)  # eval, p = 0 (identity), or outside an SFT step: the module as is
        return x * self.replay.current.mask(self.key, self.module, x)


def replay_callable(module: nn.Module | None, key: int, replay: MaskReplay) -> SampleDropReplay | None:
    """The replaying stand-in for ``module`` if it is a per-sample drop module, else None."""
    if module is None or not is_sample_drop(module):
        return None
    return SampleDropReplay(module, key, replay)
