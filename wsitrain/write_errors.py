"""A file that cannot be written is the user's to fix, not a bug: exit 2, the file, the cause in words.

Any ``OSError`` while a checkpoint, a run log, a figure or a report is written is reported the same way: a full
disk or quota (ENOSPC, EDQUOT), a file-size limit (EFBIG: ``ulimit -f``; CPython ignores SIGXFSZ from startup, so
the write returns the error instead of killing the process), a read-only file system (EROFS), missing permission
(EACCES, EPERM), a failing disk (EIO), or anything else the system says. ``torch.save`` reports a failed write as a
RuntimeError whose text lacks the cause (measured, torch 2.14.1, EFBIG: ``[enforce fail at inline_container.cc:672]
. unexpected pos 704 vs 598``), so checkpoints are written through ``RecordingFile``, which keeps the OSError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from wsitrain.errors import WsiTrainError
from wsitrain.units import format_bytes

# A full disk or quota: free space, then continue.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class RecordingFile:
    """A binary file for ``torch.save`` that keeps the first OSError its writes raised (torch drops it)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = self.error or e
            raise


def os_error(exc: BaseException, recorded: OSError | None = None) -> OSError | None:
    """The OSError behind a failed write: ``exc`` itself, or the one a RecordingFile kept while torch raised."""
    if isinstance(exc, OSError):
        return exc
    return recorded if isinstance(exc, RuntimeError) else None


def write_error(path: Path, err: OSError, what: str = "", then: str | None = None, kept: str = "") -> WsiTrainError:
    """WsiTrainError (exit 2) for ``err`` while writing ``path``: the file, the cause in words, how to fix it.

    ``what``: the kind of file ("the checkpoint"); ``then``: what to run once fixed; ``kept``: what is left intact.
    """
    path = Path(path)
    name = errno.errorcode.get(err.errno or 0, "")
    if err.errno == errno.ENOSPC:
        cause = "no space left on the device"
    elif err.errno == errno.EDQUOT:
        cause = "no space left on the device (disk quota exceeded)"
    else:
        words = (err.strerror or str(err) or type(err).__name__).strip()
        cause = (words[:1].lower() + words[1:]) + (f" ({name})" if name else "")
    fix = _fix(err.errno, path.parent)
    return WsiTrainError(
        f"cannot write {what + ' ' if what else ''}{path}: {cause}{kept}",
        hint=fix + (f", then {then}" if then else ""),
    )


def _fix(code: int | None, folder: Path) -> str:
    if code in NO_SPACE:
        return f"free disk space in {folder} (or set log.dir to a larger disk)"
    if code == errno.EFBIG:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if soft != resource.RLIM_INFINITY:
            return (f"this process may not write files over {format_bytes(soft)} (a file-size limit: `ulimit -f`, "
                    "often set by a job scheduler or a shell profile); raise it with `ulimit -f unlimited` or ask "
                    "for a higher limit")  # fmt: skip
        return f"the file system of {folder} does not take files this large: set log.dir to another disk"
    if code == errno.EROFS:
        return f"{folder} is on a read-only file system: set log.dir to a writable disk"
    if code in (errno.EACCES, errno.EPERM):
        uid = os.getuid() if hasattr(os, "getuid") else "?"
        return f"this process (uid {uid}) may not write in {folder}: fix its permissions or set log.dir elsewhere"
    if code == errno.EIO:
        return f"the disk under {folder} reported an input/output error: check it (dmesg) or set log.dir elsewhere"
    return f"check the disk and the folder {folder} (free space, permissions, limits)"


@contextlib.contextmanager
def named_write_errors(path: Path, what: str = "", then: str | None = None) -> Iterator[None]:
    """Any OSError raised inside becomes ``write_error`` for ``path`` (exit 2 naming the file)."""
    try:
        yield
    except OSError as e:
        raise write_error(path, e, what, then) from e
