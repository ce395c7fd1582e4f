"""Used as a library on CPU, the engine tunes glibc's allocator at first use and says so once per process."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import wsitrain.memory as memory
from wsitrain.sft import SFT


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A process-state mirror as a new process has it, and a record of mallopt calls."""
    monkeypatch.setattr(memory, "_ALLOCATOR", memory._AllocatorState())
    calls: list[str] = []

    def fake_tune() -> bool:
        calls.append("mallopt")
        memory._ALLOCATOR.tuned = True
        return True

    monkeypatch.setattr(memory, "tune_cpu_allocator", fake_tune)
    monkeypatch.delenv(memory.ALLOCATOR_ENV, raising=False)
    return calls


def _step(m: nn.Module) -> None:
    m(torch.randn(1, 3, 16, 16)).sum().backward()


def test_first_cpu_use_tunes_once_and_says_so_once(fresh: list[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        for _ in range(2):  # two engines in one process: one tuning, one message
            _step(SFT(nn.Conv2d(3, 4, 3), memory_budget="1GiB"))
    assert fresh == ["mallopt"]
    said = [r.getMessage() for r in caplog.records if "mmap threshold" in r.getMessage()]
    assert len(said) == 1 and memory.ALLOCATOR_ENV in said[0]


def test_opt_out_keeps_the_default_and_warns_once(
    fresh: list[str], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(memory.ALLOCATOR_ENV, "default")
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        _step(SFT(nn.Conv2d(3, 4, 3), memory_budget="1GiB"))
        _step(SFT(nn.Conv2d(3, 4, 3), memory_budget="1GiB"))
    assert fresh == []
    assert sum("may be exceeded" in r.getMessage() for r in caplog.records) == 1


def test_cpu_tuning_is_not_repeated_when_fit_already_tuned(fresh: list[str], caplog: pytest.LogCaptureFixture) -> None:
    memory._ALLOCATOR.tuned = True  # fit (which owns its process) tuned it already: nothing more to say
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        assert memory.tune_library_allocator(torch.device("cpu")) is True
    assert fresh == [] and not caplog.records


@pytest.fixture
def cuda_fresh(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The CUDA allocator's state as a new process has it; the settings wsitrain would give PyTorch, recorded."""
    monkeypatch.setattr(memory, "_CUDA_ALLOCATOR", memory._AllocatorState())
    settings: list[str] = []
    monkeypatch.setattr(memory, "_set_cuda_allocator_settings", settings.append)
    monkeypatch.delenv(memory.CUDA_ALLOCATOR_ENV, raising=False)
    monkeypatch.delenv(memory.TORCH_ALLOC_ENV, raising=False)
    return settings


def test_cuda_use_turns_on_expandable_segments_once_and_says_so_once(
    cuda_fresh: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Fixed segments fragmented a real H100 run out of memory under its plan: the library turns them off once."""
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        for _ in range(3):
            assert memory.tune_library_allocator(torch.device("cuda", 0)) is True
    assert cuda_fresh == [memory.CUDA_ALLOCATOR_SETTING] == ["expandable_segments:True"]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "expandable segments" in said[0] and memory.CUDA_ALLOCATOR_ENV in said[0]


def test_cuda_owner_process_tunes_silently(cuda_fresh: list[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        assert memory.tune_cuda_allocator(say=False) is True  # fit: its own log says it
        assert memory.tune_library_allocator(torch.device("cuda", 0)) is True  # a later SFT: nothing more
    assert cuda_fresh == ["expandable_segments:True"] and not caplog.records


@pytest.mark.parametrize(("conf", "on"), [("expandable_segments:True", True), ("expandable_segments:False", False),
                                          ("max_split_size_mb:64,expandable_segments: true", True)])  # fmt: skip
def test_the_users_own_allocator_setting_is_kept(
    cuda_fresh: list[str], monkeypatch: pytest.MonkeyPatch, conf: str, on: bool
) -> None:
    monkeypatch.setenv(memory.TORCH_ALLOC_ENV, conf)
    assert memory.tune_cuda_allocator() is on and cuda_fresh == []


def test_cuda_opt_out_keeps_pytorchs_default_and_warns_once(
    cuda_fresh: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(memory.CUDA_ALLOCATOR_ENV, "default")
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        assert memory.tune_cuda_allocator() is False and memory.tune_cuda_allocator() is False
    assert cuda_fresh == [] and sum("fragmentation" in r.getMessage() for r in caplog.records) == 1


def test_an_unknown_opt_out_value_is_named(
    cuda_fresh: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(memory.CUDA_ALLOCATOR_ENV, "off")
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        assert memory.tune_cuda_allocator() is True  # not an opt-out: tuned, and the value named with the fix
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"{memory.CUDA_ALLOCATOR_ENV}=off is not a setting" in said and "'default'" in said


def test_an_allocator_without_the_setting_is_reported_not_fatal(
    cuda_fresh: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(setting: str) -> None:
        raise RuntimeError("pluggable allocator: no settings")

    monkeypatch.setattr(memory, "_set_cuda_allocator_settings", refuse)
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        assert memory.tune_cuda_allocator() is False
    assert any(memory.TORCH_ALLOC_ENV in r.getMessage() for r in caplog.records)


def test_torchs_runtime_setting_exists() -> None:
    """The private entry point wsitrain calls is present in the installed torch (a rename would break GPUs only)."""
    assert callable(getattr(torch._C, "_accelerator_setAllocatorSettings", None)) or callable(
        getattr(torch.cuda.memory, "_set_allocator_settings", None)
    )
