"""The simulated clock: the time of a step on a GPU preset, from the operators the executor really issues.

``OpClock`` is a ``TorchDispatchMode`` that sees every aten operator of a step run on fake tensors (the real
executor, or plain PyTorch) and prices it with a preset's constants (``wsitrain.gpu_speed``):

- on the device, an operator takes max(FLOPs / convolution rate, bytes read and written / memory rate) plus a
  kernel floor per kernel it launches (FLOPs from ``torch.utils.flop_counter``'s formulas; views and
  allocations launch nothing). Convolutions on small maps run below the large-map rate (``small_map_px``);
- on the host, each operator costs its dispatch time (eager PyTorch's Python and autograd work), views less, and
  host-side copies (cropping the uint8 image) their bytes at one thread's copy rate; each tile visit adds the
  executor's own bookkeeping (``tile_host_us``);
- copies between host and device cost bytes at the link's rate, on a copy engine.

The three run concurrently (the host queues kernels ahead; copies overlap on a side stream) but the executor's
tiles pace them: a step is split into windows (one per tile visit, one per plain segment and phase), a window
takes the longest of its three, and the step is their sum. In bf16 (``low_precision``) floating-point tensors
of forward and backward move two bytes per element (autocast's activations), convolutions run on tensor cores,
and each convolution casts its float32 weight (tiles never use autocast's weight cache) and each weight gradient
back; the optimizer step stays in float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from wsitrain.gpu_speed import GpuSpeed
from wsitrain.sft.simulate.tracker import tensors_in

aten = torch.ops.aten
DEVICE = "meta"  # the simulated GPU's tensors (runtime.DEVICE_TYPE)
# Operators that launch no kernel: allocations and metadata (views are found from the schema).
NO_KERNEL = {
    aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.detach,
    aten.alias, aten.lift_fresh, aten.set_, aten.resize_, aten._local_scalar_dense, aten.is_same_size,
    aten._has_compatible_shallow_copy_type, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset,
}  # fmt: skip
CONVS = {aten.convolution, aten.convolution_backward}
# Tensors a multi-tensor (foreach) kernel takes per launch (PyTorch's multi_tensor_apply: up to 110 tensors of
# its depth-1 lists, fewer for deeper ones); a round figure for the optimizer's lists.
FOREACH_TENSORS = 64
# Categories the breakdown reports, by operator name.
JOINS = {"copy_", "cat", "constant_pad_nd", "slice_scatter", "clone", "_to_copy", "narrow_copy", "index_put_", "fill_",
         "zero_", "zeros_like", "new_zeros", "pad", "reflection_pad2d", "replication_pad2d"}  # fmt: skip


@dataclass
class Window:
    """One stretch of the step the executor paces: a tile visit, or a plain segment's phase."""

    label: str
    gpu: float = 0.0
    host: float = 0.0
    link: float = 0.0
    weight: int = 1  # how many tile visits this one stands for (representative tiles)

    @property
    def seconds(self) -> float:
        return self.weight * max(self.gpu, self.host, self.link)


@dataclass
class ClockTotals:
    """What the step's operators add up to (weighted by the tiles each visit stands for)."""

    flops: float = 0.0
    bytes: float = 0.0
    kernels: float = 0.0
    operators: float = 0.0
    link_bytes: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)  # GPU seconds per kind of operator


