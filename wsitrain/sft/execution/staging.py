"""Staging of tiles between host tensors and the device: two buffers per lane, prefetch, ordered host adds.

One ``HostStager`` per ``SFT``. It owns the copies (``wsitrain.sft.execution.transfers``: side CUDA streams, or
synchronous copies on CPU) and three lanes of two reused staging buffers (page-locked on CUDA). Buffers are
flat and grow to the largest tile seen, so the memory held is two tiles' worth per lane whatever the shapes.

Up (host -> device), lanes "input" (a tile's input region) and "grad" (a tile of the output's gradient):
a tile cut from a host tensor is a strided view, which PyTorch copies through a pageable temporary,
blocking the host. It is first packed into a staging buffer (a host memcpy), then copied with
``non_blocking``. ``fetch`` returns tile t and immediately starts the upload of the tile the caller will
ask for next (t+1), so that copy overlaps tile t's compute; the compute stream waits on the upload's event
before using the tile. A buffer is repacked only after the host has waited on its previous upload's event.

Where the copies allow it (CUDA: ``Copies.threads``), the next tile's pack and the issue of its upload run on one
worker thread of the stager's own, so the host memcpy (the image's uint8 tiles: 0.051 s of a capped ResNet-50 step at
8192 px on the H200 preset, simulated) no longer holds up the Python thread that issues the kernels. A lane's buffers
then belong to one thread at a time: the caller touches a lane only after the worker's task for it has returned
(``fetch`` waits on the prefetch before anything else), and the worker runs one task at a time. Elsewhere (the CPU,
the simulated device) the pack runs on the caller's thread, in the same order.

Down (device -> host), output tiles (``store``) and input-gradient tiles (``accumulate``): each tile is
copied into a staging buffer on the side stream after the compute stream produced it; at most two copies
are in flight. Issuing a third first waits for the oldest and applies it to its host destination (copy or
add), so tile t's copy and host add overlap tile t+1's compute; host adds happen in tile order, so tiles
whose regions overlap (halos) sum as they would in place. ``drain`` applies all of them; the executor
drains at the end of each segment's forward and backward, before anyone reads the host tensors.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch

from wsitrain.sft.execution.runtime import DeviceRuntime
from wsitrain.sft.execution.spill import HostAllocator, SpillFiles
from wsitrain.sft.execution.transfers import Copies, CopyEvent, SyncCopies, copies_for

Interval = tuple[int, int]
Lane = Literal["input", "grad"]  # up lanes: tiles' input regions, tiles of the output's gradient
LANES: tuple[Lane, ...] = ("input", "grad")


class _Pair:
    """Two flat staging buffers used in turn; an event guards each buffer's reuse."""

    def __init__(self) -> None:
        self.flat: list[torch.Tensor | None] = [None, None]
        self.events: list[CopyEvent | None] = [None, None]
        self.turn = 0

    def claim(self, like: torch.Tensor, copies: Copies, name: str) -> tuple[int, torch.Tensor]:
        """The next buffer, shaped like ``like`` (contiguous), once its previous copy is done."""
        k = self.turn
        self.turn ^= 1
        event = self.events[k]
        if event is not None:
            event.synchronize()  # the copy that last used this buffer is done: it may be overwritten
            self.events[k] = None
        nbytes = like.numel() * like.element_size()
        flat = self.flat[k]
        if flat is None or flat.numel() < nbytes:
            # free the smaller buffer before taking the larger one (the local name too: the simulated device
            # showed both alive at once, one region above the plan's host memory)
            self.flat[k] = flat = None
            flat = self.flat[k] = copies.buffer(nbytes, f"{name} staging buffer {k}")
        return k, flat[:nbytes].view(like.dtype).view(like.shape)


@dataclass
class _Prefetch:
    """An upload started for the tile the caller is expected to ask for next."""

    source: weakref.ref[torch.Tensor]  # the host tensor (weak: a prefetch never keeps a checkpoint alive)
    version: int  # its version counter then: an in-place change in between makes the prefetch stale
    rows: Interval
    cols: Interval
    upload: Future[tuple[torch.Tensor, CopyEvent]]  # the tile on the device and its event (done at once inline)

    def matches(self, src: torch.Tensor, rows: Interval, cols: Interval) -> bool:
        return self.source() is src and self.version == src._version and (self.rows, self.cols) == (rows, cols)


