"""Byte sizes for people and configs: parse "11GiB", format "1.50 GiB". Torch-free, so config checks stay light."""

from __future__ import annotations

import re

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


def round_up_printed(n: int) -> int:
    """The least byte count of at least ``n`` that ``format_bytes`` prints exactly, in whole hundredths of its unit.

    A minimum shown to people must still hold when they copy it: "needs at least 14.51 MiB" for 14.506 MiB would
    read back (``parse_bytes``) as less than the minimum. The result prints as the figure it is.
    """
    if n < 1024 or n >= 1024**5:  # whole bytes print exactly; PiB are printed but not read (no such budget)
        return max(0, int(n))
    # the unit format_bytes chooses: the largest whose count is below 1024
    k, unit = next((k, u) for k, u in enumerate(("KiB", "MiB", "GiB", "TiB"), 1) if n < 1024 ** (k + 1))
    scale = 1024**k
    hundredths = -(-int(n) * 100 // scale)  # ceiling division in integers: no float error in the rounding up
    while True:
        r = parse_bytes(f"{hundredths / 100:.2f}{unit}")  # what a user typing the printed figure gets
        if r >= n:
            return r
        hundredths += 1  # parse_bytes truncates the float product: the next hundredth is above n
