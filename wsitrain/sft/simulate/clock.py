"""The simulated clock: the time of a step on a GPU preset, from the operators the executor really issues.

``OpClock`` is a ``TorchDispatchMode`` that sees every aten operator of a step run on fake tensors (the real
executor, or plain PyTorch) and prices it with a preset's constants (``wsitrain.gpu_speed``):

- on the device, an operator takes max(FLOPs / convolution rate, bytes read and written / memory rate) plus a
  kernel floor per kernel it launches (FLOPs from ``torch.utils.flop_counter``'s formulas; views and
  allocations launch nothing). Convolutions on small maps run below the large-map rate (``small_map_px``); 1x1
  ones in half precision on maps whose pixels are not a multiple of 8 at ``unaligned_conv_efficiency`` of it (a
  tile's halo; cuDNN's fallback kernels), and matrix products whose rows are not 16 bytes aligned (what a tile runs
  in such layers' place: ops/pointwise_conv.py) at ``unaligned_matmul_efficiency`` of the tensor rate;
  BatchNorm's kernels move their bytes at their own measured share of the bandwidth (``norm_efficiency``,
  ``norm_backward_efficiency``; docs/benchmarks/gpu_time_breakdown.md);
- on the host, each operator costs its dispatch time (eager PyTorch's Python and autograd work), views less, and
  host-side copies (cropping the uint8 image) their bytes at one thread's copy rate; each tile visit adds the
  executor's own bookkeeping (``tile_host_us``);
- copies between host and device cost bytes at the link's rate, on a copy engine;
- the stager's worker thread packs the image's tiles into page-locked buffers (``execution/staging.py``; on CUDA
  it runs beside the thread that issues kernels): those memcpys cost their bytes at one thread's copy rate, and the
  tile's upload follows its pack, so the stager's lane is the packs plus the link's copies.

The four run concurrently (the host queues kernels ahead; copies overlap on a side stream) but the executor's
tiles pace them: a step is split into windows (one per tile visit, one per plain segment and phase), a window
takes the longest of its lanes, and the step is their sum. A synchronization (the host reading device content,
``sync``; the executor reports each one, as fake tensors have no content to read) drains the GPU's queue: the
GPU then idles while the host issues the next work, so it ends its window and opens another.

Fake tensors answer ``.device`` through a dispatched ``prim.device`` query that real tensors answer from a field
(no dispatch): the clock does not count those (12,562 per capped ResNet-50 step at 8192 px; counted as views
before, they were 25 ms of simulated host time no GPU step spends). In bf16 (``low_precision``) floating-point tensors
of forward and backward move two bytes per element (autocast's activations), convolutions run on tensor cores,
and each convolution casts its float32 weight (a tiled sweep once per weight, ``execution/autocast.py``; a plain
segment once per use) and each weight gradient back (per tile); the optimizer step stays in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from wsitrain.gpu_speed import GpuSpeed
from wsitrain.sft.ops.pointwise_conv import ALIGN
from wsitrain.sft.simulate.tracker import tensors_in
from wsitrain.sft.target import CONV_ELEMENTS_LIMIT

aten = torch.ops.aten
DEVICE = "meta"  # the simulated GPU's tensors (runtime.DEVICE_TYPE)
# Operators that launch no kernel: allocations and metadata (views are found from the schema).
NO_KERNEL = {
    aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.detach,
    aten.alias, aten.lift_fresh, aten.set_, aten.resize_, aten._local_scalar_dense, aten.is_same_size,
    aten._has_compatible_shallow_copy_type, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset,
}  # fmt: skip
CONVS = {aten.convolution, aten.convolution_backward}
# matrix products: a tile's 1x1 layers on unaligned maps run as these (ops/pointwise_conv.py)
MATMULS = {aten.mm, aten.bmm, aten.addmm}
# BatchNorm's own kernels, priced at their measured share of the bandwidth (gpu_speed.NORM_EFFICIENCY)
NORMS = {"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
         "_native_batch_norm_legit_functional", "cudnn_batch_norm", "batch_norm_stats", "batch_norm_elemt"}  # fmt: skip
NORM_BACKWARDS = {"native_batch_norm_backward", "cudnn_batch_norm_backward", "batch_norm_backward_reduce",
                  "batch_norm_backward_elemt"}  # fmt: skip
# Tensors a multi-tensor (foreach) kernel takes per launch (PyTorch's multi_tensor_apply: up to 110 tensors of
# its depth-1 lists, fewer for deeper ones); a round figure for the optimizer's lists.
FOREACH_TENSORS = 64
# Categories the breakdown reports, by operator name: the copy counter counts the first.
COPY_KIND = "copies, crops, pads, joins"
JOINS = {"copy_", "cat", "constant_pad_nd", "slice_scatter", "clone", "_to_copy", "narrow_copy", "index_put_", "fill_",
         "zero_", "zeros_like", "new_zeros", "pad", "reflection_pad2d", "replication_pad2d", "slice_backward",
         "select_backward"}  # fmt: skip
# Operators the clock sees once that run two copy kernels on a GPU: a zeroed buffer, then the gradient copied into it
# (slicing's backward, per axis); the copy counter counts both (their time is priced from their bytes either way)
TWO_COPIES = {"slice_backward", "select_backward"}


@dataclass(frozen=True)
class OpRecord:
    """One device operator as the clock saw it: what it does, not yet priced (so constants can be refitted)."""

    kind: str  # the breakdown's category
    flops: float
    bytes: float  # read and written, at the step's precision
    kernels: int
    conv_px: float  # output pixels per channel of a convolution (its small-map factor); 0 for other operators
    low_precision: bool  # tensor-core (bf16/fp16) arithmetic
    op: str = ""  # the aten operator's name
    # a 1x1 convolution in half precision on a map whose pixels are not a multiple of 8 (gpu_speed.UNALIGNED_CONV_...),
    # or a half-precision matrix product whose rows are not 16 bytes aligned (gpu_speed.UNALIGNED_MATMUL_EFFICIENCY)
    unaligned: bool = False
    channels: int = 0  # a convolution's narrower channel count, min(input channels per group, output channels)
    large: bool = False  # a convolution on a map of 2^31 elements per sample or more (cuDNN's 64-bit-index kernels)


@dataclass
class Window:
    """One stretch of the step the executor paces: a tile visit, or a plain segment's phase."""

    label: str
    weight: int = 1  # how many tile visits this one stands for (representative tiles)
    tile: bool = False  # a tile visit (pays the executor's per-tile host work)
    ops: list[OpRecord] = field(default_factory=list)
    host_ops: int = 0  # operators dispatched that launch kernels (device or host)
    views: int = 0  # metadata-only operators
    host_bytes: float = 0.0  # bytes host-side operators write on the main thread (host adds of gradient tiles)
    stager_ops: int = 0  # operators issued on the stager's worker thread (``staging``: prefetches' packs, uploads)
    stager_bytes: float = 0.0  # bytes they write (the image's tiles into page-locked buffers)
    link_bytes: float = 0.0  # bytes copied over the host link
    syncs: int = 0  # synchronizations that end this window (the host waits for the GPU's queue to drain)
    sweep: str | None = None  # the sweep of tiles it is part of, when that sweep casts each weight once


