"""Weights cast once per sweep under autocast (wsitrain/sft/execution/autocast.py): bitwise the per-tile casts.

A tiled segment's forward and recompute sweeps cast each weight once (autocast's cache, cleared when the sweep ends)
instead of once per tile. Under CPU bf16 autocast the step's output, every parameter gradient and the input gradient
must equal, bit for bit, the step that casts per tile, with fewer casts.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.models.resnet import BasicBlock

from wsitrain.sft import SFT
from wsitrain.sft.execution.tiled import TiledSegment


class _Casts(TorchDispatchMode):
    """Counts float32 -> bf16 casts."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is torch.bfloat16:
            self.n += 1
        return func(*args, **kwargs)


def _net() -> nn.Module:
    down = nn.Sequential(nn.Conv2d(8, 12, 1, 2, bias=False), nn.BatchNorm2d(12))
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), BasicBlock(8, 8), BasicBlock(8, 12, 2, down),
        nn.Conv2d(12, 12, 3, padding=1), nn.ReLU(),
    )  # fmt: skip
    return nn.Sequential(trunk, nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(12, 3)).eval()


class _Shared(nn.Module):
    """One convolution applied twice in a row: its two bf16 gradients per tile must not be summed before the cast."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv = nn.Conv2d(3, 6, 3, padding=1), nn.Conv2d(6, 6, 3, padding=1)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(torch.relu(self.conv(torch.relu(self.stem(x))))))
        return self.head(y.mean(dim=(2, 3)))


def _tiled(sft: SFT) -> list[TiledSegment]:
    compiled = next(iter(sft._cache.values()))
    return [s for s in compiled.segments if isinstance(s, TiledSegment)]


def _step(sft: SFT, x: torch.Tensor) -> tuple[list[torch.Tensor | None], int]:
    xr = x.clone().requires_grad_(True)
    with _Casts() as casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = sft(xr)
            loss = (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
        loss.backward()
    assert any(t.seg.n_tiles > 1 for t in _tiled(sft)), "the case is meant to tile"
    return [y.detach(), xr.grad, *(p.grad for p in sft.model.parameters())], casts.n


@pytest.mark.parametrize(("shape", "tile"), [((1, 3, 70, 58), 16), ((2, 3, 45, 62), 24)])
def test_casting_once_per_sweep_is_bitwise_the_per_tile_casts(
    shape: tuple[int, ...], tile: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    net = _net()
    x = torch.randn(shape)
    once, n_once = _step(SFT(copy.deepcopy(net), memory_budget="1GiB", tile_size=tile), x)
    init = TiledSegment.__init__

    def per_tile(self: TiledSegment, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.cast_once = False  # the per-tile casts this change replaced

    monkeypatch.setattr(TiledSegment, "__init__", per_tile)
    each, n_each = _step(SFT(copy.deepcopy(net), memory_budget="1GiB", tile_size=tile), x)
    for k, (a, b) in enumerate(zip(once, each, strict=True)):
        assert a is not None and b is not None and a.dtype == b.dtype, k
        assert torch.equal(a, b), f"value {k} differs"
    assert 0 < n_once < n_each


def test_a_weight_two_layers_share_keeps_per_tile_casts() -> None:
    torch.manual_seed(0)
    sft = SFT(_Shared(), memory_budget="1GiB", tile_size=16, checkpoints=[])  # one tiled segment: both uses
    got, _ = _step(sft, torch.randn(1, 3, 48, 40))
    assert [s.cast_once for s in _tiled(sft)] == [False]
    assert all(g is not None for g in got)


def test_the_plan_counts_the_held_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast a tiled segment's sweep holds a bf16 copy of its weights: the plan's peak counts them
    (float32 plans hold none)."""
    from wsitrain.sft.planning import tile_memory

    def peak(dtype: torch.dtype) -> tuple[int, int]:
        sft = SFT(_net(), memory_budget="1GiB", tile_size=16)
        plan = sft.plan_for((1, 3, 70, 58), dtype=dtype)
        assert any(s.mode == "tiled" for s in plan.segments)
        return plan.estimated_peak_bytes, max(s.peak_bytes for s in plan.segments if s.mode == "tiled")

    with_casts = peak(torch.bfloat16)
    fp32 = peak(torch.float32)
    monkeypatch.setattr(tile_memory, "cast_bytes", lambda f, nodes: 0)
    without = peak(torch.bfloat16)
    assert peak(torch.float32) == fp32
    assert with_casts[1] > without[1]
    assert with_casts[1] - without[1] <= 2 * sum(p.numel() for p in _net().parameters())
