"""An out-of-memory error in a training step re-plans with a lower budget and retries once; a second ends the run
with exit 2 and the last checkpoint intact. The error is injected on CPU by a gradient hook on the first conv's
weight, the last gradient of backward: every other parameter already holds its share of the failed step."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.errors import PlanError
from wsitrain.gpus import GiB
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.distributed import DistInfo
from wsitrain.train.oom import OOM_MARGIN, MemoryAtOom, describe, lowered_budget, probe_memory_at_oom
from wsitrain.train.recipe import FitRecipe

SYNTH = {"n": 8, "size": 128, "seed": 0, "positive_fraction": 0.5}
BUDGET = 1 * GiB


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    write_synthetic_dataset(out, **SYNTH)
    return out


def cfg_for(synth_dir: Path, log_dir: Path, **train: Any) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": "exp", "seed": 1,
        "data": {"synthetic": {**SYNTH, "cache_dir": str(synth_dir)}, "region": "whole", "val_fraction": 0.25},
        "model": {"name": "tiny"},
        "engine": {"device": "cpu", "memory_budget": BUDGET},
        "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.1, "schedule": "constant", **train},
        "log": {"dir": str(log_dir)},
    })  # fmt: skip


class OomAt:
    """A gradient hook raising torch.OutOfMemoryError at the listed backward calls (1-based)."""

    def __init__(self, calls: set[int] | None = None, from_call: int | None = None) -> None:
        self.calls, self.from_call, self.n = calls or set(), from_call, 0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        self.n += 1
        if self.n in self.calls or (self.from_call is not None and self.n >= self.from_call):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB (injected)")
        return grad


def run(cfg: WsiTrainConfig, hook: OomAt | None, probe: Any = None) -> tuple[FitRecipe, str]:
    buf = io.StringIO()
    recipe = FitRecipe(cfg, console=Console(file=buf, width=300), quiet=True, dist=DistInfo())
    recipe.setup(resume=None, force=False, name=None)
    if probe is not None:
        recipe.oom.probe = probe
    if hook is not None:
        recipe.model.features.conv1.weight.register_hook(hook)
    try:
        recipe.train()
    finally:
        recipe.recorder.close()
    return recipe, buf.getvalue()


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("accumulate", [1, 3])
def test_one_oom_replans_lower_and_retries_without_double_counting(
    synth_dir: Path, tmp_path: Path, accumulate: int
) -> None:
    clean, _ = run(cfg_for(synth_dir, tmp_path / "clean", accumulate=accumulate), None)
    # The 2nd slide's backward fails: with accumulate 3 the 1st slide's gradient is in .grad and must survive.
    failed, out = run(cfg_for(synth_dir, tmp_path / "oom", accumulate=accumulate), OomAt({2}))
    assert failed.oom.replans == 1
    assert failed.engine.budget_bytes == int(BUDGET - OOM_MARGIN * BUDGET)  # CPU: no overshoot is known
    assert "out of device memory" in out and "Re-planning with the budget lowered" in out
    events = [r for r in rows(failed.run_dir) if r["kind"] == "oom_replan"]
    assert len(events) == 1 and events[0]["new_budget_bytes"] < events[0]["budget_bytes"] == BUDGET
    assert events[0]["requested_bytes"] == 64 * 2**20
    assert len([r for r in rows(failed.run_dir) if r["kind"] == "train"]) == len(failed.data.train)
    plans = [json.loads(line) for line in (failed.run_dir / "plans.jsonl").read_text().splitlines()]
    assert [p["plan"]["budget_bytes"] for p in plans] == [BUDGET, failed.engine.budget_bytes]
    # Same weights as the run that never failed: the failed step's partial gradient was dropped, not added.
    for (name, a), b in zip(clean.model.state_dict().items(), failed.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def test_second_oom_ends_the_run_with_exit_2_and_last_checkpoint_intact(synth_dir: Path, tmp_path: Path) -> None:
    def gpu_figures(device: torch.device, message: str) -> MemoryAtOom:
        return MemoryAtOom(allocated=90 * 2**20, reserved=95 * 2**20, peak=90 * 2**20, requested=64 * 2**20,
                           largest_blocks=(30 * 2**20, 10 * 2**20))  # fmt: skip

    recipe = FitRecipe(cfg_for(synth_dir, tmp_path, epochs=2), console=Console(file=io.StringIO()), quiet=True,
                       dist=DistInfo())  # fmt: skip
    recipe.setup(resume=None, force=False, name=None)
    recipe.oom.probe = gpu_figures
    last = recipe.run_dir / "last.pt"
    n_train = len(recipe.data.train)
    before: list[str] = []

    class EpochTwoFails(OomAt):
        """Epoch 1 runs clean and writes last.pt at its end; every backward of epoch 2 fails."""

        def __call__(self, grad: torch.Tensor) -> torch.Tensor:
            if self.n == n_train:
                before.append(hashlib.sha256(last.read_bytes()).hexdigest())
            return super().__call__(grad)

    hook = EpochTwoFails(from_call=n_train + 1)
    recipe.model.features.conv1.weight.register_hook(hook)
    with pytest.raises(PlanError) as info:
        recipe.train()
    assert before and hashlib.sha256(last.read_bytes()).hexdigest() == before[0]
    err = info.value
    assert err.exit_code == 2
    assert re.match(r"slide slide_\d+: out of device memory again after re-planning", err.message)
    assert "last checkpoint is unchanged" in err.message
    assert "allocated 90.00 MiB" in err.message and "largest blocks 30.00 MiB, 10.00 MiB" in err.message
    assert "engine.memory_budget" in (err.hint or "")
    events = [r for r in rows(recipe.run_dir) if r["kind"] == "oom_replan"]
    # the overshoot over the plan is what the device held plus the failed request, less the planned peak
    assert len(events) == 1 and events[0]["overshoot_bytes"] == 154 * 2**20 - events[0]["planned_peak_bytes"]
    assert events[0]["new_budget_bytes"] == int(BUDGET - events[0]["overshoot_bytes"] - OOM_MARGIN * BUDGET)
    assert hook.n == n_train + 2  # the failed step and its one retry


def test_lowered_budget_subtracts_the_overshoot_and_the_margin() -> None:
    mem = MemoryAtOom(allocated=10 * GiB, reserved=11 * GiB, peak=9 * GiB, requested=1 * GiB)
    assert mem.needed == 11 * GiB
    new, over = lowered_budget(12 * GiB, 8 * GiB, mem)
    assert over == 3 * GiB and new == int(12 * GiB - 3 * GiB - OOM_MARGIN * 12 * GiB)
    assert lowered_budget(12 * GiB, 12 * GiB, mem) == (int(12 * GiB * (1 - OOM_MARGIN)), 0)
    assert lowered_budget(12 * GiB, 8 * GiB, MemoryAtOom()) == (int(12 * GiB * (1 - OOM_MARGIN)), 0)


def test_cpu_probe_reads_the_failed_request_only_and_the_report_says_so() -> None:
    mem = probe_memory_at_oom(torch.device("cpu"), "CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has ...")
    assert mem == MemoryAtOom(requested=int(2.5 * GiB))
    assert probe_memory_at_oom(torch.device("cpu"), "something else").requested is None

    class P:
        estimated_peak_bytes = 3 * GiB

    text = describe(P(), 4 * GiB, mem)  # type: ignore[arg-type]
    assert "planned peak 3.00 GiB of a 4.00 GiB budget" in text and "allocated not known on this device" in text


def test_oom_whose_lowered_budget_fits_nothing_says_both(synth_dir: Path, tmp_path: Path) -> None:
    def huge(device: torch.device, message: str) -> MemoryAtOom:  # the step needed 60% more than the budget
        return MemoryAtOom(allocated=int(0.8 * BUDGET), requested=int(0.8 * BUDGET))

    with pytest.raises(PlanError, match="no smaller budget is left") as info:
        run(cfg_for(synth_dir, tmp_path / "a"), OomAt({1}), probe=huge)
    assert info.value.exit_code == 2

    def large(device: torch.device, message: str) -> MemoryAtOom:
        # lowered budget = the planned peak less 6 MiB (~8 MiB): below the tiny model's weights and workspaces
        return MemoryAtOom(allocated=int((1 - OOM_MARGIN) * BUDGET) + 6 * 2**20, requested=0)

    with pytest.raises(PlanError, match=r"out of device memory \(planned peak .*re-planned within .*does not fit"):
        run(cfg_for(synth_dir, tmp_path / "b"), OomAt({1}), probe=large)
