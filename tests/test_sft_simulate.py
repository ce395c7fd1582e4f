"""The simulated device: the real executor on fake tensors, its memory against the plan, its stream ordering checked.

Reference vs variant: the tracker against exact byte counts, the simulated peak against the planner's replay, and
the transfer code against deliberately broken variants that drop one event wait or one ``record_stream``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from sft_models import MODELS
from sft_models_modern import MODELS as MODERN
from sft_models_modern import se_form_net
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.models import build
from wsitrain.sft.execution.runtime import DeviceRuntime
from wsitrain.sft.execution.transfers import CopyEvent, StreamCopies
from wsitrain.sft.simulate import (
    SimRuntime,
    SimulatedStep,
    StreamOrderError,
    simulate_step,
    simulation_dict,
    simulation_text,
)
from wsitrain.sft.simulate.tracker import LiveMemory

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
# The target: the simulated live peak within 3% of the planner's replay (whole-slide sizes, the 2080 Ti cases).
REPLAY_TOLERANCE = (-0.03, 0.03)
# Toy models on toy images with forced small tiles, where one tile map is 5-10% of the step: one tile-sized gradient
# of a two-input operator the replay does not place (arith: +4.4% measured), and the replay's halo rounding and
# its multi-pass sweeps make it conservative by up to 19% (the squeeze-excitation toy, whose tile-input gradient
# the replay counts at every sweep). The plan's estimate keeps 10% slack above the replay, so neither breaks a budget.
TOY_TOLERANCE = (-0.20, 0.05)


def _meta(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return make()


def _check(s: SimulatedStep, tol: tuple[float, float] = REPLAY_TOLERANCE) -> None:
    assert tol[0] <= s.over_replay <= tol[1], simulation_text(s)
    assert s.within_budget, simulation_text(s)
    assert s.host_within_plan, simulation_text(s)


# ---- the tracker -----------------------------------------------------------------------------------
def test_tracker_counts_live_storages_byte_for_byte() -> None:
    """Real CPU tensors: allocations, views (no new bytes), in-place ops (no new bytes), frees."""
    mem = LiveMemory(devices=("cpu",))
    with mem:
        a = torch.ones(1000, dtype=torch.float32)  # 4000 B
        b = a.view(10, 100)  # a view: same storage
        c = a * 2  # 4000 B
        c.add_(1)  # in place: same storage
        assert mem.live["cpu"] == 8000
        del a, b
        gc.collect()
        assert mem.live["cpu"] == 4000  # a's storage died with its last view
        d = torch.empty(250, dtype=torch.float64)  # 2000 B
        assert mem.live["cpu"] == 6000
        del c, d
    assert mem.live["cpu"] == 0
    assert mem.peaks["cpu"].bytes == 8000


# ---- simulated steps against their plans --------------------------------------------------------------
@pytest.mark.parametrize("name", ["vgg_chain", "resnet_basic", "resnet_bottleneck", "dense", "odd_ops", "gated"])
def test_simulated_peak_matches_the_replay_on_forced_tiles(name: str) -> None:
    s = simulate_step(
        _meta(MODELS[name]), (2, 3, 150, 222), "1GiB", input_dtype=torch.float32, tile_size=48,
        host_checkpoints="always",
    )  # fmt: skip
    assert any(seg.mode == "tiled" for seg in s.plan.segments)
    _check(s, TOY_TOLERANCE)


@pytest.mark.parametrize("name", sorted(MODERN))
def test_simulated_peak_matches_the_replay_on_modern_blocks(name: str) -> None:
    s = simulate_step(_meta(MODERN[name]), (1, 3, 160, 192), "1GiB", input_dtype=torch.float32, tile_size=64)
    _check(s, TOY_TOLERANCE)


@pytest.mark.parametrize("train_bn", [False, True])
def test_simulated_peak_matches_the_replay_on_multipass_segments(train_bn: bool) -> None:
    """Squeeze-excitation, or train-mode BatchNorm: segments that sweep their tiles more than once."""

    def make() -> nn.Module:
        if not train_bn:
            return se_form_net("selayer")
        return build("resnet18", 2, freeze_bn=False).train()

    s = simulate_step(_meta(make), (1, 3, 192, 160), "1GiB", input_dtype=torch.float32, tile_size=96)
    _check(s, TOY_TOLERANCE)


@pytest.mark.parametrize(("name", "size", "budget"), [("tiny", 4096, "200MiB"), ("tiny", 3000, "240MiB")])
def test_budget_driven_whole_slide_plan_holds_when_simulated(name: str, size: int, budget: str) -> None:
    """A budget-driven plan on a uint8 host image: tiled, host staging, fused pool; the budget holds."""
    s = simulate_step(_meta(lambda: build(name, 2)), (1, 3, size, size), budget)
    assert s.plan.fits and s.plan.tiled_segments
    _check(s)
    assert s.accesses_checked > 1000
    d = simulation_dict(s)
    assert d["device_peak"]["bytes"] == s.device_peak.bytes and d["stream_order"] == "checked"
    assert d["device_peak"]["largest"] and d["device_peak"]["where"] not in ("", "start")


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("name", "size", "budget"),
    [
        ("darknet19", 8192, None),  # the 2080 Ti preset
        # squeeze-excitation (multi-pass segments) and ConvNeXt: 15-41 s each in CI (measured), CI's `make test-heavy`;
        # EfficientNet-B0 at 1024 px in 512 MiB: 26 s alone against 34 s at 1536 px in 1 GiB, nearly all the planner's
        # search (measured 2026-12-02, one process)
        pytest.param("torchvision/efficientnet_b0", 1024, "512MiB", marks=pytest.mark.heavy),
        pytest.param("torchvision/convnext_tiny", 2048, "1.5GiB", marks=pytest.mark.heavy),
    ],
)
def test_whole_slide_models_fit_when_simulated(name: str, size: int, budget: str | None) -> None:
    """Cases that simulate in seconds; the 2080 Ti table at 8192-100,000 px: benchmarks/bench_simulated.py.

    At these sizes the fixed parts weigh more and the replay is conservative (EfficientNet-B0 -4%, ConvNeXt-T -15%
    measured: the head's backward replays buffers the real step frees earlier); at whole-slide sizes both are
    within 2% (docs/benchmarks/bench_simulated.md). Never more than 3% above the replay, here or there.
    """
    from wsitrain.gpus import gpu_preset

    s = simulate_step(
        _meta(lambda: build(name, 2)), (1, 3, size, size), budget or gpu_preset("2080ti").memory_bytes
    )  # fmt: skip
    assert s.plan.tiled_segments
    _check(s, (-0.20, 0.03) if budget else REPLAY_TOLERANCE)


# ---- representative tiles: the same peaks as visiting every tile ----------------------------------------------
@pytest.mark.parametrize(
    ("case", "make", "shape", "budget", "kw"),
    [
        ("budget-driven, host-staged uint8, fused pool", lambda: build("tiny", 2), (1, 3, 4096, 4096), "200MiB", {}),
        ("host checkpoints, ragged grid, batch 2", MODELS["vgg_chain"], (2, 3, 180, 250), "1GiB",
         {"input_dtype": torch.float32, "tile_size": 32, "host_checkpoints": "always"}),
        ("squeeze-excitation multi-pass", lambda: se_form_net("selayer"), (1, 3, 288, 224), "1GiB",
         {"input_dtype": torch.float32, "tile_size": 32}),
        ("train-mode BatchNorm multi-pass", lambda: build("tiny", 2, freeze_bn=False).train(), (1, 3, 400, 336),
         "1GiB", {"input_dtype": torch.float32, "tile_size": 48}),
    ],
)  # fmt: skip
def test_representative_tiles_give_the_peaks_of_every_tile(
    case: str, make: Callable[[], nn.Module], shape: tuple[int, ...], budget: str, kw: dict[str, object]
) -> None:
    """Reference vs variant: the default simulation (representative tiles) against one that visits every tile."""
    every = simulate_step(_meta(make), shape, budget, every_tile=True, **kw)  # type: ignore[arg-type]
    some = simulate_step(_meta(make), shape, budget, **kw)  # type: ignore[arg-type]
    assert every.tiles_visited == every.tiles_in_step == some.tiles_in_step
    assert some.tiles_visited < every.tiles_visited, f"{case}: the case must skip tiles to test anything"
    assert some.device_peak.bytes == every.device_peak.bytes, f"{case}\n{simulation_text(some)}"
    assert some.host_peak.bytes == every.host_peak.bytes, f"{case}\n{simulation_text(some)}"


def test_representative_tiles_cover_every_kind_of_row() -> None:
    from wsitrain.sft import SFT
    from wsitrain.sft.simulate.representative import ENDS, _signature, representative_indices

    model = MODELS["resnet_basic"]().double()
    plan = SFT(model, memory_budget="1GiB", tile_size=16).plan_for((1, 3, 250, 322))
    seg = next(s for s in plan.segments if s.mode == "tiled" and s.regions is not None)
    assert seg.regions is not None
    for axis in (seg.regions.rows, seg.regions.cols):
        kept = representative_indices(axis)
        assert len(kept) < len(axis)
        assert set(range(ENDS)) | set(range(len(axis) - ENDS, len(axis))) <= set(kept)
        assert {_signature(t) for t in axis} == {_signature(axis[i]) for i in kept}


def test_simulation_needs_a_meta_model() -> None:
    with pytest.raises(PlanError, match="meta device"):
        simulate_step(MODELS["vgg_chain"](), (1, 3, 64, 64), "1GiB")


# ---- the stream-ordering checker ---------------------------------------------------------------------
class NoWaitOnUpload(StreamCopies):
    """Drops the compute stream's wait on an upload's event."""

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        self.rt.record_stream(tensor, self.rt.current_stream(tensor.device))
        return tensor


class NoRecordStreamOnUpload(StreamCopies):
    """Waits on the upload but drops ``record_stream`` for the compute stream."""

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        self.rt.wait_event(self.rt.current_stream(tensor.device), event)
        return tensor


class NoRecordStreamOnDownload(StreamCopies):
    """A download that drops ``record_stream`` for the side stream reading the tile."""

    def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> CopyEvent:
        rt = self.rt
        src = src.contiguous()
        rt.wait_stream(self.down_stream, rt.current_stream(src.device))
        with rt.use_stream(self.down_stream):
            dst.copy_(src, non_blocking=True)
        return rt.record_event(self.down_stream)


class NoWaitBeforeDownload(StreamCopies):
    """A download that does not wait for the compute stream's work (the tile may not exist yet)."""

    def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> CopyEvent:
        rt = self.rt
        src = src.contiguous()
        rt.describe(src, what)
        with rt.use_stream(self.down_stream):
            dst.copy_(src, non_blocking=True)
        event = rt.record_event(self.down_stream)
        rt.record_stream(src, self.down_stream)
        return event


class _NeverDone:
    def synchronize(self) -> None:
        return None


class EventLostOnDownload(StreamCopies):
    """The host is handed an event that never waits: it reads the staging buffer while the copy may run."""

    def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> CopyEvent:
        super().down(dst, src, what)
        return _NeverDone()


class EventLostOnUpload(StreamCopies):
    """The stager repacks a staging buffer without knowing its previous upload finished."""

    def up(self, src: torch.Tensor, device: torch.device, what: str = "") -> tuple[torch.Tensor, CopyEvent]:
        out, event = super().up(src, device, what)
        self.rt.wait_event(self.rt.current_stream(device), event)  # compute is safe; the host is not told
        return out, _NeverDone()

    def ready(self, tensor: torch.Tensor, event: CopyEvent) -> torch.Tensor:
        self.rt.record_stream(tensor, self.rt.current_stream(tensor.device))  # waited on in ``up``
        return tensor


def _host_step(copies: Callable[[DeviceRuntime], StreamCopies]) -> None:
    simulate_step(
        _meta(MODELS["vgg_chain"]), (1, 3, 90, 111), "1GiB", input_dtype=torch.float32, tile_size=32,
        host_checkpoints="always", copies=lambda rt: copies(rt),
    )  # fmt: skip


def test_the_real_transfer_code_passes_the_checker() -> None:
    _host_step(lambda rt: StreamCopies(rt, torch.device("meta")))


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        (NoWaitOnUpload, r"compute stream reads input tile rows \d+:\d+ cols \d+:\d+ .*wait_event"),
        (NoRecordStreamOnUpload, r"allocated on the side stream 1 and used on the compute stream .*record_stream"),
        (NoRecordStreamOnDownload, r"allocated on the compute stream and used on the side stream 2 .*record_stream"),
        (NoWaitBeforeDownload, r"side stream 2 reads output tile rows \d+:\d+ cols \d+:\d+"),
        (EventLostOnDownload, r"host reads down staging buffer \d \(holding (output|input-gradient) tile rows"),
        (EventLostOnUpload, r"host writes input staging buffer \d \(holding input tile rows"),
    ],
)
def test_a_broken_ordering_is_an_error_naming_buffer_and_tile(variant: type[StreamCopies], message: str) -> None:
    with pytest.raises(StreamOrderError, match=message):
        _host_step(lambda rt: variant(rt, torch.device("meta")))


def test_the_runtime_checks_only_what_the_device_could_reorder() -> None:
    """Same-stream use, a waited event and a synchronized download are all fine; a plain host op is fine."""
    rt = SimRuntime()
    mem = LiveMemory(observer=rt.observe)
    mem.on_free = rt.on_free
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), mem:
        side = rt.new_stream(torch.device("meta"))
        buf = rt.pinned_empty(64)
        with rt.use_stream(side):
            dev = buf.to("meta", non_blocking=True)
        ev = rt.record_event(side)
        rt.wait_event(rt.compute, ev)
        rt.record_stream(dev, rt.compute)
        y = dev.float() + 1  # compute stream, after the wait
        ev.synchronize()
        buf.fill_(3)  # the host may now refill the buffer
        del y, dev
        z = torch.ones(3) * 2  # host only
        del z
