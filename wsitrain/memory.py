"""Byte sizes: parse "11GiB", format for people, detect a device's memory, read peak memory."""

from __future__ import annotations

import contextlib
import ctypes
import re
import resource
import sys

import torch

from wsitrain.errors import WsiTrainError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

# Fraction of detected free memory the engine plans for: allocator fragmentation, CUDA context,
# and the transient workspace of cuDNN are not in the model.
SAFETY_MARGIN = 0.85


def parse_bytes(value: int | float | str, what: str = "memory") -> int:
    """Parse ``11GiB``, ``24 GB``, ``512MiB`` or a plain number of bytes into an int."""
    if isinstance(value, bool):
        raise WsiTrainError(f"{what}: {value!r} is not a size", hint="write a size such as 11GiB, 24GB or 512MiB")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise WsiTrainError(f"{what}: {value!r} must be positive", hint="write a size such as 11GiB")
        return int(value)
    m = _PATTERN.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise WsiTrainError(
            f"{what}: cannot read {value!r} as a size",
            hint="write a number with an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 11GiB)",
        )
    n = float(m.group(1)) * _UNITS[unit]
    if n <= 0:
        raise WsiTrainError(f"{what}: {value!r} must be positive", hint="write a size such as 11GiB")
    return int(n)


def format_bytes(n: float | int | None) -> str:
    """``1.5 GiB`` style, for people."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"


def available_host_bytes() -> int:
    """Memory a new allocation can take on the host (psutil's ``available``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing: fall back to /proc/meminfo
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise


def detect_budget(device: torch.device | str | None = None) -> int:
    """Default memory budget: free memory of the device (CPU: available RAM) times a safety margin."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free * SAFETY_MARGIN)
    return int(available_host_bytes() * SAFETY_MARGIN)


def peak_rss_bytes() -> int:
    """Process peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


class CpuPeak:
    """Peak resident memory of one step on Linux: reset the high-water mark, run, read VmHWM.

    ``ru_maxrss`` cannot be reset, so after the warm-up it would only ever show the largest step so far;
    writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS. Falls back to ru_maxrss elsewhere.
    """

    def __init__(self) -> None:
        self.resettable = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return peak_rss_bytes()

    def start(self) -> None:
        if self.resettable:
            self._reset()

    def peak(self) -> int:
        return self._hwm() if self.resettable else peak_rss_bytes()


def return_freed_memory_to_os() -> None:
    """Serve large blocks by mmap so frees go back to the OS and resident memory follows live tensors.

    Otherwise glibc keeps freed heap memory, and one step's peak would include what an earlier one left.
    """
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 64 * 1024)
