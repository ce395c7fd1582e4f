"""Each training slide's predicted step cost, from what the preflight already knows: no pixel is read here.

A slide's cost is its bucket's plan's step time in the planner's time model (``Plan.time_sft``, FLOP-equivalents:
FLOPs, memory traffic and per-call costs, ``wsitrain.sft.planning.costs``), scaled by the slide's share of the
bucket's area (training reads the slide's own shape; the bucket's plan is the one planned for it). With
``data.mask_background`` the tiles of the first tiled segment that see only masked background are computed once per
sweep and reused, so the tiled work counts only the tiles that touch tissue (``Plan.slowdown_at``'s rule), counted
on the preflight's coarse tissue grid (``SlideShape.tissue_cells``) laid over the bucket's tiles. A patch encoder
(``patch``: its patch size) works per patch, not per tile: a chunk that computes encodes its tissue patches and one
background patch (``wsitrain/patch/flat_cells.py``), so its share is counted in patches, as the fit's log counts it
(``wsitrain.sft.planning.tissue_share``).

The costs only rank slides against each other (``wsitrain.train.balance.deal``): their unit does not matter, but every
slide's must be the same, so a run in which any slide lacks a plan falls back to pixel area for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from wsitrain.preflight import PreflightReport, SlideShape
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.tissue_share import patches_encoded
from wsitrain.slides.dataset import SlideRecord


def slide_costs(
    report: PreflightReport, records: Sequence[SlideRecord], patch: int | None = None
) -> tuple[list[float], list[tuple[int, int]]]:
    """(cost, bucket) of each of ``records``, in their order; ``patch``: the model is a patch encoder."""
    by_path = {_key(s.path): s for s in report.slides}
    plans = {b.bucket: b.plan for b in report.buckets}
    shapes = [by_path.get(_key(r.path)) for r in records]
    missing = [str(r.path) for r, s in zip(records, shapes, strict=True) if s is None]
    if missing:  # the preflight reads the same labels as fit: a bug, not the user's input
        raise AssertionError(f"no preflight shape for {', '.join(missing[:3])}")
    found = [s for s in shapes if s is not None]
    if any(plans.get(s.bucket) is None or not plans[s.bucket].time_sft for s in found):  # type: ignore[union-attr]
        return [float(s.shape[0] * s.shape[1]) for s in found], [s.bucket for s in found]
    costs = [predicted_cost(s, plans[s.bucket], patch) for s in found]  # type: ignore[arg-type]
    return costs, [s.bucket for s in found]


def predicted_cost(shape: SlideShape, plan: Plan, patch: int | None = None) -> float:
    """The step time of ``plan`` (planned for ``shape``'s bucket) for this slide: its tissue, its area."""
    share = tile_share(shape.tissue_cells, plan, patch)
    time = plan.time_sft if share is None else plan.time_sft - (1.0 - share) * plan.time_tiles
    (h, w), (bh, bw) = shape.shape, shape.bucket
    return float(time * (h * w) / (bh * bw))


def tile_share(cells: np.ndarray | None, plan: Plan, patch: int | None = None) -> float | None:
    """Share of the first tiled segment's tiles that compute: those on the image border (as the executor counts)
    and those whose input region, halo included, meets a tissue cell of ``cells`` stretched over the plan's input.
    None when nothing is reused (no grid, no reuse, no tiling from the image on). With ``patch`` (a patch encoder's
    patch size), the share of patches encoded instead (``_patch_share``)."""
    tiled = plan.tiled_segments
    if cells is None or not plan.reuse_tiles or not tiled or tiled[0].start != 0 or tiled[0].regions is None:
        return None
    reg = tiled[0].regions
    h, w = plan.input_shape[-2:]
    ch, cw = cells.shape
    # cumulative sums: "any tissue cell in rows [a, b) x cols [c, d)" in O(1) per tile
    acc = np.zeros((ch + 1, cw + 1), dtype=np.int64)
    acc[1:, 1:] = np.cumsum(np.cumsum(cells.astype(np.int64), axis=0), axis=1)
    if patch is not None:
        return _patch_share(acc, plan, patch)
    computed = 0
    for rt in reg.rows:
        r0, r1 = rt.need[0]
        a, b = _cell_span(r0, r1, h, ch)
        for ct in reg.cols:
            c0, c1 = ct.need[0]
            c, d = _cell_span(c0, c1, w, cw)
            border = r0 <= 0 or c0 <= 0 or r1 >= h or c1 >= w
            computed += int(border or acc[b, d] - acc[a, d] - acc[b, c] + acc[a, c] > 0)
    return computed / (len(reg.rows) * len(reg.cols))


def _patch_share(acc: np.ndarray, plan: Plan, p: int) -> float:
    """Share of the patches a patch encoder encodes, on the tissue grid whose cumulative sums are ``acc``: as
    ``tissue_share._patch_share`` counts on the pixels, a chunk all background and off the border is the sweep's
    cached chunk (none), a chunk that computes encodes its tissue patches and one background patch where it has any.
    A patch is tissue when its pixels meet a tissue cell."""
    reg = plan.tiled_segments[0].regions
    assert reg is not None
    h, w = plan.input_shape[-2:]
    gh, gw = h // p, w // p
    if gh * gw == 0:
        return 1.0
    ch, cw = acc.shape[0] - 1, acc.shape[1] - 1
    rows = np.array([_cell_span(i * p, (i + 1) * p, h, ch) for i in range(gh)])  # (gh, 2): cells [a, b) of row i
    cols = np.array([_cell_span(j * p, (j + 1) * p, w, cw) for j in range(gw)])  # (gw, 2)
    a, b, c, d = rows[:, :1], rows[:, 1:], cols[:, 0][None], cols[:, 1][None]
    tissue = acc[b, d] - acc[a, d] - acc[b, c] + acc[a, c] > 0  # (gh, gw)
    return patches_encoded(tissue, reg, (h, w), p) / (gh * gw)


def _cell_span(start: int, stop: int, extent: int, cells: int) -> tuple[int, int]:
    """The cells [a, b) that pixels [start, stop) of ``extent`` fall in, ``cells`` cells over the extent."""
    a = min(cells - 1, max(0, start) * cells // extent)
    return a, max(a + 1, min(cells, -(-min(stop, extent) * cells // extent)))


def _key(path: Path | str) -> str:
    return str(Path(path).resolve())
