"""The simulated CUDA runtime: streams, events and page-locked buffers as bookkeeping, with the ordering checked.

The transfer code (``execution/transfers.StreamCopies``) runs unchanged against this runtime, on fake tensors
(the ``meta`` device stands in for the GPU, fake CPU tensors for host memory). Every operator is reported by the
memory tracker (``tracker.LiveMemory``) with the stream current when it was issued; the runtime keeps a vector
clock per stream and for the host, and checks every data access against the last write and the reads since:

- the host reads or writes a page-locked buffer before the copy into (or out of) it is known complete: an
  ``Event.synchronize`` on an event recorded after the copy, or a synchronous operation on that stream;
- a stream uses a tensor another stream wrote without having waited on an event recorded after that write
  (``wait_event`` / ``wait_stream``);
- a tensor used on a stream other than the one that allocated it is freed without ``record_stream`` for that
  stream (the caching allocator would hand its memory to the allocating stream's next tensor while the other
  stream may still read it), unless the allocating stream had already waited for that use.

A broken rule raises ``StreamOrderError`` naming the buffer (and the tile it holds) and the two streams.
Copies between device and pageable host memory, and copies without ``non_blocking``, are synchronous, as on CUDA.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from wsitrain.sft.simulate.tracker import storage_key, tensors_in

HOST = "host"
DEVICE_TYPE = "meta"  # the simulated GPU's tensors


class StreamOrderError(RuntimeError):
    """A copy or a use of a tensor that a real GPU could run in the wrong order."""


@dataclass
class SimStream:
    name: str
    clock: dict[str, int] = field(default_factory=dict)  # what this context has seen of each context's work

    def tick(self) -> int:
        self.clock[self.name] = self.clock.get(self.name, 0) + 1
        return self.clock[self.name]

    def join(self, other: dict[str, int]) -> None:
        for k, v in other.items():
            if v > self.clock.get(k, 0):
                self.clock[k] = v

    def has_seen(self, ctx: str, at: int) -> bool:
        return ctx == self.name or self.clock.get(ctx, 0) >= at


@dataclass
class SimEvent:
    """An event recorded on a stream: completes (for whoever waits on it) the work issued there before it."""

    runtime: SimRuntime
    clock: dict[str, int]

    def synchronize(self) -> None:
        self.runtime.host.join(self.clock)


@dataclass
class _Access:
    """The last write to a storage and the reads since: (context, clock, what the operator was)."""

    write: tuple[str, int, str] | None = None
    # the latest read per context since the last write: a later read by the same context covers an earlier one
    # (a context's work is ordered), so parameters read by every tile keep one entry, not one per tile
    reads: dict[str, tuple[int, str]] = field(default_factory=dict)
    alloc: str = HOST
    used_on: dict[str, int] = field(default_factory=dict)  # foreign stream -> clock of its last use
    recorded: set[str] = field(default_factory=set)


class SimRuntime:
    """A ``DeviceRuntime`` (``execution/runtime.py``) for the simulated device; see the module doc."""

    plan_device = "cuda"
    asynchronous = True
    # Operators are seen through thread-local dispatch modes: the stager packs on the caller's thread here, and the
    # clock prices that copy on the stager's own lane (``clock.OpClock.staging``), as CUDA runs it on a worker.
    host_threads = False

    def on_worker(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def __init__(self) -> None:
        self.host = SimStream(HOST)
        self.compute = SimStream("compute stream")
        self.current = self.compute
        self._streams = 0
        self._pinned: set[int] = set()
        self._names: dict[int, str] = {}
        self._holds: dict[int, str] = {}  # storage -> the tile it holds now
        self._access: dict[int, _Access] = {}
        self._pending: list[str] = []  # violations found while freeing (raised at the next operator)
        self.checked = 0  # accesses checked

    # ---- the DeviceRuntime interface -----------------------------------------------------------
    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        self._pinned.add(storage_key(t))
        return t

    def new_stream(self, device: torch.device) -> SimStream:
        self._streams += 1
        return SimStream(f"side stream {self._streams}")

    def current_stream(self, device: torch.device) -> SimStream:
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        assert isinstance(stream, SimStream)
        old, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = old

    def record_event(self, stream: Any) -> SimEvent:
        assert isinstance(stream, SimStream)
        stream.join(self.host.clock)  # recorded after the host work issued so far
        return SimEvent(self, dict(stream.clock))

    def wait_event(self, stream: Any, event: Any) -> None:
        assert isinstance(stream, SimStream) and isinstance(event, SimEvent)
        stream.join(event.clock)

    def wait_stream(self, stream: Any, other: Any) -> None:
        assert isinstance(stream, SimStream) and isinstance(other, SimStream)
        stream.join(other.clock)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        assert isinstance(stream, SimStream)
        self._access.setdefault(storage_key(tensor), _Access()).recorded.add(stream.name)

    def describe(self, tensor: torch.Tensor, what: str) -> None:
        k = storage_key(tensor)
        if k in self._names:
            self._holds[k] = what
        else:
            self._names[k] = what

    def synchronize(self) -> None:
        """The host waits for every stream (``torch.cuda.synchronize``)."""
        for s in (self.compute, self.current):
            self.host.join(s.clock)

    # ---- checks, called by the memory tracker for every operator -----------------------------
    def observe(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor], new: set[int]
    ) -> None:
        if self._pending:
            raise StreamOrderError(self._pending.pop(0))
        if getattr(func, "is_view", False) or func in _NO_DATA:
            return
        ins = tensors_in((args, kwargs))
        on_device = any(t.device.type == DEVICE_TYPE for t in (*ins, *outs))
        ctx = self.current if on_device else self.host
        if on_device:
            ctx.join(self.host.clock)  # device work is issued after the host work before it
        at = ctx.tick()
        name = func.__name__
        written = _written(func, args, kwargs)
        asynchronous = bool(_argument(func, args, kwargs, "non_blocking"))
        synchronous_host = False
        for t in ins:
            k = storage_key(t)
            acc = self._access.get(k)
            if acc is None:  # made before the simulation: parameters and buffers live in the compute stream's pool
                acc = self._access[k] = _Access(alloc=self.compute.name if t.device.type == DEVICE_TYPE else HOST)
            if t.device.type == "cpu" and on_device and not (asynchronous and k in self._pinned):
                synchronous_host = True  # pageable memory, or a blocking copy: the host waits for the stream
            if id(t) in written:
                self._check(ctx, k, acc, name, write=True)
                acc.write, acc.reads = (ctx.name, at, name), {}
            else:
                self._check(ctx, k, acc, name, write=False)
                acc.reads[ctx.name] = (at, name)
            if on_device and t.device.type == DEVICE_TYPE and ctx.name != acc.alloc:
                acc.used_on[ctx.name] = at
        for t in outs:
            k = storage_key(t)
            if k in new:
                self._access[k] = _Access(write=(ctx.name, at, name), alloc=ctx.name if on_device else HOST)
            if t.device.type == "cpu" and on_device and not (asynchronous and k in self._pinned):
                synchronous_host = True
        if synchronous_host:
            self.host.join(ctx.clock)

    def _check(self, ctx: SimStream, k: int, acc: _Access, op: str, write: bool) -> None:
        self.checked += 1
        hazards = [acc.write] if acc.write is not None else []
        if write:
            hazards += [(c, at, op_) for c, (at, op_) in acc.reads.items()]
        for other, at, other_op in hazards:
            if not ctx.has_seen(other, at):
                raise StreamOrderError(self._message(ctx.name, k, op, write, other, other_op))

    def _message(self, ctx: str, k: int, op: str, write: bool, other: str, other_op: str) -> str:
        buf = self._names.get(k, "a tensor")
        holds = self._holds.get(k)
        what = f"{buf}" + (f" (holding {holds})" if holds and holds != buf else "")
        verb = "writes" if write else "reads"
        if ctx == HOST:
            fix = "synchronize the copy's event first"
        else:
            fix = f"make the {ctx} wait on an event recorded on the {other} after it (wait_event)"
        return f"{ctx} {verb} {what} ({op}) while {other}'s {other_op} on it may still be running: {fix}"

    def on_free(self, k: int) -> None:
        """A storage died: every foreign stream that used it must be recorded (or already waited for)."""
        acc = self._access.pop(k, None)
        self._names.pop(k, None)
        self._holds.pop(k, None)
        self._pinned.discard(k)
        if acc is None:
            return
        for s, at in acc.used_on.items():
            if s in acc.recorded:
                continue
            alloc = self.compute if acc.alloc == self.compute.name else None
            if alloc is not None and alloc.has_seen(s, at):
                continue
            self._pending.append(
                f"a tensor allocated on the {acc.alloc} and used on the {s} was freed without record_stream: the "
                f"allocator may give its memory to the {acc.alloc}'s next tensor while the {s} still reads it"
            )


# Operators that touch no data: allocation metadata, shape queries.
_NO_DATA = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.record_stream.default,
}


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """An operator's argument by its schema name, given by keyword or position (None when absent)."""
    if name in kwargs:
        return kwargs[name]
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    for pos, a in enumerate(schema.arguments):
        if a.name == name:
            return args[pos] if pos < len(args) and not a.kwarg_only else None
    return None


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """ids of the tensors the operator writes (schema alias annotations with ``!``: ``self_``, ``out``)."""
    out: set[int] = set()
    for name in _write_names(func):
        for t in tensors_in(_argument(func, args, kwargs, name)):
            out.add(id(t))
    return out


@functools.lru_cache(maxsize=4096)  # one entry per operator overload (aten has about 3,000)
def _write_names(func: Any) -> tuple[str, ...]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return ()
    return tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
