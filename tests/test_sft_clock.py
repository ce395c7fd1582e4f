"""The simulated clock (wsitrain/sft/simulate/clock.py): what it counts, and that its shortcuts change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from wsitrain.gpu_speed import GPU_SPEEDS, gpu_speed
from wsitrain.gpus import gpu_preset
from wsitrain.models import build
from wsitrain.sft.planning.calibration import Calibration, clock_speed, clock_time_model, write_calibration
from wsitrain.sft.simulate.clock import OpClock
from wsitrain.sft.simulate.representative import representative_weights
from wsitrain.sft.simulate.timing import clock_plain_step, clock_sft_step

H100 = gpu_speed("h100")
assert H100 is not None


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2),
    )  # fmt: skip


def _meta_net() -> nn.Module:
    with torch.device("meta"):
        return _net()


def _tiny(classes: int = 2) -> nn.Module:
    with torch.device("meta"):  # the built-in tiny model: it normalizes the uint8 image SFT is fed
        return build("tiny", classes)


def _tiny_recomputed() -> nn.Module:
    """Three classes: the pooled gradient has no direction known in forward, so every tiled segment recomputes in
    backward (no one pass, planning/one_pass.py): the tests of the recompute's windows and casts."""
    return _tiny(3)


def test_flops_are_those_of_a_real_step() -> None:
    """The clock's FLOPs of a plain step on fake tensors equal torch's flop counter on a real CPU step."""
    torch.manual_seed(0)
    net = _net()
    x = torch.rand(1, 3, 40, 48)
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(net(x), torch.zeros(1, dtype=torch.long)).backward()
    reading, _ = clock_plain_step(_meta_net(), (1, 3, 40, 48), H100, "fp32")
    assert reading.flops == counter.get_total_flops() > 0


def test_operators_are_those_a_real_step_dispatches() -> None:
    """The clock counts the operators a real CPU step dispatches, not the fake tensors' own ``prim.device`` queries
    (a real tensor answers ``.device`` from a field)."""

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net = _net()
    x = torch.rand(1, 3, 40, 48)
    with Count() as count:
        nn.functional.cross_entropy(net(x), torch.zeros(1, dtype=torch.long)).backward()
    _, clock = clock_plain_step(_meta_net(), (1, 3, 40, 48), H100, "fp32")
    forward_and_backward = clock.windows[1:3]  # the optimizer step (window 3) is not in the real step above
    assert sum(w.host_ops + w.views for w in forward_and_backward) == count.n > 0


def test_a_synchronization_ends_its_window() -> None:
    """A content check drains the GPU's queue: the GPU's and the host's work before it do not overlap what follows."""
    reading, sim, clock = clock_sft_step(
        _tiny_recomputed(), (1, 3, 256, 256), "1GiB", H100, tile_size=64, every_tile=True
    )
    assert reading.syncs > 0
    assert 0 < reading.host_copy_seconds < reading.host_seconds  # the image's tiles packed on the host; dispatch
    tiled = [s for s in sim.plan.segments if s.mode == "tiled" and s.fused_pool is None]
    assert any(s.n_tiles > 1 for s in tiled)
    # one zero-gradient read per tiled segment's backward, not one per tile
    after = [w for w in clock.windows if "after the zero-gradient check" in w.label]
    assert 0 < len(after) <= len(tiled) < sum(s.n_tiles for s in tiled)


def test_a_tiled_sweep_casts_each_weight_once() -> None:
    """bf16: a tiled segment's forward and recompute cast each weight once per sweep (execution/autocast.py), so the
    casts do not grow with the tiles, and representative tiles count them as every tile does."""
    net = _tiny_recomputed()
    every, sim, clock = clock_sft_step(net, (1, 3, 128, 128), "1GiB", H100, "bf16", tile_size=32, every_tile=True)
    some, _, _ = clock_sft_step(net, (1, 3, 128, 128), "1GiB", H100, "bf16", tile_size=32, every_tile=False)
    assert any(s.n_tiles > 9 for s in sim.plan.segments)  # representative tiles skip some
    once = [o for o in clock._once.ops if o.kind == "weight casts (autocast)"]
    assert once and some.kernels == every.kernels
    assert some.by_kind["weight casts (autocast)"] == pytest.approx(every.by_kind["weight casts (autocast)"])
    # per tile only the weight gradients' casts back remain: fewer than one cast per convolution per tile
    convs = sum(1 for w in clock.windows if w.tile for o in w.ops if o.op == "convolution")
    tile_casts = sum(1 for w in clock.windows if w.tile for o in w.ops if o.kind == "weight casts (autocast)")
    assert 0 < tile_casts < convs


