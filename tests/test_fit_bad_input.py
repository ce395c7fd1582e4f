"""Each class of bad input ends with exit 2, the path or key named, a hint, and nothing written.

CLI cases run the real command (CliRunner) and check the exit code, the message, and that no run folder appeared.
"""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.config import WsiTrainConfig
from wsitrain.errors import PlanError, SlideError, WsiTrainError
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.checkpoint import load_checkpoint, save_checkpoint
from wsitrain.train.data import load_fit_data
from wsitrain.train.fit import run_fit
from wsitrain.train.recipe import annotate_plan_error

SYNTH = {"n": 4, "size": 128, "seed": 0, "positive_fraction": 0.5}
QUIET = Console(file=io.StringIO())
runner = CliRunner()


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), env={"COLUMNS": "300", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    write_synthetic_dataset(out, **SYNTH)
    return out


def make_cfg(synth_dir: Path, log_dir: Path, **sections: Any) -> WsiTrainConfig:
    base: dict[str, Any] = {
        "name": "exp",
        "data": {"synthetic": {**SYNTH, "cache_dir": str(synth_dir)}, "region": "whole", "val_fraction": 0.5},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": "1GiB", "device": "cpu"},
        "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.01},
        "log": {"dir": str(log_dir), "tiles": "off"},
    }
    for key, value in sections.items():
        base[key] = {**base[key], **value} if isinstance(value, dict) else value
    return WsiTrainConfig.model_validate(base)


def config_file(tmp_path: Path, synth_dir: Path, extra: str = "") -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(
        f"name: exp\ndata:\n  synthetic: {{n: 4, size: 128, seed: 0, cache_dir: {synth_dir}}}\n  region: whole\n"
        f"  val_fraction: 0.5\nmodel: {{name: tiny}}\nengine: {{memory_budget: 1GiB, device: cpu}}\n"
        f"train: {{epochs: 1, optimizer: sgd}}\nlog: {{dir: {tmp_path / 'runs'}, tiles: 'off'}}\n{extra}"
    )
    return path


def tree(root: Path) -> dict[str, float]:
    """Every file under root with its modification time: 'nothing written' means this does not change."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


# ---- run names stay inside log.dir


@pytest.mark.parametrize("name", ["../../x", "..", ".", "a/b", ".hidden", ""])
def test_cli_run_name_outside_log_dir_is_refused(synth_dir: Path, tmp_path: Path, name: str) -> None:
    result = invoke("fit", str(config_file(tmp_path, synth_dir)), "--name", name)
    assert result.exit_code == 2, result.output
    assert "--name" in result.output and "hint:" in result.output
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "x").exists()


@pytest.mark.parametrize("name", ["..", "../x", "."])
def test_config_run_name_outside_log_dir_is_refused(tmp_path: Path, name: str) -> None:
    result = invoke("validate", str(config_file(tmp_path, tmp_path)), "--set", f"name={name}")
    assert result.exit_code == 2, result.output
    assert "name: " in result.output and "log.dir" in result.output


# ---- log.dir that cannot hold run folders


def test_log_dir_under_a_file(synth_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = invoke("fit", str(config_file(tmp_path, synth_dir)), "--set", f"log.dir={blocker / 'runs'}")
    assert result.exit_code == 2, result.output
    assert "log.dir" in result.output and str(blocker) in result.output and "hint:" in result.output
    assert blocker.read_text() == "x"


def test_unwritable_log_dir(synth_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tests may run as root, where permissions do not stop a write: refuse at the system call instead.
    real_mkdir = os.mkdir

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).startswith(str(tmp_path / "locked")):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    cfg = make_cfg(synth_dir, tmp_path / "locked" / "runs")
    with pytest.raises(WsiTrainError) as err:
        run_fit(cfg, console=QUIET, quiet=True)
    assert "log.dir" in err.value.message and "Permission denied" in err.value.message and err.value.hint
    assert not (tmp_path / "locked").exists()


def test_log_dir_not_writable_is_refused_before_the_slides_are_checked(
    synth_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A container's /runs volume owned by another uid: os.access says so (as root it never would: patch it).
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real_access(p, mode, **kw))
    result = invoke("fit", str(config_file(tmp_path, synth_dir)), "--set", f"log.dir={locked / 'runs'}")
    assert result.exit_code == 2, result.output
    assert f"log.dir {locked / 'runs'} (its existing parent {locked}): not writable" in result.output
    assert "--user $(id -u):$(id -g)" in result.output
    assert list(locked.iterdir()) == []


@pytest.mark.parametrize("where", ["write_run_files", "write_job_file", "RunRecorder"])
def test_a_start_that_fails_while_filling_the_run_folder_leaves_none(
    synth_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    import wsitrain.train.recipe as recipe

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(recipe, where, fail)
    with pytest.raises(OSError, match="Input/output error"):
        run_fit(make_cfg(synth_dir, tmp_path / "runs"), console=QUIET, quiet=True)
    assert list((tmp_path / "runs").iterdir()) == []


def test_a_failed_resume_keeps_the_resumed_folder(synth_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import wsitrain.train.recipe as recipe

    run = run_fit(make_cfg(synth_dir, tmp_path / "runs"), console=QUIET, quiet=True)
    before = tree(run)
    monkeypatch.setattr(recipe, "RunRecorder", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O")))
    cfg = make_cfg(synth_dir, tmp_path / "runs", train={"epochs": 2})
    with pytest.raises(OSError):
        run_fit(cfg, console=QUIET, quiet=True, resume=run, force=True)
    assert run.is_dir() and set(before) <= set(tree(run))


# ---- predict: --out a folder, a checkpoint of another model


@pytest.fixture(scope="module")
def trained(synth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = make_cfg(synth_dir, tmp_path_factory.mktemp("runs"))
    return run_fit(cfg, console=QUIET, quiet=True)


def test_predict_out_naming_a_folder(trained: Path, synth_dir: Path, tmp_path: Path) -> None:
    cfg = config_file(tmp_path, synth_dir)
    result = invoke("predict", str(cfg), "--checkpoint", str(trained / "last.pt"), "--slides", str(synth_dir),
                    "--out", str(tmp_path))  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--out" in result.output and "is a folder" in result.output and "hint:" in result.output


def test_predict_refuses_a_checkpoint_of_another_model(trained: Path, synth_dir: Path, tmp_path: Path) -> None:
    cfg = config_file(tmp_path, synth_dir)
    out = tmp_path / "p.csv"
    result = invoke("predict", str(cfg), "--set", "model.name=vgg16", "--checkpoint", str(trained / "last.pt"),
                    "--slides", str(synth_dir), "--out", str(out))  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "tiny" in result.output and "vgg16" in result.output and "model.name" in result.output
    assert not out.exists()


# ---- resume --force with another model


def test_resume_force_with_another_model_is_refused_before_touching_the_folder(
    trained: Path, synth_dir: Path
) -> None:
    before = tree(trained)
    other = make_cfg(synth_dir, trained.parent, model={"name": "vgg16"})
    with pytest.raises(WsiTrainError) as err:
        run_fit(other, resume=trained, force=True, console=QUIET, quiet=True)
    assert "model.name" in err.value.message and "'tiny' -> 'vgg16'" in err.value.message and err.value.hint
    assert tree(trained) == before


# ---- synth into a path under a file


def test_synth_under_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = invoke("synth", str(blocker / "slides"), "--n", "2", "--size", "64")
    assert result.exit_code == 2, result.output
    assert str(blocker) in result.output and "hint:" in result.output


# ---- a full disk while a checkpoint is written


def test_disk_full_while_writing_a_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path / "last.pt", model={"w": torch.ones(2)}, epoch=1)

    class DiskFull:
        def __reduce__(self):  # noqa: ANN204 - pickling fails mid-write, as a write to a full disk does
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(WsiTrainError) as err:
        save_checkpoint(tmp_path / "last.pt", model={"w": torch.zeros(2)}, epoch=2, junk=DiskFull())
    assert err.value.exit_code == 2 and "no space left" in err.value.message and "last.pt" in err.value.message
    assert "previous last.pt is intact" in err.value.message and "--resume" in err.value.hint
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


# ---- validate checks that the files it names exist


def test_validate_checks_that_labels_and_weights_exist(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(f"data: {{labels: {tmp_path / 'nope.csv'}}}\nmodel: {{weights: {tmp_path / 'w.pt'}}}\n")
    result = invoke("validate", str(path))
    assert result.exit_code == 2, result.output
    assert "data.labels" in result.output and "nope.csv" in result.output
    assert "model.weights" in result.output and "w.pt" in result.output and "is valid" not in result.output


# ---- labels that differ only in case or spaces; a split column with no training slide


def test_split_column_with_no_training_slide_names_the_split_column(synth_dir: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label,split\n" + "".join(
        f"slide_{i:03d}.svs,{'positive' if i % 2 else 'negative'},val\n" for i in range(4)))  # fmt: skip
    cfg = make_cfg(synth_dir, tmp_path / "runs", data={"synthetic": None, "labels": str(labels),
                                                      "slides_dir": str(synth_dir)})  # fmt: skip
    with pytest.raises(SlideError) as err:
        load_fit_data(cfg)
    assert "split column" in err.value.message and "4 val" in err.value.message and str(labels) in err.value.message
    assert "data.val_fraction is not used" in err.value.message and "train" in err.value.hint


# ---- the engine's plan errors name the slide and the config keys behind them


def test_plan_errors_name_freeze_bn_and_tile_size(synth_dir: Path, tmp_path: Path) -> None:
    bn = PlanError("layer 'features.bn1' (BatchNorm2d) sits where activations must be tiled to fit 2.00 GiB, but it "
                   "cannot be tiled: BatchNorm2d in training mode ...", hint="give the engine more memory")  # fmt: skip
    cfg = make_cfg(synth_dir, tmp_path, model={"freeze_bn": False}, engine={"tile_size": 64})
    err = annotate_plan_error(bn, cfg, "slide_007", batchnorm=True)
    assert err.exit_code == 2 and err.message.startswith("slide slide_007: layer 'features.bn1'")
    assert "model.freeze_bn: true" in err.hint and "engine.tile_size is forced to 64" in err.hint
    assert "more memory" not in err.hint  # no memory would make training-mode BatchNorm tileable

    too_big = PlanError("tiny on input (1, 3, 2048, 2048) does not fit 20.00 MiB", hint="raise the memory budget")
    err = annotate_plan_error(too_big, make_cfg(synth_dir, tmp_path), "slide_001", batchnorm=False)
    assert "slide_001" in err.message and err.hint == "raise the memory budget"


def test_resume_force_with_other_classes_is_refused_before_touching_the_folder(
    trained: Path, synth_dir: Path, tmp_path: Path
) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\n" + "".join(f"slide_{i:03d}.svs,{'b' if i % 2 else 'a'}\n" for i in range(4)))
    before = tree(trained)
    other = make_cfg(synth_dir, trained.parent, data={"synthetic": None, "labels": str(labels),
                                                      "slides_dir": str(synth_dir)})  # fmt: skip
    with pytest.raises(WsiTrainError) as err:
        run_fit(other, resume=trained, force=True, console=QUIET, quiet=True)
    assert "classes ['negative', 'positive']" in err.value.message and "['a', 'b']" in err.value.message
    assert tree(trained) == before


def test_disk_full_while_writing_a_run_log(tmp_path: Path) -> None:
    from wsitrain.train.runfolder import JsonlWriter

    w = JsonlWriter(tmp_path / "metrics.jsonl")
    w.close()
    w._f = open("/dev/full", "w")  # noqa: SIM115 - every write to /dev/full fails with ENOSPC
    with pytest.raises(WsiTrainError) as err:
        w.write({"step": 1})
    assert "no space left" in err.value.message and "metrics.jsonl" in err.value.message and err.value.hint
