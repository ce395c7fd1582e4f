"""The convolution size limit: no plan offers a convolution of 2^31 elements per sample or more on CUDA.

Below cuDNN 9.3 with torch 2.6, PyTorch routes such a convolution to its im2col fallback, whose column buffer
is about the kernel area (9 for 3x3) times the input: memory no plan accounts for; from cuDNN 9.3 it runs on slow
64-bit-index kernels (``target.CONV_ELEMENTS_LIMIT``). Where the target has the limit
(``TargetDevice.conv_elements_limit``: every CUDA target, unless no plan fits within it), a plain segment with such
a convolution is not offered, and a tiled segment's edges (its forward sweep's too) are cut to those whose largest
tile keeps every convolution within it.
"""

from __future__ import annotations

from dataclasses import replace

from wsitrain.sft.ops.patch_grid import patch_cost, patches_in
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.ops.space import tile_numel
from wsitrain.sft.planning.session import PlanSession
from wsitrain.sft.planning.tile_memory import tile_geometry
from wsitrain.sft.target import TargetDevice


def _convs(sess: PlanSession, start: int, end: int) -> list[int]:
    nodes = sess.facts.nodes
    return [i for i in range(start + 1, end + 1) if nodes[i].spec.kind == WINDOW and nodes[i].spec.has_params]


def _batch(sess: PlanSession) -> int:
    return max(1, sess.facts.input_shape[0])


def _patch_elements(sess: PlanSession, i: int, numel: int) -> int:
    """A patch encoder's largest tensor for ``numel`` output elements: its patches times the largest tensor one patch
    makes (an MLP's hidden tokens, a qkv projection; patch/cost.py); a convolution's own output otherwise."""
    spec = sess.facts.nodes[i].spec
    cost = patch_cost(spec)
    return numel if cost is None else int(patches_in(spec, numel)) * cost(sess.facts.act_dtype).largest_tensor


def plain_breaks_limit(sess: PlanSession, start: int, end: int) -> bool:
    """Does a convolution of (start, end] run whole hold more elements per sample than the target allows?"""
    limit = sess.target.conv_elements_limit
    if limit is None:
        return False
    nodes = sess.facts.nodes
    for i in _convs(sess, start, end):
        ins = [sess.numel(v) for v in nodes[i].inputs[:1]]
        if max([_patch_elements(sess, i, sess.numel(i)), *ins]) // _batch(sess) > limit:
            return True
    return False


def tile_breaks_limit(sess: PlanSession, start: int, end: int, edge: int) -> bool:
    """Does the largest tile of (start, end] with ``edge`` give a convolution more elements per sample than allowed?"""
    limit = sess.target.conv_elements_limit
    if limit is None:
        return False
    f = sess.facts
    geo = tile_geometry(sess, start, end, edge)

    def elements(i: int) -> int:  # node i's largest tile, per sample
        h = max(t.computed[i][1] - t.computed[i][0] for t, _ in geo.rows)
        w = max(t.computed[i][1] - t.computed[i][0] for t, _ in geo.cols)
        return _patch_elements(sess, i, tile_numel(f.nodes[i].spec, f.nodes[i].shape, h, w)) // _batch(sess)

    convs = _convs(sess, start, end)
    return any(max(elements(i), *(elements(v) for v in f.nodes[i].inputs[:1])) > limit for i in convs)


def edges_within_limit(sess: PlanSession, start: int, end: int, edges: list[int]) -> list[int]:
    """``edges`` (largest first) without those whose tiles break the limit (a tile grows with its edge: bisect)."""
    if not edges or not plain_breaks_limit(sess, start, end):
        return edges  # the whole map is within the limit, so is every tile
    lo, hi = -1, len(edges)  # edges[hi:] keep the limit; edges[lo] breaks it (-1: none tried)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tile_breaks_limit(sess, start, end, edges[mid]) else (lo, mid)
    return edges[hi:]


def beyond_limit(target: TargetDevice) -> TargetDevice | None:
    """The target a second search plans for where no plan keeps every convolution within the limit: the same device
    running larger ones whole, where its cuDNN can (slowly); None where it cannot, or this already was that search."""
    return replace(target, whole_large_conv=True) if target.large_conv and not target.whole_large_conv else None
