"""``wsitrain plan``: what the SFT engine would do with a model, an image size and a GPU, from shapes alone.

The model is built on the meta device, so planning a 100000 x 100000 image allocates nothing. The plan
renders itself (``str(plan)`` and ``plan.to_dict()``, the engine's one text and JSON form); this command adds
only what belongs to the command: where the budget came from, the GPU preset, the largest square image.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

from wsitrain.errors import PlanError, WsiTrainError
from wsitrain.gpus import Budget, gpu_preset, resolve_budget
from wsitrain.host_need import host_need, streamed_bytes
from wsitrain.models import build
from wsitrain.models.heads import AVG, POOLS
from wsitrain.models.registry import resolve_model_name
from wsitrain.precision import Precision, activation_dtype, check_precision
from wsitrain.sft import Plan, max_square_size
from wsitrain.sft import plan as plan_model
from wsitrain.sft.plan_api import MAX_SQUARE_LIMIT
from wsitrain.sft.planning.calibration import cpu_name, time_model_for
from wsitrain.sft.planning.costs import DEFAULT_TIME_MODEL
from wsitrain.sft.simulate import SimulatedStep, simulate_step, simulation_dict, simulation_text
from wsitrain.sft.simulate.step import Progress
from wsitrain.slides.tile_source import READ_AHEAD

PLAN_NUM_CLASSES = 2  # the head is tiny next to the trunk; any class count plans the same
DEFAULT_OPTIMIZER = "adamw"  # what ``wsitrain fit`` trains with unless train.optimizer says otherwise


@dataclass(frozen=True)
class PlanReport:
    """The engine's plan and the command's envelope around it."""

    plan: Plan
    budget: Budget
    precision: Precision
    max_size: int | None  # largest square edge that fits the budget; 0: none; None: not computed
    time_model: str = DEFAULT_TIME_MODEL  # where the time model's constants came from
    simulated: SimulatedStep | None = None  # one step run on the simulated device (``--simulate``)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "budget_source": self.budget.source,
            "gpu": self.budget.gpu,
            "precision": self.precision,
            "max_size": self.max_size,
            "time_model": self.time_model,
            "plan": self.plan.to_dict(),
        }
        if self.simulated is not None:
            d["simulated"] = simulation_dict(self.simulated)
        return d

    def __str__(self) -> str:
        lines = [str(self.plan), f"budget source: {self.budget.source}", f"time model: {self.time_model}"]
        if self.simulated is not None:
            lines.append(simulation_text(self.simulated))
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
    whole = host_need(plan, b * c * h * w, 2, "cuda")
    streamed = streamed_bytes(plan, READ_AHEAD)
    text = f"host RAM per rank (planned): {whole.describe()} with whole slides and data.prefetch"
    if not streamed:
        return text + "; data.stream_tiles would read the whole image too (the first segment is not tiled)"
    return text + f"; {host_need(plan, 0, 0, 'cuda', 1, streamed).describe()} with data.stream_tiles"


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
    model: str,
    size: str,
    gpu: str | None,
    memory: str | None,
    batch: int = 1,
    precision: str = "fp32",
    tile: int | None = None,
    optimizer: str | None = None,
    with_max_size: bool = True,
    simulate: bool = False,
    progress: Progress | None = None,
    every_tile: bool = False,
    pool: str = AVG,
) -> PlanReport:
    """Validate the inputs, plan on the meta device, and return the plan with the command's envelope.

    ``simulate``: also run one training step of the real executor on the simulated CUDA device
    (``wsitrain.sft.simulate``); the plan shown is then the one that step ran (with ``optimizer``, default adamw,
    as ``wsitrain fit`` trains), for the GPU preset's generation. bf16/fp16 are planned but not simulated (the
    simulated device has no autocast). ``every_tile``: simulate every tile, not only the representative ones.
    ``pool``: the head's pooling (wsitrain.models.heads.POOLS; attention with its default settings).
    """
    _check_model(model)
    if pool not in POOLS:
        raise WsiTrainError(f"--pool: unknown pool {pool!r}", hint=f"choose one of: {', '.join(POOLS)}")
    prec = check_precision(precision)
    dtype = activation_dtype(prec)
    budget = resolve_budget(gpu, memory)
    if prec == "bf16" and budget.target.generation == "volta-turing":
        raise WsiTrainError(
            f"--precision bf16: {budget.target.label} is older than Ampere and has no bf16 kernels",
            hint="plan with --precision fp16 or fp32, or choose an Ampere or newer GPU",
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise WsiTrainError(f"--batch: {batch!r} must be a positive integer", hint="use --batch 1 (the default)")
    if tile is not None and tile <= 0:
        raise WsiTrainError(f"--tile: {tile!r} must be positive", hint="give a tile edge in pixels, or omit --tile")
    with torch.device("meta"):  # shapes only: no parameter or activation is ever allocated
        net = build(model, PLAN_NUM_CLASSES, pool=pool)
    h, w = parse_size(size, net.stride, model)
    if simulate:
        return _simulated(
            net, (batch, 3, h, w), budget, prec, optimizer or DEFAULT_OPTIMIZER, tile, progress, every_tile
        )  # fmt: skip
    tm = time_model_for(budget.device, _device_name(budget))
    p = plan_model(
        net, input_shape=(batch, 3, h, w), memory_budget=budget.bytes, dtype=dtype, tile_size=tile,
        optimizer=optimizer, device=budget.device, target=budget.target, time_model=tm,
    )  # fmt: skip
    max_size = None
    if with_max_size:
        max_size = int(
            max_square_size(
                net, budget.bytes, dtype=dtype, batch=batch, optimizer=optimizer, device=budget.device,
                target=budget.target, time_model=tm,
            )  # fmt: skip
        )
    source = tm.source
    if source == DEFAULT_TIME_MODEL:
        source = (f"{DEFAULT_TIME_MODEL} for {budget.device} (no calibration of this device; `wsitrain doctor "
                  "--calibrate` fits them on yours)")  # fmt: skip
    return PlanReport(p, budget, prec, max_size, source)


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
) -> PlanReport:
    if budget.device != "cuda":
        raise WsiTrainError(
            "--simulate runs the CUDA executor on a simulated GPU: it needs a GPU budget",
            hint="give --gpu (e.g. --gpu 2080ti), or --memory with --gpu for a card's kind",
        )
    if activation_dtype(prec) != torch.float32:
        raise WsiTrainError(
            f"--simulate runs float32 steps only, not {prec}: the simulated device has no autocast",
            hint="drop --precision, or plan bf16 without --simulate",
        )
    try:
        sim = simulate_step(
            net, shape, budget.bytes, optimizer=optimizer, tile_size=tile, progress=progress, target=budget.target,
            every_tile=every_tile,
        )  # fmt: skip
    except PlanError as e:  # does not fit: show the plan as the plain command would
        raise WsiTrainError(str(e), hint=e.hint) from e
    return PlanReport(sim.plan, budget, prec, None, simulated=sim)


def run_plan(
    *,
    model: str,
    size: str,
    gpu: str | None,
    memory: str | None,
    batch: int,
    precision: str,
    tile: int | None,
    as_json: bool,
    console: Console,
    optimizer: str | None = None,
    simulate: bool = False,
    every_tile: bool = False,
    tissue: float | None = None,
    pool: str = AVG,
) -> int:
    """``wsitrain plan``: print the plan (readable, or one JSON object); exit code 0 when it fits, 1 when not.

    Bad input raises WsiTrainError (the CLI prints it and exits 2).
    """
    report = make_plan(
        model=model, size=size, gpu=gpu, memory=memory, batch=batch, precision=precision, tile=tile,
        optimizer=optimizer, simulate=simulate, progress=_progress_bar(console) if simulate and not as_json else None,
        every_tile=every_tile, pool=pool,
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
            console.print(
                f"with tissue in {tissue:.0%} of the tiles (data.mask_background: background computed once): "
                f"predicted step time vs plain {report.plan.slowdown_at(tissue):.2f}x "
                f"(all tissue {report.plan.slowdown:.2f}x)",
                markup=False, highlight=False, soft_wrap=True,
            )
    if report.simulated is not None and not (report.simulated.within_budget and report.simulated.host_within_plan):
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
