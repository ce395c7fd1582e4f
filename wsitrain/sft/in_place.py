"""Activations a tile runs in place: decided once per node when annotating, once per segment when planning.

Tiles run every layer out of place (a tile cut from a checkpoint is a view of it). Out of place, an activation
after a BatchNorm or a residual add leaves two maps alive where one would do: LeakyReLU, ReLU6 and Hardtanh keep
their input for backward *and* make an output (DarkNet-19's conv-BN-LeakyReLU tiles held three maps per layer
where two suffice), and ReLU holds its input and output at once. In place, the activation overwrites its input
and autograd keeps that one storage, the result. That is exact, and lets the planner choose larger tiles, when:

* the in-place form gives the same bits (``activations.exact_in_place``: ReLU, LeakyReLU, ReLU6, Hardtanh);
* its input is a fresh tensor of the same tile that nobody else reads (one user: never a residual branch's
  value) and that its producer did not keep for backward: a BatchNorm, an activation that keeps its input, or an
  element-wise merge (add, mul). Not a convolution's output: the tile executor slices it, and writing into a
  slice makes autograd copy the whole map in backward; not a copy method (``x.float()`` may return ``x``);
* the input is not the segment's input (a view of the checkpoint) and the segment has no barriers (multi-pass
  tiles run their own loop, out of place).

``NodeFacts.in_place_in_tile`` holds the first two per node; ``segment_in_place`` adds the third for one segment.
Planning replays those nodes in place (``planning.session``); the executor reads ``SegmentPlan.in_place``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import fx, nn

from wsitrain.sft.ops.activations import ACTIVATIONS, exact_in_place
from wsitrain.sft.ops.barriers import barrier_kind, in_chain, segment_barriers
from wsitrain.sft.ops.registry import MERGE, OpSpec, exact_in_place_function
from wsitrain.sft.ops.types import TILE_CALL, out_of_place


class NodeInPlace(Protocol):
    """What ``segment_in_place`` reads of a node (``facts.NodeFacts``)."""

    @property
    def spec(self) -> OpSpec: ...

    @property
    def inputs(self) -> tuple[int, ...]: ...

    @property
    def in_place_in_tile(self) -> bool: ...


def _fresh_unsaved(spec: OpSpec, module: nn.Module | None) -> bool:
    """Does the producer, as a tile runs it, return a new tensor it does not keep for backward?"""
    tile = out_of_place(spec)
    if tile.alias or tile.saves_output or TILE_CALL in tile.extra or barrier_kind(tile) or in_chain(tile):
        return False
    if module is None:
        return tile.kind == MERGE  # add, sub, mul, div of two maps: a new result
    if isinstance(module, nn.BatchNorm2d):  # eval or frozen BatchNorm: keeps its input, returns a new map
        # torch's forward or wsitrain's FrozenBatchNorm2d (F.batch_norm); a subclass's own forward may return a view
        return type(module).forward is nn.BatchNorm2d.forward or type(module).__name__ == "FrozenBatchNorm2d"
    return type(module) in ACTIVATIONS  # an out-of-place activation that keeps its input (not its output)


def may_run_in_place(
    node: fx.Node,
    module: nn.Module | None,
    producer: int,
    producer_spec: OpSpec,
    producer_module: nn.Module | None,
    producer_users: tuple[int, ...],
    index: int,
) -> bool:
    """Whether node ``index`` may overwrite its input ``producer`` inside a tile (both computed in the tile)."""
    exact = exact_in_place(module) if module is not None else exact_in_place_function(node)
    if not exact or producer == 0 or set(producer_users) != {index}:
        return False
    return _fresh_unsaved(producer_spec, producer_module)


def segment_in_place(nodes: Sequence[NodeInPlace], start: int, end: int) -> tuple[int, ...]:
    """The nodes of segment (start, end] that its tiles run in place (what ``SegmentPlan.in_place`` holds);
    ``nodes``: every node's facts (``GraphFacts.nodes``)."""
    seg = range(start + 1, end + 1)
    if not any(nodes[i].in_place_in_tile for i in seg):
        return ()
    if segment_barriers({i: nodes[i].spec for i in seg}, {i: nodes[i].inputs for i in seg}, start, end):
        return ()
    return tuple(i for i in seg if nodes[i].in_place_in_tile and nodes[i].inputs[0] != start)
