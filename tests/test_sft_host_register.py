"""Pin only what a transfer reads from: the whole image's copy registers its pages for that copy alone."""

from __future__ import annotations

import pytest
import torch

from wsitrain.sft.execution.host_register import upload_whole, whole_image_transfer

CUDA = torch.device("cuda", 0)


class FakeLocker:
    def __init__(self, log: list[str], ok: bool = True) -> None:
        self.log, self.ok = log, ok
        self.ptrs: list[int] = []

    def register(self, t: torch.Tensor) -> bool:
        self.log.append("register")
        self.ptrs.append(t.data_ptr())
        return self.ok

    def unregister(self, t: torch.Tensor) -> None:
        assert t.data_ptr() == self.ptrs[-1]  # the same pages are given back
        self.log.append("unregister")

    def synchronize(self, device: torch.device) -> None:
        self.log.append("synchronize")


def _copier(log: list[str]):
    def copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        log.append("copy")
        return t.clone()  # stands in for the host -> device copy (no GPU here)

    return copy


def test_decision() -> None:
    x = torch.zeros(1, 3, 8, 8, dtype=torch.uint8)
    assert whole_image_transfer(x, CUDA) == "register"
    assert whole_image_transfer(x, torch.device("cpu")) == "direct"
    assert whole_image_transfer(x, torch.device("meta")) == "direct"


def test_pageable_image_is_registered_for_the_copy_only() -> None:
    log: list[str] = []
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.uint8).view(2, 3, 4, 5)
    y = upload_whole(x, CUDA, FakeLocker(log), _copier(log))
    # unregistering before the copy has completed would let the DMA read pages no longer locked
    assert log == ["register", "copy", "synchronize", "unregister"]
    assert torch.equal(y, x)


def test_strided_image_is_registered_as_one_contiguous_range() -> None:
    log: list[str] = []
    x = torch.arange(3 * 8 * 8, dtype=torch.uint8).view(1, 3, 8, 8)[:, :, :, :5]
    locker = FakeLocker(log)
    y = upload_whole(x, CUDA, locker, _copier(log))
    assert torch.equal(y, x) and log[0] == "register" and locker.ptrs[0] != x.data_ptr()


def test_failed_registration_falls_back_to_a_pageable_copy() -> None:
    log: list[str] = []
    x = torch.ones(1, 3, 4, 4, dtype=torch.uint8)
    y = upload_whole(x, CUDA, FakeLocker(log, ok=False), _copier(log))
    assert log == ["register", "copy"] and torch.equal(y, x)


def test_copy_error_still_unregisters() -> None:
    log: list[str] = []

    def broken(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        upload_whole(torch.ones(1, 3, 4, 4, dtype=torch.uint8), CUDA, FakeLocker(log), broken)
    assert log == ["register", "unregister"]


def test_cpu_and_pinned_images_are_not_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    x = torch.ones(1, 3, 4, 4, dtype=torch.uint8)
    assert upload_whole(x, torch.device("cpu"), FakeLocker(log)) is x and log == []
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    upload_whole(x, CUDA, FakeLocker(log), _copier(log))
    assert log == ["copy"]
