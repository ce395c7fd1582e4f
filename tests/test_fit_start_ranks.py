"""A start that fails on one rank leaves no run folder and stops every rank with a message (2 CPU processes, gloo).

The failure this guards against: one rank's slide check failed while rank 0 had already made the run folder, which
stayed behind empty, and rank 0 died on "Connection closed by peer" instead of saying what happened.
"""

from __future__ import annotations

import errno
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
from wsitrain.errors import WsiTrainError
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.fit import run_fit

SYNTH = {"n": 4, "size": 128, "seed": 0, "positive_fraction": 0.5}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(root: Path) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({
        "name": "start",
        "data": {"synthetic": {**SYNTH, "cache_dir": str(root / "synth")}, "region": "whole", "val_fraction": 0.5},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": "1GiB", "device": "cpu"},
        "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.01},
        "distributed": {"backend": "gloo"},
        "log": {"dir": str(root / "runs"), "tiles": "off"},
    })  # fmt: skip


def _worker(rank: int, world: int, port: int, root: str, failing_rank: int, where: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    if rank == failing_rank:
        import wsitrain.train.recipe as recipe

        if where == "checks":

            def unreadable(*args: Any, **kwargs: Any) -> Any:
                raise WsiTrainError("slide_001.svs: not a readable slide", hint="replace the file")

            recipe.load_fit_data = unreadable
        else:  # rank 0 cannot make the run folder
            real_mkdir = os.mkdir

            def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
                if "runs" in str(path):
                    raise PermissionError(errno.EACCES, "Permission denied", str(path))
                real_mkdir(path, *args, **kwargs)

            os.mkdir = refuse
    try:
        run_fit(_cfg(Path(root)), console=Console(file=io.StringIO()), quiet=True)
        outcome = "finished"
    except WsiTrainError as e:
        outcome = f"{type(e).__name__}: {e.message}"
    except Exception as e:  # what the test must not see: a raw collective error
        outcome = f"raw {type(e).__name__}: {e}"
    Path(root, f"rank{rank}.txt").write_text(outcome)


@pytest.mark.heavy  # two processes started per case: 8-9 s each (measured); CI runs them (`make test-heavy`)
@pytest.mark.parametrize(
    ("failing_rank", "where", "others_hear"),
    [(1, "checks", "another rank failed to start"), (0, "folder", "rank 0 could not create the run folder")],
)
def test_one_rank_failing_to_start_stops_all_and_leaves_no_run_folder(
    tmp_path: Path, failing_rank: int, where: str, others_hear: str
) -> None:
    write_synthetic_dataset(tmp_path / "synth", **SYNTH)
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), failing_rank, where), nprocs=2, join=True)
    own = (tmp_path / f"rank{failing_rank}.txt").read_text()
    other = (tmp_path / f"rank{1 - failing_rank}.txt").read_text()
    assert own.startswith("WsiTrainError") and ("not a readable slide" in own or "Permission denied" in own), own
    assert other.startswith("WsiTrainError") and others_hear in other, other
    runs = tmp_path / "runs"
    assert not runs.exists() or list(runs.iterdir()) == []
