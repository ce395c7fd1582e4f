"""The device a plan is for: presets as usable memory, workspaces per GPU generation, the convolution size limit,
the price of a byte moved to host memory, and which device a budget and a target are detected on."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from wsitrain.gpus import GPU_PRESETS, resolve_budget
from wsitrain.models import build
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.planning.planner import build_plan
from wsitrain.sft.target import (
    CONV_ELEMENTS_LIMIT,
    GENERATIONS,
    TargetDevice,
    detected_target,
    generation_of,
    large_conv_supported,
)

GiB = 1024**3
MiB = 2**20


def test_generations_and_their_allowances() -> None:
    assert generation_of((7, 5)) == "volta-turing" and generation_of((6, 1)) == "volta-turing"
    assert generation_of((8, 0)) == "ampere-ada" and generation_of((8, 9)) == "ampere-ada"
    assert generation_of((9, 0)) == "hopper+" and generation_of((10, 0)) == "hopper+"
    # Hopper: two 32 MiB cuBLAS workspaces (forward and autograd's backward thread) exceed the old 64 MiB alone
    assert GENERATIONS["hopper+"].runtime_bytes > 2 * 32 * MiB + 32 * MiB
    assert GPU_PRESETS["h100"].target().runtime_bytes == GENERATIONS["hopper+"].runtime_bytes
    assert GPU_PRESETS["2080ti"].target().runtime_bytes == 64 * MiB
    assert GPU_PRESETS["a100-80"].target().runtime_bytes == GENERATIONS["ampere-ada"].runtime_bytes


def test_large_conv_decision() -> None:
    assert large_conv_supported("2.6.0+cu124", 90300) and large_conv_supported("2.7.1", 90501)
    assert not large_conv_supported("2.5.1+cu124", 90300)  # torch too old
    assert not large_conv_supported("2.6.0", 90100)  # cuDNN too old
    assert not large_conv_supported("2.6.0", None) and not large_conv_supported("garbage", 90300)
    assert GPU_PRESETS["h100"].target().conv_elements_limit == CONV_ELEMENTS_LIMIT  # assumed unless told
    # a device that runs larger convolutions keeps the limit too (slow kernels), unless no plan fits within it
    assert GPU_PRESETS["h100"].target(large_conv=True).conv_elements_limit == CONV_ELEMENTS_LIMIT
    lifted = dataclasses.replace(GPU_PRESETS["h100"].target(large_conv=True), whole_large_conv=True)
    assert lifted.conv_elements_limit is None
    assert dataclasses.replace(GPU_PRESETS["h100"].target(), whole_large_conv=True).conv_elements_limit is not None
    assert TargetDevice("cpu", "CPU").conv_elements_limit is None


def test_host_byte_price_follows_link_and_flop_rate() -> None:
    # FLOP rate over link rate: a 2080 Ti (13.4 TFLOP/s) on PCIe 3.0 (12 GB/s) pays 1117 FLOPs a byte
    assert GPU_PRESETS["2080ti"].target().host_byte_flops == pytest.approx(13.4e12 / 12e9)
    assert GPU_PRESETS["t4"].target().host_byte_flops == pytest.approx(8.1e12 / 12e9)
    assert GPU_PRESETS["h100"].target().host_byte_flops == pytest.approx(67e12 / 48e9)


def _vgg_plan(target: TargetDevice, budget: int, size: int = 20480):
    with torch.device("meta"):
        net = build("vgg16", 2)
    return build_plan(
        ModelGraph(net), "vgg16", (1, 3, size, size), budget, torch.float32, torch.uint8, "cuda", True, target=target
    )


def _largest_conv_elements(plan, facts) -> int:
    """Per-sample elements of the largest convolution input or output the plan runs, from its segments."""
    worst = 0
    for s in plan.segments:
        for i in range(s.start + 1, s.end + 1):
            node = facts.nodes[i]
            if not (node.spec.kind == WINDOW and node.spec.has_params):
                continue
            for v in (i, node.inputs[0]):
                shape = facts.nodes[v].shape
                if s.regions is None:
                    n = math.prod(shape[1:])
                else:
                    h = max(t.computed[v][1] - t.computed[v][0] for t in s.regions.rows)
                    w = max(t.computed[v][1] - t.computed[v][0] for t in s.regions.cols)
                    n = shape[1] * h * w
                worst = max(worst, n)
    return worst


def test_convolutions_stay_below_two_to_the_31_where_a_plan_can() -> None:
    """Below cuDNN 9.3 a larger convolution takes memory no plan counts; from 9.3 it runs on slow kernels (1 TFLOP/s
    against 13 on tiles, measured on an H200): either way plans keep every convolution within the limit."""
    a100 = GPU_PRESETS["a100-80"]
    for large_conv, why in ((False, "im2col fallback"), (True, "cuDNN's slow 64-bit-index kernels")):
        plan, facts = _vgg_plan(a100.target(large_conv=large_conv), a100.usable_bytes)
        assert plan.fits and _largest_conv_elements(plan, facts) <= CONV_ELEMENTS_LIMIT
        assert f"at or below 2^31 elements per sample ({why} otherwise)" in str(plan)
    # the limit is the largest 32-bit index: 32 x 8192 x 8192 = 2^31 elements ran on the slow path
    assert CONV_ELEMENTS_LIMIT == 2**31 - 1


def test_convolutions_run_whole_only_where_no_plan_keeps_them_within_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where every plan within the limit fails and the device runs larger convolutions, the planner searches again
    without the limit (and says so); a device that cannot run them gets no such plan."""
    from wsitrain.sft.planning import planner

    real = planner.fitting_plan

    def only_without_limit(sess, *args, **kwargs):  # as if no plan kept every convolution within the limit
        return None if sess.target.conv_elements_limit is not None else real(sess, *args, **kwargs)

    monkeypatch.setattr(planner, "fitting_plan", only_without_limit)
    a100 = GPU_PRESETS["a100-80"]
    free, facts = _vgg_plan(a100.target(large_conv=True), a100.usable_bytes)
    # the cheapest plan without the limit runs VGG-16's conv4 block plain: 512 x 2560 x 2560 = 3.4e9 elements
    assert free.fits and _largest_conv_elements(free, facts) > CONV_ELEMENTS_LIMIT
    assert free.target.whole_large_conv and "run whole" in str(free)
    limited, _ = _vgg_plan(a100.target(), a100.usable_bytes)
    assert not limited.fits


