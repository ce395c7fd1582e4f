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


def test_not_on_cuda_and_not_when_fit_already_tuned(fresh: list[str], caplog: pytest.LogCaptureFixture) -> None:
    assert memory.tune_library_allocator(torch.device("cuda", 0)) is False and fresh == []
    memory._ALLOCATOR.tuned = True  # fit (which owns its process) tuned it already: nothing more to say
    with caplog.at_level(logging.WARNING, logger="wsitrain"):
        assert memory.tune_library_allocator(torch.device("cpu")) is True
    assert fresh == [] and not caplog.records
