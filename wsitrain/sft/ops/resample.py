"""Upsampling and space/depth regroupings: operators that change the image extents by an integer factor.

- ``nn.Upsample`` / ``F.interpolate`` with an integer scale factor, nearest or bilinear with
  ``align_corners=False``: output pixel ``o`` reads input ``o // s`` (nearest) or the two inputs around
  ``(o + 0.5) / s - 0.5`` (bilinear, clamped at the image border). Both maps commute with a shift of
  the input by whole pixels (the output moves by ``s`` pixels), so the original layer run on a crop
  ``[lo, hi)`` produces global outputs ``[lo * s, hi * s)``, exact wherever its reads stay inside the crop.
  This is a strided layer in reverse (``Upscale``).
- ``nn.PixelShuffle`` / ``F.pixel_shuffle`` and timm's ``DepthToSpace`` (depth-to-space): output ``o``
  reads input ``o // s``, an ``Upscale`` of nearest kind.
- ``nn.PixelUnshuffle`` / ``F.pixel_unshuffle`` and timm's ``SpaceToDepth`` (TResNet's stem): output ``o``
  reads inputs ``[s * o, s * o + s)``, a ``Window`` of kernel and stride ``s``; crops start on the block grid.
- timm's ``BlurPool2d`` (anti-aliased downsampling in TResNet, ResNet-D variants): symmetric reflect / constant
  padding and a fixed depthwise blur with a stride, i.e. a ``Window`` like a conv with ``padding_mode="reflect"``:
  crops start at 0 only at the true image border, where the module's own padding is the image's.

- An explicit output size (``size=``, fixed or measured at run time as GhostNetV2's ``out.shape[-2:]``) that the
  plan's shapes show to be a whole multiple of the input on both axes: an ``Upscale`` by that factor, which tiles
  run with ``scale_factor=`` (``FixedFactor``), since the size itself would resize every crop to the whole map's.

- Bilinear with ``align_corners=True`` (source ``o * (in - 1) / (out - 1)``) and output sizes that are not a whole
  multiple of the input (source ``o * in / out``, GhostNetV2's gate on odd maps): grids stretched by the whole map's
  extents, which the original layer run on a crop does not reproduce; tiles run a stand-in that gathers the crop at
  the global source indices with the global weights (``stretch.py``). Fractional factors with
  ``recompute_scale_factor=True`` are output sizes too.

Not tiled (with the reason): fractional factors passed to the kernel as such, antialiasing and the other modes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from wsitrain.sft.ops.stretch import Stretch, StretchCall
from wsitrain.sft.ops.types import OPAQUE, TILE_CALL, WINDOW, OpSpec, Window, call_arg, not_tileable

NEAREST = "nearest"
BILINEAR = "bilinear"
# timm's regroupings, known by class name (timm is optional); ``bs`` is their block size
SPACE_TO_DEPTH_NAMES = ("SpaceToDepth",)
DEPTH_TO_SPACE_NAMES = ("DepthToSpace",)
BLUR_POOL_NAMES = ("BlurPool2d",)  # timm.layers.BlurPool2d: F.pad(padding, pad_mode) then a strided depthwise blur
RESIZE = "resize"  # OpSpec.extra key of a resize to an output size: (mode, align_corners), until shapes are known
# FLOPs per output: a nearest copy moves one value; bilinear weighs four inputs (4 multiplies, 3 adds)
_FLOPS = {NEAREST: 1.0, BILINEAR: 7.0}
MAX_STRETCHED = 1 << 25  # stretched resizes compute fused source indices exactly below this output extent


@dataclass(frozen=True)
class Upscale:
    """One axis of an integer upscaling by ``factor``: the reverse of a strided window.

    ``bilinear``: each output reads the two inputs around ``(o + 0.5) / factor - 0.5`` (PyTorch's
    ``align_corners=False`` source index, clamped to 0); otherwise the input ``o // factor``.
    """

    factor: int
    bilinear: bool

    def input_interval(self, a: int, b: int, size_in: int) -> tuple[int, int]:
        """Input crop [lo, hi) from which the layer yields exact outputs [a, b)."""
        s = self.factor
        if not self.bilinear:
            return a // s, min(size_in, -(-b // s))
        # floor of the source index (2o + 1 - s) / (2s), clamped to 0 as PyTorch does; the last output also
        # reads the pixel after its floor
        lo = max(0, (2 * a + 1 - s) // (2 * s))
        hi = max(0, (2 * (b - 1) + 1 - s) // (2 * s)) + 2
        return lo, min(size_in, hi)

    def first_output(self, lo: int) -> int:
        """Global index of the first output the layer produces on a crop starting at ``lo``."""
        return lo * self.factor

    def output_count(self, lo: int, hi: int) -> int:
        """Outputs the layer produces on the crop [lo, hi)."""
        return (hi - lo) * self.factor


def _int_factor(v: Any, whole: bool = True) -> tuple[int, int] | None:
    """(sh, sw) when ``v`` is a positive whole scale factor (or a pair of them), else None.

    ``whole=False``: any positive constant factor passes (the pair returned is then meaningless).
    """
    pair = tuple(v) if isinstance(v, (tuple, list)) else (v, v)
    if len(pair) != 2 or any(isinstance(p, (fx.Node, bool)) or not isinstance(p, (int, float)) for p in pair):
        return None
    if any(p <= 0 or (whole and (p < 1 or float(p) != int(p))) for p in pair):
        return None
    return (int(pair[0]), int(pair[1])) if whole else (1, 1)


def _sized(type_name: str, mode: str, align_corners: bool | None) -> OpSpec:
    """A resize resolved against the plan's shapes (``resize_spec``), refused until they are known."""
    why = f"{type_name} resizes to a size fixed by the whole map, which a tile's crop does not have"
    return replace(not_tileable(type_name, OPAQUE, why), extra={RESIZE: (mode, align_corners)})


