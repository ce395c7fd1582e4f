"""A two-rank fit (gloo) on slides of different sizes: time-balanced steps, and the waiting share it reports."""

from __future__ import annotations

import io
import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from rich.console import Console

from wsitrain.config import WsiTrainConfig, config_to_dict
from wsitrain.errors import WsiTrainError
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.train.balance.deal import Balance
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.fit import run_fit
from wsitrain.train.runfolder import load_resume

SIDES = [128, 384, 160, 320, 192, 352, 224, 288]  # 9x in area from the smallest to the largest


def _cfg(root: Path, name: str) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": name, "seed": 3,
        "data": {"labels": str(root / "labels.csv"), "region": "whole", "val_fraction": 0.0, "read_threads": 1,
                 "augment": {"flips": False, "rot90": False}},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": "1GiB", "device": "cpu"},
        "train": {"epochs": 2, "optimizer": "sgd", "lr": 0.01},
        "distributed": {"backend": "gloo"},  # balance: time, the default
        "log": {"dir": str(root / "runs"), "tiles": "off"},
    })  # fmt: skip


def _worker(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    with open(Path(root) / f"console-{rank}.txt", "w") as out:
        run_fit(_cfg(Path(root), "two"), console=Console(file=out, width=200), quiet=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.heavy
def test_two_ranks_train_balanced_steps_and_report_their_waiting(tmp_path: Path) -> None:
    for i, side in enumerate(SIDES):
        write_synthetic_slide(tmp_path / f"s{i}.svs", size=side, positive=bool(i % 2), seed=i)
    (tmp_path / "labels.csv").write_text(
        "slide,label\n" + "".join(f"s{i}.svs,{'positive' if i % 2 else 'negative'}\n" for i in range(len(SIDES)))
    )
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    run = tmp_path / "runs" / "two"

    # the costs the run balanced by, kept in the checkpoint: larger slides cost more
    saved = load_checkpoint(run / "last.pt")["balance"]
    assert saved["mode"] == "time"
    by_side = sorted(zip(SIDES, saved["costs"], strict=True))
    assert [c for _, c in by_side] == sorted(c for _, c in by_side), by_side
    # rank 0 trained exactly the balancer's share for it, epoch by epoch (4 steps of 1 slide per rank)
    balance = Balance("time", 3, 2, 1, tuple(saved["costs"]), tuple(tuple(b) for b in saved["buckets"]))
    rows = _rows(run)
    for epoch in (1, 2):
        trained = [int(r["slide"][1:]) for r in rows if r.get("kind") == "train" and r["epoch"] == epoch]
        assert trained == balance.rank_slides(len(SIDES), epoch - 1, 0)
    # the waiting share: per log interval and per epoch in metrics.jsonl, the epoch line, the summary
    ranks = [r for r in rows if r.get("kind") == "ranks"]
    epochs = [r for r in ranks if r["scope"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and all(r["steps"] == 4 for r in epochs)
    assert sum(r["steps"] for r in ranks if r["scope"] == "steps") == 8  # log.every 1: every step gathered
    for r in epochs:
        assert 0.0 <= r["wait_share"] <= 0.5 and len(r["compute_s"]) == 2 and r["balance"] == "time"
        assert r["waited_s"] == pytest.approx(r["wait_share"] * 2 * r["slowest_s"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["balance"] == "time" and 0.0 <= summary["rank_wait_share"] <= 0.5
    said = (tmp_path / "console-0.txt").read_text()
    assert "epoch 2/2: train loss" in said and "ranks waited" in said and "% of their time" in said

    # one process: nothing to wait for, so no share anywhere (absent, not 0)
    single = run_fit(_cfg(tmp_path, "one"), console=Console(file=io.StringIO()), quiet=True)
    assert not [r for r in _rows(single) if r.get("kind") == "ranks"]
    one = json.loads((single / "summary.json").read_text())
    assert "rank_wait_share" not in one and "balance" not in one
    assert not math.isnan(one["last_epoch_train_loss"])

    # a run folder written before distributed.balance existed resumes without --force (the key is not a change)
    ckpt = load_checkpoint(single / "last.pt")
    del ckpt["config"]["distributed"]["balance"], ckpt["balance"]
    torch.save(ckpt, single / "last.pt")
    cfg_dict = config_to_dict(_cfg(tmp_path, "one"))
    assert load_resume(single, cfg_dict, force=False)[1] == single
    ckpt["config"]["distributed"]["balance"] = "time"
    torch.save(ckpt, single / "last.pt")
    cfg_dict["distributed"]["balance"] = "round_robin"  # a real change of a recorded value still needs --force
    with pytest.raises(WsiTrainError, match="distributed.balance"):
        load_resume(single, cfg_dict, force=False)