def test_bf16_moves_half_the_bytes_and_runs_on_tensor_cores() -> None:
    net = _meta_net()
    fp32, _ = clock_plain_step(net, (1, 3, 256, 256), H100, "fp32")
    bf16, _ = clock_plain_step(net, (1, 3, 256, 256), H100, "bf16")
    assert bf16.flops == fp32.flops
    assert bf16.bytes < 0.6 * fp32.bytes
    assert bf16.kernels > fp32.kernels  # autocast's weight casts


def test_time_grows_with_the_image_and_the_slower_card() -> None:
    net = _meta_net()
    small, _ = clock_plain_step(net, (1, 3, 512, 512), H100, "fp32")
    large, clock = clock_plain_step(net, (1, 3, 4096, 4096), H100, "fp32")
    assert large.gpu_seconds > 10 * small.gpu_seconds
    slow = clock.reading(GPU_SPEEDS["2080ti"], "fp32")
    assert slow.seconds > large.seconds and slow.flops == large.flops


def test_host_bound_steps_wait_on_the_host() -> None:
    """Tiny tiles: the host's dispatch outlasts the kernels, and the step is the host's time."""
    net = _tiny()
    reading, _, _ = clock_sft_step(net, (1, 3, 128, 128), "1GiB", H100, tile_size=32, every_tile=True)
    assert reading.host_seconds > reading.gpu_seconds
    assert reading.host_bound_seconds > 0
    assert reading.seconds == pytest.approx(max(reading.host_seconds, reading.gpu_seconds), rel=0.2)


@pytest.mark.parametrize(("size", "tile"), [((1, 3, 200, 264), 48), ((2, 3, 160, 136), 40)])
def test_representative_tiles_time_every_tile(size: tuple[int, ...], tile: int) -> None:
    """Visiting one tile of each kind, weighted by the tiles it stands for, gives every tile's clock."""
    net = _tiny()
    every, sim, _ = clock_sft_step(net, size, "1GiB", H100, tile_size=tile, every_tile=True)
    some, _, _ = clock_sft_step(net, size, "1GiB", H100, tile_size=tile, every_tile=False)
    assert any(s.n_tiles > 9 for s in sim.plan.segments)  # some tiles were skipped
    assert some.operators == every.operators and some.kernels == every.kernels
    assert some.flops == pytest.approx(every.flops, rel=1e-12)
    assert some.bytes == pytest.approx(every.bytes, rel=1e-12)
    assert some.seconds == pytest.approx(every.seconds, rel=1e-9)


def test_representative_weights_cover_the_axis() -> None:
    net = _tiny()
    _, sim, _ = clock_sft_step(net, (1, 3, 200, 264), "1GiB", H100, tile_size=24, every_tile=False)
    for seg in sim.plan.segments:
        if seg.regions is not None:
            for axis in (seg.regions.rows, seg.regions.cols):
                assert sum(representative_weights(axis).values()) == len(axis)


def _pointwise() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.Conv2d(64, 256, 1), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 2))  # fmt: skip


@pytest.mark.parametrize(("size", "unaligned"), [((1, 3, 263, 263), True), ((1, 3, 264, 263), False),
                                                  ((8, 3, 263, 263), False)])  # fmt: skip
def test_half_precision_1x1_layers_on_unaligned_maps_run_slower(size: tuple[int, ...], unaligned: bool) -> None:
    """A 1x1 convolution whose batch times pixels is not a multiple of 8 (a tile's halo) runs at
    ``unaligned_conv_efficiency`` in bf16 (cuDNN's fallback kernels, measured on an H200); a 3x3 one, float32 or an
    aligned map does not."""
    _, clock = clock_plain_step(_pointwise(), size, H100, "bf16")
    flagged = [o for w in clock.windows for o in w.ops if o.unaligned and o.conv_px]  # (the head's products: their own)
    assert bool(flagged) == unaligned
    assert all(o.op.startswith("convolution") for o in flagged)
    assert len({o.op for o in flagged}) == (2 if unaligned else 0)  # forward and backward
    fast = clock.reading(dataclasses.replace(H100, unaligned_conv_efficiency=1.0), "bf16").gpu_seconds
    assert (clock.reading(H100, "bf16").gpu_seconds > fast) == unaligned
    _, fp32 = clock_plain_step(_pointwise(), size, H100, "fp32")
    assert not any(o.unaligned for w in fp32.windows for o in w.ops)  # float32: no tensor cores, no alignment


