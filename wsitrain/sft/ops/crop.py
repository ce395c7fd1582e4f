"""Cutting a tile out of a value: a view on the image axes, with a gradient padded back in one buffer."""

from __future__ import annotations

from typing import Any

import torch

Dims = tuple[int, int]


def crop(value: Any, dims: Dims | None, rows: tuple[int, int], cols: tuple[int, int]) -> Any:
    """``value`` cut to ``rows`` x ``cols`` (local offsets) on its image axes; tuples of tensors element-wise.

    Values constant over the image plane (dims None: ints, constants) are returned whole.
    """
    if dims is None:
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(crop(v, dims, rows, cols) for v in value)
    if rows == (0, value.shape[dims[0]]) and cols == (0, value.shape[dims[1]]):
        return value  # nothing to cut: no view, and no padded copy of its gradient
    index: list[slice] = [slice(None)] * value.dim()
    index[dims[0]] = slice(*rows)
    index[dims[1]] = slice(*cols)
    if torch.is_grad_enabled() and isinstance(value, torch.Tensor) and value.requires_grad:
        return _Crop.apply(value, tuple(index))
    return value[tuple(index)]


class _Crop(torch.autograd.Function):
    """A crop on both image axes whose gradient is one buffer of the uncropped shape.

    Slicing H then W makes autograd pad the gradient twice (``slice_backward`` per axis): the half-padded
    intermediate and the padded result are both alive for a moment, one tile map more than the replay counts
    (ResNet-50's identity crop at 16,384 px: +3.8% over the replay on the simulated device, measured).
    """

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, index: tuple[slice, ...]) -> torch.Tensor:  # type: ignore[override]
        ctx.shape, ctx.index = value.shape, index
        return value[index]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = grad.new_zeros(ctx.shape)
        out[ctx.index] = grad
        return out, None
