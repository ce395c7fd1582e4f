"""Which configurations a benchmark runs: strategies x sizes x their variants, and the defaults.

Defaults: on a CPU, VGG-16 at 128, 256 and 512 px with 2 timed runs each, checkpoint_sequential with
2, sqrt(L) and L segments, SFT tiles of size/2 and size/4 (18 configurations, about 4 minutes on an idle
2-core machine); on a GPU, VGG-16 at 1024 to 16384 px with 5 runs, 8 segment counts and SFT tiles
size/2 .. size/32 (the paper's protocol).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from wsitrain.errors import WsiTrainError

STRATEGIES = ("base", "checkpoint", "sft")
DEFAULT_MODEL = "vgg16"
DEFAULT_SIZES = {"cpu": (128, 256, 512), "cuda": (1024, 2048, 4096, 8192, 16384)}
DEFAULT_RUNS = {"cpu": 2, "cuda": 5}
# SFT tile edges tried: size // 2**n for n = 1..5 (the paper); on CPU 1..2, as small tiles there take minutes.
MAX_TILE_LEVEL = {"cpu": 2, "cuda": 5}


@dataclass(frozen=True)
class BenchConfig:
    """One measured configuration: a strategy at a size, with its variant (segments or tile edge)."""

    model: str
    size: int
    strategy: str
    segments: int | None = None  # checkpoint_sequential segments
    tile: int | None = None  # SFT tile edge; None with strategy "sft" = the planner's choice
    budget_bytes: int | None = None
    device: str = "cpu"
    precision: str = "fp32"
    runs: int = 1
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def variant(self) -> str:
        if self.strategy == "checkpoint":
            return f"s={self.segments}"
        if self.strategy == "sft":
            return f"tile={self.tile}" if self.tile else "planner"
        return "-"

    def to_worker(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def parse_sizes(text: str, stride: int) -> list[int]:
    """``"512,1024"`` into sorted unique edges; each a positive integer of at least the model's stride."""
    sizes = []
    for part in str(text).replace(" ", "").split(","):
        if not part:
            continue
        if not part.isdigit() or int(part) <= 0:
            raise WsiTrainError(f"--sizes: cannot read {part!r} as an image edge", hint="e.g. --sizes 256,512,1024")
        if int(part) < stride:
            raise WsiTrainError(
                f"--sizes: {part} is smaller than the model's stride of {stride} px",
                hint=f"give edges of at least {stride} px",
            )
        sizes.append(int(part))
    if not sizes:
        raise WsiTrainError("--sizes: no size given", hint="e.g. --sizes 256,512,1024")
    return sorted(set(sizes))


def parse_strategies(text: str) -> list[str]:
    names = [s for s in str(text).replace(" ", "").split(",") if s]
    bad = [s for s in names if s not in STRATEGIES]
    if bad or not names:
        raise WsiTrainError(
            f"--strategies: unknown {', '.join(map(repr, bad)) or 'empty list'}",
            hint=f"choose from: {', '.join(STRATEGIES)}",
        )
    return [s for s in STRATEGIES if s in names]  # fixed order: base first, it is the reference


def checkpoint_segment_counts(n_layers: int, device: str) -> list[int]:
    """Segment counts for checkpoint_sequential. The paper tries 2..2L; a few on CPU keep it fast.

    More segments than layers is not possible with checkpoint_sequential, so counts stop at L.
    """
    if device == "cpu":
        counts = {2, round(math.sqrt(n_layers)), n_layers}
    else:
        counts = {2, 3, 4, 6, 8, round(math.sqrt(n_layers)), n_layers // 2, n_layers}
    return sorted(c for c in counts if 2 <= c <= n_layers)


def sft_tiles(size: int, stride: int, device: str = "cuda") -> list[int]:
    """Tile edges size // 2**n (n = 1..5; 1..2 on CPU) that keep at least two trunk output pixels per tile."""
    return [size >> n for n in range(1, MAX_TILE_LEVEL[device] + 1) if (size >> n) >= 2 * stride]


def make_configs(
    *,
    model: str,
    sizes: list[int],
    strategies: list[str],
    n_layers: int,
    stride: int,
    budget_bytes: int,
    device: str,
    precision: str,
    runs: int,
) -> list[BenchConfig]:
    """All configurations, ordered by size, then strategy."""
    common = dict(model=model, budget_bytes=budget_bytes, device=device, precision=precision, runs=runs)
    out: list[BenchConfig] = []
    for size in sizes:
        for strategy in strategies:
            if strategy == "base":
                out.append(BenchConfig(size=size, strategy="base", **common))
            elif strategy == "checkpoint":
                for s in checkpoint_segment_counts(n_layers, device):
                    out.append(BenchConfig(size=size, strategy="checkpoint", segments=s, **common))
            else:
                out.append(BenchConfig(size=size, strategy="sft", **common))
                for t in sft_tiles(size, stride, device):
                    out.append(BenchConfig(size=size, strategy="sft", tile=t, **common))
    return out
