"""Choose the pyramid level and the remaining resize for a target mpp, magnification or level index."""

from __future__ import annotations

from dataclasses import dataclass

from wsitrain.errors import SlideError
from wsitrain.slides.metadata import SlideInfo

# A level whose downsample is within this factor of the wanted one is used as is (no 0.3% resizes).
_TOLERANCE = 1.01
# Conventional scanner relation: 40x is about 0.25 um/px, so mpp ~= 10 / objective power.
_MICRONS_AT_1X = 10.0


@dataclass(frozen=True)
class Resolution:
    """Read level ``level`` and resize it by ``scale`` (output px per level px, <= 1); ``mpp`` of the output."""

    level: int
    scale: float
    downsample: float  # output px -> level-0 px
    mpp: float | None


def choose_resolution(
    info: SlideInfo,
    *,
    level: int | None = None,
    mpp: float | None = None,
    magnification: float | None = None,
    fallback_mpp: float | None = None,
) -> Resolution:
    """Pick the best level for one of ``level``, ``mpp`` or ``magnification`` (at most one); level 0 if none."""
    name = info.name
    given = [k for k, v in (("level", level), ("mpp", mpp), ("magnification", magnification)) if v is not None]
    if len(given) > 1:
        raise SlideError(
            f"{name}: choose the resolution by one of level, mpp or magnification, not {' and '.join(given)}",
            hint="keep one of data.level, data.mpp, data.magnification",
        )
    base_mpp = _base_mpp(info, fallback_mpp)
    if level is not None:
        if not 0 <= level < info.level_count:
            raise SlideError(
                f"{name}: level {level} does not exist (the slide has {info.level_count} level"
                f"{'s' if info.level_count != 1 else ''})",
                hint=f"set data.level between 0 and {info.level_count - 1}, or choose by data.mpp",
            )
        ds = info.level_downsamples[level]
        return Resolution(level, 1.0, ds, base_mpp * ds if base_mpp else None)
    if mpp is not None:
        if mpp <= 0:
            raise SlideError(f"{name}: mpp {mpp} must be positive", hint="set data.mpp to e.g. 0.5 (20x) or 1.0 (10x)")
        if base_mpp is None:
            raise SlideError(
                f"{name}: the slide has no mpp (openslide.mpp-x) metadata, and the config asks for mpp {mpp}",
                hint="set data.fallback_mpp (e.g. 0.25 for 40x scans) or choose by data.level",
            )
        return _for_downsample(info, mpp / base_mpp, base_mpp, f"mpp {mpp}")
    if magnification is not None:
        if magnification <= 0:
            raise SlideError(f"{name}: magnification {magnification} must be positive", hint="e.g. 20 or 10")
        power = info.objective_power
        if power is None and base_mpp is not None:
            power = _MICRONS_AT_1X / base_mpp
        if power is None:
            raise SlideError(
                f"{name}: the slide has neither objective power (openslide.objective-power) nor mpp metadata, "
                f"and the config asks for magnification {magnification}",
                hint="set data.fallback_mpp (e.g. 0.25 for 40x scans) or choose by data.level",
            )
        return _for_downsample(info, power / magnification, base_mpp, f"magnification {magnification}")
    return Resolution(0, 1.0, 1.0, base_mpp)


def _base_mpp(info: SlideInfo, fallback_mpp: float | None) -> float | None:
    if info.mpp is not None:
        return (info.mpp[0] + info.mpp[1]) / 2
    if fallback_mpp is not None:
        if fallback_mpp <= 0:
            raise SlideError(f"{info.name}: fallback_mpp {fallback_mpp} must be positive", hint="e.g. 0.25 for 40x")
        return float(fallback_mpp)
    return None


def _for_downsample(info: SlideInfo, want: float, base_mpp: float | None, asked: str) -> Resolution:
    if want < 1 / _TOLERANCE:
        have = f"{base_mpp:.3g} um/px" if base_mpp else f"{info.objective_power}x"
        raise SlideError(
            f"{info.name}: {asked} is finer than the slide's full resolution ({have}); wsitrain does not upsample",
            hint="ask for a coarser data.mpp (larger) or lower data.magnification",
        )
    want = max(want, 1.0)
    # Coarsest level that is still at least as fine as wanted: read fewest pixels, never upsample.
    best = 0
    for i, ds in enumerate(info.level_downsamples):
        if ds <= want * _TOLERANCE:
            best = i if ds >= info.level_downsamples[best] else best
    ds = info.level_downsamples[best]
    scale = ds / want
    if scale > 1 / _TOLERANCE:
        scale, want = 1.0, ds
    return Resolution(best, scale, want, base_mpp * want if base_mpp else None)