@dataclass(frozen=True)
class ClockReading:
    """A step's simulated time on one preset, with what it is made of."""

    preset: str
    precision: str
    seconds: float
    gpu_seconds: float
    host_seconds: float
    link_seconds: float
    host_bound_seconds: float  # time the GPU waits for the host (windows whose host work outlasts their kernels)
    flops: float
    bytes: float
    kernels: float
    operators: float
    link_bytes: float
    windows: int
    syncs: float  # synchronizations per step (each drains the GPU's queue)
    host_copy_seconds: float  # of ``host_seconds``: host memcpys on the main thread (host adds of gradient tiles)
    stager_seconds: float  # the stager's worker thread: the image's tiles packed for upload (not in ``host_seconds``)
    by_kind: dict[str, float]  # GPU seconds per kind of operator
    constants: str
    norm_kernels: float = 0.0  # BatchNorm kernels priced at its own measured rate (none when folded: ops/fold_bn.py)
    # the copy counter: kernels that only move device memory (``COPY_KIND``: copies, crops, pads, joins) per step,
    # and per operator; the CPU-side evidence for a step's copies (issue 57: 61 of 683 ms measured on an H200)
    copies: float = 0.0
    copies_by_op: dict[str, float] = field(default_factory=dict)

    @property
    def unused_constants(self) -> tuple[str, ...]:
        """The preset's measured constants that priced nothing in this step: BatchNorm's rates when no BatchNorm
        kernel ran (shown as unused, not refitted: they stay what the H200 measured)."""
        return () if self.norm_kernels else ("norm_efficiency", "norm_backward_efficiency")

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "unused_constants": list(self.unused_constants)}

    def text(self) -> str:
        kinds = ", ".join(f"{k} {v:.3f} s" for k, v in self.by_kind.items() if v >= 5e-4)
        return "\n".join([
            f"simulated step time on the {self.preset} preset ({self.precision}): {self.seconds:.3f} s",
            f"    GPU {self.gpu_seconds:.3f} s ({kinds}); host {self.host_seconds:.3f} s (dispatch "
            f"{self.host_seconds - self.host_copy_seconds:.3f} s, host adds {self.host_copy_seconds:.3f} s; "
            f"{self.host_seconds / max(self.gpu_seconds, 1e-12):.1%} of the GPU's), stager thread "
            f"{self.stager_seconds:.3f} s (tiles packed for upload), of which the GPU waits "
            f"{self.host_bound_seconds:.3f} s; host link {self.link_seconds:.3f} s ({self.link_bytes / 1e9:.2f} GB)",
            f"    {self.flops / 1e12:.1f} TFLOP, {self.bytes / 1e9:.0f} GB moved, {self.kernels:.0f} kernel launches, "
            f"{self.operators:.0f} operators ({self.copies:.0f} copy kernels), {self.syncs:.0f} synchronizations, "
            f"{self.windows} windows "
            f"(constants: {self.constants})",
            *([f"    unused in this step: {', '.join(self.unused_constants)} (no BatchNorm kernel ran; BatchNorm's "
               "measured rates stay as measured)"] if self.unused_constants else []),
        ])  # fmt: skip


