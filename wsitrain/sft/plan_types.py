"""The frozen, printable facts a plan records (kept apart from the planner's search and the executor)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from wsitrain.sft.regions import SegmentRegions
from wsitrain.sft.target import CPU_TARGET, TargetDevice
from wsitrain.units import format_bytes


@dataclass(frozen=True)
class SegmentPlan:
    """One segment: consecutive layers between two checkpoints, run tiled or plain."""

    index: int
    layers: tuple[str, ...]
    mode: str  # "tiled" | "plain"
    tile_grid: tuple[int, int]  # (rows, cols)
    tile_edge: int  # tile edge in the segment's output pixels (halo excluded)
    tile_shape: tuple[int, int]  # largest tile's input region incl. halo, in segment-input pixels
    halo: tuple[int, int]  # halo per side (h, w) of an interior tile, in segment-input pixels
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    checkpoint_bytes: int  # the segment input kept for backward (0 when it lives on the host)
    checkpoint_location: str  # "device" | "host"
    tile_activation_bytes: int  # one tile's working set while recomputed and back-propagated
    peak_bytes: int  # estimated peak while this segment runs
    flops: float  # forward + recompute + backward FLOPs of this segment
    fused_pool: str | None = None  # "avg" / "max" / "amax": the global pool folds this segment's tiles
    output_location: str = "device"  # "host" when the next segment's checkpoint lives in host memory
    # the checkpoint (and its gradient buffer) is a host tensor backed by a file in engine.spill_dir, not RAM: the
    # host's RAM budget did not hold it (planning/placement.py); the image when it is segment 0's input
    spilled: bool = False
    output_spilled: bool = False  # the next segment's checkpoint is spilled: this segment writes its output there
    start: int = field(default=0, repr=False)  # node index of the segment input (a cut)
    end: int = field(default=0, repr=False)  # node index of the segment output (a cut)
    # the activations its tiles run in place, overwriting their input (wsitrain/sft/in_place.py): node indices
    in_place: tuple[int, ...] = field(default=(), repr=False)
    # the 1x1 convolutions its tiles run as matrix products where a tile's map is not a multiple of 8 pixels
    # (wsitrain/sft/ops/pointwise_conv.py: CUDA, half precision): node indices
    pointwise_matmul: tuple[int, ...] = field(default=(), repr=False)
    # every tile's intervals (tiled segments): what the executor runs; not part of the printed plan
    regions: SegmentRegions | None = field(default=None, repr=False, compare=False)
    # the forward sweep's own, larger tiles (planning/forward.py), when it runs on other tiles than the recompute;
    # () / None: on the recompute's
    forward_grid: tuple[int, ...] = ()
    forward_tile_shape: tuple[int, ...] = ()  # its largest tile's input region incl. halo, segment-input pixels
    forward_tile_edge: int = 0  # its tile edge in the segment's output pixels; 0: the recompute's
    forward_regions: SegmentRegions | None = field(default=None, repr=False, compare=False)
    # each tile's forward and backward together, in forward (planning/one_pass.py): no forward sweep, no recompute
    one_pass: bool = False
    # a patch trunk's frozen prefix (wsitrain/patch/prefix.py; planning/kept_prefix.py): the first trainable block's
    # input for every patch, ``prefix_bytes`` in all; kept from the forward sweep for the recompute when
    # ``kept_prefix``, else recomputed in each chunk. 0 / False: no frozen prefix to keep
    prefix_bytes: int = 0
    kept_prefix: bool = False
    prefix_blocks: int = 0  # the frozen leading blocks (with the stem) the prefix is
    prefix_why: str = ""  # why it is recomputed, when it is

    @property
    def n_tiles(self) -> int:
        return self.tile_grid[0] * self.tile_grid[1]

    @property
    def n_forward_tiles(self) -> int:
        """Tiles the forward sweep visits: its own grid's, or the recompute's."""
        grid = self.forward_grid or self.tile_grid
        return grid[0] * grid[1]

    @property
    def sweep_tile_shape(self) -> tuple[int, ...]:
        """The forward sweep's largest tile region (halo in, segment-input pixels): its own, or the recompute's."""
        return self.forward_tile_shape or self.tile_shape

    @property
    def staged_tile_shape(self) -> tuple[int, ...]:
        """The larger of the two sweeps' largest tile regions: what a staging buffer of the input must hold."""
        return max(self.tile_shape, self.sweep_tile_shape, key=lambda s: s[0] * s[1])

    @property
    def sweep_regions(self) -> SegmentRegions | None:
        """The regions the forward sweep runs: its own, or the recompute's."""
        return self.forward_regions or self.regions

    @property
    def brief(self) -> str:
        """"plain", "tiled 3x3", "tiled 3x3 (forward 1x1)" (the forward sweep on its own tiles), "tiled 3x3 one pass":
        what a replay of the plan on the simulated clock must reproduce (benchmarks/gpu_session.py, fit_clock.py)."""
        if self.mode != "tiled":
            return self.mode
        own = f" (forward {self.forward_grid[0]}x{self.forward_grid[1]})" if self.forward_grid else ""
        return f"tiled {self.tile_grid[0]}x{self.tile_grid[1]}{own}{' one pass' if self.one_pass else ''}"

    @property
    def checkpoint_home(self) -> str:
        """Where the segment's input lives: "device", "host" (RAM) or "disk" (a mapped file in engine.spill_dir)."""
        if self.checkpoint_location == "host" and self.spilled:
            return "disk"
        return self.checkpoint_location

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("regions", "forward_regions")}
        d["n_tiles"] = self.n_tiles
        d["checkpoint_home"] = self.checkpoint_home
        for k in ("tile_grid", "tile_shape", "halo", "input_shape", "output_shape", "layers", "forward_grid",
                  "forward_tile_shape"):  # fmt: skip
            d[k] = list(d[k])
        return d


