"""Explicit padding: ``F.pad`` and ``nn.ZeroPad2d`` / ``ConstantPad2d`` / ``ReflectionPad2d`` / ``ReplicationPad2d``.

Along one axis, a padding of ``before`` and ``after`` pixels puts input pixel ``i`` at output ``i + before``,
with ``before`` / ``after`` padded values at the two ends (a constant, a reflection or a copy of the border
pixel). The original layer runs on each tile's input crop ``[lo, hi)`` and pads *the crop*: at the true image
border (``lo == 0``, ``hi == size``) that padding is the image's, at an interior crop edge it is made up. The
interval map keeps only outputs that read real pixels there (``Pad``), the way a conv's zero padding at an
interior tile edge is never kept, and asymmetric paddings (HGNetV2's stem pads right and bottom only) are two
different numbers per axis, not one.

Not tiled (with the reason): negative padding (a crop of the map), circular padding (wraps the image around),
and paddings computed at run time (timm's dynamic "same" padding measures the tile, not the image).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import fx, nn

from wsitrain.sft.ops.types import OPAQUE, WINDOW, OpSpec, call_arg, not_tileable

PAD_MODES = ("constant", "reflect", "replicate")
_PAD_MODULES = (nn.ZeroPad2d, nn.ConstantPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d)
PAD_FUNCS = (F.pad,)


@dataclass(frozen=True)
class Pad:
    """One axis of a padding: ``before`` pixels ahead of the input, ``after`` pixels behind it.

    ``min_crop``: the fewest input pixels the layer accepts (reflect padding needs more pixels than it pads,
    on the crop as on the image); crops are widened to it inside the image, never past its border.
    """

    before: int
    after: int
    min_crop: int = 1

    def input_interval(self, a: int, b: int, size_in: int) -> tuple[int, int]:
        """Input crop [lo, hi) from which the layer yields exact outputs [a, b).

        Output ``o`` reads input ``o - before``. Outputs in the padding read nothing; they are exact only when
        the crop touches that border, so the crop starts at 0 for outputs before the input, ends at ``size_in``
        for outputs after it, and is never empty (a crop of nothing would pad nothing real).
        """
        lo = min(max(0, a - self.before), size_in)
        hi = max(min(size_in, b - self.before), lo)
        if hi - lo < self.min_crop:  # widen inside the image: forward first, then back from the far border
            hi = min(size_in, lo + self.min_crop)
            lo = max(0, hi - self.min_crop)
        return lo, hi

    def first_output(self, lo: int) -> int:
        """Global index of the layer's first output on a crop starting at ``lo``.

        At ``lo == 0`` the first output is the image's first padded pixel (global 0); inside the image the
        layer's first ``before`` outputs are made-up padding standing at globals ``lo .. lo + before - 1``,
        and the crop's first pixel lands at ``lo + before``, where it belongs. Both are ``lo``.
        """
        return lo

    def output_count(self, lo: int, hi: int) -> int:
        """Outputs the layer produces on the crop [lo, hi) (it pads both ends of any crop)."""
        return hi - lo + self.before + self.after


def _pad_spec(type_name: str, pad: Any, mode: str) -> OpSpec:
    """Spec of a padding by ``pad`` (F.pad's order: W before, W after, H before, H after, then other dims)."""
    if not isinstance(pad, Sequence) or any(isinstance(p, fx.Node) or not isinstance(p, int) for p in pad):
        why = (
            f"{type_name} with a padding computed at run time (such as timm's dynamic 'same' padding) would measure "
            "each tile rather than the image; use a fixed padding (a conv's padding= or nn.ZeroPad2d)"
        )
        return not_tileable(type_name, OPAQUE, why)
    pads = [int(p) for p in pad]
    if mode not in PAD_MODES:
        why = f"{type_name} mode {mode!r}: only 'constant', 'reflect' and 'replicate' padding tile"
        return not_tileable(type_name, OPAQUE, f"{why} (circular padding wraps the image around)")
    # constant pads any dims (those off the image axes do not touch tiling); PyTorch pads a 4-D map with
    # reflect and replicate only on its last two dims
    if len(pads) % 2 or not 2 <= len(pads) <= 8 or (len(pads) != 4 and mode != "constant"):
        why = f"{type_name} with padding {pads} of a (B, C, H, W) map is not supported when tiled"
        return not_tileable(type_name, OPAQUE, why)
    if any(p < 0 for p in pads):
        why = f"{type_name} with negative padding {pads} crops the map at its border, which is not supported when tiled"
        return not_tileable(type_name, OPAQUE, why)
    (wl, wr), (ht, hb) = pads[0:2], (pads[2:4] if len(pads) >= 4 else (0, 0))
    # reflect pads with pixels the crop must hold: PyTorch wants more pixels than it pads, on each side
    need_h, need_w = (max(ht, hb) + 1, max(wl, wr) + 1) if mode == "reflect" else (1, 1)
    # autograd keeps only sizes; one copy per output
    return OpSpec(WINDOW, type_name, windows=(Pad(ht, hb, need_h), Pad(wl, wr, need_w)), flops_per_output=1.0)


def is_pad_module(m: nn.Module) -> bool:
    return isinstance(m, _PAD_MODULES)


def pad_module_spec(m: nn.Module) -> OpSpec:
    """nn.ZeroPad2d / ConstantPad2d / ReflectionPad2d / ReplicationPad2d (``padding`` is W, W, H, H)."""
    mode = "constant"
    if isinstance(m, nn.ReflectionPad2d):
        mode = "reflect"
    elif isinstance(m, nn.ReplicationPad2d):
        mode = "replicate"
    return _pad_spec(type(m).__name__, tuple(m.padding), mode)  # type: ignore[arg-type]


def pad_function_spec(node: fx.Node) -> OpSpec:
    """F.pad(input, pad, mode, value) with constant arguments."""
    return _pad_spec("pad", call_arg(node, 1, "pad"), str(call_arg(node, 2, "mode", "constant") or "constant"))
