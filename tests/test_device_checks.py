"""Device checks before a run: bf16 needs Ampere, peaks report reserved memory too, budgets on the model's device."""

from __future__ import annotations

import pytest
import torch

import wsitrain.precision as precision
from wsitrain.config import WsiTrainConfig
from wsitrain.errors import WsiTrainError
from wsitrain.memory import DeviceMemory, PeakMeter
from wsitrain.plan.command import make_plan
from wsitrain.precision import check_device_precision
from wsitrain.preflight import check_run
from wsitrain.sft import SFT

CUDA1 = torch.device("cuda", 1)


def test_bf16_before_ampere_is_refused() -> None:
    with pytest.raises(WsiTrainError, match="train.precision: bf16 needs an Ampere"):
        check_device_precision("bf16", CUDA1, has_bf16=lambda d: False)
    asked: list[torch.device] = []
    check_device_precision("bf16", CUDA1, has_bf16=lambda d: asked.append(d) or True)
    assert asked == [CUDA1]  # the run's device is the one asked, not the current one
    check_device_precision("fp16", CUDA1, has_bf16=lambda d: False)  # fp16 runs on any GPU
    check_device_precision("bf16", torch.device("cpu"), has_bf16=lambda d: False)  # CPU: no such check


def test_fit_preflight_refuses_bf16_before_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_cuda_has_bf16", lambda d: False)
    cfg = WsiTrainConfig.model_validate({"model": {"name": "tiny"}, "train": {"precision": "bf16"}})
    with pytest.raises(WsiTrainError, match="bf16") as info:
        check_run(cfg, torch.device("cuda", 0))  # no labels yet: the device check still comes first
    assert "fp16" in (info.value.hint or "")


def test_plan_for_a_preset_refuses_bf16_before_ampere() -> None:
    with pytest.raises(WsiTrainError, match="older than Ampere"):
        make_plan(model="tiny", size="256", gpu="2080ti", memory=None, precision="bf16", with_max_size=False)
    assert make_plan(model="tiny", size="256", gpu="a100-40", memory=None, precision="bf16", with_max_size=False)


def test_peak_meter_reports_reserved_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 100)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 160)
    meter = PeakMeter("cuda:0")
    assert meter.peak() == 100 and meter.peak_reserved() == 160
    assert PeakMeter("cpu").peak_reserved() > 0  # CPU: the resident peak


def test_sft_detects_its_budget_on_the_models_device() -> None:
    seen: list[object] = []

    def probe(device: torch.device | str) -> DeviceMemory:
        seen.append(device)
        return DeviceMemory(free=2**30, held=0)

    sft = SFT(torch.nn.Conv2d(3, 4, 3), memory_probe=probe)
    assert sft.budget_bytes > 0 and seen == [torch.device("cpu")]  # a device, not the type string
