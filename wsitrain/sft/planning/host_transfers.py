"""What a plan moves through host memory per step: bytes staged host -> device, and the stager's page-locked
buffers (``execution/staging.py``)."""

from __future__ import annotations

import math

from wsitrain.sft.plan_types import SegmentPlan
from wsitrain.sft.planning.options import TILED
from wsitrain.sft.planning.session import PlanSession


def transfer_bytes(sess: PlanSession, segments: tuple[SegmentPlan, ...]) -> int:
    """Bytes copied host -> device per step: the image's tiles with halo twice (forward and recompute), or once."""
    if not sess.input_on_host or not segments:
        return 0
    first = segments[0]
    if first.regions is None:
        return sess.nbytes(0)  # a plain first segment copies the image once
    b, c, h, w = sess.facts.input_shape
    staged = 0
    for reg in (first.sweep_regions, first.regions):  # forward, then recompute
        assert reg is not None
        rows = sum(t.need[0][1] - t.need[0][0] for t in reg.rows)
        cols = sum(t.need[0][1] - t.need[0][0] for t in reg.cols)
        staged += sess.nbytes(0) * rows * cols // max(1, h * w)
    return staged


def staging_bytes(sess: PlanSession, segments: tuple[SegmentPlan, ...]) -> int:
    """The stager's page-locked buffers (``execution/staging.py``): two per lane, each as large as its largest tile.

    Lanes: "input" (input regions of segments whose input lives on the host), "grad" (output-gradient tiles of
    segments whose output lives on the host), "down" (output tiles into a host checkpoint, input-gradient tiles of
    a host checkpoint). Buffers grow to the largest tile and are kept across segments and steps.
    """
    f = sess.facts
    lanes = {"input": 0, "grad": 0, "down": 0}

    def elem(i: int) -> int:
        return sess.nbytes(i) // max(1, math.prod(f.nodes[i].shape))

    for s in segments:
        if s.mode != TILED or s.regions is None:
            continue
        b, c_in = f.nodes[s.start].shape[:2]
        c_out = f.nodes[s.end].shape[1]
        region = b * c_in * s.staged_tile_shape[0] * s.staged_tile_shape[1]
        reg = s.sweep_regions  # the forward sweep's output tiles are the larger
        assert reg is not None
        out_h = max(hi - lo for lo, hi in reg.rows_out)
        out_w = max(hi - lo for lo, hi in reg.cols_out)
        out_tile = b * c_out * out_h * out_w * elem(s.end)
        if s.checkpoint_location == "host":
            lanes["input"] = max(lanes["input"], region * elem(s.start))
            if f.nodes[s.start].requires_grad:
                lanes["down"] = max(lanes["down"], region * elem(s.start))
        if s.output_location == "host":
            lanes["grad"] = max(lanes["grad"], out_tile)
            lanes["down"] = max(lanes["down"], out_tile)
    return 2 * sum(lanes.values())