@dataclass
class _Down:
    """A device -> host copy in flight into a staging buffer, and where the host puts it when it lands."""

    event: CopyEvent
    k: int  # which down buffer
    staged: torch.Tensor
    dst: torch.Tensor  # a view of the host tensor
    add: bool  # add into dst (gradient tiles) or copy (output tiles)


class HostStager:
    """Host <-> device staging for one ``SFT`` (see the module doc).

    ``copies``: how copies are issued; by default chosen per device from ``runtime`` (side streams where the
    runtime is asynchronous: CUDA, the simulated device; synchronous copies on CPU). Tests inject a deferred
    implementation to check every read waits for its copy. ``spill``: where host checkpoints the plan placed on disk
    are allocated (``spill.SpillFiles`` in the system temp folder by default; the simulated device counts them).
    """

    def __init__(
        self, copies: Copies | None = None, runtime: DeviceRuntime | None = None, spill: HostAllocator | None = None
    ) -> None:
        self.spill: HostAllocator = spill if spill is not None else SpillFiles()
        self._worker: ThreadPoolExecutor | None = None  # started at the first threaded prefetch
        # entered around a prefetch's pack and upload when they run on the caller's thread: what CUDA does on the
        # worker thread (the simulated clock and the host-time measurement count it on that thread's lane)
        self.pack_scope: Callable[[], AbstractContextManager[None]] = nullcontext
        self._fixed = copies
        self._runtime = runtime
        self._copies: dict[torch.device, Copies] = {}
        self._up = {lane: _Pair() for lane in LANES}
        self._pending: dict[Lane, _Prefetch] = {}
        self._down = _Pair()
        self._queue: deque[_Down] = deque()
        self.max_in_flight = 0  # the most device -> host copies ever in flight at once (at most two)

    def copies(self, device: torch.device) -> Copies:
        if self._fixed is not None:
            return self._fixed
        if device not in self._copies:
            self._copies[device] = copies_for(device, self._runtime)
        return self._copies[device]

    @property
    def buffers(self) -> int:
        """Staging buffers held now (at most two per lane)."""
        return sum(b is not None for p in self._pairs() for b in p.flat)

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for p in self._pairs() for b in p.flat if b is not None)

    def _pairs(self) -> list[_Pair]:
        return [*self._up.values(), self._down]

    # ---- up ------------------------------------------------------------------------------------
    def pack(
        self, region: torch.Tensor, lane: Lane = "input", copies: Copies | None = None
    ) -> tuple[int, torch.Tensor]:
        """Copy ``region`` into the lane's next buffer; returns (buffer index, packed view)."""
        k, buf = self._up[lane].claim(region, copies or SyncCopies(), lane)
        buf.copy_(region)
        return k, buf

    def _start_up(
        self, lane: Lane, src: torch.Tensor, rows: Interval, cols: Interval, device: torch.device, copies: Copies
    ) -> tuple[torch.Tensor, CopyEvent]:
        k, buf = self.pack(src[:, :, rows[0] : rows[1], cols[0] : cols[1]], lane, copies)
        tensor, event = copies.up(buf, device, f"{lane} tile rows {rows[0]}:{rows[1]} cols {cols[0]}:{cols[1]}")
        self._up[lane].events[k] = event  # the buffer is repacked only after this upload is done
        return tensor, event

    def _prefetch(
        self, lane: Lane, src: torch.Tensor, rows: Interval, cols: Interval, device: torch.device
    ) -> Future[tuple[torch.Tensor, CopyEvent]]:
        """Start the upload of a tile the caller will ask for next: on the worker thread where the copies allow."""
        copies = self.copies(device)
        if copies.threads:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wsitrain-stager")
            return self._worker.submit(self._start_up_on_worker, lane, src, rows, cols, device, copies)
        done: Future[tuple[torch.Tensor, CopyEvent]] = Future()
        with self.pack_scope():
            done.set_result(self._start_up(lane, src, rows, cols, device, copies))
        return done

    def _start_up_on_worker(
        self, lane: Lane, src: torch.Tensor, rows: Interval, cols: Interval, device: torch.device, copies: Copies
    ) -> tuple[torch.Tensor, CopyEvent]:
        with copies.on_worker(device):
            return self._start_up(lane, src, rows, cols, device, copies)

    def close(self) -> None:
        """Stop the worker thread (after waiting for its task); a later prefetch starts another."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def fetch(
        self,
        lane: Lane,
        src: torch.Tensor,
        rows: Interval,
        cols: Interval,
        device: torch.device,
        next_tile: tuple[Interval, Interval] | None = None,
    ) -> torch.Tensor:
        """The tile ``src[:, :, rows, cols]`` on ``device``, ready for compute; starts uploading ``next_tile``.

        Takes the upload prefetched by the previous call when it was for this tile, else uploads now.
        """
        got: tuple[torch.Tensor, CopyEvent] | None = None
        p = self._pending.pop(lane, None)
        if p is not None:
            upload = p.upload.result()  # the worker is done with this lane (its error, if any, is raised here)
            if p.matches(src, rows, cols):
                got = upload
            del upload  # a stale prefetch is dropped (its buffer is guarded by its event)
        del p
        tensor, event = got if got is not None else self._start_up(lane, src, rows, cols, device, self.copies(device))
        if next_tile is not None:
            nr, nc = next_tile
            version = src._version  # before the worker starts: an in-place change from now on makes it stale
            upload = self._prefetch(lane, src, nr, nc, device)
            self._pending[lane] = _Prefetch(weakref.ref(src), version, nr, nc, upload)
        return self.copies(device).ready(tensor, event)

    # ---- down ----------------------------------------------------------------------------------
    def store(self, dst: torch.Tensor, tile: torch.Tensor, what: str = "output tile") -> None:
        """``dst[...] = tile`` (dst a view of a host tensor, tile on the device), applied by a later wait."""
        self._start_down(dst, tile, False, what)

    def accumulate(self, dst: torch.Tensor, tile: torch.Tensor, what: str = "input-gradient tile") -> None:
        """``dst += tile``, applied after the previous tiles' adds (in order), by a later wait."""
        self._start_down(dst, tile, True, what)

    def _start_down(self, dst: torch.Tensor, tile: torch.Tensor, add: bool, what: str) -> None:
        assert dst.shape == tile.shape, (dst.shape, tile.shape)
        if len(self._queue) == 2:  # double buffering: the oldest copy lands before its buffer is reused
            self._land_oldest()
        copies = self.copies(tile.device)
        k, staged = self._down.claim(tile, copies, "down")
        if any(d.k == k for d in self._queue):
            raise RuntimeError(f"down staging buffer {k} is reused while its copy is in flight (a stager bug)")
        event = copies.down(staged, tile, what)
        self._down.events[k] = event
        self._queue.append(_Down(event, k, staged, dst, add))
        self.max_in_flight = max(self.max_in_flight, len(self._queue))

    def _land_oldest(self) -> None:
        d = self._queue.popleft()
        d.event.synchronize()  # waits for this copy only (its compute finished before it); not a device sync
        if d.add:
            d.dst.add_(d.staged)
        else:
            d.dst.copy_(d.staged)

    @property
    def in_flight(self) -> int:
        return len(self._queue)

    def abandon(self) -> None:
        """After an error mid-segment: wait for every copy in flight, apply none, forget every prefetch.

        The next step then starts clean: no download of the failed step lands in a host tensor later, no stale
        prefetched tile is matched, and every staging buffer may be reused.
        """
        for d in self._queue:
            d.event.synchronize()
        self._queue.clear()
        for p in self._pending.values():
            try:
                _, event = p.upload.result()
            except Exception:  # the prefetch failed on the worker: nothing of it is in flight
                continue
            event.synchronize()
        self._pending.clear()
        for pair in self._pairs():
            for k, event in enumerate(pair.events):
                if event is not None:
                    event.synchronize()
                    pair.events[k] = None

    def drain(self) -> None:
        """Wait for every device -> host copy and apply it, in the order issued; host tensors are then complete."""
        while self._queue:
            self._land_oldest()
