"""Stream a slide region, chunk by chunk, into one preallocated uint8 CHW tensor (pinned when CUDA is available).

No full-size intermediate ever exists: each chunk is read (and, off a pyramid level, resized with PIL's
antialiased bilinear filter using absolute source coordinates, so chunks join without seams) and copied into
its place in the output. Peak host memory is the output plus a few chunk buffers.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from wsitrain.errors import SlideError
from wsitrain.slides.readers import Background, SlideReader, open_slide
from wsitrain.slides.resolution import Resolution, choose_resolution

REGIONS = ("whole", "tissue", "fixed")


@dataclass
class ReadResult:
    """A streamed region and how it was read. ``box`` is (x, y, w, h) in level-0 pixels of the whole image."""

    image: torch.Tensor  # uint8 (3, H, W), contiguous
    path: str
    level: int
    scale: float  # output px per level px (<= 1)
    downsample: float  # level-0 px per output px
    box: tuple[int, int, int, int]
    mpp: float | None
    bytes: int
    seconds: float
    tissue_box: tuple[int, int, int, int] | None = None
    pinned: bool = False

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")


def _as_hw(size: int | tuple[int, int] | list[int], name: str) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        h = w = size
    elif isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) for v in size):
        h, w = size
    else:
        raise SlideError(
            f"{name}: size {size!r} is not an int or (height, width)", hint="set data.size to e.g. 4096 or [4096, 6144]"
        )
    if h <= 0 or w <= 0:
        raise SlideError(f"{name}: size {size!r} must be positive", hint="set data.size to e.g. 4096")
    return int(h), int(w)


def _allocate(shape: tuple[int, int, int], pin_memory: bool | None) -> tuple[torch.Tensor, bool]:
    pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
    if pin and not torch.cuda.is_available():
        pin = False  # pinning needs a CUDA driver; asking for it on a CPU machine is not an error
    if pin:
        try:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError as e:  # pinned memory is a limited resource: train slower rather than fail
            warnings.warn(f"could not pin {shape} uint8 ({e}); using pageable memory", stacklevel=3)
    return torch.empty(shape, dtype=torch.uint8), False


def fill_region(
    reader: SlideReader,
    out: torch.Tensor,
    level: int,
    scale: float,
    origin: tuple[float, float],
    chunk: int = 4096,
) -> None:
    """Fill ``out`` (3, H, W) with level ``level`` pixels starting at ``origin`` (level px), resized by ``scale``.

    Output pixel (i, j) covers level pixels [origin + j / scale, origin + (j + 1) / scale).
    """
    _, H, W = out.shape
    if chunk < 64:
        raise SlideError(f"chunk {chunk} is too small", hint="use data.chunk of at least 64 (default 4096)")
    if scale >= 1.0:
        ox, oy = int(round(origin[0])), int(round(origin[1]))
        for y in range(0, H, chunk):
            for x in range(0, W, chunk):
                h, w = min(chunk, H - y), min(chunk, W - x)
                reader.read_into(level, ox + x, oy + y, out[:, y : y + h, x : x + w])
        return
    # Resize path: keep each chunk's *source* read about chunk x chunk, however strong the downscale.
    step = max(64, int(chunk * scale))
    margin = int(math.ceil(1.0 / scale)) + 2  # bilinear support is 1/scale source px on each side
    for y in range(0, H, step):
        for x in range(0, W, step):
            h, w = min(step, H - y), min(step, W - x)
            bx0, by0 = origin[0] + x / scale, origin[1] + y / scale
            bx1, by1 = origin[0] + (x + w) / scale, origin[1] + (y + h) / scale
            sx0, sy0 = int(math.floor(bx0)) - margin, int(math.floor(by0)) - margin
            sx1, sy1 = int(math.ceil(bx1)) + margin, int(math.ceil(by1)) + margin
            src = reader.read_region(level, sx0, sy0, sx1 - sx0, sy1 - sy0)
            img = Image.fromarray(src).resize(
                (w, h), Image.Resampling.BILINEAR, box=(bx0 - sx0, by0 - sy0, bx1 - sx0, by1 - sy0)
            )
            out[:, y : y + h, x : x + w].copy_(torch.from_numpy(np.array(img)).permute(2, 0, 1))


def read_thumbnail(reader: SlideReader, max_side: int = 512) -> tuple[np.ndarray, float]:
    """(h, w, 3) uint8 view of the whole slide with its longer side <= ``max_side``; and its level-0 downsample."""
    info = reader.info
    w0, h0 = info.dimensions
    want = max(w0, h0) / max_side if max(w0, h0) > max_side else 1.0
    level = 0
    for i, ds in enumerate(info.level_downsamples):
        if ds <= want and ds >= info.level_downsamples[level]:
            level = i
    ds_l = info.level_downsamples[level]
    scale = min(1.0, ds_l / want)
    lw, lh = info.level_dimensions[level]
    tw, th = max(1, int(round(lw * scale))), max(1, int(round(lh * scale)))
    out = torch.empty((3, th, tw), dtype=torch.uint8)
    fill_region(reader, out, level, scale, (0.0, 0.0))
    return out.permute(1, 2, 0).numpy(), (w0 / tw + h0 / th) / 2


# Tissue boxes by (path, size, mtime, background): a single-level slide's thumbnail costs a full read, so a slide
# read every epoch detects its tissue once per process.
_TISSUE_CACHE: dict[tuple[str, int, int, Background], tuple[int, int, int, int] | None] = {}


def _tissue_box(reader: SlideReader) -> tuple[int, int, int, int] | None:
    from wsitrain.slides.tissue import detect_tissue

    st = reader.path.stat()
    key = (str(reader.path.resolve()), st.st_size, st.st_mtime_ns, reader.background)
    if key not in _TISSUE_CACHE:
        if len(_TISSUE_CACHE) > 10000:
            _TISSUE_CACHE.clear()
        _TISSUE_CACHE[key] = detect_tissue(reader).box
    return _TISSUE_CACHE[key]


def read_slide_region(
    path: str | Path | SlideReader,
    *,
    level: int | None = None,
    mpp: float | None = None,
    magnification: float | None = None,
    fallback_mpp: float | None = None,
    region: str = "whole",
    size: int | tuple[int, int] | None = None,
    background: Background = (255, 255, 255),
    pad_multiple: int = 1,
    pin_memory: bool | None = None,
    chunk: int = 4096,
) -> ReadResult:
    """Read a slide region at the chosen resolution into a (3, H, W) uint8 tensor.

    ``region``: "whole" (the slide), "tissue" (bounding box of detected tissue; the whole slide when none is found)
    or "fixed" (``size`` = int or (h, w) output px centred on the tissue: cropped when tissue is larger, padded with
    ``background`` when smaller). The output is padded at the right and bottom to a multiple of ``pad_multiple``.
    """
    t0 = time.perf_counter()
    own = not isinstance(path, SlideReader)
    reader = open_slide(path, background) if own else path  # type: ignore[arg-type]
    try:
        info = reader.info
        name = info.name
        if region not in REGIONS:
            raise SlideError(f"{name}: region {region!r} is not one of {', '.join(REGIONS)}", hint="set data.region")
        if not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise SlideError(
                f"pad_multiple {pad_multiple!r} must be a positive int", hint="use the model's stride, e.g. 32"
            )
        if region == "fixed" and size is None:
            raise SlideError(f"{name}: region 'fixed' needs a size", hint="set data.size, e.g. 4096 or [4096, 6144]")
        if region != "fixed" and size is not None:
            raise SlideError(
                f"{name}: size {size!r} is only used with region 'fixed' (got {region!r})",
                hint="set data.region: fixed, or remove data.size",
            )
        res: Resolution = choose_resolution(
            info, level=level, mpp=mpp, magnification=magnification, fallback_mpp=fallback_mpp
        )
        w0, h0 = info.dimensions
        tissue_box = None
        if region in ("tissue", "fixed"):
            tissue_box = _tissue_box(reader)
        ds = res.downsample
        if region == "fixed":
            assert size is not None
            oh, ow = _as_hw(size, name)
            cx, cy = (
                (w0 / 2, h0 / 2)
                if tissue_box is None
                else (tissue_box[0] + tissue_box[2] / 2, tissue_box[1] + tissue_box[3] / 2)
            )
            bx, by = cx - ow * ds / 2, cy - oh * ds / 2
        else:
            bx, by, bw, bh = (0, 0, w0, h0) if region == "whole" or tissue_box is None else tissue_box
            ow, oh = max(1, int(round(bw / ds))), max(1, int(round(bh / ds)))
        ow = -(-ow // pad_multiple) * pad_multiple
        oh = -(-oh // pad_multiple) * pad_multiple
        ds_level = info.level_downsamples[res.level]
        if res.scale >= 1.0:  # snap to the level grid so no resampling happens
            bx, by = round(bx / ds_level) * ds_level, round(by / ds_level) * ds_level
        out, pinned = _allocate((3, oh, ow), pin_memory)
        fill_region(reader, out, res.level, res.scale, (bx / ds_level, by / ds_level), chunk)
        seconds = time.perf_counter() - t0
        box = (int(round(bx)), int(round(by)), int(round(ow * ds)), int(round(oh * ds)))
        return ReadResult(
            image=out,
            path=str(reader.path),
            level=res.level,
            scale=res.scale,
            downsample=ds,
            box=box,
            mpp=res.mpp,
            bytes=out.numel(),
            seconds=seconds,
            tissue_box=tissue_box,
            pinned=pinned,
        )
    finally:
        if own:
            reader.close()