@dataclass(frozen=True)
class Plan:
    """How a model runs on one input shape within a memory budget, and what that costs."""

    model_name: str
    input_shape: tuple[int, ...]
    dtype: str
    input_dtype: str
    device: str
    budget_bytes: int
    estimated_peak_bytes: int
    fits: bool
    segments: tuple[SegmentPlan, ...]
    breakdown: dict[str, int]
    baseline_peak_bytes: int
    checkpoint_peak_bytes: int
    checkpoint_segments: int
    flops_plain: float
    flops_sft: float
    recomputed_tiles: int
    input_on_host: bool
    feature_map_bytes: int = 0  # the paper's accounting: every feature map (and the image) once
    notes: tuple[str, ...] = ()
    limiting_part: str | None = None  # when it does not fit: the part of memory no tile size shrinks
    # when it does not fit: the least budget at which this model and shape plan as fitting, rounded up to the figure
    # printed (a budget of exactly that fits); None when it fits, or when no budget tried did
    min_budget_bytes: int | None = None
    host_bytes: int = 0  # host RAM the step needs beside the process: the image (and host checkpoints), not spilled
    spill_bytes: int = 0  # host checkpoints (and the image) placed on local disk, engine.spill_dir (placement.py)
    host_budget_bytes: int | None = None  # the host RAM budget per rank placement decided by; None: not placed
    transfer_bytes: int = 0  # bytes staged host -> device per step (tiles with halo, in forward and recompute)
    staging_bytes: int = 0  # the stager's page-locked host buffers (in host_bytes)
    replayed_peak_bytes: int = 0  # the replay's peak of tensor bytes (no runtime allowance, no slack): what a
    # simulated step (wsitrain.sft.simulate) measures
    tiling: tuple[str, ...] = ()  # how much of the network can and does run tiled, and what ends tiling
    # the step in the planner's time model (FLOPs, memory traffic, per-call costs; costs.py), FLOP-equivalents
    time_plain: float = 0.0
    time_sft: float = 0.0
    # the tiled segments' share of ``time_sft``: what background reuse (execution/reuse.py) saves on background
    # tiles; 0 when reuse is off
    time_tiles: float = 0.0
    # whether the executor may keep a background tile per sweep: planned with its cache, or off where only a plan
    # without it fits the budget
    reuse_tiles: bool = False
    # the device's planning facts: generation, kernel workspaces, the convolution size limit, the link's price
    target: TargetDevice = field(default=CPU_TARGET, compare=False)

    @property
    def overhead(self) -> float:
        """Extra compute of recomputation and halos, as a fraction of plain training."""
        return self.flops_sft / self.flops_plain - 1.0 if self.flops_plain else 0.0

    @property
    def slowdown(self) -> float:
        """Predicted step time over plain training's (1.0 when plain runs), from the time model."""
        return self.time_sft / self.time_plain if self.time_plain else 1.0

    def slowdown_at(self, tissue: float) -> float:
        """Predicted step time over plain training's when ``tissue`` (0..1) of the tiles hold tissue and the rest are
        masked background computed once per sweep: the tiled work scales with the tissue, the rest does not. Tiles
        on the tissue's edge compute too, so the share of tiles computed is somewhat above the pixels' tissue
        fraction (``wsitrain fit`` logs the measured share: ``computed_tile_share``)."""
        if not self.time_plain:
            return 1.0
        return (self.time_sft - (1.0 - min(1.0, max(0.0, tissue))) * self.time_tiles) / self.time_plain

    @property
    def brief(self) -> str:
        """Each segment's ``brief``, in order: "plain, tiled 2x2 (forward 1x1), plain" (no "|": it goes into tables)."""
        return ", ".join(s.brief for s in self.segments)

    @property
    def tiled_segments(self) -> tuple[SegmentPlan, ...]:
        return tuple(s for s in self.segments if s.mode == "tiled")

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "input_shape": list(self.input_shape),
            "dtype": self.dtype,
            "input_dtype": self.input_dtype,
            "device": self.device,
            "input_on_host": self.input_on_host,
            "fits": self.fits,
            "budget_bytes": self.budget_bytes,
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "checkpoint_peak_bytes": self.checkpoint_peak_bytes,
            "checkpoint_segments": self.checkpoint_segments,
            "feature_map_bytes": self.feature_map_bytes,
            "flops_plain": self.flops_plain,
            "flops_sft": self.flops_sft,
            "overhead": self.overhead,
            "slowdown": self.slowdown,
            "slowdown_at_half_tissue": self.slowdown_at(0.5),
            "reuse_tiles": self.reuse_tiles,
            "recomputed_tiles": self.recomputed_tiles,
            "breakdown": dict(self.breakdown),
            "segments": [s.to_dict() for s in self.segments],
            "notes": list(self.notes),
            "limiting_part": self.limiting_part,
            "min_budget_bytes": self.min_budget_bytes,
            "host_bytes": self.host_bytes,
            "spill_bytes": self.spill_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "tiling": list(self.tiling),
            "transfer_bytes": self.transfer_bytes,
            "staging_bytes": self.staging_bytes,
            "replayed_peak_bytes": self.replayed_peak_bytes,
            "target": self.target.to_dict(),
        }

    def __str__(self) -> str:
        shape = "x".join(str(s) for s in self.input_shape)
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines = [
            f"SFT plan for {self.model_name} on {shape} ({self.dtype}, {self.device}): {verdict}",
            f"  budget {format_bytes(self.budget_bytes)}, estimated peak {format_bytes(self.estimated_peak_bytes)}",
            f"  plain PyTorch would need {format_bytes(self.baseline_peak_bytes)}; best checkpoint_sequential "
            f"({self.checkpoint_segments} segments) {format_bytes(self.checkpoint_peak_bytes)}",
            f"  feature maps (each once, the SFT paper's count): {format_bytes(self.feature_map_bytes)}",
            f"  extra compute vs plain: {100 * self.overhead:+.1f}% "
            f"({self.recomputed_tiles} tiles recomputed per step)",
            f"  predicted step time vs plain: {self.slowdown:.2f}x ({self.device} time model: FLOPs, memory traffic, "
            "calls; benchmarks/calibrate_costs.py)",
        ]
        if self.time_tiles:
            lines.append(
                f"  with background reuse, a slide whose tissue fills half the tiles: {self.slowdown_at(0.5):.2f}x "
                "(masked background tiles compute once per sweep; data.mask_background)"
            )
        for s in self.segments:
            first, last = s.layers[0], s.layers[-1]
            span = first if first == last else f"{first} .. {last}"
            if s.mode == "tiled":
                desc = (
                    f"tiled {s.tile_grid[0]}x{s.tile_grid[1]}, tile {s.tile_shape[0]}x{s.tile_shape[1]} px with halo "
                    f"{s.halo[0]}/{s.halo[1]}, checkpoint {format_bytes(s.checkpoint_bytes)} on {s.checkpoint_home}"
                )
                if s.forward_grid:
                    fr, fc = s.forward_grid
                    tile = "x".join(str(v) for v in s.forward_tile_shape)
                    own = f"on its own {fr}x{fc} tiles ({tile} px: without autograd a tile keeps no activations)"
                    desc += f"; forward sweep {own if (fr, fc) != (1, 1) else 'untiled (no autograd)'}"
                if s.fused_pool:
                    desc += f"; global {s.fused_pool} pool fused (the last feature map never exists whole)"
                if s.one_pass:
                    desc += (
                        "; one pass: each tile's backward runs in forward along the linear head's gradient "
                        "direction (no forward sweep, no recompute)"
                    )
            else:
                desc = "plain autograd (activations kept, no recompute)"
            lines.append(
                f"  segment {s.index}: {len(s.layers)} layers [{span}] {desc}; peak {format_bytes(s.peak_bytes)}"
            )
        lines.extend(self._host_lines())
        lines.extend(f"  tiling: {t}" for t in self.tiling)
        lines.extend(f"  {t}" for t in self.target.lines())
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.breakdown.items() if v)
        lines.append(f"  memory parts: {parts}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def _host_lines(self) -> list[str]:
        """Host RAM and disk spill per rank, and what lives where (the image, host checkpoints, staging buffers)."""
        host_ck = [s for s in self.segments if s.start and s.checkpoint_location == "host"]
        if not (self.input_on_host or host_ck):
            return []
        first = self.segments[0] if self.segments else None
        image_home = "disk" if first is not None and first.spilled else "host"
        in_ram = [s for s in host_ck if not s.spilled]
        parts = (["the image"] if self.input_on_host and image_home == "host" else []) + (
            [f"{len(in_ram)} checkpoint(s) and their gradient buffers"] if in_ram else []
        )
        if self.staging_bytes:
            parts.append(f"page-locked staging buffers {format_bytes(self.staging_bytes)}")
        budget = f" of {format_bytes(self.host_budget_bytes)}" if self.host_budget_bytes is not None else ""
        lines = [
            f"  host memory per rank: {format_bytes(self.host_bytes)}{budget} RAM ({', '.join(parts) or 'nothing'}); "
            f"{format_bytes(self.transfer_bytes)} moved between host and device per step"
        ]
        if self.spill_bytes:
            spilled = (["the image"] if self.input_on_host and image_home == "disk" else []) + (
                [f"{len(host_ck) - len(in_ram)} checkpoint(s) and their gradient buffers"] if len(in_ram) < len(host_ck)
                else []
            )
            lines.append(
                f"  disk spill per rank: {format_bytes(self.spill_bytes)} ({', '.join(spilled)}) in memory-mapped "
                "files in engine.spill_dir: past the host RAM budget (engine.host_memory, plan --host-memory)"
            )
        return lines
