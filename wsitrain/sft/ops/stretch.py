"""Resizes whose source grid is stretched by the whole map's extents, tiled with the global source indices.

``F.interpolate`` / ``nn.Upsample`` to an output size that is not a whole multiple of the input (GhostNetV2's gate
restores a 2 x 2 pooled map to 4 x 5), or bilinear with ``align_corners=True`` at any size, read input pixels at
an affine function of the output index whose coefficients come from the whole map's extents (PyTorch's
``UpSample.h``; ``in`` and ``out`` are the untiled extents along one axis):

- nearest: ``floor(o * scale)`` (clamped to ``in - 1``), ``scale = in / out``, in float64 for float64 maps on CPU
  and in float32 otherwise (CUDA computes nearest scales in float32; not checked on a GPU here);
- bilinear, ``align_corners=False``: ``real = max(0, scale * (o + 0.5) - 0.5)`` with ``scale = in / out``. Whether
  the CPU kernel rounds that once (an FMA) or twice depends on the torch build and the loop it takes, not on the
  formula (measured, torch 2.14.1 on x86-64: float64 fuses in the AVX2 loop and not under
  ``ATEN_CPU_CAPABILITY=default``; float32 fused on long axes with 2.15.0 and not with 2.14.1). The stand-in fuses
  in float64 and rounds twice in float32; its weights equal the kernel's or lie one rounding of ``real`` (at most
  ``ulp(in)``) from them, and ``tests/test_sft_ops_stretch.py`` asserts exactly that, not bit equality;
  ``align_corners=True``: ``real = scale * o`` with ``scale = (in - 1) / (out - 1)`` (0 when ``out == 1``). Both in
  the op's math type (float64 for float64 maps, float32 otherwise). The layer reads ``i0 = floor(real)`` (clamped
  to ``in - 1``) and ``i0 + 1`` (``i0`` at the last pixel) with weights ``1 - l`` and ``l = real - i0``. The CPU
  kernel floors ``real`` after rounding it to float32 (``floorf``), CUDA truncates it; the weights follow.

The original layer run on a crop would stretch the crop's own extents, so a tile runs a stand-in instead
(``StretchCall``): it gathers the crop's pixels at the global indices, shifted by the crop's global start, and
weighs them with the global weights, as ordinary autograd ops (``index_select``, multiply, add). The per-axis
interval map (``Stretch``) answers, for an output interval, the input interval every variant above reads (the
hull: a plan does not know the device or the dtype a step will run in), and for a crop, the outputs whose reads
all lie inside it; the stand-in computes exactly those.

Which index a bilinear output reads near an integer ``real`` differs between variants only where the weight of
the other pixel is ~0, so the value agrees with the kernel to rounding whichever variant the stand-in uses;
nearest has no such slack, and its formula is the same everywhere once the scale is ``in / out`` (PyTorch's
``out == in`` and ``out == 2 in`` shortcuts give the formula's indices there). Scales passed by the caller
(``scale_factor=`` without ``recompute_scale_factor=True``) are not handled here: CPU and CUDA treat them
differently where ``out`` equals ``in`` or ``2 in``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

Reads = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # i0, i1 (global, int64), weight of i1 (bilinear)


def _scale(n_in: int, n_out: int, align_corners: bool, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's ``area_pixel_compute_scale`` in ``dtype`` (0-d; a float division rounded in that type)."""
    if align_corners:
        if n_out <= 1:
            return torch.zeros((), dtype=dtype)
        num, den = n_in - 1, n_out - 1
    else:
        num, den = n_in, n_out
    return torch.tensor(float(num), dtype=dtype) / torch.tensor(float(den), dtype=dtype)


def nearest_reads(o: torch.Tensor, n_in: int, n_out: int, dtype: torch.dtype) -> torch.Tensor:
    """Input index of each output index ``o`` (int64): ``min(floor(o * scale), in - 1)`` computed in ``dtype``."""
    scale = _scale(n_in, n_out, False, dtype).to(o.device)
    return torch.floor(o.to(dtype) * scale).to(torch.int64).clamp(max=n_in - 1)


def nearest_dtype(x: torch.Tensor) -> torch.dtype:
    """The type the nearest kernel computes indices in: float64 for float64 maps on CPU, else float32."""
    return torch.float64 if x.dtype == torch.float64 and x.device.type == "cpu" else torch.float32


