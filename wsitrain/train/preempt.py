"""Preemption-safe training: stop signals, the stop every rank agrees on, time-based checkpoints, ``--resume auto``.

A cluster stops a job with SIGTERM (Slurm: at the time limit, on preemption, on scancel), or with a signal asked for
in advance (``sbatch --signal=B:USR1@120``). The handler only sets a flag: the training loop looks at it at its next
safe point (after an optimizer step), where every rank agrees on it with one all_reduce, writes ``last.pt`` at that
step and exits with ``PREEMPTED_EXIT_CODE``. A second SIGINT (Ctrl-C twice) interrupts at once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from wsitrain.errors import WsiTrainError
from wsitrain.train import distributed as D
from wsitrain.write_errors import named_write_errors

# EX_TEMPFAIL (sysexits.h): "try again later"; distinct from 0 (done), 1 (bug), 2 (bad input), 3 (not available).
PREEMPTED_EXIT_CODE = 75
JOB_FILE = "job.json"  # in the run folder: the Slurm job that started it, for `--resume auto`


class Preempted(WsiTrainError):
    """The run stopped on a signal after writing last.pt; the message says how to continue."""

    exit_code = PREEMPTED_EXIT_CODE
    notice = True


def parse_signal(name: str | None) -> signal.Signals | None:
    """``USR1``, ``SIGUSR1`` or a number to a signal; None for None. Bad names are rejected by the config."""
    if name is None:
        return None
    text = str(name).strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]


class StopSignals:
    """Installed for the duration of ``train()`` (a context manager); the previous handlers are restored on exit.

    ``requested`` holds the name of the first signal received. Handlers can only be installed from the main thread;
    elsewhere (a fit run from a worker thread) nothing is installed and only ``request()`` stops the run.
    """

    def __init__(self, extra: signal.Signals | None = None) -> None:
        sigs = [signal.SIGTERM, signal.SIGINT]
        if extra is not None and extra not in sigs:
            sigs.append(extra)
        self.signals = sigs
        self.requested: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, old in self._previous.items():
            signal.signal(s, old)
        self._previous.clear()

    def request(self, why: str) -> None:
        """Ask for a stop at the next safe point (what the handler does; tests call it directly too)."""
        if self.requested is None:
            self.requested = why

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.requested is not None:
            raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step to finish
        self.request(signal.Signals(signum).name)


class SafePoint:
    """What the loop asks after each optimizer step: stop now? write a time-based checkpoint now?

    Both answers are agreed by all ranks (one all_reduce of two flags, MAX), so every rank takes the same branch
    and the collectives that follow (a gather of the epoch's losses) line up. One process: no collective.
    """

    def __init__(self, signals: StopSignals, dist: D.DistInfo, checkpoint_minutes: float | None) -> None:
        self.signals = signals
        self.dist = dist
        self.every_s = None if checkpoint_minutes is None else checkpoint_minutes * 60.0
        self._last_save = time.monotonic()

    def saved(self) -> None:
        """A checkpoint was written: the time-based clock starts again."""
        self._last_save = time.monotonic()

    def poll(self) -> tuple[bool, bool]:
        """(stop, checkpoint due)."""
        stop = self.signals.requested is not None
        due = self.every_s is not None and time.monotonic() - self._last_save >= self.every_s
        if not self.dist.enabled:
            return stop, due
        import torch.distributed as dist

        flags = torch.tensor([float(stop), float(due)])
        if dist.get_backend() == "nccl":
            flags = flags.cuda()
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()), bool(flags[1].item())


# ---- --resume auto: the run this Slurm job started


def job_key(env: dict[str, str] | None = None) -> str | None:
    """The Slurm job this process belongs to (array jobs: one key per task); None outside Slurm.

    A requeued job keeps its SLURM_JOB_ID, so the key finds the run it started before the requeue.
    """
    env = dict(os.environ) if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def write_job_file(run_dir: Path, env: dict[str, str] | None = None) -> None:
    """Record the Slurm job (id and name) that started this run folder; nothing outside Slurm."""
    env = dict(os.environ) if env is None else env
    key = job_key(env)
    if key is None:
        return
    data = {"job": key, "slurm_job_id": env.get("SLURM_JOB_ID"), "slurm_job_name": env.get("SLURM_JOB_NAME")}
    with named_write_errors(Path(run_dir) / JOB_FILE, "the job file"):
        (Path(run_dir) / JOB_FILE).write_text(json.dumps(data, indent=2) + "\n")


def find_job_run(log_dir: Path, env: dict[str, str] | None = None) -> Path | None:
    """The run folder under ``log_dir`` this job started and checkpointed (the newest if several), else None.

    ``--resume auto`` outside Slurm is bad input: there is no job to find the run of.
    """
    key = job_key(env)
    if key is None:
        raise WsiTrainError(
            "--resume auto: not inside a Slurm job (SLURM_JOB_ID is not set), so there is no job to find the run of",
            hint="pass the run folder, e.g. --resume runs/NAME, or drop --resume to start a new run",
        )
    found = []
    base = Path(log_dir)
    if not base.is_dir():
        return None
    for job_file in base.glob(f"*/{JOB_FILE}"):
        try:
            data = json.loads(job_file.read_text())
        except (OSError, ValueError):
            continue
        if data.get("job") == key and (job_file.parent / "last.pt").is_file():
            found.append(job_file.parent)
    return max(found, key=lambda p: (p / "last.pt").stat().st_mtime) if found else None
