"""Checkpoints written atomically (temp file + fsync + rename): a kill at any moment leaves the previous
complete file or the new complete file, never a torn one."""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsitrain.errors import WsiTrainError
from wsitrain.safe_load import safe_torch_load
from wsitrain.write_errors import RecordingFile, os_error, write_error

CHECKPOINT_FORMAT = 1


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save into a temp file in the same folder, fsync, then os.replace (atomic on POSIX).

    A failed write (full disk, file-size limit, read-only or failing disk, permissions) raises WsiTrainError naming
    the file and the cause; the previous file at ``path`` is left intact and no temp file remains.
    """
    path = Path(path)
    tmp, out = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            out = RecordingFile(f)
            torch.save(obj, out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        # Also on KeyboardInterrupt: never leave temp files behind; the old checkpoint stays intact.
        if tmp is not None and os.path.exists(tmp):
            with contextlib.suppress(OSError):  # a disk that fails the write may fail this too: the first error counts
                os.unlink(tmp)
        cause = os_error(e, out.error if out is not None else None)
        if cause is None:
            raise
        kept = f"; the previous {path.name} is intact" if path.exists() else ""
        raise write_error(path, cause, "the checkpoint", then=f"continue with `wsitrain fit CONFIG --resume "
                          f"{path.parent}`", kept=kept) from e  # fmt: skip
    # fsync the folder so the rename itself survives a power cut.
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def rng_states() -> dict[str, Any]:
    """Every RNG the training loop draws from, so a resume continues the same random streams.

    Plain data only (tensors, lists, numbers, strings), so the checkpoint loads with a bare
    ``torch.load(weights_only=True)``: numpy's state tuple holds an ndarray, stored here as a list of ints.
    """
    name, key, pos, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"bit_generator": str(name), "key": [int(k) for k in key], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},  # fmt: skip
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``rng_states`` captured."""
    torch.set_rng_state(states["torch"])
    np.random.set_state(_numpy_state(states["numpy"]))
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _numpy_state(saved: Any) -> tuple[Any, ...]:
    """np.random.set_state's tuple from what ``rng_states`` saved (a dict), or as written before (the tuple itself)."""
    if not isinstance(saved, dict):
        return tuple(saved)
    key = np.array(saved["key"], dtype=np.uint32)
    return saved["bit_generator"], key, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]


def save_checkpoint(path: Path, **state: Any) -> None:
    """Save a training checkpoint: model, optimizer, scheduler, scaler, counters, RNG states, config."""
    atomic_torch_save({"format": CHECKPOINT_FORMAT, **state}, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` onto the CPU; clear errors for missing or foreign files."""
    path = Path(path)
    if not path.is_file():
        raise WsiTrainError(
            f"checkpoint {path} does not exist",
            hint="pass a file written by `wsitrain fit`, e.g. runs/NAME/best.pt or runs/NAME/last.pt",
        )
    # Read as data only: a crafted file (an object that runs code when unpickled) is refused here, exit 2.
    ckpt = safe_torch_load(path, "checkpoint")
    if not isinstance(ckpt, dict) or "model" not in ckpt or "format" not in ckpt:
        raise WsiTrainError(
            f"checkpoint {path} was not written by `wsitrain fit` (no model/format entries)",
            hint="use last.pt or best.pt from a wsitrain run folder",
        )
    return ckpt
