"""Reading .pt files as data: checkpoints and weights never run code.

Every ``torch.load`` in wsitrain goes through ``safe_torch_load``: ``weights_only=True`` (tensors, plain containers,
numbers and strings), plus the one allowlist below, scoped to the call with ``torch.serialization.safe_globals``.
A file that needs anything else (a class, a function such as ``os.system``) is refused before any of it runs.

The allowlist exists only for checkpoints written before wsitrain saved numpy's RNG state as plain data
(``wsitrain.train.checkpoint.rng_states``): there ``np.random.get_state()`` was pickled as a tuple holding an
ndarray of uint32.
Such an array pickles as ``_reconstruct(ndarray, (0,), b"b")`` + ``ndarray.__setstate__`` with a ``dtype("u4")``
whose state is set by BUILD, so it needs exactly: ``numpy.ndarray``, ``numpy.dtype``, the uint32 dtype's class
(BUILD is only allowed on allowlisted types) and ``_reconstruct``. numpy 1.x pickles ``_reconstruct`` as
``numpy.core.multiarray._reconstruct``, numpy 2 as ``numpy._core.multiarray._reconstruct``; both names are
registered, so a checkpoint written under either numpy loads under the other (checked with numpy 1.26.4 and 2.4).
Nothing on the list executes user-chosen code: ``_reconstruct`` makes an empty array of an allowlisted type, and any
objects inside an array would still go through the restricted unpickler.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsitrain.errors import WsiTrainError

_GLOBAL = re.compile(r"GLOBAL (\S+)")
_FUNCTION = re.compile(r"unrecognized function (\S+(?: of \S+)?)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def allowed_globals() -> list[Any]:
    """The only non-torch globals a wsitrain file may name (see the module docstring for why each is there)."""
    reconstruct = np.zeros(0).__reduce__()[0]  # numpy's own pickling function, without naming numpy.core/_core
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        (reconstruct, "numpy.core.multiarray._reconstruct"),  # written under numpy 1.x
        (reconstruct, "numpy._core.multiarray._reconstruct"),  # written under numpy 2
    ]


def safe_torch_load(path: Path, what: str) -> Any:
    """``torch.load(path, weights_only=True)`` with wsitrain's allowlist, on the CPU.

    ``what`` names the file in errors ("checkpoint", "weights file"). A file that asks for anything outside the
    allowlist raises WsiTrainError (exit 2) naming the file; so does a file that is no torch file at all.
    """
    path = Path(path)
    foreign = not_a_torch_file(path)
    if foreign:  # text, an image, an empty file: torch's own error would be an opcode or a KeyError of a byte
        raise WsiTrainError(
            f"{what} {path} is not a wsitrain {what} (a torch save file, which is a zip archive or a pickle): "
            f"{foreign}",
            hint="use best.pt or last.pt of a wsitrain run, or a state dict saved with "
            "torch.save(model.state_dict(), path)",
        )
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # weights_only refused something, or the bytes are no pickle
        raise WsiTrainError(
            f"{what} {path} {refusal(exc)}",
            hint="use best.pt or last.pt of a wsitrain run, or a state dict saved with "
            "torch.save(model.state_dict(), path); checkpoints are read as data (tensors and plain values) only",
        ) from exc
    except Exception as exc:  # torch raises many types for a torn or foreign file (zip, EOF, storage errors)
        raise WsiTrainError(
            f"{what} {path} cannot be read: {first_line(exc)}",
            hint="use best.pt or last.pt of a wsitrain run (a torn file from a killed copy: copy it again)",
        ) from exc


# What torch.save writes starts with one of these: a zip archive (torch >= 1.6), or a pickle of protocol 2 or more
# (the legacy format, whose first record is a pickled magic number).
TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")
# Bytes of a foreign file shown in the message.
SHOWN_BYTES = 24


def not_a_torch_file(path: Path) -> str:
    """What ``path`` is instead of a torch save file, for a message ("it is empty", "it starts with the text
    'hello'"); an empty string when it starts as one does, or cannot be opened (torch.load's own error says why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(SHOWN_BYTES)
    except OSError:
        return ""
    if not head:
        return "it is empty"
    if head.startswith(TORCH_FILE_STARTS):
        return ""
    for cut in range(4):  # the read may end inside a multi-byte character
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if all(c.isprintable() or c.isspace() for c in text):
            return f"it starts with the text {' '.join(text.split())!r}"
        break
    return f"it starts with the bytes {head[:8].hex(' ')}"


# torch.load reads weights_only whatever its caller passed while this is set (torch >= 2.4).
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"


@contextlib.contextmanager
def library_loads_weights_only() -> Iterator[None]:
    """Within: every torch.load reads weights_only, also in libraries that pass ``weights_only=False``.

    torchvision's pretrained builders read ``$TORCH_HOME/hub/checkpoints`` through
    ``torch.hub.load_state_dict_from_url``, whose default is ``weights_only=False`` (torchvision 0.29.1): a file
    planted in that cache would run code. torch honours TORCH_FORCE_WEIGHTS_ONLY_LOAD at each call, so it is set
    for the call and restored after (a process-wide variable, held only while the library loads).
    """
    old = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = old


def refusal(exc: pickle.UnpicklingError) -> str:
    """The end of a sentence that starts with the file: why a weights_only load refused it."""
    asked = _asked_for(exc)
    return f"is not a wsitrain checkpoint or asks to run code{asked}; nothing in it was run and it was not loaded"


def _asked_for(exc: BaseException) -> str:
    """What the file asked for, from torch's weights_only message (its advice to allowlist it is left out)."""
    text = _ANSI.sub("", str(exc))
    found = _GLOBAL.search(text) or _FUNCTION.search(text)
    return f" (it needs {found.group(1)})" if found else ""


def first_line(exc: BaseException) -> str:
    """An exception as one plain line: its type and the first line of its message, without terminal escapes
    (torch's weights-only error carries ANSI bold codes)."""
    text = _ANSI.sub("", str(exc)).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0]}" if text else exc.__class__.__name__
