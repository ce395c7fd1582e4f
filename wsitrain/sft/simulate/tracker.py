"""Live storages per device, counted as the code allocates and frees them: the simulated device's memory.

``LiveMemory`` is a ``TorchDispatchMode``: every operator's output whose storage is new (not one of its inputs'
storages, not seen before) is registered with a ``weakref.finalize`` that subtracts its bytes when the storage dies. On
real CPU tensors this matches the tensors PyTorch's allocator hands out byte for byte; it does not see the allocator's
rounding and fragmentation, library workspaces or the CUDA context (docs/engine/measured-and-planned.md).

At each new peak of the device it notes where the step was (``where``, set by the caller: segment, tile, phase)
and the largest live storages then, so a report can say what fills the device at its peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Largest live storages a report lists at a peak: enough to see what dominates (checkpoints, a tile's maps).
TOP_TENSORS = 6

# fn(op, args, kwargs, output tensors, new storage keys): the simulated runtime's ordering check
OpObserver = Callable[[Any, tuple[Any, ...], dict[str, Any], list[torch.Tensor], set[int]], None]


@dataclass(frozen=True)
class LiveTensor:
    """One live storage at a peak."""

    nbytes: int
    device: str
    made_by: str  # the operator and shape that allocated it
    where: str  # where the step was when it was allocated


@dataclass(frozen=True)
class Peak:
    """A device's peak: bytes, where the step was, and the largest storages live then."""

    bytes: int
    where: str
    largest: tuple[LiveTensor, ...]


class SimSpill:
    """The simulated step's spill files: host tensors counted as "disk", not host RAM (execution/spill.py's
    ``SpillFiles`` maps real files; under fake tensors there is nothing to map)."""

    def __init__(self, memory: LiveMemory) -> None:
        self.memory = memory

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "spilled checkpoint") -> torch.Tensor:
        old, self.memory.relabel = self.memory.relabel, "disk"
        try:
            return torch.empty(shape, dtype=dtype)
        finally:
            self.memory.relabel = old

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, what: str = "spilled gradient") -> torch.Tensor:
        old, self.memory.relabel = self.memory.relabel, "disk"
        try:
            return torch.zeros(shape, dtype=dtype)
        finally:
            self.memory.relabel = old


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or result (tuples, lists, dicts): pytree's flatten, 4x cheaper."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_in(o)]
    return []


class LiveMemory(TorchDispatchMode):
    """Counts live storages per device type (``"meta"`` is the simulated device, ``"cpu"`` the host, ``"disk"``
    host tensors spilled to files, ``SimSpill``)."""

    def __init__(
        self,
        devices: tuple[str, ...] = ("meta", "cpu"),
        observer: OpObserver | None = None,
        fast: dict[Any, Callable[..., Any]] | None = None,
    ) -> None:
        super().__init__()
        self.fast = fast or {}  # shape-only stand-ins for slow fake implementations (``fast_ops.py``)
        self.live: dict[str, int] = dict.fromkeys(devices, 0)
        self.peaks: dict[str, Peak] = {d: Peak(0, "start", ()) for d in devices}
        self.where = "start"
        self.observer = observer
        self._info: dict[int, LiveTensor] = {}
        self.ops = 0  # operators seen (the simulation's own progress measure)
        self.on_free: Callable[[int], None] | None = None  # the runtime's check at each free (record_stream)
        # counts the storages allocated meanwhile under this name instead of their device's (``SimSpill``: "disk")
        self.relabel: str | None = None

    def adopt(self, tensors: list[torch.Tensor], what: str) -> None:
        """Count tensors made before the mode was entered (parameters, buffers, the image) as live."""
        for t in tensors:
            self._register(t, what, set())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fast = self.fast.get(func)
        out = fast(*args, **kwargs) if fast is not None else func(*args, **kwargs)
        self.ops += 1
        ins = tensors_in((args, kwargs))
        outs = tensors_in(out)
        in_keys = {storage_key(t) for t in ins}
        new: set[int] = set()
        for t in outs:
            k = storage_key(t)
            if k not in in_keys and k not in self._info:
                self._register(t, f"{func.__name__} {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}", new)
        if self.observer is not None:
            self.observer(func, args, kwargs, outs, new)
        return out

    def _register(self, t: torch.Tensor, made_by: str, new: set[int]) -> None:
        s = t.untyped_storage()
        k = s._cdata
        if k in self._info:
            return
        dev = self.relabel or t.device.type
        n = s.nbytes()
        self._info[k] = LiveTensor(n, dev, made_by, self.where)
        new.add(k)
        self.live[dev] = self.live.get(dev, 0) + n
        if self.live[dev] > self.peaks.setdefault(dev, Peak(0, "start", ())).bytes:
            self._new_peak(dev)
        weakref.finalize(s, self._free, k)

    def _new_peak(self, dev: str) -> None:
        here = sorted((i for i in self._info.values() if i.device == dev), key=lambda i: -i.nbytes)
        self.peaks[dev] = Peak(self.live[dev], self.where, tuple(here[:TOP_TENSORS]))

    def _free(self, k: int) -> None:
        info = self._info.pop(k, None)
        if info is not None:
            self.live[info.device] -= info.nbytes
        if self.on_free is not None:
            self.on_free(k)

    def name_of(self, k: int) -> str:
        info = self._info.get(k)
        return info.made_by if info is not None else "a tensor"
