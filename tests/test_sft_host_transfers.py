"""Host <-> device transfers of host checkpoints: staging buffers, prefetch, ordered host adds, drains.

On CPU the stager's copies are synchronous, so a missing wait would never show. These tests inject
``DeferredCopies``: a copy happens only when its event is waited on (``synchronize``, or the compute side's
``ready``). An executor that reads a host buffer, or reuses a staging buffer, before waiting then computes
with stale data (uploads start as NaN) and fails the float64 comparison with plain autograd.

``ThreadedDeferredCopies`` does the same with the stager's worker thread on (as on CUDA): the next tile's pack and
upload are issued from that thread, a little late (a short sleep first), so a lane touched by both threads at once,
or a prefetch used before the worker finished it, shows as a wrong tile or a buffer overwritten in flight.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import pytest
import torch
from sft_models import MODELS
from torch import nn

from wsitrain.sft import SFT
from wsitrain.sft.execution.multipass import MultiPassSegment
from wsitrain.sft.execution.staging import HostStager, _Pair
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph

F64 = {"rtol": 1e-10, "atol": 1e-11}
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


class _Deferred:
    """The event of a copy that runs only when waited on."""

    def __init__(self, run: Callable[[], object], owner: DeferredCopies, kind: str) -> None:
        self.run, self.owner, self.kind, self.done = run, owner, kind, False

    def synchronize(self) -> None:
        with self.owner.lock:
            if not self.done:
                self.run()
                self.done = True
                self.owner.pending[self.kind] -= 1


class DeferredCopies:
    """Copies that happen late: at the event's ``synchronize`` (host) or ``ready`` (compute). See the module doc."""

    pinned = False
    threads = False

    def __init__(self) -> None:
        self.pending = {"down": 0, "up": 0}  # issued, not yet performed
        self.most = {"down": 0, "up": 0}
        self.issued = {"down": 0, "up": 0}
        self.lock = threading.RLock()
        self.up_threads: list[str] = []  # the thread that issued each upload
        self.fail_upload_at: int | None = None  # the upload (0-based) that raises, as an allocation might

    @contextlib.contextmanager
    def on_worker(self, device: torch.device) -> Iterator[None]:
        yield

    def _issue(self, run: Callable[[], object], kind: str) -> _Deferred:
        with self.lock:
            self.pending[kind] += 1
            self.issued[kind] += 1
            self.most[kind] = max(self.most[kind], self.pending[kind])
            return _Deferred(run, self, kind)

    def buffer(self, nbytes: int, what: str) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> _Deferred:
        return self._issue(lambda: dst.copy_(src), "down")

    def up(self, src: torch.Tensor, device: torch.device, what: str = "") -> tuple[torch.Tensor, _Deferred]:
        with self.lock:
            self.up_threads.append(threading.current_thread().name)
            if self.fail_upload_at is not None and len(self.up_threads) - 1 == self.fail_upload_at:
                raise RuntimeError("injected upload failure")
        out = torch.empty_like(src, device=device)
        out.fill_(float("nan") if out.is_floating_point() else 77)  # what a tile read too early holds
        return out, self._issue(lambda: out.copy_(src), "up")

    def ready(self, tensor: torch.Tensor, event: _Deferred) -> torch.Tensor:
        event.synchronize()
        return tensor


class ThreadedDeferredCopies(DeferredCopies):
    """Deferred copies whose uploads the stager packs and issues on its worker thread, late (see the module doc)."""

    threads = True

    @contextlib.contextmanager
    def on_worker(self, device: torch.device) -> Iterator[None]:
        time.sleep(0.002)  # the worker is slow: the caller's thread runs ahead until it needs the tile
        yield


COPIES = pytest.mark.parametrize("copies_cls", [DeferredCopies, ThreadedDeferredCopies], ids=["caller", "worker"])


