"""Shape-only stand-ins for the operators whose fake-tensor implementation is slow.

Under ``FakeTensorMode`` BatchNorm runs PyTorch's Python decomposition on every call: 60-100 ms for one call on a
(1, 64, 2048, 2048) map, measured; half of a DarkNet-19 simulation's time at 16,384 px went there. These
stand-ins return tensors of the same shapes, dtypes and layouts the decomposition returns, allocated through the
fake mode (so the tracker counts them as it would the originals) in microseconds. In-place updates of running
statistics are still reported to the stream-ordering checker from the schema, as for any operator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    # BatchNorm keeps its saved statistics in float32 for half and bfloat16 inputs (the accumulation type)
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _batch_norm(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = x.shape[1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # (B, C, H, W)
    return out, x.new_empty((c,), dtype=_stat_dtype(x)), x.new_empty((c,), dtype=_stat_dtype(x))


def _batch_norm_backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    mask = kwargs.get("output_mask", args[-1] if args else (True, True, True))
    c = x.shape[1]
    wdt = weight.dtype if weight is not None else x.dtype
    gx = torch.empty_like(x, memory_format=torch.contiguous_format) if mask[0] else None
    gw = x.new_empty((c,), dtype=wdt) if mask[1] else None
    gb = x.new_empty((c,), dtype=wdt) if mask[2] else None
    return gx, gw, gb


FAST_OPS: dict[Any, Callable[..., Any]] = {
    aten.native_batch_norm.default: _batch_norm,
    aten.native_batch_norm_backward.default: _batch_norm_backward,
}