def _fused_source_index(scale: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """``fma(scale, o + 0.5, -0.5)`` in float64: ``scale * (o + 0.5) - 0.5`` rounded once, as compiled kernels do.

    It is ``(scale * k - 1) / 2`` with ``k = 2 o + 1``. Split ``scale`` into 26 high and 27 low bits (Veltkamp):
    ``hi * k`` and ``lo * k`` are exact for ``k < 2^26``, and so is ``hi * k - 1``, so the last addition is the one
    rounding; halving is exact. (A float32 scale has no low bits: its fused result is this rounded to float32.)
    """
    k = (2 * o + 1).to(torch.float64)
    c = scale * 134217729.0  # 2^27 + 1
    hi = c - (c - scale)
    lo = scale - hi
    return ((hi * k - 1) + lo * k) / 2


def bilinear_reads(
    o: torch.Tensor, n_in: int, n_out: int, align_corners: bool, dtype: torch.dtype, cuda: bool
) -> Reads:
    """(i0, i1, l) of each output index ``o``: output = x[i0] * (1 - l) + x[i1] * l, computed in ``dtype``."""
    if n_in == n_out:  # the kernels copy an axis whose extent does not change (CUDA only when both do; same values)
        return o, o, torch.zeros(o.shape, dtype=dtype, device=o.device)
    scale = _scale(n_in, n_out, align_corners, dtype).to(o.device)
    if align_corners:
        real = scale * o.to(dtype)
    elif dtype == torch.float64:  # the compiled kernel fuses the multiply and the subtraction: emulated exactly
        real = _fused_source_index(scale, o).clamp(min=0)
    else:
        real = (scale * (o.to(dtype) + 0.5) - 0.5).clamp(min=0)
    # CPU: floorf(real), i.e. real rounded to float32 first; CUDA: (int) real
    i0 = (torch.trunc(real) if cuda else torch.floor(real.to(torch.float32))).to(torch.int64).clamp(max=n_in - 1)
    lam = (real - i0.to(dtype)).clamp(0, 1)
    i1 = i0 + (i0 < n_in - 1).to(torch.int64)
    return i0, i1, lam


# the variants a step may run: (math type, CUDA) — float64 maps compute in float64, all others in float32
_VARIANTS = ((torch.float32, False), (torch.float64, False), (torch.float64, True))


@dataclass(frozen=True)
class Stretch:
    """One axis of a resize from ``size_in`` to ``size_out`` whose source grid the whole map's extents stretch."""

    size_in: int
    size_out: int
    bilinear: bool
    align_corners: bool = False
    @cached_property
    def _reads(self) -> tuple[np.ndarray, np.ndarray]:
        """First and one-past-last input each output reads, over every variant (both monotone in the output)."""
        o = torch.arange(self.size_out, dtype=torch.int64)
        if not self.bilinear:
            i32, i64 = (nearest_reads(o, self.size_in, self.size_out, t) for t in (torch.float32, torch.float64))
            return torch.minimum(i32, i64).numpy(), (torch.maximum(i32, i64) + 1).numpy()
        lo, hi = None, None
        for dtype, cuda in _VARIANTS:
            i0, i1, _ = bilinear_reads(o, self.size_in, self.size_out, self.align_corners, dtype, cuda)
            lo = i0 if lo is None else torch.minimum(lo, i0)
            hi = i1 + 1 if hi is None else torch.maximum(hi, i1 + 1)
        assert lo is not None and hi is not None
        return lo.numpy(), hi.numpy()

    def input_interval(self, a: int, b: int, size_in: int) -> tuple[int, int]:
        """Input crop [lo, hi) holding every pixel outputs [a, b) read (reads are monotone in the output)."""
        assert size_in == self.size_in, (size_in, self.size_in)
        lo, hi = self._reads
        return int(lo[a]), int(hi[b - 1])

    def first_output(self, lo: int) -> int:
        """The first output whose reads all start at or after ``lo``: the first one the stand-in computes."""
        return int(np.searchsorted(self._reads[0], lo, side="left"))

    def output_count(self, lo: int, hi: int) -> int:
        """Outputs whose reads lie inside [lo, hi): the stand-in computes them all."""
        return max(0, int(np.searchsorted(self._reads[1], hi, side="right")) - self.first_output(lo))


@dataclass(frozen=True)
class StretchCall:
    """A tile's stand-in for a stretched resize (``OpSpec.extra[TILE_CALL]``), placed on the tile's crop."""

    rows: Stretch
    cols: Stretch

    def at(self, rows: tuple[int, int], cols: tuple[int, int]) -> Callable[..., torch.Tensor]:
        """The call for a tile whose crop of the resized map spans global ``rows`` x ``cols``.

        Called with the node's own arguments (the crop, then the size, mode, ... of F.interpolate or nothing more
        for nn.Upsample), it ignores all but the crop: the size is measured on the tile or fixed for the whole map.
        """

        def call(*args: Any, **kwargs: Any) -> torch.Tensor:
            x = args[0] if args else kwargs["input"]
            return self.resize(x, rows, cols)

        return call

    def resize(self, x: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Outputs ``first_output .. + output_count`` on each axis from the crop x (B, C, hi - lo, ...)."""
        assert tuple(x.shape[-2:]) == (rows[1] - rows[0], cols[1] - cols[0]), (tuple(x.shape), rows, cols)
        if not self.rows.bilinear:
            y = x.index_select(3, self._nearest(self.cols, cols, x))  # (B, C, th_in, tw_out)
            return y.index_select(2, self._nearest(self.rows, rows, x))  # (B, C, th_out, tw_out)
        # the kernels weigh in float64 for float64 maps, float32 otherwise; W inside H, as they do
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = self._bilinear(x.to(dtype), 3, self.cols, cols)  # (B, C, th_in, tw_out)
        return self._bilinear(y, 2, self.rows, rows).to(x.dtype)  # (B, C, th_out, tw_out)

    @staticmethod
    def _outputs(m: Stretch, span: tuple[int, int], device: torch.device) -> torch.Tensor:
        o0 = m.first_output(span[0])
        return torch.arange(o0, o0 + m.output_count(*span), dtype=torch.int64, device=device)

    def _nearest(self, m: Stretch, span: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
        return nearest_reads(self._outputs(m, span, x.device), m.size_in, m.size_out, nearest_dtype(x)) - span[0]

    def _bilinear(self, x: torch.Tensor, dim: int, m: Stretch, span: tuple[int, int]) -> torch.Tensor:
        o = self._outputs(m, span, x.device)
        i0, i1, lam = bilinear_reads(o, m.size_in, m.size_out, m.align_corners, x.dtype, x.device.type == "cuda")
        assert lam is not None
        shape = (-1, 1) if dim == 2 else (-1,)  # weights along H broadcast over W
        w1 = lam.view(shape)
        w0 = 1 - w1
        return x.index_select(dim, i0 - span[0]) * w0 + x.index_select(dim, i1 - span[0]) * w1
