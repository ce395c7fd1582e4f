"""Shape buckets: pad each slide's sides up to a short ladder of edges, so a run meets only a few input shapes.

Every distinct input shape costs the engine a plan (and the preflight a check). Slides read whole or by tissue box
come in as many shapes as there are slides; rounding each side up to the next edge of a geometric ladder leaves a
handful. The ladder has ``steps`` edges per doubling (``data.bucket``): 4 gives 1024, 1280, 1536, 1792, 2048, 2560,
... (in units of the model's stride), so no side grows by more than about 1/steps. The ladder does not depend on
the data set: a slide added later, or seen only by ``predict``, falls into the same bucket.

Padding goes at the right and bottom (pixel (0, 0) stays the region's origin, as for the reader's stride padding)
and uses the background colour, which the tissue detector and the model see as empty glass.
"""

from __future__ import annotations

import torch

Background = tuple[int, int, int]


def bucket_edge(length: int, *, multiple: int = 1, steps: int | None = 4) -> int:
    """The smallest ladder edge >= ``length``: a multiple of ``multiple`` (the model's stride).

    In units of ``multiple``, the edges between 2**k and 2**(k+1) are ceil(2**k * (1 + j / steps)), j = 0..steps;
    below ``steps`` units every whole number is an edge. ``steps=None`` turns bucketing off: the length is only
    rounded up to the multiple. The result is idempotent (an edge maps to itself) and monotone in ``length``.
    """
    if length < 1:
        raise ValueError(f"length must be positive, got {length}")
    if multiple < 1:
        raise ValueError(f"multiple must be positive, got {multiple}")
    units = -(-length // multiple)  # ceil(length / multiple)
    if steps is None:
        return units * multiple
    if steps < 1:
        raise ValueError(f"steps must be positive or None, got {steps}")
    octave = 1 << (units.bit_length() - 1)  # largest power of two <= units
    if octave <= steps:
        return units * multiple  # the ladder's step would be below one unit: every whole number is an edge
    j = -(-(units - octave) * steps // octave)  # first step whose edge reaches units
    return -(-(octave * (steps + j)) // steps) * multiple


def bucket_shape(shape_hw: tuple[int, int], *, multiple: int = 1, steps: int | None = 4) -> tuple[int, int]:
    """(H, W) of the bucket that holds a region of ``shape_hw`` = (H, W): each side on its own ladder edge."""
    h, w = shape_hw
    return bucket_edge(h, multiple=multiple, steps=steps), bucket_edge(w, multiple=multiple, steps=steps)


def pad_to_bucket(image: torch.Tensor, bucket_hw: tuple[int, int], background: Background) -> torch.Tensor:
    """``image`` (3, H, W) uint8 padded at the right and bottom with ``background`` to (3, *bucket_hw).

    Returns ``image`` itself when it already has the bucket's shape; otherwise a new tensor on the same device,
    pinned when the input is pinned (the slide still travels to the GPU asynchronously).
    """
    if image.dim() != 3 or image.shape[0] != len(background):
        raise ValueError(f"expected a (3, H, W) image, got shape {tuple(image.shape)}")
    _, h, w = image.shape
    bh, bw = bucket_hw
    if h > bh or w > bw:
        raise ValueError(f"image {h}x{w} does not fit in bucket {bh}x{bw}")
    if (h, w) == (bh, bw):
        return image
    pin = image.device.type == "cpu" and image.is_pinned()
    out = torch.empty((3, bh, bw), dtype=image.dtype, device=image.device, pin_memory=pin)
    # Fill only the margins (right strip, bottom strip): the image part is overwritten right after.
    fill = torch.tensor(background, dtype=image.dtype, device=image.device)[:, None, None]  # (3, 1, 1)
    out[:, :h, w:] = fill
    out[:, h:, :] = fill
    out[:, :h, :w] = image
    return out
