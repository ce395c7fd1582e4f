"""Data-parallel fit over 2 CPU processes (gloo): the same weights as one process accumulating 2 slides a step."""

from __future__ import annotations

import csv
import io
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.distributed import DistInfo, shard
from wsitrain.train.fit import run_fit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(root: Path, name: str, accumulate: int) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": name,
        "seed": 1,
        "data": {"labels": str(root / "labels.csv"), "slides_dir": str(root / "slides"), "region": "whole",
                 "augment": {"flips": False, "rot90": False}},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": "1GiB", "tile_size": 128, "device": "cpu"},
        "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.05, "accumulate": accumulate},
        "distributed": {"backend": "gloo", "bucket_mb": 0.05},  # 50 KB buckets: the 60 KB of gradients take 2 calls
        "log": {"dir": str(root / "runs"), "tiles": "off"},
    })


def _fit_worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    run_fit(_cfg(Path(root), "ddp", accumulate=1), console=Console(file=io.StringIO()), quiet=True)


def _six_train_two_val(root: Path, size: int = 256) -> None:
    """root/slides: 8 synthetic slides of ``size`` px; root/labels.csv: 6 to train (3 per rank), 2 to validate."""
    rows = list(csv.DictReader(write_synthetic_dataset(root / "slides", n=8, size=size, seed=0).open()))
    with (root / "labels.csv").open("w") as f:
        f.write("slide,label,split\n")
        for i, r in enumerate(rows):
            f.write(f"{r['slide']},{r['label']},{'val' if i >= 6 else 'train'}\n")


def test_shard_pads_so_every_rank_runs_the_same_steps() -> None:
    order = [4, 0, 3, 1, 2]
    parts = [shard(order, DistInfo(r, 2, r)) for r in range(2)]
    assert parts == [[4, 3, 2], [0, 1, 4]]
    assert shard(order, DistInfo()) == order


@pytest.mark.heavy
def test_two_process_fit_equals_one_process_with_accumulation(tmp_path: Path) -> None:
    _six_train_two_val(tmp_path)
    mp.spawn(_fit_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    single = run_fit(_cfg(tmp_path, "single", accumulate=2), console=Console(file=io.StringIO()), quiet=True)

    a = load_checkpoint(tmp_path / "runs" / "ddp" / "last.pt")
    b = load_checkpoint(single / "last.pt")
    assert a["global_step"] == b["global_step"] == 3
    # distributed.balance: time (the default) pairs slides by predicted cost; these slides are alike (256 px, whole,
    # every tile on the border), so the costs tie and each step holds round robin's two slides: one process's
    # accumulation windows (tests/test_balance.py: test_equal_costs_keep_round_robins_steps)
    assert a["balance"]["mode"] == "time" and len(set(a["balance"]["costs"])) == 1, a["balance"]
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=1e-5, atol=1e-6, msg=key)
    val = [_last_val(tmp_path / "runs" / name / "metrics.jsonl") for name in ("ddp", "single")]
    assert val[0]["n"] == val[1]["n"] == 2
    assert val[0]["loss"] == pytest.approx(val[1]["loss"], rel=1e-5)


def _last_val(path: Path) -> dict[str, Any]:
    import json

    return [json.loads(x) for x in path.read_text().splitlines() if '"val"' in x][-1]


