"""Heatmap PNGs: class activation maps over the slide's thumbnail, with colour bar, tissue outline and title.

Placement is done in level-0 slide coordinates (matplotlib ``extent``), so the thumbnail (a pyramid level, or the
already-read image shrunk) and the maps (CAM pixels of ``stride`` image pixels) line up without resampling code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from wsitrain.report.heatmap import SlideMaps  # noqa: E402
from wsitrain.write_errors import named_write_errors  # noqa: E402

# Panels per PNG at most: with many classes the most probable ones are drawn (the .npy holds every class).
MAX_CLASS_PANELS = 4


@dataclass(frozen=True)
class Placement:
    """Where the analysed image sits on the slide: level-0 ``box`` (x, y, w, h), ``downsample`` level-0 px per
    image px, and the slide's level-0 (width, height)."""

    box: tuple[float, float, float, float]
    downsample: float
    slide_wh: tuple[int, int]


@dataclass(frozen=True)
class Thumbnail:
    """An (h, w, 3) uint8 picture covering level-0 ``extent`` (x0, x1, y1, y0) as matplotlib wants it."""

    rgb: np.ndarray
    extent: tuple[float, float, float, float]


# Pixels of one band of shrink_image: 16 Mpx, 192 MiB as float (a 4096-row band of a 4096 px wide image, as before).
BAND_PX = 1 << 24


