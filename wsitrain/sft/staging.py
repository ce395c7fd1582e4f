"""Host -> device staging of tile regions through two reused pinned buffers (one pair per ``SFT``).

A region cut from a host image is a strided view; copying it to the device directly goes through a
pageable temporary and blocks. The region is first packed into a pinned buffer, then copied with
``non_blocking=True``; two buffers alternate so packing the next tile overlaps the transfer of the
current one, and an event guards a buffer's reuse. Buffers are flat and grow to the largest region
seen, so the pinned memory held is two regions' worth however many input shapes a run sees.
"""

from __future__ import annotations

import torch


class HostStager:
    def __init__(self) -> None:
        self._flat: list[torch.Tensor | None] = [None, None]
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    @property
    def buffers(self) -> int:
        """Pinned buffers held now (at most two)."""
        return sum(b is not None for b in self._flat)

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._flat if b is not None)

    def pack(self, region: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Copy ``region`` into the next buffer (pinned where CUDA exists); returns (buffer index, packed view)."""
        k = self._turn
        self._turn ^= 1
        event = self._events[k]
        if event is not None:
            event.synchronize()  # the previous transfer out of this buffer is done
        nbytes = region.numel() * region.element_size()
        flat = self._flat[k]
        if flat is None or flat.numel() < nbytes:
            self._flat[k] = None  # free the smaller buffer before taking the larger one
            flat = self._flat[k] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        buf = flat[:nbytes].view(region.dtype).view(region.shape)
        buf.copy_(region)
        return k, buf

    def to_device(self, region: torch.Tensor, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return region.to(device)
        k, buf = self.pack(region)
        out = buf.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[k] = event
        return out
