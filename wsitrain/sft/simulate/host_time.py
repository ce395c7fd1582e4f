"""The host's share of a step, without a GPU: the executor's Python and dispatch time and the kernels it launches.

A GPU step cannot run faster than the host can issue its kernels. This runs one training step of the real
executor (the real graph, the real plan's grid and every tile, the real staging code against the simulated
CUDA runtime) on the ``meta`` device, after one warm-up step. Meta kernels compute shapes only; a dispatch mode
below autograd times what happens inside every operator and excludes it. What is left is the host's own work
per step: the executor's Python, autograd's bookkeeping, each operator's call, and the real host work of
staging (the image's tiles packed into page-locked buffers, gradient tiles added on the host). Each operator
that reads or writes device memory is one launch; a copy between host and device is one copy; a read of a
device value by the host (``bool(tensor)``, ``.item()``, ``torch.equal``) is one synchronization, and so is each
content check the executor reports (``ExecHooks.on_sync``: background reuse's, which it skips on the meta device).
Content checks answer as on a slide all tissue: no tile is flat, every output-gradient tile holds a nonzero value.
The mode's own cost per operator (the call into Python and back, ``mode_overhead``, measured on a cheap operator
in the same process) is subtracted. CPU time (``time.process_time``), not wall time: other processes on a shared
machine do not inflate it, though they still slow it through shared caches.

What a real GPU adds on top: CUDA's own cost per launch (a few microseconds; the simulated clock multiplies
``launches`` by its per-preset constant). Figures are *measured on this CPU* (``seconds``) and *simulated*
(``launches``, ``copies``, ``syncs``).

The simulated clock consumes ``HostTime``; ``plan --simulate`` and ``bench`` print it.
"""

from __future__ import annotations

import math
import platform
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from wsitrain.errors import PlanError
from wsitrain.memory import available_host_bytes
from wsitrain.sft.api import SFT
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.costs import TimeModel
from wsitrain.sft.simulate.runtime import DEVICE_TYPE, SimRuntime
from wsitrain.sft.simulate.step import OPTIMIZERS
from wsitrain.sft.target import TargetDevice

# Operators that launch no kernel: allocation, shape and stride queries, stream bookkeeping.
_NO_KERNEL = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.record_stream.default,
    torch.ops.aten.set_.source_Storage_storage_offset,
    torch.ops.aten.is_pinned.default,
}


@dataclass(frozen=True)
class HostTime:
    """The host's work in one training step (forward, loss, backward, optimizer step) of a plan."""

    plan: Plan
    seconds: float  # host time per step: wall time minus the time inside operators (measured on this CPU)
    launches: int  # kernels issued on the device (every tile, the optimizer included)
    copies: int  # host <-> device copies among the launches
    syncs: int  # operators that make the host wait for the device (.item(), nonzero, bool(tensor))
    host_ops: int  # operators on host tensors only (staging memcpys, host adds of gradient tiles)
    host_bytes: int  # bytes those host operators write
    staging_seconds: float  # the host operators' time, among ``seconds`` (measured on this CPU)
    stager_seconds: float  # of ``staging_seconds``: the packs CUDA runs on the stager's worker thread (staging.py)
    operators: int  # every operator dispatched, views and allocations included
    tile_visits: int  # forward and recompute visits of tiles
    optimizer_launches: int  # the launches of the optimizer step, among ``launches``
    excluded_seconds: float  # time inside the operators (meta kernels) and the mode's own cost, not host time
    by_op: dict[str, int] = field(default_factory=dict)  # launches per operator, most first
    machine: str = ""  # the CPU that measured ``seconds``

    @property
    def seconds_per_launch(self) -> float:
        return self.seconds / max(1, self.launches)

    @property
    def main_seconds(self) -> float:
        """The thread that issues kernels, on CUDA: ``seconds`` less the packs the stager's worker thread does."""
        return self.seconds - self.stager_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "host_seconds_per_step": self.seconds,
            "launches_per_step": self.launches,
            "copies_per_step": self.copies,
            "syncs_per_step": self.syncs,
            "host_ops_per_step": self.host_ops,
            "host_bytes_per_step": self.host_bytes,
            "staging_seconds_per_step": self.staging_seconds,
            "stager_thread_seconds_per_step": self.stager_seconds,
            "main_thread_seconds_per_step": self.main_seconds,
            "operators_per_step": self.operators,
            "tile_visits": self.tile_visits,
            "optimizer_launches": self.optimizer_launches,
            "excluded_kernel_seconds": self.excluded_seconds,
            "top_launches": dict(list(self.by_op.items())[:12]),
            "machine": self.machine,
            "how": "measured on this CPU (host time); simulated (launches): the real executor on fake tensors",
        }

    def text(self) -> str:
        top = ", ".join(f"{k} {v}" for k, v in list(self.by_op.items())[:6])
        return "\n".join(
            [
                f"host side per step (measured on {self.machine or 'this CPU'}, kernels excluded): "
                f"{self.seconds * 1e3:.1f} ms ({self.main_seconds * 1e3:.1f} ms on the thread that issues kernels, "
                f"{self.stager_seconds * 1e3:.1f} ms packing tiles on the stager's thread), "
                f"{self.launches} launches ({self.seconds_per_launch * 1e6:.1f} "
                f"us each), {self.copies} host<->device copies, {self.syncs} synchronizations",
                f"  {self.tile_visits} tile visits; optimizer {self.optimizer_launches} launches; host staging "
                f"{self.host_ops} host operators writing {self.host_bytes / 2**20:.0f} MiB in "
                f"{self.staging_seconds * 1e3:.1f} ms (part of the host time); most launched: {top}",
            ]
        )


