"""Which files are slides: the one list of slide file endings used by fit, predict and validate."""

from __future__ import annotations

from pathlib import Path

# What OpenSlide and tifffile open. Multi-part endings (".ome.tif") are listed for people; matching is by the end
# of the lower-cased file name, so "x.OME.TIFF" is a slide through ".tiff" as well.
SLIDE_SUFFIXES: tuple[str, ...] = (
    ".svs",
    ".tif",
    ".tiff",
    ".ome.tif",
    ".ome.tiff",
    ".ndpi",
    ".vms",
    ".vmu",
    ".scn",
    ".mrxs",
    ".svslide",
    ".bif",
    ".dcm",
    ".qptiff",
)


def is_slide_name(path: str | Path) -> bool:
    """True when the file name ends with a slide suffix (case-insensitive); the file itself is not opened."""
    return Path(path).name.lower().endswith(SLIDE_SUFFIXES)