def test_batch_norm_runs_at_its_own_share_of_the_bandwidth() -> None:
    """BatchNorm's kernels are priced at NORM_EFFICIENCY / NORM_BACKWARD_EFFICIENCY (measured on an H200), not at
    the element-wise rate: at the element-wise rate the step is faster by BatchNorm's difference alone."""
    reading, clock = clock_plain_step(_meta_net(), (1, 3, 1024, 1024), H100, "bf16")
    assert reading.by_kind["batch norm"] > 0
    same = dataclasses.replace(H100, norm_efficiency=H100.memory_efficiency,
                               norm_backward_efficiency=H100.memory_efficiency)  # fmt: skip
    fast = clock.reading(same, "bf16")
    assert fast.by_kind["batch norm"] < reading.by_kind["batch norm"]
    others = {k: v for k, v in reading.by_kind.items() if k != "batch norm"}
    assert others == {k: v for k, v in fast.by_kind.items() if k != "batch norm"}


def test_convolution_rate_follows_channels_and_the_two_to_the_31_path() -> None:
    """A convolution's share of the rate grows with its narrower channel count; on a map of 2^31 elements per sample
    it runs at ``large_conv_efficiency`` of that, and a layer on RGB (3 input channels) at the thin share (measured
    on an H200: 1 TFLOP/s whole against 13 on tiles)."""
    s = GPU_SPEEDS["h200"]
    shares = [s.conv_shape_factor(c, False) for c in (3, 64, 128, 256, 512)]
    assert shares == sorted(shares) and shares[-1] < 1.0 and s.conv_shape_factor(0, False) == 1.0
    assert s.conv_shape_factor(64, True) == pytest.approx(shares[1] * s.large_conv_efficiency)
    assert s.conv_shape_factor(3, True) == pytest.approx(shares[0] * s.large_thin_conv_efficiency)
    with torch.device("meta"):
        convs = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1))
    for edge, large in ((8, False), (8192, True)):  # 32 x 8192 x 8192 = 2^31 elements per sample
        clock = OpClock(low_precision=True)
        x = torch.empty(1, 3, edge, edge, device="meta", requires_grad=True)
        with clock:
            convs(x).sum().backward()
        ops = [o for w in clock.windows for o in w.ops if o.conv_px]
        assert {o.op for o in ops} == {"convolution", "convolution_backward"} and {o.channels for o in ops} == {3, 32}
        assert all(o.large == large for o in ops)


def test_planner_time_model_uses_the_clock_constants() -> None:
    """A byte costs the planner's FLOP rate / byte rate; tiled FLOPs cost 1 / tile_conv_efficiency; the planner's
    rate is PLAN_CONV_EFFICIENCY's (gpu_speed.py: the constants that chose the plan measured fastest)."""
    h200 = GPU_SPEEDS["h200"]
    tm = clock_time_model(h200, True)
    assert tm.byte_flops == pytest.approx(h200.plan_conv_rate(True) / h200.bytes_per_second)
    assert h200.plan_conv_rate(True) == pytest.approx(1e12 * h200.tensor_tflops * h200.plan_conv_efficiency)
    assert tm.tile_flop_factor == pytest.approx(1.0 / h200.tile_conv_efficiency)
    assert tm.tile_flop_factor > 1.0
    assert gpu_preset("h200").host_link_gb_s == h200.link_gb_s