def shrink_image(image: torch.Tensor, max_side: int, rows_per_chunk: int = 4096) -> tuple[np.ndarray, int]:
    """(3, H, W) or (1, 3, H, W) uint8 -> (h, w, 3) uint8 by an integer box filter, band by band (no full-size float
    copy). ``image`` may be a region source (a slide read tile by tile): each band is read from it in turn."""
    h, w = image.shape[-2:]
    x = image if len(image.shape) == 4 else image[None]  # (1, 3, H, W); a source is cut as [:, :, rows, cols]
    f = max(1, -(-max(h, w) // max_side))
    hh, ww = h // f * f, w // f * f  # whole cells only: the last partial row/column of cells is dropped
    if hh == 0 or ww == 0:
        return x[:, :, 0:h, 0:w][0].permute(1, 2, 0).numpy().copy(), 1
    # a band's rows: at most rows_per_chunk and BAND_PX pixels (a float band is 12 bytes a pixel), whole cells
    band = max(f, min(rows_per_chunk, BAND_PX // max(1, ww)) // f * f)
    parts = [
        F.avg_pool2d(x[:, :, r : min(r + band, hh), 0:ww].float(), f)[0].round().to(torch.uint8)
        for r in range(0, hh, band)
    ]
    return torch.cat(parts, dim=1).permute(1, 2, 0).numpy(), f


def slide_thumbnail(reader: object, image: torch.Tensor, where: Placement, max_side: int = 1024) -> Thumbnail:
    """A thumbnail without a second full-resolution read: a coarser pyramid level when the slide has one
    (``read_thumbnail``), else the image already in memory shrunk (a slide read tile by tile: read band by band)."""
    from wsitrain.slides.pixels import read_thumbnail

    info = reader.info  # type: ignore[attr-defined]
    w0, h0 = info.dimensions
    want = max(w0, h0) / max_side  # level-0 px per thumbnail px
    # A level helps only if it is clearly coarser than the image already read, yet no coarser than wanted.
    if any(where.downsample * 1.5 < ds <= want for ds in info.level_downsamples):
        rgb, _ = read_thumbnail(reader, max_side)  # type: ignore[arg-type]
        return Thumbnail(rgb, (0.0, float(w0), float(h0), 0.0))
    rgb, f = shrink_image(image, max_side)
    x, y = where.box[0], where.box[1]
    ds = where.downsample * f
    return Thumbnail(rgb, (x, x + rgb.shape[1] * ds, y + rgb.shape[0] * ds, y))


def _map_extent(shape: tuple[int, int], cell: float, where: Placement) -> tuple[float, float, float, float]:
    x, y = where.box[0], where.box[1]
    ds = cell * where.downsample  # level-0 px per map pixel
    return (x, x + shape[1] * ds, y + shape[0] * ds, y)


def _view(where: Placement) -> tuple[float, float, float, float]:
    """Axis limits: the analysed box, clipped to the slide (padding past the edge is not slide)."""
    x, y, w, h = where.box
    return max(0.0, x), min(float(where.slide_wh[0]), x + w), min(float(where.slide_wh[1]), y + h), max(0.0, y)


def render_heatmap(
    path: Path,
    maps: SlideMaps,
    thumb: Thumbnail,
    where: Placement,
    class_names: list[str],
    title: str,
    tissue: np.ndarray | None = None,
) -> Path:
    """Write the PNG: the attention map of each branch (attention heads: up to MAX_CLASS_PANELS, the predicted
    class's branch first), one panel per class CAM (up to MAX_CLASS_PANELS, most probable first), the saliency."""
    probs = maps.probs.numpy()
    order = [int(k) for k in np.argsort(-probs)[:MAX_CLASS_PANELS]]
    att = maps.attention.double().numpy() if maps.attention is not None else None
    branches = ([0] if att.shape[0] == 1 else order) if att is not None else []
    n = len(branches) + len(order) + (maps.saliency is not None)
    x0, x1, y1, y0 = _view(where)
    aspect = (y1 - y0) / max(1e-9, x1 - x0)
    fig, axes = plt.subplots(1, n, figsize=(4.6 * n, 3.9 * aspect + 0.9), squeeze=False, layout="constrained")
    cam = maps.cam.double().numpy()
    for ax, b in zip(axes[0], branches, strict=False):
        assert att is not None
        _base(ax, thumb, tissue)
        # positions without attention (off the tissue mask) stay unpainted, so the slide shows through
        im = ax.imshow(np.ma.masked_equal(att[b], 0.0), extent=_map_extent(att.shape[1:], maps.stride, where),
                       cmap="inferno", alpha=0.6,
                       vmin=0.0, vmax=float(att[b].max()) or 1.0, interpolation="nearest")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="attention weight (sums to 1)")
        ax.set_title("attention" if len(branches) == 1 and att.shape[0] == 1 else f"attention, branch {class_names[b]}",
                     fontsize=10)  # fmt: skip
        ax.set_xlim(x0, x1)
        ax.set_ylim(y1, y0)
    for ax, k in zip(axes[0][len(branches) :], order, strict=False):
        _base(ax, thumb, tissue)
        lim = float(np.abs(cam[k]).max()) or 1.0
        im = ax.imshow(cam[k], extent=_map_extent(cam.shape[1:], maps.stride, where), cmap="RdBu_r", vmin=-lim,
                       vmax=lim, alpha=0.55, interpolation="bilinear")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="logit contribution")
        ax.set_title(f"CAM {class_names[k]} (p = {probs[k]:.3f})", fontsize=10)
        if maps.decisive is not None:
            r, c = maps.decisive[k].tolist()
            ds = maps.stride * where.downsample
            ax.plot(where.box[0] + (c + 0.5) * ds, where.box[1] + (r + 0.5) * ds, marker="o", ls="none", ms=14,
                    mfc="none", mec="black", mew=2.0, label="decided the max-pooled score")
            ax.legend(loc="lower left", fontsize=7, framealpha=0.8)
        ax.set_xlim(x0, x1)
        ax.set_ylim(y1, y0)
    if maps.saliency is not None:
        ax = axes[0][-1]
        _base(ax, thumb, tissue)
        mag = maps.saliency.double().norm(dim=0).numpy()  # per-cell L2 norm over colour channels
        im = ax.imshow(mag, extent=_map_extent(mag.shape, maps.block, where), cmap="magma", alpha=0.6,
                       interpolation="nearest", vmin=0.0, vmax=float(mag.max()) or 1.0)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label=f"|d logit / d image|, {maps.block} px cells")
        ax.set_title(f"saliency of {class_names[maps.predicted]}", fontsize=10)
        ax.set_xlim(x0, x1)
        ax.set_ylim(y1, y0)
    k = maps.predicted
    fig.suptitle(f"{title}: predicted {class_names[k]} (p = {probs[k]:.3f}), {maps.pool}-pool head", fontsize=12)
    try:
        with named_write_errors(path, "the heatmap"):
            fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def _base(ax: plt.Axes, thumb: Thumbnail, tissue: np.ndarray | None) -> None:
    ax.imshow(thumb.rgb, extent=thumb.extent, interpolation="bilinear")
    if tissue is not None and tissue.any() and not tissue.all():
        x0, x1, y1, y0 = thumb.extent
        h, w = tissue.shape
        xs = x0 + (np.arange(w) + 0.5) * (x1 - x0) / w
        ys = y0 + (np.arange(h) + 0.5) * (y1 - y0) / h
        ax.contour(xs, ys, tissue.astype(float), levels=[0.5], colors="forestgreen", linewidths=1.2)
    ax.set_xticks([])
    ax.set_yticks([])
