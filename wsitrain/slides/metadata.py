"""What a slide is: dimensions, pyramid levels, mpp and objective power, as one frozen record (no I/O here)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SlideInfo:
    """Facts about one slide file, read from its metadata (no pixels)."""

    path: str
    reader: str  # "openslide" or "tifffile"
    vendor: str | None
    dimensions: tuple[int, int]  # (width, height) of level 0
    level_count: int
    level_dimensions: tuple[tuple[int, int], ...]
    level_downsamples: tuple[float, ...]
    mpp: tuple[float, float] | None  # microns per pixel (x, y) at level 0
    objective_power: float | None
    associated_images: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return Path(self.path).name

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (tuples become lists)."""
        d = asdict(self)
        d["dimensions"] = list(self.dimensions)
        d["level_dimensions"] = [list(x) for x in self.level_dimensions]
        d["level_downsamples"] = list(self.level_downsamples)
        d["mpp"] = list(self.mpp) if self.mpp is not None else None
        return d