def test_plan_runtime_term_names_the_generation() -> None:
    h100, t4 = GPU_PRESETS["h100"], GPU_PRESETS["t4"]
    p_h, _ = _vgg_plan(h100.target(), 8 * GiB, 2048)
    p_t, _ = _vgg_plan(t4.target(), 8 * GiB, 2048)
    assert p_h.breakdown["runtime"] - p_t.breakdown["runtime"] == 96 * MiB  # 160 MiB against 64 MiB
    assert "Hopper" in str(p_h) and "Volta/Turing" in str(p_t)


def test_detected_target_reads_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    def capability(dev: object) -> tuple[int, int]:
        asked.append(dev)
        return (9, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    t = detected_target(torch.device("cuda", 1))
    assert asked == [torch.device("cuda", 1)] and t.generation == "hopper+" and not t.large_conv
    assert "cuda:1" in t.label


def test_preset_budget_is_usable_memory() -> None:
    b = resolve_budget("t4", None)
    assert b.bytes == GPU_PRESETS["t4"].usable_bytes < 15 * GiB and b.target.generation == "volta-turing"
    assert "usable" in b.source and "nominal 16.00 GiB" in b.source
    assert resolve_budget("cpu", "1GiB").target.kind == "cpu"


@pytest.mark.parametrize(("name", "preset"), [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                              ("NVIDIA A100-SXM4-80GB", "a100-80"), ("NVIDIA RTX A6000", None)])
def test_a_detected_card_prices_host_transfers_as_its_preset(monkeypatch: pytest.MonkeyPatch, name: str,
                                                             preset: str | None) -> None:  # fmt: skip
    """A run on a card `plan --gpu` knows prices a host byte as the preset does, so it runs the plan printed for it
    (the H200 of 2026-11-27 planned with a 2080 Ti's rates and chose another plan); other cards keep the defaults."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: name)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    t = detected_target(torch.device("cuda", 0))
    if preset is None:
        assert t.host_link_gb_s == 0.0 and t.tflops == 0.0
        return
    p = GPU_PRESETS[preset].target(t.large_conv)
    assert t.host_byte_flops == p.host_byte_flops and (t.host_link_gb_s, t.tflops) == (p.host_link_gb_s, p.tflops)
