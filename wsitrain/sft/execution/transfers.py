"""How one copy between host and device is issued and awaited.

``wsitrain.sft.execution.staging`` decides *what* to copy and *when* (two buffers, prefetch, the order of host
adds); a ``Copies`` object only issues one copy and hands back the event that says when it is done. Three
implementations share one protocol:

- ``StreamCopies``: two side streams of a ``DeviceRuntime`` (``runtime.py``) owned by one ``SFT`` (no global state),
  one per direction, so an upload never queues behind a download that waits for compute (a GPU has a copy engine
  per direction). Downloads wait on the compute stream's work issued so far (the tile exists), uploads wait on
  nothing; the compute stream waits on an upload's event before it uses the tile. The same code runs on CUDA and
  on the simulated device, whose runtime checks every ordering rule.
- ``SyncCopies``: a runtime without streams (the CPU): the copy happens at once; the same bookkeeping runs around it.
- a test fake (tests/test_sft_host_transfers.py) that performs a copy only when its event is waited on,
  so an executor that reads a buffer before waiting gets stale data and fails its exactness test.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from wsitrain.sft.execution.runtime import DONE, DeviceRuntime, Event, runtime_for

CopyEvent = Event


class Copies(Protocol):
    """Issues copies between host buffers and device tensors; see the module doc."""

    @property
    def pinned(self) -> bool:
        """Whether copies are asynchronous (then host staging buffers are page-locked)."""

    @property
    def threads(self) -> bool:
        """Whether uploads may be packed and issued on the stager's worker thread (``DeviceRuntime.host_threads``)."""

    def on_worker(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """Entered by the worker thread around the work it issues for ``device``."""

    def buffer(self, nbytes: int, what: str) -> torch.Tensor:
        """A flat uint8 host staging buffer (page-locked where copies are asynchronous), named ``what``."""

    def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> CopyEvent:
        """Copy device tile ``src`` into host buffer ``dst`` (same shape, contiguous) once the compute work
        issued so far is done; ``dst`` holds it after the event's ``synchronize``."""

    def up(self, src: torch.Tensor, device: torch.device, what: str = "") -> tuple[torch.Tensor, CopyEvent]:
        """Start copying host buffer ``src`` into a new tensor on ``device``; ``src`` must stay unchanged until
        the event's ``synchronize``. Before computing with the tensor, pass it through ``ready``."""

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        """Make the compute stream wait for the upload ``event`` of ``tensor``; returns the tensor."""


class SyncCopies:
    """Copies done at once (CPU and any device without streams): the staging bookkeeping still runs around them."""

    pinned = False
    threads = False

    def on_worker(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def buffer(self, nbytes: int, what: str) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> CopyEvent:
        dst.copy_(src)
        return DONE

    def up(self, src: torch.Tensor, device: torch.device, what: str = "") -> tuple[torch.Tensor, CopyEvent]:
        # copy=True: on CPU ``to`` would return the staging buffer itself, which the next tile overwrites
        return src.to(device, copy=True), DONE

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        return tensor


class StreamCopies:
    """Copies on two side streams of one device: uploads on one, downloads on the other."""

    pinned = True

    def __init__(self, runtime: DeviceRuntime, device: torch.device) -> None:
        self.rt = runtime
        self.device = device
        self.up_stream = runtime.new_stream(device)
        self.down_stream = runtime.new_stream(device)

    @property
    def threads(self) -> bool:
        return self.rt.host_threads

    def on_worker(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        return self.rt.on_worker(device)

    def buffer(self, nbytes: int, what: str) -> torch.Tensor:
        buf = self.rt.pinned_empty(nbytes)
        self.rt.describe(buf, what)
        return buf

    def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> CopyEvent:
        rt = self.rt
        compute = rt.current_stream(src.device)
        # contiguous on the compute stream: a strided tile would otherwise get its contiguous temporary on
        # the side stream, whose allocations the compute stream's memory pool does not reuse
        src = src.contiguous()
        rt.describe(src, what)
        rt.describe(dst, what)  # the staging buffer now holds this tile
        # the side stream waits for the work issued so far on the compute stream (the tile exists)
        rt.wait_stream(self.down_stream, compute)
        with rt.use_stream(self.down_stream):
            dst.copy_(src, non_blocking=True)  # page-locked, contiguous destination: a true asynchronous DMA
        event = rt.record_event(self.down_stream)
        # src was allocated on the compute stream and is read on the side stream: without this, freeing it
        # (the executor drops the tile right away) would let the caching allocator hand its memory to the
        # next tile's kernels while the copy still reads it; the block is reused only after the copy
        rt.record_stream(src, self.down_stream)
        return event

    def up(self, src: torch.Tensor, device: torch.device, what: str = "") -> tuple[torch.Tensor, CopyEvent]:
        rt = self.rt
        rt.describe(src, what)  # the staging buffer holds this tile until the copy is done
        with rt.use_stream(self.up_stream):
            # allocated on the side stream, so the copy cannot write into memory the compute stream is still
            # using (a block freed on the compute stream is not reused by another stream before it is done)
            out = src.to(device, non_blocking=True)
        rt.describe(out, what)
        return out, rt.record_event(self.up_stream)

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        rt = self.rt
        compute = rt.current_stream(tensor.device)
        rt.wait_event(compute, event)  # the device waits; the host does not
        # the tensor belongs to the side stream's pool but is read (and freed) on the compute stream: this keeps
        # its memory from being reused by the side stream's next upload until the compute work using it is done
        rt.record_stream(tensor, compute)
        return tensor


def copies_for(device: torch.device, runtime: DeviceRuntime | None = None) -> Copies:
    """The copies for a device: side streams where the runtime is asynchronous, synchronous copies elsewhere."""
    rt = runtime or runtime_for(device)
    return StreamCopies(rt, device) if rt.asynchronous else SyncCopies()
