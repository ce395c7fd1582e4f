"""Host RAM a training run takes per node: the slides, what the plan keeps in host memory, the stager's buffers.

Preflight compares this with the RAM available before anything is written, so a run it approves is not killed
by the OS midway. Per process: the uint8 slides held at once (the one trained, the one read ahead, a 90-degree
turn of a non-square one); on CUDA the plan's host checkpoints and their gradient buffers (pageable), and the
stager's page-locked buffers, two per lane (tiles' input regions up, output-gradient tiles up, output and
input-gradient tiles down), each rounded up to a power of two by PyTorch's pinned allocator; on CPU the plan's
whole estimated peak, which is host memory. Times the processes on the node (``LOCAL_WORLD_SIZE``, set by
torchrun): each rank holds all of it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from wsitrain.errors import WsiTrainError
from wsitrain.sft.plan_types import Plan, SegmentPlan
from wsitrain.units import format_bytes

# Buffers per lane of the stager (wsitrain.sft.execution.staging: two used in turn) and its lanes.
BUFFERS_PER_LANE = 2


def ranks_per_node(env: dict[str, str] | None = None) -> int:
    """Processes sharing this node's RAM: torchrun's ``LOCAL_WORLD_SIZE`` (1 when not launched by it)."""
    raw = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise WsiTrainError(
            f"LOCAL_WORLD_SIZE={raw!r} is not a positive number of processes",
            hint="launch with torchrun, which sets it, or unset it",
        )
    return n


def pinned_size(nbytes: int) -> int:
    """What PyTorch's pinned allocator takes for a request: the next power of two (its size classes)."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


def _elem(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def _tile_bytes(seg: SegmentPlan, elem: int, side: str) -> int:
    """A tile of the segment's input region (halo included) or of its output, in bytes (largest tile)."""
    if side == "input":  # the larger of the forward sweep's tiles and the recompute's
        b, c = seg.input_shape[0], seg.input_shape[1]
        th, tw = seg.staged_tile_shape
        return b * c * th * tw * elem
    b, c, h, w = seg.output_shape[0], seg.output_shape[1], seg.output_shape[2], seg.output_shape[3]
    edge = max(seg.tile_edge, seg.forward_tile_edge)
    return b * c * min(h, edge) * min(w, edge) * elem


def staging_buffers(plan: Plan) -> list[int]:
    """Bytes of each staging buffer a CUDA step of ``plan`` allocates (the largest tile of each lane, twice)."""
    act, img = _elem(plan.dtype), _elem(plan.input_dtype)
    up_in = up_grad = down = 0
    for k, s in enumerate(plan.segments):
        if s.mode != "tiled":
            continue
        reads_host = s.checkpoint_location == "host"
        if reads_host:
            up_in = max(up_in, _tile_bytes(s, img if k == 0 else act, "input"))
            if k > 0:  # a host checkpoint's input-gradient tiles go down
                down = max(down, _tile_bytes(s, act, "input"))
        if s.output_location == "host":
            down = max(down, _tile_bytes(s, act, "output"))  # output tiles down
            up_grad = max(up_grad, _tile_bytes(s, act, "output"))  # the output's gradient tiles up
    return [n for n in (up_in, up_grad, down) for _ in range(BUFFERS_PER_LANE) if n]


@dataclass(frozen=True)
class HostNeed:
    """Host RAM of one process by part, and the node's total."""

    images: int
    plan: int  # CUDA: host checkpoints and their gradient buffers; CPU: the plan's whole peak
    staging: int  # the stager's page-locked buffers, as requested
    rounding: int  # what the pinned allocator adds by rounding them up to powers of two
    ranks: int = 1
    streamed: bool = False  # ``images`` are the regions of a slide read tile by tile (data.stream_tiles)

    @property
    def per_rank(self) -> int:
        return self.images + self.plan + self.staging + self.rounding

    @property
    def total(self) -> int:
        return self.ranks * self.per_rank

    def describe(self) -> str:
        parts = {
            "streamed tiles" if self.streamed else "slides": self.images,
            "host checkpoints and gradient buffers" if self.staging or self.rounding else "the plan's peak": self.plan,
            "staging buffers": self.staging,
            "pinned rounding": self.rounding,
        }
        what = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
        ranks = f" x {self.ranks} processes on this node" if self.ranks > 1 else ""
        return f"{format_bytes(self.total)} ({what}{ranks})"


def _host_checkpoints(plan: Plan) -> int:
    """Host RAM of the plan's host checkpoints with their gradient buffers; spilled ones live on disk instead."""
    return sum(2 * s.checkpoint_bytes for s in plan.segments if s.start and s.checkpoint_home == "host")


def streamed_bytes(plan: Plan, ahead: int) -> int:
    """Host bytes of a slide read tile by tile (``data.stream_tiles``) into ``plan``'s tiled first segment: the
    region in use, the ``ahead`` regions decoded ahead and the decode box of one (uint8 input regions, halo in);
    0 when the first segment is not tiled (then the whole image is read)."""
    first = plan.segments[0] if plan.segments else None
    if first is None or first.mode != "tiled":
        return 0
    return (ahead + 2) * _tile_bytes(first, _elem(plan.input_dtype), "input")


def host_need(
    plan: Plan | None, image_bytes: int, images: int, device: str, ranks: int = 1, streamed: int = 0
) -> HostNeed:
    """Host RAM for ``images`` slides of ``image_bytes`` each trained under ``plan`` on ``device`` ("cuda"/"cpu").

    ``streamed``: the slide is read tile by tile (``streamed_bytes``, its regions held at once) and no whole image
    is held; the plan was made with the image on the host, outside its peak."""
    if plan is not None and streamed:
        if device != "cuda":
            return HostNeed(streamed, plan.estimated_peak_bytes, 0, 0, ranks, streamed=True)
        bufs = staging_buffers(plan)
        host_ck = _host_checkpoints(plan)
        rounding = sum(pinned_size(n) for n in bufs) - sum(bufs)
        return HostNeed(streamed, host_ck, sum(bufs), rounding, ranks, streamed=True)
    if plan is None:
        return HostNeed(images * image_bytes, 0, 0, 0, ranks)
    if device != "cuda":
        # the plan's peak includes the one image being trained (it is read per tile from host memory)
        return HostNeed((images - 1) * image_bytes, plan.estimated_peak_bytes, 0, 0, ranks)
    host_ck = _host_checkpoints(plan)
    bufs = staging_buffers(plan)
    staging = sum(bufs)
    rounding = sum(pinned_size(n) for n in bufs) - staging
    return HostNeed(images * image_bytes, host_ck, staging, rounding, ranks)
