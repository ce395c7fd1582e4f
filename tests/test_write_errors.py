"""Files written by a failing disk: any write error of a checkpoint, a run log or a report is exit 2 with the file,
the cause in words and, for a checkpoint, the previous one intact (wsitrain.write_errors).

The file-size limit is real (RLIMIT_FSIZE, what `ulimit -f` sets): in a subprocess for a whole fit, in this process
(lowered, then restored) for single writes. Other errors are injected where the bytes are written, below torch.save,
which wraps them in a RuntimeError from inline_container.cc.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_runs import config_file, finished_run, invoke, synthetic_slides

from wsitrain.errors import WsiTrainError
from wsitrain.train.checkpoint import load_checkpoint, save_checkpoint
from wsitrain.train.runfolder import JsonlWriter

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_slides(tmp_path_factory.mktemp("synth"))


@pytest.fixture(scope="module")
def run_dir(synth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return finished_run(config_file(tmp_path_factory.mktemp("run"), synth_dir))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """This process may not grow a file past ``limit`` bytes (the soft limit; restored afterwards)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_python_ignores_sigxfsz() -> None:
    """Why a file-size limit is an error and not a kill: CPython sets SIGXFSZ to SIG_IGN at startup."""
    out = subprocess.run([sys.executable, "-c", "import signal; print(int(signal.getsignal(signal.SIGXFSZ)))"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    assert int(out.stdout) == int(signal.SIG_IGN)


def test_file_size_limit_while_a_fit_writes_last_pt(tmp_path: Path, synth_dir: Path, run_dir: Path) -> None:
    """`ulimit -f` below the checkpoint's size: the resumed fit stops with exit 2 naming last.pt (was: internal
    error, RuntimeError from inline_container.cc, exit 1); the previous last.pt is intact and loads."""
    run = shutil.copytree(run_dir, tmp_path / "run")
    before = digest(run / "last.pt")
    ckpt_size = (run / "last.pt").stat().st_size
    others = max(p.stat().st_size for p in run.iterdir() if p.suffix != ".pt")
    limit = (others + ckpt_size) // 2  # every other file of the run fits; the checkpoint does not
    assert others * 1.2 < limit < ckpt_size
    cmd = [sys.executable, "-m", "wsitrain", "fit", str(config_file(tmp_path, synth_dir, epochs=2)),
           "--resume", str(run), "--force"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "300", "NO_COLOR": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))  # fmt: skip
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, out
    assert f"cannot write the checkpoint {run / 'last.pt'}: file too large (EFBIG)" in out, out
    assert "the previous last.pt is intact" in out and "ulimit -f" in out and "--resume" in out, out
    assert "internal error" not in out and "inline_container" not in out, out
    assert digest(run / "last.pt") == before
    assert load_checkpoint(run / "last.pt")["epoch"] == 1
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("name", ["last.pt", "best.pt"])
def test_file_size_limit_while_a_checkpoint_is_written(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    save_checkpoint(path, model={"w": torch.ones(16)}, epoch=1)
    before = digest(path)
    with file_size_limit(64 * 1024), pytest.raises(WsiTrainError) as err:
        save_checkpoint(path, model={"w": torch.zeros(64 * 1024)}, epoch=2)  # 256 KiB of float32
    assert err.value.exit_code == 2
    assert err.value.message == f"cannot write the checkpoint {path}: file too large (EFBIG); the previous {name} " \
                                "is intact"  # fmt: skip
    assert "64.00 KiB" in err.value.hint and "ulimit -f" in err.value.hint
    assert digest(path) == before and load_checkpoint(path)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


class _FailingFile:
    """A written file whose disk fails after ``ok`` bytes with ``code``."""

    def __init__(self, f: Any, code: int, ok: int) -> None:
        self._f, self.code, self.left = f, code, ok

    def write(self, data: Any) -> int:
        self.left -= len(data)
        if self.left < 0:
            raise OSError(self.code, os.strerror(self.code))
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FailingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


CODES = [errno.EIO, errno.EROFS, errno.EACCES, errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.ENXIO]


@pytest.mark.parametrize("code", CODES, ids=[errno.errorcode[c] for c in CODES])
def test_any_write_error_of_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(path, model={"w": torch.ones(16)}, epoch=1)
    before = digest(path)
    fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: _FailingFile(fdopen(fd, mode), code, ok=1000))
    with pytest.raises(WsiTrainError) as err:
        save_checkpoint(path, model={"w": torch.zeros(4096)}, epoch=2)
    monkeypatch.undo()
    msg = err.value.message
    assert err.value.exit_code == 2 and str(path) in msg and "the previous last.pt is intact" in msg
    words = "no space left on the device" if code in (errno.ENOSPC, errno.EDQUOT) else os.strerror(code).lower()
    assert words in msg.lower(), msg
    assert "--resume" in err.value.hint and isinstance(err.value.__cause__, RuntimeError | OSError)
    assert digest(path) == before and load_checkpoint(path)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_a_bug_while_saving_is_still_an_internal_error(tmp_path: Path) -> None:
    """Only write errors become exit 2: an object torch cannot pickle stays a bug to report."""

    class Unpicklable:
        def __reduce__(self):  # noqa: ANN204
            raise TypeError("no")

    with pytest.raises(TypeError):
        save_checkpoint(tmp_path / "last.pt", model={}, junk=Unpicklable())
    assert list(tmp_path.iterdir()) == []


def test_file_size_limit_while_metrics_jsonl_grows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    w = JsonlWriter(path)
    w.write({"step": 1})
    with file_size_limit(path.stat().st_size + 100), pytest.raises(WsiTrainError) as err:
        w.write({"step": 2, "note": "x" * 1000})
    w.close()
    assert err.value.exit_code == 2 and f"cannot write {path}: file too large (EFBIG)" == err.value.message
    assert "ulimit -f" in err.value.hint


def test_file_size_limit_while_the_report_is_written(tmp_path: Path, run_dir: Path) -> None:
    run = shutil.copytree(run_dir, tmp_path / "run")
    with file_size_limit(16 * 1024):  # report.html embeds the PNGs: well over 16 KiB
        result = invoke("report", str(run), "--no-heatmaps")
    out = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"cannot write the report {run / 'report.html'}: file too large (EFBIG)" in out, out
    assert f"wsitrain report {run}" in out and "internal error" not in out, out


def test_write_error_of_a_figure(tmp_path: Path, run_dir: Path) -> None:
    """curves.png (redrawn every epoch by fit): a failed write names it."""
    from wsitrain.report.curves import write_curves

    run = shutil.copytree(run_dir, tmp_path / "run")
    (run / "curves.png").unlink()
    with file_size_limit(1024), pytest.raises(WsiTrainError) as err:
        write_curves(run)
    assert err.value.message.startswith(f"cannot write the figure {run / 'curves.png'}: file too large (EFBIG)")


def test_file_size_limit_on_the_job_file_and_doctor_json(tmp_path: Path) -> None:
    """The Slurm job file and doctor's JSON: a write error is exit 2 naming the file, as for checkpoints."""
    from wsitrain.doctor.report import write_json
    from wsitrain.train.preempt import JOB_FILE, write_job_file

    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "x" * 4000}  # a record larger than the limit below
    with file_size_limit(64), pytest.raises(WsiTrainError) as err:
        write_job_file(tmp_path, env)
    assert str(tmp_path / JOB_FILE) in str(err.value) and "EFBIG" in str(err.value)
    with file_size_limit(64), pytest.raises(WsiTrainError) as err:
        write_json(tmp_path / "doctor.json", {"x": "y" * 4000})
    assert str(tmp_path / "doctor.json") in str(err.value) and "EFBIG" in str(err.value)