class _OpClock(TorchDispatchMode):
    """Counts the operators below autograd, times what happens inside them and stands in for the device's content
    (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0.0
        self.counting = True
        self.ops = 0
        self.launches: Counter[str] = Counter()
        self.copies = 0
        self.syncs = 0
        self.host_ops = 0
        self.host_bytes = 0
        self.host_op_seconds = 0.0
        self.stager_seconds = 0.0
        self.packing = False  # inside ``HostStager.pack``: work CUDA does on the stager's worker thread

    @contextmanager
    def staging(self) -> Iterator[None]:
        self.packing = True
        try:
            yield
        finally:
            self.packing = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        t0 = time.process_time()
        kwargs = kwargs or {}
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type == DEVICE_TYPE for t in ins)
        sync = on_device and func in _CONTENT
        if sync:
            out = _CONTENT[func]  # the host reads a device value: a synchronization on a GPU
        elif on_device and func in _DOWN and _lands_on_host(func, args, kwargs):
            out = _down(func, args, kwargs)  # a copy into host memory (meta tensors hold no data to copy)
        else:
            out = func(*args, **kwargs)
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in (*ins, *outs)}
        if self.counting:
            self._count(func, devices, outs, sync)
        spent = time.process_time() - t0
        if DEVICE_TYPE in devices or not devices:
            # a device kernel (shapes only here) or a scalar query: not host work; a host operator (staging's
            # memcpys, host adds of gradient tiles) is real host work and stays in the host's time
            self.inside += spent
        else:
            self.host_op_seconds += spent
            self.stager_seconds += spent if self.packing else 0.0
        return out

    def executor_sync(self, what: str) -> None:
        """A content read the executor reports instead of making (the meta device has no content)."""
        self.syncs += self.counting

    def _count(self, func: Any, devices: set[str], outs: list[torch.Tensor], sync: bool) -> None:
        self.ops += 1
        self.syncs += sync
        if sync or getattr(func, "is_view", False) or func in _NO_KERNEL or func.namespace == "prim":
            return
        if DEVICE_TYPE not in devices:
            if devices:
                self.host_ops += 1
                self.host_bytes += sum(t.numel() * t.element_size() for t in outs)
            return
        self.launches[func.__name__] += 1
        if "cpu" in devices:
            self.copies += 1


# What the host reads of device content, answered as for a slide all tissue: ``bool(t.any())`` is true (no
# output-gradient tile is all zero, every tile may hold a pool's maximum), ``torch.equal`` false (no tile is flat).
_CONTENT: dict[Any, Any] = {torch.ops.aten._local_scalar_dense.default: True, torch.ops.aten.equal.default: False}
_DOWN = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}


def _lands_on_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is torch.ops.aten.copy_.default:
        return args[0].device.type == "cpu"
    return str(kwargs.get("device", args[0].device)) == "cpu"


def _down(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    if func is torch.ops.aten.copy_.default:
        return args[0]  # (B, C, th, tw) staging buffer or host checkpoint: its bytes are not simulated
    src = args[0]
    return torch.empty(src.shape, dtype=kwargs.get("dtype") or src.dtype, pin_memory=False)


def host_image_refusal(input_shape: Sequence[int], input_dtype: torch.dtype = torch.uint8) -> str | None:
    """Why ``measure_host_time`` should not run here, or None: it stages a real host image (the staging memcpys are
    part of the host time), and an image larger than half of this machine's available RAM would exhaust it
    (a 100,000 px slide is 28 GiB as uint8)."""
    need = math.prod(input_shape) * torch.empty((), dtype=input_dtype).element_size()
    free = available_host_bytes()
    if need <= free // 2:
        return None
    return (
        f"host side per step: not measured (the {need / 2**30:.2f} GiB image it stages in host memory is more than "
        f"half of this machine's {free / 2**30:.2f} GiB available RAM); measure it at a smaller --size"
    )


def measure_host_time(
    model: nn.Module,
    input_shape: tuple[int, ...],
    memory_budget: int | str,
    *,
    dtype: torch.dtype = torch.float32,
    optimizer: str = "adamw",
    input_dtype: torch.dtype = torch.uint8,
    target: TargetDevice | None = None,
    tile_size: int | None = None,
    time_model: TimeModel | None = None,
    fold_bn: bool = True,
) -> HostTime:
    """The host's work in one training step of ``SFT(model)`` planned for CUDA within ``memory_budget``.

    ``time_model``: the constants the plan is chosen by; give the ones the simulated step was planned with, so that
    both measure the same plan (default: the device's). ``fold_bn``: as ``SFT``'s.

    ``model`` lives on the meta device. ``dtype``: the activations' dtype the plan is made for (bf16: the plan
    ``fit`` runs under autocast); the step itself runs in the model's own dtype (the meta device has no
    autocast), which issues the same operators per tile except autocast's weight casts. The image is a host
    uint8 tensor, as ``fit`` streams it (allocated for real: 200 MB at 8192 px).
    """
    if any(t.device.type != DEVICE_TYPE for t in [*model.parameters(), *model.buffers()]):
        raise PlanError(
            "measuring the host's share needs a model built on the meta device",
            hint='build it under `with torch.device("meta"):` and pass that model',
        )
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer {optimizer!r} is not simulated", hint=f"use one of: {', '.join(OPTIMIZERS)}")
    sft = _PlannedAs(
        dtype, model, memory_budget=memory_budget, tile_size=tile_size, optimizer=optimizer, collect_stats=False,
        runtime=SimRuntime(), target=target, time_model=time_model, fold_bn=fold_bn,
    )  # fmt: skip
    shape = tuple(input_shape)
    plan = sft.plan_for(shape, dtype=dtype, input_dtype=input_dtype, input_on_host=True)  # raises when too big
    visits = [0]

    def at_tile(seg: int, r: int, c: int, phase: str) -> None:
        visits[0] += phase in ("forward", "backward")

    sft._hooks.on_tile = at_tile
    clock = _OpClock()
    sft._hooks.on_sync = clock.executor_sync  # content checks the executor skips on the meta device (reuse.py)
    sft._stager.pack_scope = clock.staging
    params = [p for p in model.parameters() if p.requires_grad]
    image = torch.zeros(shape, dtype=input_dtype)  # (B, C, H, W) in host memory
    target_t = torch.zeros(shape[0], dtype=torch.long, device=DEVICE_TYPE)
    try:
        opt = OPTIMIZERS[optimizer](params)
        with clock:
            clock.counting = False
            _step(sft, opt, params, image, target_t)  # warm-up: optimizer state, staging buffers, caches
            clock.counting, clock.inside, clock.host_op_seconds, visits[0] = True, 0.0, 0.0, 0
            clock.stager_seconds = 0.0
            t0 = time.process_time()
            opt_launches = _step(sft, opt, params, image, target_t, clock)
            wall = time.process_time() - t0
    finally:
        sft._hooks.on_tile = None
        sft._hooks.on_sync = None
        sft._stager.pack_scope = nullcontext
        for p in params:
            p.grad = None
    overhead = mode_overhead()
    return HostTime(
        plan=plan,
        seconds=max(0.0, wall - clock.inside - clock.ops * overhead),
        launches=sum(clock.launches.values()),
        copies=clock.copies,
        syncs=clock.syncs,
        host_ops=clock.host_ops,
        host_bytes=clock.host_bytes,
        staging_seconds=clock.host_op_seconds,
        stager_seconds=clock.stager_seconds,
        operators=clock.ops,
        tile_visits=visits[0],
        optimizer_launches=opt_launches,
        excluded_seconds=clock.inside + clock.ops * overhead,
        by_op=dict(clock.launches.most_common()),
        machine=platform.processor() or platform.machine(),
    )


def mode_overhead(calls: int = 2000, repeats: int = 3) -> float:
    """Seconds per operator the dispatch mode adds outside its own timing (the call into Python and back), which
    no real step pays: measured on a cheap operator here, now, the least of ``repeats``."""
    x = torch.empty(1, 8, 16, 16, device=DEVICE_TYPE)
    best = float("inf")
    for _ in range(repeats):
        clock = _OpClock()
        clock.counting = False
        with clock:
            t0 = time.process_time()
            for _ in range(calls):
                torch.neg(x)
            total = time.process_time() - t0
        best = min(best, (total - clock.inside) / calls)
    return max(0.0, best)


def _step(
    sft: SFT,
    opt: torch.optim.Optimizer,
    params: list[nn.Parameter],
    image: torch.Tensor,
    target: torch.Tensor,
    clock: _OpClock | None = None,
) -> int:
    """One training step; returns the optimizer step's launches (counted by ``clock``)."""
    opt.zero_grad(set_to_none=True)
    logits = sft(image)
    loss = nn.functional.cross_entropy(logits.float(), target)
    del logits
    loss.backward()
    del loss
    before = sum(clock.launches.values()) if clock is not None else 0
    opt.step()
    return sum(clock.launches.values()) - before if clock is not None else 0


class _PlannedAs(SFT):
    """``SFT`` whose activations are planned in a given dtype (autocast's, which the meta device cannot enter)."""

    def __init__(self, act_dtype: torch.dtype, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._planned_dtype = act_dtype

    def _act_dtype(self, device: torch.device) -> torch.dtype:
        return self._planned_dtype
