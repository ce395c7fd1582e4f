"""Cutting a tile out of a value: a view on the image axes, with a gradient padded back in one kernel."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

Dims = tuple[int, int]


def crop(value: Any, dims: Dims | None, rows: tuple[int, int], cols: tuple[int, int], one_pad: bool = True) -> Any:
    """``value`` cut to ``rows`` x ``cols`` (local offsets) on its image axes; tuples of tensors element-wise.

    Values constant over the image plane (dims None: ints, constants) are returned whole. ``one_pad``: the gradient
    goes back as one zero pad (``constant_pad_nd``); False: a zeroed buffer the gradient is copied into (two kernels,
    the same values: the executor's path before issue 57, kept for the tests that compare the two bit for bit).
    """
    if dims is None:
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(crop(v, dims, rows, cols, one_pad) for v in value)
    if rows == (0, value.shape[dims[0]]) and cols == (0, value.shape[dims[1]]):
        return value  # nothing to cut: no view, and no padded copy of its gradient
    index: list[slice] = [slice(None)] * value.dim()
    index[dims[0]] = slice(*rows)
    index[dims[1]] = slice(*cols)
    if torch.is_grad_enabled() and isinstance(value, torch.Tensor) and value.requires_grad:
        return _Crop.apply(value, tuple(index), one_pad)
    return value[tuple(index)]


def _pads(shape: torch.Size, index: tuple[slice, ...]) -> list[int]:
    """``F.pad``'s widths (last dimension first) that put a tensor cut by ``index`` back into ``shape``."""
    first = min(d for d, s in enumerate(index) if s != slice(None))
    pads: list[int] = []
    for d in reversed(range(first, len(shape))):
        s = index[d]
        lo = 0 if s.start is None else int(s.start)
        hi = int(shape[d]) if s.stop is None else int(s.stop)
        pads += [lo, int(shape[d]) - hi]
    return pads


class _Crop(torch.autograd.Function):
    """A crop on both image axes whose gradient is one buffer of the uncropped shape.

    Slicing H then W makes autograd pad the gradient twice (``slice_backward`` per axis): the half-padded
    intermediate and the padded result are both alive for a moment, one tile map more than the replay counts
    (ResNet-50's identity crop at 16,384 px: +3.8% over the replay on the simulated device, measured). The buffer is
    one zero pad of the gradient: one kernel writing it once, where zeroing a buffer and copying into it wrote the
    tile's map twice (issue 57: a crop's gradient padded into zeros cost 18 ms of the capped ResNet-50 step on an
    H200).
    """

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, index: tuple[slice, ...], one_pad: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.shape, ctx.index, ctx.one_pad = value.shape, index, one_pad
        return value[index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.one_pad:
            return F.pad(grad, _pads(ctx.shape, ctx.index)), None, None
        out = grad.new_zeros(ctx.shape)
        out[ctx.index] = grad
        return out, None, None
