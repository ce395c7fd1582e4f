"""Pixels out of a slide: fill a preallocated (3, H, W) uint8 tensor from one pyramid level, resized on the fly.

The low layer under streaming (``stream``) and tissue detection (``tissue``), so neither needs the other.
Chunks are read (and, off a pyramid level, resized with PIL's antialiased bilinear filter using absolute source
coordinates, so chunks join without seams) and copied into place: no full-size intermediate ever exists.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

from wsitrain.errors import SlideError
from wsitrain.slides.readers import SlideReader


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
