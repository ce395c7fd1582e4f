"""``wsitrain plan``: what the SFT engine would do with a model, an image size and a GPU, from shapes alone.

The model is built on the meta device, so planning a 100000 x 100000 image allocates nothing. The plan
renders itself (``str(plan)`` and ``plan.to_dict()``, the engine's one text and JSON form); this command adds
only what belongs to the command: where the budget came from, the GPU preset, the largest square image.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

from wsitrain.errors import PlanError, WsiTrainError
from wsitrain.gpu_speed import GpuSpeed
from wsitrain.gpus import Budget, gpu_preset, resolve_budget
from wsitrain.host_need import host_need, ranks_per_node, streamed_bytes
from wsitrain.models import build
from wsitrain.models.freeze import FreezeSpec, Frozen
from wsitrain.models.heads import AVG, MAP_NORMS, NO_NORM, POOLS
from wsitrain.models.registry import resolve_model_name
from wsitrain.patch.plan_summary import PatchPlanSummary, summarize
from wsitrain.plan.from_config import PLAN_NUM_CLASSES, from_config
from wsitrain.precision import Precision, activation_dtype, check_precision
from wsitrain.sft import Plan, max_square_size
from wsitrain.sft import plan as plan_model
from wsitrain.sft.plan_api import MAX_SQUARE_LIMIT
from wsitrain.sft.planning.calibration import CLOCK_SOURCE, cpu_name, run_time_model
from wsitrain.sft.planning.costs import DEFAULT_TIME_MODEL, OPTIMIZER_STATE, TimeModel
from wsitrain.sft.planning.placement import place_host
from wsitrain.sft.simulate import SimulatedStep, simulate_step, simulation_dict, simulation_text
from wsitrain.sft.simulate.clock import ClockReading, OpClock
from wsitrain.sft.simulate.host_time import HostTime, host_image_refusal, measure_host_time
from wsitrain.sft.simulate.step import Progress
from wsitrain.sft.simulate.timing import LOW_PRECISION, PATCH, PATCHES, clock_patch_reference, clock_plain_step
from wsitrain.slides.read_rate import StreamRead, stream_read_bytes
from wsitrain.slides.tile_source import READ_AHEAD
from wsitrain.spill_dir import default_host_memory
from wsitrain.units import format_bytes, parse_bytes

DEFAULT_OPTIMIZER = "adamw"  # what ``wsitrain fit`` trains with unless train.optimizer says otherwise
# ``--input-dtype``: the image as the engine gets it. uint8 is what fit reads slides as (on CPU inside the budget, on
# CUDA in host memory); float32 is a library user's float tensor. The library plans each the same (SFT.plan_of).
INPUT_DTYPES = {"uint8": torch.uint8, "float32": torch.float32}


@dataclass(frozen=True)
class PlanReport:
    """The engine's plan and the command's envelope around it."""

    plan: Plan
    budget: Budget
    precision: Precision
    max_size: int | None  # largest square edge that fits the budget; 0: none; None: not computed
    time_model: str = DEFAULT_TIME_MODEL  # where the time model's constants came from
    simulated: SimulatedStep | None = None  # one step run on the simulated device (``--simulate``, fp32)
    clock: ClockReading | None = None  # that step's simulated time on the preset (``--simulate``)
    clock_plain: ClockReading | None = None  # plain PyTorch's step on the same card, simulated
    # patch training as users run it (timing.clock_patch_reference: 256 patches of 224 px, BatchNorm in training
    # mode, nothing folded), simulated on the same card: the throughput a whole-slide step is compared with
    clock_patches: ClockReading | None = None
    flop_rate: float | None = None  # FLOP/s of the time model when it is the clock's (its time in seconds)
    host: HostTime | None = None  # the host's share of that step: time and launches (``--simulate``)
    host_skipped: str | None = None  # why ``host`` was not measured (the image would not fit this machine's RAM)
    frozen: Frozen | None = None  # what ``--freeze`` froze
    unfrozen: PlanReport | None = None  # the same plan with nothing frozen, to show what freezing saves
    patch: PatchPlanSummary | None = None  # a patch-encoder model's patches, chunks and memory by part

    def saving(self) -> dict[str, Any] | None:
        """Planned FLOPs and time (and simulated tile visits) with ``--freeze`` against without; None without it."""
        if self.frozen is None or self.unfrozen is None:
            return None
        a, b = self.unfrozen.plan, self.plan
        rate = b.target.tflops * 1e12
        d: dict[str, Any] = {
            "frozen_modules": list(self.frozen.modules), "frozen_parameters": self.frozen.n_frozen,
            "flops_unfrozen": a.flops_sft, "flops_frozen": b.flops_sft,
            # the time model's step (FLOP-equivalents; costs.py), in seconds at the target's nominal rate where known
            "time_unfrozen": a.time_sft, "time_frozen": b.time_sft,
            "time_unfrozen_s": a.time_sft / rate if rate else None,
            "time_frozen_s": b.time_sft / rate if rate else None,
            "flops_saving": 1.0 - b.flops_sft / a.flops_sft if a.flops_sft else 0.0,
            "time_saving": 1.0 - b.time_sft / a.time_sft if a.time_sft else 0.0,
        }  # fmt: skip
        if self.clock is not None and self.unfrozen.clock is not None:  # the simulated clock's step, both ways
            d.update({"clock_unfrozen_s": self.unfrozen.clock.seconds, "clock_frozen_s": self.clock.seconds,
                      "clock_saving": 1.0 - self.clock.seconds / self.unfrozen.clock.seconds})
        if self.simulated is not None and self.unfrozen.simulated is not None:
            sa, sb = self.unfrozen.simulated, self.simulated
            d.update({"simulated_visits_unfrozen": sa.tiles_in_step, "simulated_visits_frozen": sb.tiles_in_step,
                      "simulated_peak_unfrozen": sa.device_peak.bytes, "simulated_peak_frozen": sb.device_peak.bytes})
        return d

    def saving_text(self) -> str | None:
        s = self.saving()
        if s is None:
            return None
        text = (f"freezing {', '.join(s['frozen_modules'])} ({s['frozen_parameters']:,} parameters, forward-only): "
                f"planned {s['flops_unfrozen'] / 1e12:.1f} -> {s['flops_frozen'] / 1e12:.1f} TFLOP per step "
                f"({-s['flops_saving']:+.0%}), planned step time {-s['time_saving']:+.0%}")  # fmt: skip
        if s["time_unfrozen_s"] is not None:
            text += f" ({s['time_unfrozen_s']:.2f} -> {s['time_frozen_s']:.2f} s at the nominal rate)"
        if "clock_saving" in s:
            text += (f"; simulated step time {s['clock_unfrozen_s']:.3f} -> {s['clock_frozen_s']:.3f} s "
                     f"({-s['clock_saving']:+.0%})")
        if "simulated_visits_unfrozen" in s:
            text += (f"; simulated step: {s['simulated_visits_unfrozen']} -> {s['simulated_visits_frozen']} forward "
                     f"and recompute tile visits, device peak {format_bytes(s['simulated_peak_unfrozen'])} -> "
                     f"{format_bytes(s['simulated_peak_frozen'])}")  # fmt: skip
        return text

    @property
    def clock_slowdown(self) -> float | None:
        """SFT's simulated step over plain PyTorch's, on the preset."""
        if self.clock is None or self.clock_plain is None or not self.clock_plain.seconds:
            return None
        return self.clock.seconds / self.clock_plain.seconds

    @property
    def whole_slide_mpx_s(self) -> float | None:
        """The simulated whole-slide step's throughput in Mpx/s (the image's pixels, every image of the batch)."""
        if self.clock is None or not self.clock.seconds:
            return None
        b, _, h, w = self.plan.input_shape
        return b * h * w / self.clock.seconds / 1e6

    @property
    def patch_mpx_s(self) -> float | None:
        """Patch training's simulated throughput in Mpx/s (``clock_patches``)."""
        if self.clock_patches is None or not self.clock_patches.seconds:
            return None
        return PATCHES * PATCH * PATCH / self.clock_patches.seconds / 1e6

    @property
    def patch_share(self) -> float | None:
        """The whole-slide step's Mpx/s as a share of patch training's, both simulated."""
        whole, patches = self.whole_slide_mpx_s, self.patch_mpx_s
        return None if whole is None or not patches else whole / patches

    def to_dict(self) -> dict[str, Any]:
        d = {
            "budget_source": self.budget.source,
            "gpu": self.budget.gpu,
            "precision": self.precision,
            "max_size": self.max_size,
            "time_model": self.time_model,
            "predicted_seconds": self.plan.time_sft / self.flop_rate if self.flop_rate else None,
            "plan": self.plan.to_dict(),
        }
        if self.simulated is not None:
            d["simulated"] = simulation_dict(self.simulated)
        if self.frozen is not None:
            d["freeze"] = self.saving()
        if self.patch is not None:
            d["patch"] = self.patch.to_dict()
        if self.clock is not None:
            d["clock"] = {
                "sft": self.clock.to_dict(),
                "plain": self.clock_plain.to_dict() if self.clock_plain is not None else None,
                "slowdown": self.clock_slowdown,
                "plan_slowdown": self.plan.slowdown,
                "whole_slide_mpx_s": self.whole_slide_mpx_s,
                "patch_training": None if self.clock_patches is None else {
                    **self.clock_patches.to_dict(), "patches": PATCHES, "patch": PATCH, "mpx_s": self.patch_mpx_s,
                },
                "share_of_patch_training": self.patch_share,
            }  # fmt: skip
        if self.host is not None:
            d["host"] = self.host.to_dict()
        if self.host_skipped is not None:
            d["host_skipped"] = self.host_skipped
        return d

    def __str__(self) -> str:
        lines = [str(self.plan), f"budget source: {self.budget.source}", f"time model: {self.time_model}"]
        if self.patch is not None:
            lines.append(self.patch.text())
        if self.flop_rate:
            lines.append(
                f"  predicted step time on the {self.budget.gpu} preset: {self.plan.time_sft / self.flop_rate:.3f} s "
                f"(plain PyTorch {self.plan.time_plain / self.flop_rate:.3f} s), from the plan's shapes"
            )
        if self.simulated is not None:
            lines.append(simulation_text(self.simulated))
        elif self.clock is not None:
            lines.append(f"memory: not simulated in {self.precision} (the simulated device has no autocast; "
                         "--precision fp32 --simulate checks the memory of the float32 plan)")  # fmt: skip
        if self.clock is not None:
            lines.append(self.clock.text())
        if self.clock_plain is not None and self.clock_slowdown is not None:
            lines.append(
                f"  plain PyTorch on the same card, simulated: {self.clock_plain.seconds:.3f} s; SFT over plain "
                f"{self.clock_slowdown:.2f}x simulated, {self.plan.slowdown:.2f}x by the plan's time model "
                f"({self.plan.slowdown / self.clock_slowdown - 1:+.0%})"
            )
        if self.clock_patches is not None and self.patch_share is not None:
            lines.append(
                f"  patch training as users run it ({PATCHES} patches of {PATCH} px, BatchNorm in training mode, "
                f"nothing folded; channels_last priced as NCHW: the clock has no memory-format term), simulated: "
                f"{self.clock_patches.seconds:.3f} s, {self.patch_mpx_s:.0f} Mpx/s; the whole-slide step "
                f"{self.whole_slide_mpx_s:.0f} Mpx/s, {self.patch_share:.2f} of patch training's"
            )
        if self.host is not None:
            lines.append(self.host.text())
        if self.host_skipped is not None:
            lines.append(self.host_skipped)
        saving = self.saving_text()
        if saving is not None:
            lines.append(saving)
        if self.budget.gpu is not None:
            lines.append(f"gpu preset: {self.budget.gpu}")
        if self.budget.gpu is not None and self.plan.transfer_bytes:
            link = gpu_preset(self.budget.gpu).host_link_gb_s
            lines.append(
                f"host -> device staging: {self.plan.transfer_bytes / 1e9 / link:.1f} s per step at {link:g} GB/s "
                "(nominal link rate; overlapped with compute where the device allows)"
            )
        if self.plan.input_on_host:
            lines.append(host_line(self.plan))
            read = stream_read(self.plan, self.clock.seconds if self.clock is not None else None,
                               self.plan.time_sft / self.flop_rate if self.flop_rate else None)  # fmt: skip
            if read is not None:
                lines.append(read)
        if self.max_size is not None:
            if self.max_size >= MAX_SQUARE_LIMIT // 64 * 64:
                lines.append(
                    f"every square image up to {self.max_size} x {self.max_size} px fits this budget: device memory "
                    "no longer grows with the image; host memory for the image is the limit"
                )
            else:
                lines.append(
                    f"largest square image that fits this budget: {self.max_size} x {self.max_size} px"
                    if self.max_size
                    else "no square image fits this budget: the weights alone need more"
                )
        return "\n".join(lines)


