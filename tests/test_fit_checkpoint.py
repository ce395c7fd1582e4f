"""Atomic checkpoints, RNG state round trip, and run folders that are never overwritten."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from wsitrain.errors import WsiTrainError
from wsitrain.train.checkpoint import load_checkpoint, rng_states, save_checkpoint, set_rng_states
from wsitrain.train.runfolder import JsonlWriter, create_run_dir, library_versions


def test_checkpoint_round_trip_and_no_temp_files(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "last.pt", model={"w": torch.arange(3.0)}, epoch=2)
    save_checkpoint(tmp_path / "last.pt", model={"w": torch.arange(4.0)}, epoch=3)
    ck = load_checkpoint(tmp_path / "last.pt")
    assert ck["epoch"] == 3 and torch.equal(ck["model"]["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_failed_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "last.pt", model={"w": torch.ones(2)}, epoch=1)

    class Boom:
        def __reduce__(self):  # noqa: ANN204 - pickling this object fails mid-write, like a kill during save
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "last.pt", model={"w": torch.zeros(2)}, epoch=2, boom=Boom())
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(WsiTrainError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(WsiTrainError, match="junk.pt"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"a": 1}, tmp_path / "other.pt")
    with pytest.raises(WsiTrainError, match="not written by"):
        load_checkpoint(tmp_path / "other.pt")


def test_rng_states_restore_all_streams() -> None:
    saved = rng_states()
    a = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_states(saved)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def test_run_dir_never_overwritten(tmp_path: Path) -> None:
    first, note = create_run_dir(tmp_path, "exp")
    assert first == tmp_path / "exp" and note is None
    (first / "keep.txt").write_text("old")
    second, note = create_run_dir(tmp_path, "exp")
    third, _ = create_run_dir(tmp_path, "exp")
    assert second == tmp_path / "exp-2" and third == tmp_path / "exp-3"
    assert "exp-2" in note and "--resume" in note
    assert (first / "keep.txt").read_text() == "old"


def test_versions_and_jsonl(tmp_path: Path) -> None:
    v = library_versions()
    assert v["torch"] == torch.__version__ and v["python"] and "device" in v
    w = JsonlWriter(tmp_path / "m.jsonl")
    w.write({"loss": float("nan"), "p": tmp_path})
    w.close()
    assert (tmp_path / "m.jsonl").read_text() == f'{{"loss": null, "p": "{tmp_path}"}}\n'
