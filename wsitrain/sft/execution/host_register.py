"""The whole image's one copy to the device (a plain first segment): its pages registered for that copy only.

A tiled first segment never copies the image whole: its tiles go through the stager's page-locked buffers, so the
slide itself need not be page-locked at all. A plain first segment copies the whole image once per step, and
the segment cannot start before that copy ends, so the copy overlaps nothing either way. Of the ways to make
it a DMA from host memory, registering the slide's own pages (``cudaHostRegister``) for the duration of the
copy is chosen over allocating the slide pinned: PyTorch's pinned allocator rounds each request up to a power
of two (a 9 GB slide takes 16 GB) and caches freed blocks by size, so slides of varied sizes pile up
page-locked memory over an epoch; a registration takes exactly the image's pages and gives them back after
the copy. Registration can fail (locked-memory limits, memory not from malloc): the copy is then a plain
pageable one, slower, never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import torch

Transfer = Literal["direct", "pinned", "register"]


class PageLocker(Protocol):
    """Page-locks host memory in place (``cudaHostRegister``) and waits for copies that read it."""

    def register(self, t: torch.Tensor) -> bool: ...

    def unregister(self, t: torch.Tensor) -> None: ...

    def synchronize(self, device: torch.device) -> None: ...


class CudaPageLocker:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()``."""

    def register(self, t: torch.Tensor) -> bool:
        try:
            rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
        except (RuntimeError, AttributeError):
            return False
        return int(rc) == 0  # cudaSuccess

    def unregister(self, t: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()


def whole_image_transfer(x: torch.Tensor, device: torch.device) -> Transfer:
    """How the whole image reaches ``device``: "direct" (not a host -> CUDA copy, or nothing to gain),
    "pinned" (already page-locked: an asynchronous copy as is), "register" (pageable host memory)."""
    if device.type != "cuda" or x.device.type != "cpu":
        return "direct"
    return "pinned" if x.is_pinned() else "register"


def _copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


def upload_whole(
    x: torch.Tensor,
    device: torch.device,
    locker: PageLocker | None = None,
    copy: Callable[[torch.Tensor, torch.device], torch.Tensor] = _copy,
) -> torch.Tensor:
    """``x`` on ``device``; a pageable host image is registered for the copy and unregistered once it is done."""
    how = whole_image_transfer(x, device)
    if how != "register":
        return copy(x, device)
    lock = locker or CudaPageLocker()
    src = x.contiguous()  # one registration covers one contiguous range
    if not lock.register(src):
        return copy(src, device)  # a pageable copy: CUDA stages it itself, synchronously
    try:
        out = copy(src, device)
        lock.synchronize(device)  # the DMA reads the pages until it completes: unregister only after
    finally:
        lock.unregister(src)
    return out