# ---- exactness with deferred copies ----------------------------------------------------------------
def _bn_chain() -> nn.Module:
    """conv-BN(train)-ReLU twice around a stride-2 conv: multi-pass segments (BatchNorm needs whole-map statistics)."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8, momentum=0.3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
    )
    head = [("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)), ("fc", nn.Linear(8, 3))]
    return nn.Sequential(OrderedDict([("features", trunk), *head]))


def _step(net: nn.Module, params: nn.Module, x: torch.Tensor) -> tuple:
    params.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    y = net(xr)
    (y * torch.linspace(0.5, 1.5, y.shape[-1], dtype=y.dtype)).sum().backward()
    return y.detach(), [p.grad.clone() for p in params.parameters()], xr.grad, [b.clone() for b in params.buffers()]


def _cuts(model: nn.Module, shape: tuple[int, ...], names: list[str] | None) -> list[str]:
    if names is not None:
        return names
    facts = annotate(ModelGraph(model), shape, torch.float64, torch.float64, True)
    return [facts.name(i) for i in facts.candidates[1:-1]][::2]  # a few checkpoints after the image


@pytest.mark.parametrize(
    ("make", "tile", "cuts"),
    [
        (MODELS["vgg_chain"], 16, None),
        (MODELS["resnet_basic"], 16, None),
        (_bn_chain, 16, ["features.2", "features.5"]),
    ],
    ids=["vgg_chain", "resnet_basic", "bn_chain_multipass"],
)
@COPIES
def test_host_checkpoints_exact_with_deferred_copies(
    make: Callable[[], nn.Module], tile: int, cuts, copies_cls: type[DeferredCopies]
) -> None:
    torch.manual_seed(0)
    model = make().double().train()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)  # batch 2, non-square, ragged last tiles
    ref = _step(model, model, x)
    sft = SFT(
        twin, tile_size=tile, memory_budget="1GiB", host_checkpoints="always", checkpoints=_cuts(model, x.shape, cuts)
    )
    fake = copies_cls()
    sft._stager = HostStager(fake)  # before the first call: the segments take the SFT's stager when compiled
    got = _step(sft, twin, x)

    p = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    host = [s for s in p.segments if s.start and s.checkpoint_location == "host"]
    assert host, "the test must place a checkpoint in host memory"
    assert all(p.segments[s.index - 1].output_location == "host" for s in host)
    assert fake.issued["down"] > 0 and fake.issued["up"] > 0, "tiles must go through the stager"
    assert fake.pending == {"down": 0, "up": 0}, "every copy drained or used; no prefetch past the last tile"
    assert fake.most["down"] <= 2, "at most two device -> host copies in flight"
    assert fake.most["up"] <= 4, "per lane (input, gradient): the tile in use and the next one"
    if fake.threads:
        assert any(t.startswith("wsitrain-stager") for t in fake.up_threads), "prefetches issued on the worker"
    if make is _bn_chain:
        compiled = next(iter(sft._cache.values()))
        mp = [s for s in compiled.segments if isinstance(s, MultiPassSegment)]
        assert any(s.in_on_host for s in mp) and any(s.out_on_host for s in mp), "multi-pass segments on the host"

    torch.testing.assert_close(got[0], ref[0], **F64)
    names = [n for n, _ in model.named_parameters()]
    for n, a, b in zip(names, ref[1], got[1], strict=True):
        torch.testing.assert_close(b, a, **F64, msg=lambda m, n=n: f"{n}: {m}")
    torch.testing.assert_close(got[2], ref[2], **F64)
    for a, b in zip(ref[3], got[3], strict=True):  # running statistics of train-mode BatchNorm
        torch.testing.assert_close(b, a, **F64)


# ---- the stager alone ------------------------------------------------------------------------------
def _tiles(h: int, w: int, step: int, halo: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Row-major tiles of a (h, w) map, each widened by ``halo`` (so neighbours overlap), clipped."""
    out = []
    for r in range(0, h, step):
        for c in range(0, w, step):
            out.append(((max(0, r - halo), min(h, r + step + halo)), (max(0, c - halo), min(w, c + step + halo))))
    return out