def interpolate_spec(
    type_name: str,
    size: Any,
    scale_factor: Any,
    mode: str,
    align_corners: bool | None,
    antialias: bool = False,
    recompute_scale_factor: bool | None = None,
) -> OpSpec:
    """Spec of an interpolation with these arguments (nn.Upsample's attributes or F.interpolate's)."""
    if antialias:
        return not_tileable(type_name, OPAQUE, f"{type_name} with antialias=True is not supported when tiled")
    if mode not in (NEAREST, BILINEAR):
        return not_tileable(type_name, OPAQUE, f"{type_name} mode {mode!r}: only 'nearest' and 'bilinear' tile")
    stretched = mode == BILINEAR and bool(align_corners)  # (in - 1) / (out - 1): the scale factor is not used
    if size is not None or stretched:
        return _sized(type_name, mode, align_corners)
    factors = _int_factor(scale_factor)  # recompute_scale_factor gives the same 1 / s on a crop as on the image
    if factors is None and recompute_scale_factor and _int_factor(scale_factor, whole=False) is not None:
        return _sized(type_name, mode, align_corners)  # the kernel sees only the output size, as with size=
    if factors is None:
        why = (
            f"scale_factor={scale_factor!r}: only whole-number factors map tiles to tiles (a fractional factor "
            "tiles with recompute_scale_factor=True, or as size=; passed to the kernel as 1 / factor, CPU and CUDA "
            "index differently where the output is as large as the input or twice it)"
        )
        return not_tileable(type_name, OPAQUE, f"{type_name} with {why}")
    bil = mode == BILINEAR
    return OpSpec(
        WINDOW,
        type_name,
        windows=(Upscale(factors[0], bil), Upscale(factors[1], bil)),
        flops_per_output=_FLOPS[mode],  # autograd keeps nothing but sizes for either mode
    )