class OpClock(TorchDispatchMode):
    """Prices every operator of a step (see the module doc); ``mark(label, weight)`` opens a new window."""

    def __init__(self, speed: GpuSpeed, low_precision: bool) -> None:
        super().__init__()
        self.speed = speed
        self.low_precision = low_precision
        self.windows: list[Window] = [Window("start")]
        self.totals = ClockTotals()
        self.optimizer_phase = False  # float32 optimizer step: no bf16 scaling

    def mark(self, label: str, weight: int = 1, tile: bool = False) -> None:
        self.windows.append(Window(label, weight=weight))
        if tile:
            self.windows[-1].host += 1e-6 * self.speed.tile_host_us

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._price(func, args, kwargs, out)
        return out

    # ---- pricing ---------------------------------------------------------------------------------------------------
    def _nbytes(self, t: torch.Tensor) -> float:
        size = t.element_size()
        if self.low_precision and not self.optimizer_phase and t.dtype.is_floating_point:
            size = 2
        return float(t.numel() * size)

    def _price(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        w, s, tot = self.windows[-1], self.speed, self.totals
        packet = func._overloadpacket
        tot.operators += w.weight
        if packet in NO_KERNEL or func.is_view:
            w.host += 1e-6 * s.view_host_us
            return
        w.host += 1e-6 * s.host_op_us
        ins, outs = tensors_in((args, kwargs)), tensors_in(out)
        devices = {t.device.type for t in (*ins, *outs)}
        if DEVICE in devices and "cpu" in devices:  # a copy over the host link (on a copy engine)
            n = sum(self._nbytes(t) for t in outs) or self._nbytes(ins[0])
            moved = sum(float(t.numel() * t.element_size()) for t in outs) or n  # copies move their real dtype
            w.link += moved / (1e9 * s.link_gb_s)
            tot.link_bytes += w.weight * moved
            return
        if DEVICE not in devices:  # host work: cropping the image into a staging buffer, the step counters
            w.host += sum(float(t.numel() * t.element_size()) for t in outs) / (1e9 * s.host_copy_gb_s)
            return
        name = packet.__name__
        moved = sum(self._nbytes(t) for t in ins) + sum(self._nbytes(t) for t in outs)
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        kernels = self._kernels(func, args, kwargs)
        if packet in CONVS:
            rate = s.conv_rate(self.low_precision) * self._small_map(packet, args, out)
            kind = "convolution backward" if packet is aten.convolution_backward else "convolution forward"
        else:
            rate = s.matmul_rate(self.low_precision)
            kind = ("optimizer" if self.optimizer_phase else
                    "copies, crops, pads, joins" if name.rstrip("_") in JOINS or name in JOINS else
                    "matrix products" if flops else "element-wise and reductions")  # fmt: skip
        t = max(flops / rate, moved / s.bytes_per_second) + kernels * 1e-6 * s.kernel_floor_us
        if self.low_precision and packet in CONVS:  # autocast's weight cast (and the weight gradient's, back)
            weight = args[1] if packet is aten.convolution else args[2]
            cast = float(weight.numel() * 6)
            wgrad = packet is aten.convolution_backward and bool(_output_mask(args, kwargs)[1])
            casts = 1 + (1 if wgrad else 0) if packet is aten.convolution or wgrad else 0
            t += casts * (cast / s.bytes_per_second + 1e-6 * s.kernel_floor_us)
            w.host += casts * 1e-6 * s.host_op_us
            kernels += casts
            moved += casts * cast
        w.gpu += t
        tot.flops += w.weight * flops
        tot.bytes += w.weight * moved
        tot.kernels += w.weight * kernels
        tot.by_kind[kind] = tot.by_kind.get(kind, 0.0) + w.weight * t

    def _kernels(self, func: Any, args: Any, kwargs: dict[str, Any]) -> int:
        packet = func._overloadpacket
        if packet is aten.convolution_backward:
            return max(1, sum(bool(m) for m in _output_mask(args, kwargs)))
        if packet.__name__.startswith("_foreach_"):
            lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
            return max(1, math.ceil(max((len(a) for a in lists), default=1) / FOREACH_TENSORS))
        return 1

    def _small_map(self, packet: Any, args: Any, out: Any) -> float:
        """The share of the large-map rate a convolution reaches on its output map (see the module doc)."""
        if not self.speed.small_map_px:
            return 1.0
        ref = out if packet is aten.convolution else args[0]  # the output (its gradient, in backward)
        px = float(ref.shape[-1] * ref.shape[-2]) if ref is not None and ref.dim() >= 2 else 1.0
        return px / (px + self.speed.small_map_px)

    # ---- the step's time -----------------------------------------------------------------------------------------
    @property
    def seconds(self) -> float:
        return sum(w.seconds for w in self.windows)

    @property
    def gpu_seconds(self) -> float:
        return sum(w.weight * w.gpu for w in self.windows)

    @property
    def host_seconds(self) -> float:
        return sum(w.weight * w.host for w in self.windows)

    @property
    def link_seconds(self) -> float:
        return sum(w.weight * w.link for w in self.windows)

    @property
    def host_bound_seconds(self) -> float:
        """Time the GPU waits for the host: windows whose host work outlasts their kernels."""
        return sum(w.weight * max(0.0, w.host - max(w.gpu, w.link)) for w in self.windows)


def _output_mask(args: Any, kwargs: dict[str, Any]) -> tuple[bool, ...]:
    mask = kwargs.get("output_mask", args[-1] if args else (True, True, True))
    return tuple(bool(m) for m in mask)


@dataclass(frozen=True)
class ClockReading:
    """A step's simulated time on one preset, with what it is made of."""

    preset: str
    precision: str
    seconds: float
    gpu_seconds: float
    host_seconds: float
    link_seconds: float
    host_bound_seconds: float
    flops: float
    bytes: float
    kernels: float
    operators: float
    link_bytes: float
    windows: int
    by_kind: dict[str, float]
    constants: str

    @staticmethod
    def of(clock: OpClock, precision: str) -> ClockReading:
        t = clock.totals
        return ClockReading(
            clock.speed.name, precision, clock.seconds, clock.gpu_seconds, clock.host_seconds, clock.link_seconds,
            clock.host_bound_seconds, t.flops, t.bytes, t.kernels, t.operators, t.link_bytes,
            sum(w.weight for w in clock.windows), dict(sorted(t.by_kind.items(), key=lambda kv: -kv[1])),
            clock.speed.source,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def text(self) -> str:
        kinds = ", ".join(f"{k} {v:.3f} s" for k, v in self.by_kind.items())
        return "\n".join([
            f"simulated step time on the {self.preset} preset ({self.precision}): {self.seconds:.3f} s",
            f"    GPU {self.gpu_seconds:.3f} s ({kinds}); host {self.host_seconds:.3f} s, of which the GPU waits "
            f"{self.host_bound_seconds:.3f} s; host link {self.link_seconds:.3f} s ({self.link_bytes / 1e9:.2f} GB)",
            f"    {self.flops / 1e12:.1f} TFLOP, {self.bytes / 1e9:.0f} GB moved, {self.kernels:.0f} kernel launches, "
            f"{self.operators:.0f} operators, {self.windows} windows (constants: {self.constants})",
        ])  # fmt: skip


Marker = Callable[[str, int, bool], None]
