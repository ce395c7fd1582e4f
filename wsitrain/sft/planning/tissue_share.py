"""How much of a slide's first tiled segment computes: the share of its tiles that are not flat background.

A masked slide (``data.mask_background``) is one colour outside its tissue; the executor computes a tile whose input
region, halo included, is that one colour once per sweep and reuses it (``execution/reuse.py``). The share of tiles
that still compute is therefore above the slide's pixel tissue fraction (a tile with one tissue pixel in its halo
computes), and it is what the time model's prediction scales the tiled work by (``Plan.slowdown_at``). Measured on
the demo's synthetic slides: pixel tissue fraction 0.19, tiles computed 0.74 of visits (256 px tiles).

A patch encoder's segment (``patch``: its patch size) works per patch, not per tile: within a chunk that computes,
the flat patches are encoded once (``wsitrain/patch/flat_cells.py``), so its share is counted in patches, each
computing chunk's non-flat patches and one flat patch where it has any, over all the patches.
"""

from __future__ import annotations

import numpy as np
import torch

from wsitrain.sft.plan_types import Plan
from wsitrain.sft.regions import SegmentRegions


def tissue_tile_share(image: torch.Tensor, plan: Plan, patch: int | None = None) -> float | None:
    """Share of the first tiled segment's tiles that compute on ``image`` (C, H, W) or (1, C, H, W), the image that
    segment reads: a tile computes when its input region is not one colour or touches the image border. None when
    the plan does not reuse background (then every tile computes: nothing to count), tiles nothing, or does not start
    tiling at the image. ``patch``: the model is a patch encoder on ``patch`` px patches (counted per patch).

    One read of the image (each tile's region, halos included): about the image's bytes, a second per 10^9 px on one
    core, once per slide.
    """
    tiled = plan.tiled_segments
    if not plan.reuse_tiles or not tiled or tiled[0].start != 0 or tiled[0].regions is None:
        return None
    reg, img = tiled[0].regions, image.reshape(-1, *image.shape[-2:])  # (C, H, W)
    h, w = img.shape[-2:]
    if patch is not None:
        return _patch_share(img, reg, patch)
    computed = 0
    for rt in reg.rows:
        r0, r1 = rt.need[0]
        for ct in reg.cols:
            c0, c1 = ct.need[0]
            region = img[:, r0:r1, c0:c1]
            border = r0 <= 0 or c0 <= 0 or r1 >= h or c1 >= w
            computed += int(border or not torch.equal(region, region[:, :1, :1].expand_as(region)))
    return computed / (len(reg.rows) * len(reg.cols))


def _patch_share(img: torch.Tensor, reg: SegmentRegions, p: int) -> float:
    """Share of the patches a patch encoder encodes on ``img`` (C, H, W) tiled by ``reg``: a flat interior chunk is
    reused (none), a chunk that computes encodes its non-flat patches and one flat patch where it has any."""
    c, h, w = img.shape
    gh, gw = h // p, w // p
    if gh * gw == 0:
        return 1.0
    cells = img[:, : gh * p, : gw * p].reshape(c, gh, p, gw, p)
    flat = (cells == cells[:, :, :1, :, :1]).all(4).all(2).all(0)  # (gh, gw) one colour per channel
    return patches_encoded((~flat).numpy(), reg, (h, w), p) / (gh * gw)


def patches_encoded(tissue: np.ndarray, reg: SegmentRegions, hw: tuple[int, int], p: int) -> int:
    """Patches a patch encoder encodes over ``reg``'s chunks of an (h, w) image whose ``p`` px patches are
    ``tissue`` (gh, gw; False: flat background): a chunk all background and off the image border is the sweep's
    cached chunk (none), a chunk that computes encodes its tissue patches and one background patch where it has any.
    Counted on the pixels here and on the preflight's tissue grid by ``wsitrain.train.balance.cost``."""
    h, w = hw
    encoded = 0
    for rt in reg.rows:
        r0, r1 = rt.need[0]
        for ct in reg.cols:
            c0, c1 = ct.need[0]
            part = tissue[r0 // p : r1 // p, c0 // p : c1 // p]
            n_tissue = int(part.sum())
            border = r0 <= 0 or c0 <= 0 or r1 >= h or c1 >= w
            if n_tissue == 0 and not border:
                continue  # all background: the sweep's cached chunk
            encoded += n_tissue + int(n_tissue < part.size)
    return encoded
