"""Optimizers, schedules and losses."""

from __future__ import annotations

import math

import pytest
import torch

from wsitrain.errors import ConfigError
from wsitrain.train.optim import build_optimizer, build_scheduler, compute_loss, lr_factor


def test_warmup_then_cosine_reaches_zero() -> None:
    f = [lr_factor(s, "cosine", total_steps=10, warmup_steps=2) for s in range(11)]
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    assert f[2] == pytest.approx(1.0)
    assert f[10] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(f[2:], f[3:], strict=False))


def test_constant_with_warmup() -> None:
    assert [lr_factor(s, "constant", 10, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(3, "constant", 10, 0) == 1.0


def test_scheduler_drives_optimizer_lr() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], "sgd", lr=0.1)
    sched = build_scheduler(opt, "cosine", total_steps=4)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[2] == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize(
    "name,cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)]
)
def test_optimizers(name: str, cls: type) -> None:
    assert isinstance(build_optimizer([torch.nn.Parameter(torch.zeros(1))], name, lr=1e-3), cls)


def test_unknown_names_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="train.optimizer"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], "lion", lr=1e-3)
    with pytest.raises(ConfigError, match="train.schedule"):
        lr_factor(0, "step", 10)


def test_losses() -> None:
    logits = torch.tensor([[2.0, 0.0]])
    target = torch.tensor([0])
    assert compute_loss(logits, target, "cross_entropy").item() == pytest.approx(math.log(1 + math.exp(-2)))
    assert compute_loss(logits, target, "mse").item() == pytest.approx(((2 - 1) ** 2 + 0) / 2)
