"""One planning session: the frozen facts and memory terms of a shape, plus memos of the replays.

The session lives only while a plan (or ``max_square_size``) is computed; the executor never sees it.
Its replay helpers turn nodes into steps of the memory model (``wsitrain.sft.planning.memory_model``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.in_place import segment_in_place
from wsitrain.sft.ops.patch_grid import patch_cost, patches_in
from wsitrain.sft.ops.pointwise_conv import switches_to_matmul
from wsitrain.sft.ops.registry import MERGE, WINDOW
from wsitrain.sft.ops.types import in_place, out_of_place
from wsitrain.sft.planning import onednn
from wsitrain.sft.planning.costs import MemoryTerms, TimeModel, Work, default_time_model, forward_work, node_work
from wsitrain.sft.planning.memory_model import SimOp, SimResult, simulate
from wsitrain.sft.target import CPU_TARGET, TargetDevice

if TYPE_CHECKING:
    from wsitrain.patch.cost import PatchCost


@dataclass
class PlanSession:
    facts: GraphFacts
    terms: MemoryTerms
    device: str
    input_on_host: bool
    # checkpoints after the image in pinned host memory: "auto" lets the planner choose (CUDA only: on CPU host
    # memory is the same memory), "always" puts every eligible one there (tests run the host path on CPU), "never"
    host_checkpoints: str = "auto"
    target: TargetDevice = CPU_TARGET  # the device's planning facts: workspaces, convolution limit, link price
    time_model: TimeModel | None = None  # None: the device's default constants (costs.default_time_model)
    # the executor keeps one background tile per sweep (execution/reuse.py): its bytes count in each tile's peak
    reuse_tiles: bool = True
    # the last tiled segment may run in one pass where its head allows it (one_pass.py); False: never
    one_pass: bool = True
    _plain: dict[tuple[int, int], tuple[SimResult, float]] = field(default_factory=dict, repr=False)
    # memo of tile_memory (tiles, their parts, geometry) and options.tiled_option, for the one plan this session makes
    _tiles: dict[tuple[object, ...], object] = field(default_factory=dict, repr=False)
    _sweeps: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)  # memo of multipass
    _work: dict[tuple[int, int], Work] = field(default_factory=dict, repr=False)  # memo of plain_work
    # memos of tile replay steps and per-node work: a node's tile extents depend on the segment's end and tile
    # edge, not its start, so segments ending at the same cut share them (planning EfficientNet-B0 at 45% of
    # its plain memory made 850,000 replay steps for 14,000 distinct ones)
    _tile_ops: dict[tuple[int, int, int, bool, bool], SimOp] = field(default_factory=dict, repr=False)
    _in_place: dict[tuple[int, int], frozenset[int]] = field(default_factory=dict, repr=False)  # memo of in_place
    _node_work: dict[tuple[int, int, int, int], tuple[Work, Work]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.tm = self.time_model or default_time_model(self.device)
        f = self.facts
        # parameter gradients that exist once backward has passed node i (suffix sums)
        after = [0] * (f.n + 1)
        for i in range(f.n - 1, -1, -1):
            after[i] = after[i + 1] + f.nodes[i].param_bytes
        self.grads_after = after

    # ---- basic facts ---------------------------------------------------------------------------
    def param_bytes_between(self, start: int, end: int) -> int:
        """The parameter bytes of nodes start+1..end (segment (start, end]'s), from the suffix sums."""
        return self.grads_after[start + 1] - self.grads_after[end + 1]

    def nbytes(self, i: int) -> int:
        return self.facts.nodes[i].nbytes

    def device_bytes(self, i: int) -> int:
        """Bytes a value takes on the device (the image stays on the host when streamed)."""
        return 0 if i == 0 and self.input_on_host else self.nbytes(i)

    def grad_bytes(self, i: int) -> int:
        """Bytes of the gradient backward builds for node i's output (0 when it needs none)."""
        return self.nbytes(i) if self.facts.nodes[i].requires_grad else 0

    def image_stride(self, i: int) -> int:
        """How many image pixels one pixel of node i spans (its cumulative stride)."""
        return max(1, round(self.facts.input_shape[2] / max(1, self.facts.nodes[i].shape[2])))

    # ---- replay steps --------------------------------------------------------------------------
    def sim_op(self, i: int, out_bytes: int, grad: bool = True, tiled: bool = False, inplace: bool = False) -> SimOp:
        """Node i's replay step; ``tiled``: as a tile runs it, out of place (``ops.types.out_of_place``), or in
        place where its segment's plan says so (``inplace``, ``in_place.segment_in_place``)."""
        node = self.facts.nodes[i]
        spec = in_place(node.spec) if inplace else out_of_place(node.spec) if tiled else node.spec
        ins = node.inputs
        rg = node.requires_grad and grad
        saved: list[int] = []
        if spec.saves_input:
            saved += list(ins[:1]) if spec.kind != MERGE else list(ins)
        if spec.saves_output:
            saved.append(i)
        alias = ins[0] if (spec.inplace or spec.alias) and ins else None
        elem = out_bytes // max(1, self.facts.act_size)
        cost = patch_cost(spec)
        if cost is not None:  # a patch encoder: what its chunk of patches keeps and holds, measured per patch
            return self._patch_op(i, out_bytes, cost(self.facts.act_dtype), patches_in(spec, elem), rg, grad)
        return SimOp(
            out=i,
            out_bytes=out_bytes,
            inputs=ins,
            saved=tuple(saved) if rg else (),
            extra_saved=(elem * spec.index_bytes + (out_bytes if spec.saves_input_clone else 0)) if rg else 0,
            alias_of=alias,
            requires_grad=rg,
            grad_inputs=tuple(self.facts.nodes[v].requires_grad and grad for v in ins),
            param_grad_bytes=node.param_bytes if grad else 0,
            label=node.name,
        )

    def _patch_op(self, i: int, out_bytes: int, cost: PatchCost, n: float, rg: bool, grad: bool) -> SimOp:
        """A patch trunk's replay step on ``n`` patches: its saved bytes, forward working set (with or without
        autograd) and backward's gradients in flight, from the encoder's measured per-patch cost (patch/cost.py)."""
        node = self.facts.nodes[i]
        return SimOp(
            out=i, out_bytes=out_bytes, inputs=node.inputs, saved=(),
            extra_saved=int(n * cost.saved) if rg else 0,
            fwd_extra=int(n * (cost.forward_grad if rg else cost.forward_nograd)),
            bwd_extra=int(n * cost.backward) if rg else 0, requires_grad=rg,
            grad_inputs=tuple(self.facts.nodes[v].requires_grad and grad for v in node.inputs),
            param_grad_bytes=node.param_bytes if grad else 0, label=node.name,
        )  # fmt: skip

    def with_layout_copy(self, op: SimOp, tile_bytes: int) -> SimOp:
        """A conv copies its strided input crop into a layout its kernels take, in forward and backward: cuDNN needs
        a dense tensor, so PyTorch makes the crop contiguous (a tile's input is a view cut out of a larger map). On
        CPU oneDNN also computes in padded channel blocks (``onednn.py``): copies of the input, output and their
        gradients. A patch trunk's copies are in its measured per-patch cost (patch/cost.py)."""
        node = self.facts.nodes[op.out]
        if node.spec.kind != WINDOW or not node.spec.has_params or patch_cost(node.spec) is not None:
            return op
        fwd = bwd = tile_bytes
        if self.device == "cpu" and self.facts.act_dtype in onednn.DTYPES and node.spec.spatial_dims == (2, 3):
            # oneDNN's blocked copies of the tile's maps (onednn.py): on CPU only, CUDA plans are unchanged
            in_ch = self.facts.nodes[node.inputs[0]].shape[1]
            f, b = onednn.conv_copies(tile_bytes, in_ch, op.out_bytes, node.shape[1], any(op.grad_inputs))
            fwd, bwd = fwd + f, bwd + b
        return replace(op, fwd_extra=op.fwd_extra + fwd, bwd_extra=op.bwd_extra + bwd)

    def pointwise_matmul(self, start: int, end: int) -> tuple[int, ...]:
        """Segment (start, end]'s 1x1 convolutions its tiles may run as matrix products (ops/pointwise_conv.py)."""
        f = self.facts
        if not (self.target.pointwise_matmul and switches_to_matmul(self.device, f.act_dtype)):
            return ()
        return tuple(i for i in range(start + 1, end + 1) if f.nodes[i].pointwise_conv)

    def in_place(self, start: int, end: int) -> frozenset[int]:
        """The nodes the tiles of segment (start, end] run in place (memoized)."""
        key = (start, end)
        ip = self._in_place.get(key)
        if ip is None:
            ip = self._in_place[key] = frozenset(segment_in_place(self.facts.nodes, start, end))
        return ip

    def tile_op(self, i: int, out_bytes: int, in_bytes: int, grad: bool, inplace: bool = False) -> SimOp:
        """Node i's replay step on a tile: ``sim_op`` plus the copy of its input crop into a dense layout (memoized);
        ``inplace``: the tile overwrites its input (``in_place.py``)."""
        key = (i, out_bytes, in_bytes, grad, inplace)
        op = self._tile_ops.get(key)
        if op is None:
            op = self.sim_op(i, out_bytes, grad=grad, tiled=True, inplace=inplace)
            op = self._tile_ops[key] = self.with_layout_copy(op, in_bytes) if self.facts.nodes[i].inputs else op
        return op

    def tile_node_work(self, i: int, numel_out: int, numel_in: int, calls: int) -> tuple[Work, Work]:
        """Node i's forward + backward and its recompute over ``calls`` tiles (memoized)."""
        key = (i, numel_out, numel_in, calls)
        w = self._node_work.get(key)
        if w is None:
            both = node_work(self.facts, i, numel_out, numel_in, calls, self.tm, tiled=True)
            w = self._node_work[key] = (both, forward_work(self.facts, i, numel_out, numel_in, calls, self.tm))
        return w

    def plain_sim(self, start: int, end: int) -> tuple[SimResult, float]:
        """Replay of nodes start+1..end run with plain autograd from the value at ``start``, and their FLOPs."""
        key = (start, end)
        if key not in self._plain:
            ops = [self.sim_op(i, self.nbytes(i)) for i in range(start + 1, end + 1)]
            res = simulate(ops, {start: self.device_bytes(start)})
            self._plain[key] = (res, self.plain_work(start, end).flops)
        return self._plain[key]

    def numel(self, i: int) -> int:
        shape = self.facts.nodes[i].shape
        return math.prod(shape) if shape else 0

    def plain_work(self, start: int, end: int) -> Work:
        """FLOPs and modelled time of nodes start+1..end run once with plain autograd."""
        key = (start, end)
        if key not in self._work:
            total = Work()
            for i in range(start + 1, end + 1):
                ins = sum(self.numel(v) for v in self.facts.nodes[i].inputs)
                total = total + node_work(self.facts, i, self.numel(i), ins, 1, self.tm)
            self._work[key] = total
        return self._work[key]

    def head_work(self, fused: bool = False) -> Work:
        start, last = self.head_start(fused), self.facts.n - 1
        return self.plain_work(start, last) if start < last else Work()

    def head_start(self, fused: bool) -> int:
        """The node the plain head starts from: the trunk's end, or the fused pool's output."""
        f = self.facts
        return f.fusion.node if fused and f.fusion is not None else f.trunk_end

    def head_sim(self, fused: bool = False) -> tuple[SimResult, float]:
        """The head run plain after the trunk (after the pool, when the last tiled segment folds it in)."""
        start, last = self.head_start(fused), self.facts.n - 1
        return self.plain_sim(start, last) if start < last else (SimResult(0, 0, 0, ""), 0.0)

    def head_ops(self, fused: bool = False) -> list[SimOp]:
        return [self.sim_op(i, self.nbytes(i)) for i in range(self.head_start(fused) + 1, self.facts.n)]

    def saves(self, start: int, end: int, value: int) -> bool:
        """Does plain autograd over (start, end] keep ``value`` for backward?"""
        for i in range(start + 1, end + 1):
            node = self.facts.nodes[i]
            if not node.requires_grad:
                continue
            if node.spec.saves_input and value in node.inputs:
                return True
            if node.spec.saves_output and i == value:
                return True
        return False