def host_line(plan: Plan) -> str:
    """Host RAM per rank (planned): whole uint8 slides (the trained one and the one read ahead) against the slide
    read tile by tile (data.stream_tiles: the regions read ahead, slides/tile_source.py)."""
    b, c, h, w = plan.input_shape
    image = b * c * h * w
    streamed = streamed_bytes(plan, READ_AHEAD)
    whole = host_need(plan, image, 2, "cuda")
    text = f"host RAM per rank (planned): {whole.describe()} with whole slides and data.prefetch"
    if plan.segments and plan.segments[0].spilled:  # past engine.host_memory: the plan puts the image on disk
        text += (f" (the plan places the image on disk: fit decodes whole slides into engine.spill_dir, "
                 f"{host_need(plan, 0, 0, 'cuda').describe()} in RAM and {format_bytes(2 * image)} on disk, "
                 "augmented copies aside)")
    if not streamed:
        return text + "; data.stream_tiles would read the whole image too (the first segment is not tiled)"
    return text + f"; {host_need(plan, 0, 0, 'cuda', 1, streamed).describe()} with data.stream_tiles"


def stream_read(plan: Plan, simulated_s: float | None, planned_s: float | None) -> str | None:
    """data.stream_tiles' decoded bytes per step (forward and recompute) and the read rate they need at the
    simulated step time, else the planned one (a preset's); the readers measured: docs/benchmarks/read_throughput.md."""
    nbytes = stream_read_bytes(plan, 2)
    if not nbytes:
        return None
    kind, secs = ("simulated", simulated_s) if simulated_s else ("planned", planned_s)
    text = StreamRead(nbytes, 2, step_s=secs, step_kind=kind).text()
    return text + " (readers measured: docs/benchmarks/read_throughput.md)"


