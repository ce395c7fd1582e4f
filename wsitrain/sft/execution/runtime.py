"""The device runtime: streams, events and page-locked buffers behind one small interface.

The transfer code (``transfers.StreamCopies``) is written once against this interface. ``CudaRuntime`` maps it
onto ``torch.cuda``; ``wsitrain.sft.simulate.runtime.SimRuntime`` runs the same calls on fake tensors and checks
the ordering rules a GPU would not report (a host read of a page-locked buffer before its copy completed, a buffer
reused while a copy is in flight, a tensor used on another stream without an event wait or ``record_stream``).
``HostRuntime`` is every device whose copies are synchronous (the CPU): no streams, no page-locked memory.

A runtime also says which device type the planner prices (``plan_device``): the simulated device runs on the
``meta`` device but is planned as CUDA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch


class Stream(Protocol):
    """An ordered queue of device work (``torch.cuda.Stream`` on CUDA)."""


class Event(Protocol):
    def synchronize(self) -> None:
        """Block the host until the work recorded before this event is complete."""


class DeviceRuntime(Protocol):
    """Streams, events and page-locked host buffers of one kind of device (see the module doc)."""

    @property
    def plan_device(self) -> str:
        """The device type plans are priced for: "cuda" or "cpu"."""

    @property
    def asynchronous(self) -> bool:
        """Whether host <-> device copies can be in flight (side streams, page-locked buffers)."""

    @property
    def host_threads(self) -> bool:
        """Whether the stager may pack tiles and issue their uploads on a worker thread (``staging.py``): CUDA's
        calls are thread-safe and release the GIL. Not the simulated device, which sees operators through
        thread-local dispatch modes, nor a device without streams, where there is nothing to overlap."""

    def on_worker(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """Entered by a worker thread before it issues work for ``device`` (a thread's current CUDA device is its
        own: a new thread starts on device 0)."""

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer that copies can read or write asynchronously (page-locked on CUDA)."""

    def new_stream(self, device: torch.device) -> Stream: ...

    def current_stream(self, device: torch.device) -> Stream: ...

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        """Within the block, device work (and allocations) go to ``stream``."""

    def record_event(self, stream: Stream) -> Event:
        """An event that completes when the work issued on ``stream`` so far is done."""

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Work issued on ``stream`` after this waits for ``event`` (the device waits, not the host)."""

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        """Work issued on ``stream`` after this waits for the work issued on ``other`` so far."""

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor``'s memory is not reused until the work issued on ``stream`` so far is done."""

    def describe(self, tensor: torch.Tensor, what: str) -> None:
        """Name a buffer for error messages (the simulated runtime's; a no-op elsewhere)."""


class CudaRuntime:
    """``torch.cuda`` streams, events and page-locked memory."""

    plan_device = "cuda"
    asynchronous = True
    host_threads = True

    def on_worker(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.device(device)

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    @contextlib.contextmanager
    def use_stream(self, stream: Stream) -> Iterator[None]:
        assert isinstance(stream, torch.cuda.Stream)
        with torch.cuda.stream(stream):
            yield

    def record_event(self, stream: Stream) -> torch.cuda.Event:
        assert isinstance(stream, torch.cuda.Stream)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Stream, event: Event) -> None:
        assert isinstance(stream, torch.cuda.Stream) and isinstance(event, torch.cuda.Event)
        stream.wait_event(event)

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        assert isinstance(stream, torch.cuda.Stream) and isinstance(other, torch.cuda.Stream)
        stream.wait_stream(other)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        assert isinstance(stream, torch.cuda.Stream)
        tensor.record_stream(stream)

    def describe(self, tensor: torch.Tensor, what: str) -> None:
        return None


class HostRuntime:
    """Synchronous copies (the CPU, and any device without streams): nothing is ever in flight."""

    asynchronous = False
    host_threads = False

    def __init__(self, plan_device: str = "cpu") -> None:
        self.plan_device = plan_device

    def on_worker(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def new_stream(self, device: torch.device) -> Stream:
        return self

    def current_stream(self, device: torch.device) -> Stream:
        return self

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record_event(self, stream: Stream) -> Event:
        return DONE

    def wait_event(self, stream: Stream, event: Event) -> None:
        return None

    def wait_stream(self, stream: Stream, other: Stream) -> None:
        return None

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        return None

    def describe(self, tensor: torch.Tensor, what: str) -> None:
        return None


class _Done:
    """The event of work that already happened."""

    def synchronize(self) -> None:
        return None


DONE = _Done()


def runtime_for(device: torch.device) -> DeviceRuntime:
    """The runtime of a real device: CUDA's streams on CUDA, synchronous copies elsewhere."""
    return CudaRuntime() if device.type == "cuda" else HostRuntime(device.type)