class OpClock(TorchDispatchMode):
    """Records every operator of a step (see the module doc); ``mark(label, weight)`` opens a new window and
    ``reading(speed)`` prices the record."""

    def __init__(self, low_precision: bool) -> None:
        super().__init__()
        self.low_precision = low_precision
        self.windows: list[Window] = [Window("start")]
        self.optimizer_phase = False  # float32 optimizer step: no bf16 scaling
        self._once = Window("weight casts, once per sweep")  # see ``mark``'s ``sweep``
        self._cast: set[tuple[str, int]] = set()
        self._staging = False

    @contextmanager
    def staging(self) -> Iterator[None]:
        """Operators inside run on the stager's worker thread on CUDA (``HostStager.pack_scope``)."""
        self._staging = True
        try:
            yield
        finally:
            self._staging = False

    def mark(self, label: str, weight: int = 1, tile: bool = False, sweep: str | None = None) -> None:
        """Open a window; ``sweep``: the sweep of tiles it belongs to, when that sweep casts each weight once."""
        self.windows.append(Window(label, weight, tile, sweep=sweep))

    def sync(self, what: str) -> None:
        """The host reads device content (``what``): the queue drains, so the window ends here and a new one
        (same tile visit) begins."""
        w = self.windows[-1]
        w.syncs += 1
        self.windows.append(Window(f"{w.label}, after {what}", w.weight, w.tile, sweep=w.sweep))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _nbytes(self, t: torch.Tensor) -> float:
        size = t.element_size()
        if self.low_precision and not self.optimizer_phase and t.dtype.is_floating_point:
            size = 2
        return float(t.numel() * size)

    def _record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        w = self.windows[-1]
        packet = func._overloadpacket
        if func.namespace == "prim":  # fake tensors' own queries (``prim.device``): no dispatch on a real tensor
            return
        outs = tensors_in(out)
        # metadata: views, allocations, and queries that return no tensor
        if packet in NO_KERNEL or func.is_view or not (outs or func._schema.is_mutable):
            w.views += 1
            return
        if self._staging:  # issued on the stager's worker thread
            w.stager_ops += 1
        else:
            w.host_ops += 1
        ins = tensors_in((args, kwargs))
        devices = {t.device.type for t in (*ins, *outs)}
        real = sum(float(t.numel() * t.element_size()) for t in outs)  # copies move their real dtype
        if DEVICE in devices and "cpu" in devices:  # a copy over the host link (on a copy engine)
            w.link_bytes += real or float(ins[0].numel() * ins[0].element_size())
            return
        if DEVICE not in devices:  # host work: cropping the image into a staging buffer, the step counters
            if self._staging:
                w.stager_bytes += real
            else:
                w.host_bytes += real
            return
        name = packet.__name__
        # in-place operators that return nothing (the optimizer's foreach updates) write what they read
        written = outs or _written(func, args, kwargs)
        moved = sum(self._nbytes(t) for t in ins) + sum(self._nbytes(t) for t in written)
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        kernels = self._kernels(func, args, kwargs)
        px = 0.0
        unaligned = large = False
        channels = 0
        low = self.low_precision and not self.optimizer_phase
        if packet in CONVS:
            ref = out if packet is aten.convolution else args[0]  # the output (its gradient, in backward)
            px = float(ref.shape[-1] * ref.shape[-2])
            kernel = (args[1] if packet is aten.convolution else args[2]).shape[-2:]
            # the matrix product's rows: every pixel of every image in the batch. (A batch of two unaligned NCHW maps
            # ran slowly too, 27 TFLOP/s on an H200, docs/benchmarks/pointwise_matmul.md; but 256 channels-last patches
            # whose 7 x 7 maps this rule would flag ran at the aligned rate, and the clock has no memory-format term.)
            unaligned = low and tuple(kernel) == (1, 1) and int(px) * ref.shape[0] % ALIGN != 0
            kind = "convolution backward" if packet is aten.convolution_backward else "convolution forward"
            weight = args[1] if packet is aten.convolution else args[2]
            channels = int(min(weight.shape[0], weight.shape[1]))
            maps = (args[0], out) if packet is aten.convolution else (args[0], args[1])
            large = max(t.numel() // max(1, t.shape[0]) for t in maps) > CONV_ELEMENTS_LIMIT
            if low:  # autocast's weight cast (and the weight gradient's, back): element-wise kernels
                wgrad = packet is aten.convolution_backward and bool(_output_mask(args, kwargs)[1])
                cast = OpRecord("weight casts (autocast)", 0.0, 6.0 * weight.numel(), 1, 0.0, low)
                if packet is aten.convolution and w.sweep is not None:
                    # a sweep that casts each weight once (execution/autocast.py): its first use casts, in a window
                    # of its own that counts once whatever tiles the window it happens in stands for
                    if (w.sweep, id(weight)) not in self._cast:
                        self._cast.add((w.sweep, id(weight)))
                        self._once.ops.append(cast)
                        self._once.host_ops += 1
                elif packet is aten.convolution or wgrad:  # each gradient goes back through its own cast per tile
                    w.ops.append(cast)
                    w.host_ops += 1
            w.ops += _bias_pass(packet, args, kwargs, out, self._nbytes, low)
        else:
            # a product whose operands' rows are not 16 bytes aligned (gpu_speed.UNALIGNED_MATMUL_EFFICIENCY)
            unaligned = low and packet in MATMULS and any(_unaligned_rows(t) for t in ins)
            kind = ("optimizer" if self.optimizer_phase else
                    "batch norm" if name in NORMS or name in NORM_BACKWARDS else
                    COPY_KIND if name.rstrip("_") in JOINS or name in JOINS else
                    "matrix products" if flops else "element-wise and reductions")  # fmt: skip
        w.ops.append(OpRecord(kind, flops, moved, kernels, px, low, name, unaligned, channels, large))

    def _kernels(self, func: Any, args: Any, kwargs: dict[str, Any]) -> int:
        packet = func._overloadpacket
        if packet is aten.convolution_backward:
            return max(1, sum(bool(m) for m in _output_mask(args, kwargs)))
        if packet.__name__.startswith("_foreach_"):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            return max(1, math.ceil(max((len(a) for a in lists), default=1) / FOREACH_TENSORS))
        return 1

    # ---- the step's time -----------------------------------------------------------------------------------------
    def reading(self, speed: GpuSpeed, precision: str) -> ClockReading:
        """The recorded step priced with ``speed``'s constants."""
        s = speed
        total = gpu_all = host_all = link_all = waits = 0.0
        flops = moved = kernels = ops = link_bytes = syncs = copy_all = stager_all = norms = 0.0
        kinds: dict[str, float] = {}
        copies: dict[str, float] = {}
        for w in [*self.windows, self._once]:
            gpu = 0.0
            for o in w.ops:
                if o.conv_px:
                    rate = s.conv_rate(o.low_precision) * o.conv_px / (o.conv_px + s.small_map_px)
                    rate *= s.conv_shape_factor(o.channels, o.large)  # narrow layers, whole maps of 2^31 elements
                    # the tiles' own penalty is their unaligned 1x1 layers' (measured, docs/benchmarks/traces): a tile's
                    # 3x3 layers ran at the whole map's rate
                    rate *= s.unaligned_conv_efficiency if o.unaligned else 1.0
                else:
                    rate = s.matmul_rate(o.low_precision, o.unaligned)
                norm = o.op in NORMS or o.op in NORM_BACKWARDS
                norms += w.weight * o.kernels if norm else 0.0
                if o.kind == COPY_KIND:
                    copies[o.op] = copies.get(o.op, 0.0) + w.weight * (2 if o.op in TWO_COPIES else o.kernels)
                byte_rate = s.norm_bytes_per_second(o.op in NORM_BACKWARDS) if norm else s.bytes_per_second
                t = max(o.flops / rate, o.bytes / byte_rate) + o.kernels * 1e-6 * s.kernel_floor_us
                gpu += t
                kinds[o.kind] = kinds.get(o.kind, 0.0) + w.weight * t
                flops += w.weight * o.flops
                moved += w.weight * o.bytes
                kernels += w.weight * o.kernels
            host = 1e-6 * (w.host_ops * s.host_op_us + w.views * s.view_host_us + (s.tile_host_us if w.tile else 0.0))
            copy = w.host_bytes / (1e9 * s.host_copy_gb_s)
            host += copy
            copy_all += w.weight * copy
            link = w.link_bytes / (1e9 * s.link_gb_s)
            stager = 1e-6 * w.stager_ops * s.host_op_us + w.stager_bytes / (1e9 * s.host_copy_gb_s)
            stager_all += w.weight * stager
            total += w.weight * max(gpu, host, link + stager)
            gpu_all += w.weight * gpu
            host_all += w.weight * host
            link_all += w.weight * link
            waits += w.weight * max(0.0, host - max(gpu, link + stager))
            ops += w.weight * (w.host_ops + w.views)
            link_bytes += w.weight * w.link_bytes
            syncs += w.weight * w.syncs
        return ClockReading(
            s.name, precision, total, gpu_all, host_all, link_all, waits, flops, moved, kernels, ops, link_bytes,
            sum(w.weight for w in self.windows) + 1, syncs, copy_all, stager_all,
            dict(sorted(kinds.items(), key=lambda kv: -kv[1])), s.source, norms, sum(copies.values()),
            dict(sorted(copies.items(), key=lambda kv: -kv[1])),
        )  # fmt: skip


def _bias_pass(
    packet: Any, args: Any, kwargs: dict[str, Any], out: Any, nbytes: Any, low: bool
) -> list[OpRecord]:
    """A convolution's bias on CUDA is a pass of its own: PyTorch adds it to cuDNN's output in place (forward) and
    sums the output's gradient for it (backward), one element-wise kernel each that the fake convolution does not
    issue. Every convolution a BatchNorm folds into has one (ops/fold_bn.py)."""
    if packet is aten.convolution and len(args) > 2 and args[2] is not None:
        return [OpRecord("element-wise and reductions", 0.0, 2.0 * nbytes(out), 1, 0.0, low, "add_")]
    if packet is aten.convolution_backward:
        mask = _output_mask(args, kwargs)
        if len(mask) > 2 and mask[2]:
            return [OpRecord("element-wise and reductions", 0.0, nbytes(args[0]), 1, 0.0, low, "sum")]
    return []


def _unaligned_rows(t: torch.Tensor) -> bool:
    """A matrix operand with a stride (of a dimension longer than one) that is not a multiple of ``ALIGN`` elements."""
    return any(st != 1 and st % ALIGN != 0 for st, n in zip(t.stride(), t.shape, strict=True) if n > 1)


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an operator writes in place (its schema's ``!`` arguments)."""
    out: list[torch.Tensor] = []
    for pos, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = kwargs.get(a.name, args[pos] if pos < len(args) else None)
            out += tensors_in(v)
    return out


def _output_mask(args: Any, kwargs: dict[str, Any]) -> tuple[bool, ...]:
    mask = kwargs.get("output_mask", args[-1] if args else (True, True, True))
    return tuple(bool(m) for m in mask)