def parse_size(size: str | int, stride: int, model: str) -> tuple[int, int]:
    """``"20480"`` or ``"20480x10240"`` (height x width) into (H, W); each edge at least the model's stride."""
    text = str(size).strip().lower().replace(" ", "")
    parts = text.split("x")
    if len(parts) not in (1, 2) or not all(p.lstrip("-").isdigit() for p in parts):
        raise WsiTrainError(
            f"--size: cannot read {size!r} as an image size", hint="give one edge (20480) or HEIGHTxWIDTH (20480x10240)"
        )
    edges = [int(p) for p in parts]
    h, w = (edges[0], edges[0]) if len(edges) == 1 else (edges[0], edges[1])
    if h <= 0 or w <= 0:
        raise WsiTrainError(f"--size: {size!r} must be positive", hint="give pixels, e.g. --size 20480")
    if h < stride or w < stride:
        raise WsiTrainError(
            f"--size: {size!r} is smaller than {model}'s stride of {stride} px",
            hint=f"give at least {stride} px per edge",
        )
    return h, w


def _check_model(model: str) -> None:
    resolve_model_name(model, key="--model")


def make_plan(
    *,
    model: str | None,
    size: str | None,
    gpu: str | None,
    memory: str | None,
    batch: int = 1,
    precision: str | None = None,
    tile: int | None = None,
    optimizer: str | None = None,
    with_max_size: bool = True,
    simulate: bool = False,
    progress: Progress | None = None,
    every_tile: bool = False,
    pool: str | None = None,
    freeze: str | None = None,
    host_memory: str | int | None = None,
    map_norm: str | None = None,
    config: str | Path | None = None,
    fold_bn: bool | None = None,
    input_dtype: str = "uint8",
) -> PlanReport:
    """Validate the inputs, plan on the meta device, and return the plan with the command's envelope.

    ``optimizer``: the one whose state and step the plan holds (default adamw, as ``wsitrain fit`` trains), with
    and without ``simulate``. ``simulate``: also run one training step of the real executor on the simulated CUDA
    device (``wsitrain.sft.simulate``); the plan shown is then the one that step ran, for the GPU preset's
    generation. bf16/fp16 are planned but not simulated (the
    simulated device has no autocast). ``every_tile``: simulate every tile, not only the representative ones.
    ``pool``: the head's pooling (wsitrain.models.heads.POOLS; attention with its default settings).
    ``map_norm``: ``model.map_norm`` (wsitrain.models.heads.MAP_NORMS).
    ``freeze``: ``--freeze`` (``parse_freeze``): plan with those layers frozen, and the same plan unfrozen beside it.
    ``host_memory``: ``--host-memory``, host RAM per rank (default: this node's RAM over its ranks); the host
    checkpoints it does not hold are placed on disk (``wsitrain.sft.planning.placement``).
    ``config``: a run's config (``wsitrain.plan.from_config``): its model section is planned as fit builds it, and
    it fills the precision, optimizer, budget, tile and size the call leaves at None.
    ``fold_bn``: ``engine.fold_bn`` (None: the config's, else on).
    ``input_dtype``: ``--input-dtype`` (``INPUT_DTYPES``).
    """
    if input_dtype not in INPUT_DTYPES:
        raise WsiTrainError(f"--input-dtype: unknown dtype {input_dtype!r}",
                            hint=f"choose one of: {', '.join(INPUT_DTYPES)}")  # fmt: skip
    memory_source = None  # the config's engine.memory_budget, when it gave the budget
    precision_key = "--precision"  # what an error about the precision names
    if config is not None:
        if precision is None:
            precision_key = f"train.precision ({config})"
        cp = from_config(config, model_options={"--model": model, "--pool": pool, "--map-norm": map_norm,
                                                "--freeze": freeze},
                         precision=precision, gpu=gpu, memory=memory, tile=tile, size=size,
                         host_memory=host_memory)  # fmt: skip
        model, make, spec, memory_source, host_memory = cp.model, cp.make, cp.freeze, cp.memory_source, cp.host_memory
        precision, optimizer, memory, tile, size = cp.precision, optimizer or cp.optimizer, cp.memory, cp.tile, cp.size
        fold_bn = cp.fold_bn if fold_bn is None else fold_bn
    else:
        if model is None:
            raise WsiTrainError("--model: which model to plan?", hint="give --model (e.g. --model resnet50), or "
                                "--config RUN.yaml to plan a run's model section")  # fmt: skip
        _check_model(model)
        pool, map_norm = pool or AVG, map_norm or NO_NORM
        if pool not in POOLS:
            raise WsiTrainError(f"--pool: unknown pool {pool!r}", hint=f"choose one of: {', '.join(POOLS)}")
        if map_norm not in MAP_NORMS:
            raise WsiTrainError(f"--map-norm: unknown map_norm {map_norm!r}",
                                hint=f"choose one of: {', '.join(MAP_NORMS)}")  # fmt: skip
        spec = parse_freeze(freeze)
        make = functools.partial(_build_named, model, pool, map_norm, spec)
    if size is None:
        raise WsiTrainError("--size: which image size to plan?", hint="give --size (e.g. --size 20480 or "
                            "20480x10240); a config fixes it only with data.size")  # fmt: skip
    prec = check_precision(precision or "fp32", precision_key)
    activation_dtype(prec)  # an unknown precision fails here, before any model is built
    budget = resolve_budget(gpu, memory)
    if memory_source is not None:
        budget = dataclasses.replace(budget, source=memory_source)
    if prec == "bf16" and budget.target.generation == "volta-turing":
        raise WsiTrainError(
            f"{precision_key} bf16: {budget.target.label} is older than Ampere and has no bf16 kernels",
            hint="plan with --precision fp16 or fp32, or choose an Ampere or newer GPU",
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise WsiTrainError(f"--batch: {batch!r} must be a positive integer", hint="use --batch 1 (the default)")
    if tile is not None and tile <= 0:
        raise WsiTrainError(f"--tile: {tile!r} must be positive", hint="give a tile edge in pixels, or omit --tile")
    host_budget = (default_host_memory(ranks_per_node()) if host_memory is None
                   else parse_bytes(host_memory, what="--host-memory"))  # fmt: skip
    with torch.device("meta"):  # shapes only: no parameter or activation is ever allocated
        net = make(True)
    h, w = parse_size(size, net.stride, model)
    shape = (batch, 3, h, w)
    plan_it = functools.partial(_plan_net, shape=shape, budget=budget, prec=prec, optimizer=optimizer, tile=tile,
                                simulate=simulate, progress=progress, every_tile=every_tile,
                                host_budget=host_budget, fold_bn=fold_bn is not False,
                                input_dtype=INPUT_DTYPES[input_dtype])  # fmt: skip
    report = plan_it(net, with_max_size=with_max_size)
    if spec is None:
        return report
    with torch.device("meta"):  # the same model with nothing frozen: what freezing saves
        plain = make(False)
    return dataclasses.replace(report, frozen=net.frozen, unfrozen=plan_it(plain, with_max_size=False))


def _build_named(model: str, pool: str, map_norm: str, spec: FreezeSpec | None, frozen: bool) -> torch.nn.Module:
    """The model ``--model``, ``--pool``, ``--map-norm`` and ``--freeze`` name (``frozen``: with the freeze)."""
    return build(model, PLAN_NUM_CLASSES, pool=pool, freeze=spec if frozen else None, map_norm=map_norm)


def parse_freeze(text: str | None) -> FreezeSpec | None:
    """``--freeze layer2`` (everything up to layer2, as ``model.freeze: {until: layer2}``) or ``--freeze a,b`` (those
    modules, as ``model.freeze: [a, b]``); None without it."""
    if text is None:
        return None
    names = [n.strip() for n in str(text).split(",")]
    if not all(names):
        raise WsiTrainError(f"--freeze: cannot read {text!r}",
                            hint="give one module to freeze up to (--freeze layer2) or a list (--freeze conv1,layer1)")
    return FreezeSpec(until=names[0]) if len(names) == 1 else FreezeSpec(modules=tuple(names))


def _plan_net(
    net: torch.nn.Module,
    *,
    shape: tuple[int, int, int, int],
    budget: Budget,
    prec: Precision,
    optimizer: str | None,
    tile: int | None,
    simulate: bool,
    progress: Progress | None,
    every_tile: bool,
    with_max_size: bool,
    host_budget: int | None = None,
    fold_bn: bool = True,
    input_dtype: torch.dtype = torch.uint8,
) -> PlanReport:
    """Plan (or simulate) ``net`` built on the meta device for ``shape`` within ``budget``, the image in
    ``input_dtype`` (on a GPU in host memory, on CPU inside the budget: as ``SFT`` plans such an image)."""
    batch = shape[0]
    dtype = activation_dtype(prec)
    tm, speed = _time_model(budget, prec)
    # the optimizer fit trains with: its state and step temporaries are in the plan fit runs (planned without them,
    # `plan` printed another plan than the one an H200 ran for the same budget: 2026-11-27)
    optimizer = optimizer or DEFAULT_OPTIMIZER
    if simulate:
        return _simulated(net, shape, budget, prec, optimizer, tile, progress, every_tile, speed, tm, host_budget,
                          fold_bn, input_dtype)  # fmt: skip
    p = plan_model(
        net, input_shape=shape, memory_budget=budget.bytes, dtype=dtype, tile_size=tile,
        optimizer=optimizer, device=budget.device, target=budget.target, time_model=tm, fold_bn=fold_bn,
        input_dtype=input_dtype,
    )  # fmt: skip
    p = place_host(p, host_budget)  # host checkpoints in RAM or on disk, as SFT places them
    max_size = None
    if with_max_size:
        max_size = int(
            max_square_size(
                net,
                budget.bytes,
                dtype=dtype,
                batch=batch,
                optimizer=optimizer,
                device=budget.device,
                target=budget.target,
                time_model=tm,
                input_dtype=input_dtype,
            )  # fmt: skip
        )
    patch = summarize(net, p, dtype, OPTIMIZER_STATE[optimizer])
    source = tm.source
    if source == DEFAULT_TIME_MODEL:
        source = (f"{DEFAULT_TIME_MODEL} for {budget.device} (no calibration of this device; `wsitrain doctor "
                  "--calibrate` fits them on yours)")  # fmt: skip
    return PlanReport(p, budget, prec, max_size, source, flop_rate=_flop_rate(tm, speed, prec), patch=patch)


def _flop_rate(tm: TimeModel, speed: GpuSpeed | None, prec: Precision) -> float | None:
    """The FLOP rate that turns the time model's FLOP-equivalents into seconds, when the model is the clock's."""
    if speed is None or not tm.source.startswith(CLOCK_SOURCE):
        return None
    return speed.plan_conv_rate(prec in LOW_PRECISION)


def _time_model(budget: Budget, prec: Precision) -> tuple[TimeModel, GpuSpeed | None]:
    """The planner's time model and the clock's constants: a calibration of this card where there is one, else a
    preset's clock constants (wsitrain/gpu_speed.py), else the device's defaults."""
    return run_time_model(budget.device, _device_name(budget), prec in LOW_PRECISION, budget.gpu)


def _device_name(budget: Budget) -> str | None:
    """The device whose calibration applies: the preset's card, the detected GPU, or this machine's CPU."""
    if budget.gpu is not None:
        return gpu_preset(budget.gpu).label  # used when a calibration carries exactly this name
    if budget.device == "cuda":
        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return cpu_name()


def _simulated(
    net: torch.nn.Module,
    shape: tuple[int, int, int, int],
    budget: Budget,
    prec: Precision,
    optimizer: str,
    tile: int | None,
    progress: Progress | None,
    every_tile: bool,
    speed: GpuSpeed | None,
    tm: TimeModel,
    host_budget: int | None = None,
    fold_bn: bool = True,
    input_dtype: torch.dtype = torch.uint8,
) -> PlanReport:
    if budget.device != "cuda":
        raise WsiTrainError(
            "--simulate runs the CUDA executor on a simulated GPU: it needs a GPU budget",
            hint="give --gpu (e.g. --gpu 2080ti), or --memory with --gpu for a card's kind",
        )
    low = prec in LOW_PRECISION
    if low and speed is None:
        raise WsiTrainError(
            f"--simulate runs float32 steps only, not {prec}, unless it times them on a GPU preset with speed "
            "constants: the simulated device has no autocast",
            hint="drop --precision, or give --gpu h100, h200, a100-40, a100-80 (bf16) or 2080ti (fp16)",
        )
    clock = OpClock(low) if speed is not None else None
    try:
        sim = simulate_step(
            net, shape, budget.bytes, optimizer=optimizer, tile_size=tile, progress=progress, target=budget.target,
            every_tile=every_tile, clock=clock, act_dtype=LOW_PRECISION.get(prec), time_model=tm,
            host_memory=host_budget, fold_bn=fold_bn, input_dtype=input_dtype,
        )  # fmt: skip
        skipped = host_image_refusal(shape, input_dtype)
        host = None if skipped else measure_host_time(
            net, shape, budget.bytes, dtype=LOW_PRECISION.get(prec, torch.float32), optimizer=optimizer,
            target=budget.target, tile_size=tile, time_model=tm, fold_bn=fold_bn, input_dtype=input_dtype,
        )  # fmt: skip
    except PlanError as e:  # does not fit: show the plan as the plain command would
        raise WsiTrainError(str(e), hint=e.hint) from e
    reading = plain = patches = None
    if clock is not None and speed is not None:
        reading = clock.reading(speed, prec)
        plain = clock_plain_step(net, shape, speed, prec, optimizer=optimizer)[1].reading(speed, prec)
        patches = clock_patch_reference(net, speed, prec, optimizer=optimizer)[0]
    rate = _flop_rate(tm, speed, prec)
    return PlanReport(
        sim.plan, budget, prec, None, tm.source, None if low else sim, reading, plain, patches, rate, host=host,
        host_skipped=skipped, patch=summarize(net, sim.plan, activation_dtype(prec), OPTIMIZER_STATE[optimizer]),
    )


def run_plan(
    *,
    model: str | None,
    size: str | None,
    gpu: str | None,
    memory: str | None,
    batch: int,
    precision: str | None,
    tile: int | None,
    as_json: bool,
    console: Console,
    optimizer: str | None = None,
    simulate: bool = False,
    every_tile: bool = False,
    tissue: float | None = None,
    pool: str | None = None,
    freeze: str | None = None,
    host_memory: str | None = None,
    with_max_size: bool = True,
    map_norm: str | None = None,
    config: str | Path | None = None,
    fold_bn: bool | None = None,
    input_dtype: str = "uint8",
) -> int:
    """``wsitrain plan``: print the plan (readable, or one JSON object); exit code 0 when it fits, 1 when not.

    Bad input raises WsiTrainError (the CLI prints it and exits 2).
    """
    report = make_plan(
        model=model, size=size, gpu=gpu, memory=memory, batch=batch, precision=precision, tile=tile,
        optimizer=optimizer, simulate=simulate, progress=_progress_bar(console) if simulate and not as_json else None,
        every_tile=every_tile, pool=pool, freeze=freeze, host_memory=host_memory, with_max_size=with_max_size,
        map_norm=map_norm, config=config, fold_bn=fold_bn, input_dtype=input_dtype,
    )  # fmt: skip
    if as_json:
        d = report.to_dict()
        if tissue is not None:
            d["tissue"], d["slowdown_at_tissue"] = tissue, report.plan.slowdown_at(tissue)
        # Plain write, not console.print: rich would wrap and highlight the JSON.
        console.file.write(json.dumps(d) + "\n")
        console.file.flush()
    else:
        # markup=False: the plan's "[conv1 .. pool4]" layer ranges are not rich markup tags.
        console.print(str(report), markup=False, highlight=False, soft_wrap=True)
        if tissue is not None:
            where = ("of the patches (data.mask_background: a chunk encodes its tissue patches and one background "
                     "patch, a chunk all background is computed once)" if report.patch is not None
                     else "of the tiles (data.mask_background: background computed once)")  # fmt: skip
            console.print(
                f"with tissue in {tissue:.0%} {where}: "
                f"predicted step time vs plain {report.plan.slowdown_at(tissue):.2f}x "
                f"(all tissue {report.plan.slowdown:.2f}x)"
                + (f"; {math.ceil(tissue * report.patch.patches):,} of {report.patch.patches:,} patches hold tissue"
                   if report.patch is not None else ""),
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    sim = report.simulated
    if sim is not None and not (sim.within_budget and sim.host_within_plan and sim.disk_within_plan):
        return 1
    return 0 if report.plan.fits else 1


def _progress_bar(console: Console) -> Progress:
    """A progress line for long simulations (100,000 px: minutes), on stderr so stdout stays the report."""
    from rich.console import Console as _Console
    from rich.progress import Progress as _Bar

    bar = _Bar(
        TextColumn("simulating"), BarColumn(), TextColumn("{task.completed}/{task.total} tiles"), TimeElapsedColumn(),
        console=_Console(stderr=True), transient=True,
    )  # fmt: skip
    task = bar.add_task("simulate", total=None)
    started = [False]

    def update(done: int, total: int) -> None:
        if not started[0]:
            bar.start()
            started[0] = True
        bar.update(task, completed=done, total=total)
        if done >= total:
            bar.stop()

    return update