@dataclass(frozen=True)
class FixedFactor:
    """How a tile runs a resize to an output size: ``F.interpolate`` by the whole map's factor.

    Called with the node's own arguments (the tile, then the size and mode F.interpolate or nn.Upsample got),
    it ignores the size: measured on the tile (GhostNetV2 passes ``out.shape[-2:]``) or fixed for the whole
    image, it is not what the tile's crop must grow to. For the whole map the two calls agree exactly:
    nearest reads ``o // s`` either way, and bilinear's source scale ``in / (s * in)`` is the same float as
    ``1 / s``.
    """

    factors: tuple[int, int]
    mode: str
    align_corners: bool | None

    def __call__(self, x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        return F.interpolate(x, scale_factor=self.factors, mode=self.mode, align_corners=self.align_corners)


def resize_spec(spec: OpSpec, s_in: tuple[int, ...], s_out: tuple[int, ...]) -> OpSpec:
    """A resize to an output size (``spec.extra[RESIZE]``), fitted to the untiled shapes of the plan.

    When the size is a whole multiple of the input on both axes (GhostNetV2 restores an average-pooled map
    of an even-sized one) and corners are not aligned, it is an upscaling by that factor, and tiles run it as one
    (``FixedFactor``). Otherwise output ``o`` reads input ``floor(o * in / out)`` (or bilinear around it): a grid
    stretched by the whole map's extents, which tiles compute with global indices (``stretch.StretchCall``).
    """
    mode, align_corners = spec.extra[RESIZE]
    if len(s_in) != 4 or len(s_out) != 4 or min(s_in[2:]) < 1:
        return spec
    (hi, wi), (ho, wo) = s_in[2:], s_out[2:]
    if not align_corners and ho % hi == 0 and wo % wi == 0:
        factors = (ho // hi, wo // wi)
        tiled = interpolate_spec(spec.type_name, None, factors, mode, align_corners)
        return replace(tiled, extra={TILE_CALL: FixedFactor(factors, mode, align_corners)})
    if max(ho, wo) >= MAX_STRETCHED:
        why = f"{spec.type_name} resizes {hi} x {wi} to {ho} x {wo}: outputs past {MAX_STRETCHED} are not tiled"
        return replace(spec, why_not=why)
    # output o reads input floor(o * in / out) (or around it): a grid stretched by the whole map's extents, which
    # tiles compute from global indices (stretch.py)
    bil = mode == BILINEAR
    rows, cols = Stretch(hi, ho, bil, bool(align_corners)), Stretch(wi, wo, bil, bool(align_corners))
    return OpSpec(
        WINDOW,
        spec.type_name,
        windows=(rows, cols),
        flops_per_output=_FLOPS[mode],  # autograd keeps the gathered indices and constant weights, no maps
        extra={TILE_CALL: StretchCall(rows, cols)},
    )


def pixel_shuffle_spec(type_name: str, factor: int) -> OpSpec:
    """Depth-to-space by ``factor``: output pixel o reads input o // factor (no saved tensors)."""
    up = Upscale(int(factor), False)
    return OpSpec(WINDOW, type_name, windows=(up, up), flops_per_output=1.0)


def pixel_unshuffle_spec(type_name: str, factor: int) -> OpSpec:
    """Space-to-depth by ``factor``: output pixel o reads the block [s o, s o + s) (no saved tensors)."""
    w = Window(int(factor), int(factor), 0, 1)
    return OpSpec(WINDOW, type_name, windows=(w, w), flops_per_output=1.0)


def is_resample_module(m: nn.Module) -> bool:
    """Modules this file describes (kept whole by the tracer)."""
    name = type(m).__name__
    return (
        isinstance(m, (nn.Upsample, nn.PixelShuffle, nn.PixelUnshuffle))
        or (name in SPACE_TO_DEPTH_NAMES + DEPTH_TO_SPACE_NAMES and isinstance(getattr(m, "bs", None), int))
        or (name in BLUR_POOL_NAMES and isinstance(getattr(m, "filt_size", None), int))
    )


def blur_pool_spec(m: nn.Module) -> OpSpec:
    """timm's BlurPool2d: a strided ``filt_size`` window after symmetric padding (reflect, constant, replicate)."""
    name = type(m).__name__
    pads = list(getattr(m, "padding", []))
    mode = str(getattr(m, "pad_mode", ""))
    if len(pads) != 4 or len(set(pads)) != 1 or mode not in ("reflect", "constant", "replicate"):
        why = f"padding {pads} with mode {mode!r}: only symmetric reflect, constant or replicate padding tiles"
        return not_tileable(name, OPAQUE, f"{name} with {why}")
    k, stride = int(m.filt_size), int(m.stride)
    w = Window(k, stride, int(pads[0]), 1)
    # the depthwise conv keeps its padded input for backward; 2 FLOPs per tap
    return OpSpec(WINDOW, name, windows=(w, w), saves_input=True, flops_per_output=2.0 * k * k)


def resample_module_spec(m: nn.Module) -> OpSpec | None:
    """Spec of a resampling module, None for other modules."""
    name = type(m).__name__
    if isinstance(m, nn.Upsample):
        return interpolate_spec(
            name, m.size, m.scale_factor, m.mode, m.align_corners, False, getattr(m, "recompute_scale_factor", None)
        )
    if isinstance(m, nn.PixelShuffle):
        return pixel_shuffle_spec(name, m.upscale_factor)
    if isinstance(m, nn.PixelUnshuffle):
        return pixel_unshuffle_spec(name, m.downscale_factor)
    if name in SPACE_TO_DEPTH_NAMES and isinstance(getattr(m, "bs", None), int):
        return pixel_unshuffle_spec(name, m.bs)
    if name in DEPTH_TO_SPACE_NAMES and isinstance(getattr(m, "bs", None), int):
        return pixel_shuffle_spec(name, m.bs)
    if name in BLUR_POOL_NAMES and isinstance(getattr(m, "filt_size", None), int):
        return blur_pool_spec(m)
    return None


RESAMPLE_FUNCS = (F.interpolate, F.upsample, torch.pixel_shuffle, torch.pixel_unshuffle)


def resample_function_spec(node: fx.Node) -> OpSpec:
    """Spec of F.interpolate / F.pixel_shuffle / F.pixel_unshuffle calls (``node.target`` in RESAMPLE_FUNCS)."""
    tname = getattr(node.target, "__name__", str(node.target))
    if node.target in (torch.pixel_shuffle, torch.pixel_unshuffle):
        key = "upscale_factor" if node.target is torch.pixel_shuffle else "downscale_factor"
        factor = call_arg(node, 1, key)
        if not isinstance(factor, int):
            return not_tileable(tname, OPAQUE, f"{tname} with a factor computed at run time is not supported")
        make = pixel_shuffle_spec if node.target is torch.pixel_shuffle else pixel_unshuffle_spec
        return make(tname, factor)
    return interpolate_spec(
        tname,
        call_arg(node, 1, "size"),
        call_arg(node, 2, "scale_factor"),
        call_arg(node, 3, "mode", NEAREST),
        call_arg(node, 4, "align_corners"),
        bool(call_arg(node, 6, "antialias", False)),
        call_arg(node, 5, "recompute_scale_factor"),
    )