def test_down_copies_double_buffered_and_drained_before_read() -> None:
    fake = DeferredCopies()
    stager = HostStager(fake)
    host = torch.zeros(2, 3, 13, 17, dtype=torch.float64)
    want = torch.zeros_like(host)
    tiles = _tiles(13, 17, 5, 2)
    for k, ((r0, r1), (c0, c1)) in enumerate(tiles):
        tile = torch.full((2, 3, r1 - r0, c1 - c0), float(k + 1), dtype=torch.float64)
        stager.store(host[:, :, r0:r1, c0:c1], tile)
        want[:, :, r0:r1, c0:c1] = tile  # overlapping stores: the later tile wins, so order matters
        assert stager.in_flight <= 2 and fake.pending["down"] <= 2
    assert stager.buffers == 2 and stager.max_in_flight == 2
    (r0, r1), (c0, c1) = tiles[-1]
    assert (host[:, :, r0:r1, c0:c1] != len(tiles)).all(), "the last tile has not landed before the drain"
    stager.drain()
    assert stager.in_flight == 0 and fake.pending["down"] == 0
    torch.testing.assert_close(host, want, rtol=0, atol=0)


def test_gradient_tiles_add_in_tile_order_with_halos() -> None:
    fake = DeferredCopies()
    stager = HostStager(fake)
    grad = torch.zeros(2, 3, 11, 14, dtype=torch.float64)
    want = torch.zeros_like(grad)
    torch.manual_seed(0)
    for (r0, r1), (c0, c1) in _tiles(11, 14, 4, 3):
        g = torch.randn(2, 3, r1 - r0, c1 - c0, dtype=torch.float64)
        stager.accumulate(grad[:, :, r0:r1, c0:c1], g)
        want[:, :, r0:r1, c0:c1] += g
        del g  # the copy in flight keeps the tile (on CUDA: record_stream)
    stager.drain()
    assert fake.most["down"] == 2
    torch.testing.assert_close(grad, want, rtol=0, atol=0)  # the same adds in the same order: bit-identical


def test_staging_buffer_reuse_waits_for_its_copy() -> None:
    fake = DeferredCopies()
    pair = _Pair()
    src = torch.arange(24, dtype=torch.float64).view(2, 3, 2, 2)
    k0, b0 = pair.claim(src, fake, "input")
    b0.copy_(src)
    dev, e0 = fake.up(b0, torch.device("cpu"))
    pair.events[k0] = e0
    k1, _ = pair.claim(src, fake, "input")
    assert k1 != k0 and not e0.done
    k2, b2 = pair.claim(src, fake, "input")  # buffer 0 again: its upload must be done first
    assert k2 == k0 and e0.done
    b2.fill_(-1.0)
    torch.testing.assert_close(dev, src, rtol=0, atol=0)


@COPIES
def test_uploads_prefetch_the_next_tile_once(copies_cls: type[DeferredCopies]) -> None:
    fake = copies_cls()
    stager = HostStager(fake)
    x = torch.randn(2, 3, 21, 30, dtype=torch.float64)
    tiles = _tiles(21, 30, 8, 2)
    cpu = torch.device("cpu")
    for k, (rows, cols) in enumerate(tiles):
        nxt = tiles[k + 1] if k + 1 < len(tiles) else None
        got = stager.fetch("input", x, rows, cols, cpu, nxt)
        torch.testing.assert_close(got, x[:, :, rows[0] : rows[1], cols[0] : cols[1]], rtol=0, atol=0)
        assert fake.pending["up"] <= 1, "only the next tile's upload is left in flight"
    assert fake.issued["up"] == len(tiles), "every tile uploaded exactly once: each prefetch was used"
    assert stager.buffers == 2
    # the first tile on the caller's thread; every later one prefetched, on the worker where the copies allow it
    worker = ["wsitrain-stager" in t for t in fake.up_threads]
    assert worker == [False] + [fake.threads] * (len(tiles) - 1)
    stager.close()


