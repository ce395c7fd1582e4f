"""What a caller of ``SFT`` registers to watch or steer one step's tiles (read when used)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from wsitrain.sft.execution.stats import StatsRecorder
from wsitrain.sft.regions import SegmentRegions

# fn(tile, rows, cols): a tile of a feature map, detached, with its interval along H and W
TileObserver = Callable[[torch.Tensor, tuple[int, int], tuple[int, int]], None]


@dataclass
class ExecHooks:
    """Callbacks the caller registers on an ``SFT`` (read when used, so a ``with`` block can wrap backward)."""

    trunk_observer: TileObserver | None = None  # tiles of the trunk's last feature map, in forward
    input_grad_sink: TileObserver | None = None  # tiles' shares of the image gradient, in backward
    stats: StatsRecorder | None = None
    # fn(segment index, row, col, phase) as each tile starts: where a memory peak happens (the simulated device)
    on_tile: Callable[[int, int, int, str], None] | None = None
    # fn(regions) -> the tiles to visit, in order; None visits every tile. Only the simulated device sets it (its
    # representative tiles, simulate/representative.py): a real step that skipped tiles would be wrong.
    visit: Callable[[SegmentRegions], list[tuple[int, int]]] | None = None
    # fn(what) each time the executor reads device content on the host (a synchronization on a GPU, which drains
    # its queue), also where fake tensors have no content to read: the simulated clock prices them
    on_sync: Callable[[str], None] | None = None
    # the simulated device replays a step whose one pass fell back (a GPU kit's bf16 steps before 2026-11-27: the
    # head's rounding was taken as off the direction): its held sums are dropped and the segment recomputes
    one_pass_falls_back: bool = False
    # tiles without copies where a view serves (issue 57): a crop's or a trimmed layer output's gradient goes back as
    # one zero pad, and a forward sweep whose one tile is the whole map returns that tile as the checkpoint (no join
    # copy). False: the executor's earlier path, bitwise the same step (kept for the tests that compare the two)
    copy_free: bool = True