def test_collective_timeout_from_the_config_reaches_init_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """distributed.collective_timeout_minutes -> run_fit -> init_distributed -> a real gloo group's init call."""
    from datetime import timedelta

    import torch.distributed as dist

    from wsitrain.train import distributed as D
    from wsitrain.train import fit as fit_module

    seen: dict[str, Any] = {}
    real_init = dist.init_process_group

    def recording_init(**kwargs: Any) -> None:
        seen.update(kwargs)
        # one real gloo process: the timeout must be accepted by torch itself, not only recorded
        real_init(backend=kwargs["backend"], rank=0, world_size=1, timeout=kwargs["timeout"], store=dist.HashStore())

    class Stop(Exception):
        pass

    real_join = D.init_distributed

    def stop_after_init(*args: Any) -> D.DistInfo:
        info = real_join(*args)
        try:
            t = torch.ones(2)
            dist.all_reduce(t)  # the group works
            assert torch.equal(t, torch.ones(2))
        finally:
            dist.destroy_process_group()
        raise Stop(info)

    monkeypatch.setattr(D.dist, "init_process_group", recording_init)
    monkeypatch.setattr(fit_module.D, "init_distributed", stop_after_init)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    cfg = WsiTrainConfig.model_validate({"distributed": {"backend": "gloo", "collective_timeout_minutes": 7.5},
                                         "log": {"dir": str(tmp_path)}})  # fmt: skip
    with pytest.raises(Stop):
        run_fit(cfg, console=Console(file=io.StringIO()), quiet=True)
    assert seen["backend"] == "gloo" and seen["timeout"] == timedelta(minutes=7.5)
    assert WsiTrainConfig().distributed.collective_timeout_minutes == 60.0
    with pytest.raises(ValueError, match="collective_timeout_minutes"):
        WsiTrainConfig.model_validate({"distributed": {"collective_timeout_minutes": 0}})


class _SignalRankOne:
    """Only rank 1 gets the signal (after step 1): the all_reduced flag must stop rank 0 at the same step."""

    def on_step_end(self, state: Any) -> None:
        import signal as _signal

        if state.global_step == 1 and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), _signal.SIGUSR1)


def _slow_save_checkpoint(path: Path, **state: Any) -> None:
    """Rank 0's checkpoint write, a second slower: as a large model's, which takes seconds."""
    import time

    from wsitrain.train import checkpoint

    time.sleep(1.0)
    checkpoint.save_checkpoint(path, **state)


def _preempt_worker(rank: int, world: int, port: int, root: str, name: str, stop: bool, resume: bool) -> None:
    from wsitrain.train import recipe
    from wsitrain.train.preempt import Preempted

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    cfg = _cfg(Path(root), name, accumulate=1)
    cfg.train.stop_signal = "SIGUSR1"
    if stop and rank == 0:
        recipe.save_checkpoint = _slow_save_checkpoint  # this process only (mp.spawn starts a fresh interpreter)
    try:
        run_fit(cfg, console=Console(file=io.StringIO()), quiet=True, callbacks=[_SignalRankOne()] if stop else [],
                resume=Path(root) / "runs" / name if resume else None)
    except Preempted as err:
        # What this rank finds on disk as it leaves: under torchrun its exit ends the step on its node, and srun
        # --kill-on-bad-exit (scripts/slurm/) then kills the other nodes' ranks, rank 0 included.
        last = Path(root) / "runs" / name / "last.pt"
        step = load_checkpoint(last)["global_step"] if last.is_file() else None
        (Path(root) / f"{name}-rank{rank}.stopped").write_text(f"{err.message}\nlast.pt step {step}")


@pytest.mark.heavy  # 30-50 s on 2 cores (measured 2026-11-27); CI runs it, `make test` does not
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    _six_train_two_val(tmp_path)
    mp.spawn(_preempt_worker, args=(2, _free_port(), str(tmp_path), "full", False, False), nprocs=2, join=True)
    mp.spawn(_preempt_worker, args=(2, _free_port(), str(tmp_path), "cut", True, False), nprocs=2, join=True)
    said = [(tmp_path / f"cut-rank{r}.stopped").read_text() for r in range(2)]
    assert said[1].startswith("preempted (SIGUSR1) at epoch 1 step 2;"), said
    assert said[0].startswith("preempted (a signal to another rank) at epoch 1 step 2;"), said  # the same step
    assert load_checkpoint(tmp_path / "runs" / "cut" / "last.pt")["global_step"] == 2
    # no rank leaves before rank 0 has written last.pt (its write was made a second slower)
    assert [s.splitlines()[-1] for s in said] == ["last.pt step 2", "last.pt step 2"], said
    mp.spawn(_preempt_worker, args=(2, _free_port(), str(tmp_path), "cut", False, True), nprocs=2, join=True)
    a = load_checkpoint(tmp_path / "runs" / "full" / "last.pt")
    b = load_checkpoint(tmp_path / "runs" / "cut" / "last.pt")
    assert a["global_step"] == b["global_step"] == 3
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