def test_doctor_calibration_refines_the_preset(tmp_path) -> None:
    """A calibration of the card (wsitrain doctor --calibrate) replaces the efficiency factors; another card's not."""
    h200 = GPU_SPEEDS["h200"]
    cal = Calibration("NVIDIA H200", "cuda", "2026-11-26", byte_flops=50.0, call_flops=1e8, tile_call_flops=0.0,
                      flops_per_second=100e12)  # fmt: skip
    write_calibration(cal, tmp_path)
    refined = clock_speed("h200", "NVIDIA H200", tmp_path)
    assert refined is not None and "doctor" in refined.source
    # the calibration's convolutions have 128 and 256 channels: its rate is the channel curve's share at 192 of the
    # large-channel factor
    assert refined.conv_efficiency * h200.conv_shape_factor(192, False) == pytest.approx(
        100e12 / (1e12 * h200.tf32_tflops))
    # the planner's factor moves by the same ratio
    assert refined.plan_conv_efficiency / refined.conv_efficiency == pytest.approx(
        h200.plan_conv_efficiency / h200.conv_efficiency)
    assert refined.bytes_per_second == pytest.approx(100e12 / 50.0)
    assert clock_speed("h200", "NVIDIA H100 80GB HBM3", tmp_path) == h200
    assert clock_speed("a6000", "NVIDIA RTX A6000", tmp_path) is None


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100-80"),
        ("NVIDIA A100-PCIE-40GB", "a100-40"),
        ("NVIDIA GeForce RTX 2080 Ti", "2080ti"),
        ("NVIDIA GeForce RTX 4090", None),  # a preset without speed constants: the defaults
        (None, None),
    ],
)
def test_a_run_plans_with_the_clock_plan_printed_for_its_card(name: str | None, preset: str | None) -> None:
    """fit on a GPU (train/engine.py) plans with the time model ``wsitrain plan --gpu`` prints for that card: the
    clock's constants of the preset the device's name is, at the run's precision, where no calibration exists."""
    from wsitrain.gpu_speed import speed_preset_of
    from wsitrain.sft.planning.calibration import CLOCK_SOURCE, run_time_model
    from wsitrain.sft.planning.costs import DEFAULT_TIME_MODEL

    assert speed_preset_of(name) == preset
    for low in (False, True):
        run, speed = run_time_model("cuda", name, low)
        if preset is None:
            assert speed is None and run.source == DEFAULT_TIME_MODEL
            continue
        printed, _ = run_time_model("cuda", None, low, preset)  # `wsitrain plan --gpu <preset>` on another machine
        assert run.source.startswith(CLOCK_SOURCE) and run == printed
    cpu, speed = run_time_model("cpu", name, False)
    assert speed is None and cpu.source == DEFAULT_TIME_MODEL


def test_the_planners_rate_is_its_own_factor_on_every_kind_of_card() -> None:
    """Tensor cores and TF32 count in PLAN_CONV_EFFICIENCY; a card without either (the 2080 Ti in float32) runs on its
    CUDA cores at SIMT_EFFICIENCY for the clock and the planner alike."""
    from wsitrain.gpu_speed import SIMT_EFFICIENCY

    for name, s in GPU_SPEEDS.items():
        assert s.plan_conv_rate(True) == pytest.approx(1e12 * s.tensor_tflops * s.plan_conv_efficiency), name
        if s.tf32_tflops > s.fp32_tflops:
            assert s.plan_conv_rate(False) == pytest.approx(1e12 * s.tf32_tflops * s.plan_conv_efficiency), name
        else:
            assert s.plan_conv_rate(False) == s.conv_rate(False) == 1e12 * s.fp32_tflops * SIMT_EFFICIENCY, name


def test_a_replay_plans_the_optimizer_the_cards_plan_held() -> None:
    """``plan_optimizer``: the plan holds that optimizer's state (a GPU kit of before 2026-11-27 planned with none)
    while the simulated step still runs the step's own optimizer."""
    net = _tiny()
    none, sim_none, _ = clock_sft_step(net, (1, 3, 256, 256), "1GiB", H100, "bf16", plan_optimizer=None,
                                       optimizer="adamw")  # fmt: skip
    same, sim_same, _ = clock_sft_step(_tiny(), (1, 3, 256, 256), "1GiB", H100, "bf16", optimizer="adamw")
    assert sim_none.plan.breakdown["optimizer"] == 0 < sim_same.plan.breakdown["optimizer"]
    assert none.by_kind.get("optimizer", 0) > 0 and same.by_kind.get("optimizer", 0) > 0


def test_a_replay_can_fall_back_after_its_one_pass() -> None:
    """``one_pass_falls_back``: the one-pass segment recomputes after its pass, as bf16 steps did on a GPU before
    2026-11-27 (the kit's rows replay it): more FLOPs and launches, the same plan."""
    held, sim, _ = clock_sft_step(_tiny(), (1, 3, 512, 512), "1GiB", H100, "bf16", tile_size=128)
    fell, sim_fell, _ = clock_sft_step(_tiny(), (1, 3, 512, 512), "1GiB", H100, "bf16", tile_size=128,
                                       one_pass_falls_back=True)  # fmt: skip
    assert any(s.one_pass for s in sim.plan.segments) and sim.plan.brief == sim_fell.plan.brief
    assert fell.flops > held.flops and fell.kernels > held.kernels and fell.seconds > held.seconds