def test_a_failed_prefetch_raises_where_the_tile_is_asked_for_and_leaves_nothing_in_flight() -> None:
    """An upload that fails on the worker (as an allocation on the device might) raises in the caller's thread when
    that tile is fetched; ``abandon`` then leaves no copy in flight, and the stager works again."""
    fake = ThreadedDeferredCopies()
    fake.fail_upload_at = 2  # the third tile's upload: a prefetch, on the worker
    stager = HostStager(fake)
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    tiles = _tiles(16, 16, 8, 1)
    cpu = torch.device("cpu")
    stager.fetch("input", x, *tiles[0], cpu, tiles[1])
    stager.fetch("input", x, *tiles[1], cpu, tiles[2])
    with pytest.raises(RuntimeError, match="injected upload failure"):
        stager.fetch("input", x, *tiles[2], cpu, tiles[3])
    stager.abandon()
    assert not stager._pending and fake.pending["up"] == 0
    fake.fail_upload_at = None
    for k, (rows, cols) in enumerate(tiles):
        got = stager.fetch("input", x, rows, cols, cpu, tiles[k + 1] if k + 1 < len(tiles) else None)
        torch.testing.assert_close(got, x[:, :, rows[0] : rows[1], cols[0] : cols[1]], rtol=0, atol=0)
    stager.close()


@COPIES
def test_stale_prefetch_is_not_used(copies_cls: type[DeferredCopies]) -> None:
    """Asked for another tile than predicted, or the source changed in place: the stager uploads again."""
    stager = HostStager(copies_cls())
    x = torch.randn(1, 2, 10, 10, dtype=torch.float64)
    cpu = torch.device("cpu")
    stager.fetch("input", x, (0, 5), (0, 5), cpu, ((0, 5), (5, 10)))
    got = stager.fetch("input", x, (5, 10), (0, 5), cpu, ((5, 10), (5, 10)))  # not the predicted tile
    torch.testing.assert_close(got, x[:, :, 5:10, 0:5], rtol=0, atol=0)
    x.mul_(2.0)  # in place after the prefetch of (5:10, 5:10)
    got = stager.fetch("input", x, (5, 10), (5, 10), cpu)
    torch.testing.assert_close(got, x[:, :, 5:10, 5:10], rtol=0, atol=0)


# ---- an error mid-step leaves nothing behind --------------------------------------------------------
@COPIES
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_error_mid_segment_leaves_no_copy_in_flight(phase: str, copies_cls: type[DeferredCopies]) -> None:
    """A failing tile (here: a hook that raises, as an out-of-memory error would) abandons the stager's copies and
    prefetches; the next step is exact, so nothing of the failed step lands in it."""
    torch.manual_seed(0)
    model = MODELS["vgg_chain"]().double()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)
    ref = _step(model, model, x)
    sft = SFT(twin, tile_size=16, memory_budget="1GiB", host_checkpoints="always",
              checkpoints=_cuts(model, x.shape, None))  # fmt: skip
    fake = copies_cls()
    sft._stager = HostStager(fake)
    seen: list[str] = []

    def fail_midway(seg: int, r: int, c: int, ph: str) -> None:
        seen.append(ph)
        if ph == phase and seg > 0 and (r, c) == (0, 1):
            raise RuntimeError("injected failure")

    sft._hooks.on_tile = fail_midway
    with pytest.raises(RuntimeError, match="injected failure"):
        _step(sft, twin, x)
    assert sft._stager.in_flight == 0 and not sft._stager._pending, "no download queued, no prefetch kept"
    assert fake.pending == {"down": 0, "up": 0}, "every copy in flight was waited for"
    sft._hooks.on_tile = None
    got = _step(sft, twin, x)
    torch.testing.assert_close(got[0], ref[0], **F64)
    for a, b in zip(ref[1], got[1], strict=True):
        torch.testing.assert_close(b, a, **F64)
    torch.testing.assert_close(got[2], ref[2], **F64)
