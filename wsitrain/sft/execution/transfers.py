"""How one copy between host and device is issued and awaited: side CUDA streams and events.

``wsitrain.sft.execution.staging`` decides *what* to copy and *when* (two buffers, prefetch, the order of host adds);
a ``Copies`` object only issues one copy and hands back the event that says when it is done. Three
implementations share one protocol:

- ``CudaCopies``: two side streams owned by one ``SFT`` (no global state), one per direction, so an upload
  never queues behind a download that waits for compute (a GPU has a copy engine per direction).
  Downloads wait on the compute stream's work issued so far (the tile exists), uploads wait on nothing;
  the compute stream waits on an upload's event before it uses the tile.
- ``SyncCopies``: every other device (CPU): the copy happens at once; the same bookkeeping runs around it.
- a test fake (tests/test_sft_host_transfers.py) that performs a copy only when its event is waited on,
  so an executor that reads a buffer before waiting gets stale data and fails its exactness test.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CopyEvent(Protocol):
    def synchronize(self) -> None:
        """Block the host until the copy is complete (its destination may then be read or its source reused)."""


class Copies(Protocol):
    """Issues copies between host buffers and device tensors; see the module doc."""

    @property
    def pinned(self) -> bool:
        """Whether host staging buffers should be page-locked (only then are copies truly asynchronous)."""

    def down(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        """Copy device tile ``src`` into host buffer ``dst`` (same shape, contiguous) once the compute work
        issued so far is done; ``dst`` holds it after the event's ``synchronize``."""

    def up(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, CopyEvent]:
        """Start copying host buffer ``src`` into a new tensor on ``device``; ``src`` must stay unchanged until
        the event's ``synchronize``. Before computing with the tensor, pass it through ``ready``."""

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        """Make the compute stream wait for the upload ``event`` of ``tensor``; returns the tensor."""


class _Done:
    """The event of a copy that already happened."""

    def synchronize(self) -> None:
        return None


DONE = _Done()


class SyncCopies:
    """Copies done at once (CPU and any non-CUDA device): the staging bookkeeping still runs around them."""

    pinned = False

    def down(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        dst.copy_(src)
        return DONE

    def up(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, CopyEvent]:
        # copy=True: on CPU ``to`` would return the staging buffer itself, which the next tile overwrites
        return src.to(device, copy=True), DONE

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        return tensor


class CudaCopies:
    """Copies on two side streams of one device: uploads on one, downloads on the other."""

    pinned = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.up_stream = torch.cuda.Stream(device)
        self.down_stream = torch.cuda.Stream(device)

    def down(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        compute = torch.cuda.current_stream(src.device)
        # contiguous on the compute stream: a strided tile would otherwise get its contiguous temporary on
        # the side stream, whose allocations the compute stream's memory pool does not reuse
        src = src.contiguous()
        # the side stream waits for the work issued so far on the compute stream: an event recorded there
        # after the tile was produced (wait_stream records it and makes the side stream wait on it)
        self.down_stream.wait_stream(compute)
        with torch.cuda.stream(self.down_stream):
            dst.copy_(src, non_blocking=True)  # pinned, contiguous destination: a true asynchronous DMA
            event = torch.cuda.Event()
            event.record(self.down_stream)
        # src was allocated on the compute stream and is read on the side stream: without this, freeing it
        # (the executor drops the tile right away) would let the caching allocator hand its memory to the
        # next tile's kernels while the copy still reads it; the block is reused only after the copy
        src.record_stream(self.down_stream)
        return event

    def up(self, src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, CopyEvent]:
        with torch.cuda.stream(self.up_stream):
            # allocated on the side stream, so the copy cannot write into memory the compute stream is still
            # using (a block freed on the compute stream is not reused by another stream before it is done)
            out = src.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.up_stream)
        return out, event

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        assert isinstance(event, torch.cuda.Event)
        compute = torch.cuda.current_stream(tensor.device)
        compute.wait_event(event)  # the GPU waits; the host does not
        # the tensor belongs to the side stream's pool but is read (and freed) on the compute stream: this keeps
        # its memory from being reused by the side stream's next upload until the compute work using it is done
        tensor.record_stream(compute)
        return tensor


def copies_for(device: torch.device) -> Copies:
    """The copies for a device: side streams on CUDA, synchronous copies elsewhere."""
    return CudaCopies(device) if device.type == "cuda" else SyncCopies()
