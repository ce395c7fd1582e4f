"""Preflight: everything about a run's slides that can be known before its first step, checked before it.

``run_preflight(cfg, budget_bytes, device)`` opens every slide of the labels CSV, resolves its level and mpp as
training will, computes the shape of the region it will read (tissue detection on a thumbnail, or the whole level
with ``shapes_only``), groups the shapes into buckets (``wsitrain.slides.buckets``: each side padded up to a ladder
edge), plans the model once per bucket within the run's budget (shapes only, on the meta device), and checks host
RAM for the largest slide. Every problem found is collected, each naming its slide or config key with a hint; if
there is any, one ``PreflightError`` (exit code 2) lists them all. Nothing is written (a synthetic data set named
by ``data.synthetic`` is generated into its cache first, as ``fit`` would).

Problems in the labels CSV itself (missing columns, missing files, empty labels) come from ``load_labels``, which
already lists every row at once; they stop the preflight before slides are opened.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import nn

from wsitrain.config import WsiTrainConfig
from wsitrain.errors import PlanError, SlideError, WsiTrainError
from wsitrain.gpus import run_budget
from wsitrain.host_need import HostNeed, host_need, ranks_per_node, streamed_bytes
from wsitrain.memory import available_host_bytes
from wsitrain.models.frozen_bn import is_frozen_bn
from wsitrain.models.slide_bn import RUNNING
from wsitrain.precision import activation_dtype, check_device_precision
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.placement import image_on_disk, place_host
from wsitrain.slides.buckets import bucket_shape
from wsitrain.slides.read_rate import StreamRead, measure_read_rate, segment_trains, stream_read_bytes
from wsitrain.slides.tile_source import READ_AHEAD
from wsitrain.train.engine import host_memory_per_rank, resolve_device
from wsitrain.units import format_bytes

# Autocast dtypes of train.precision (fp32 runs in the parameters' dtype).
# A progress bar appears only once the slide loop has taken this long: a 24-slide demo stays quiet.
PROGRESS_DELAY_S = 1.0
# Slides named per problem before "and N more": a bucket of 300 slides stays one readable line.
NAMES_SHOWN = 8
# Cells per side of a slide's tissue grid (SlideShape.tissue_cells): 4 KB a slide, finer than the tile grids the
# planner picks for any slide below 64 tiles a side, which is what the predicted step time counts tiles on.
TISSUE_CELLS = 64
# Slides shown in validate's tissue table (those with doubts first): a cohort of thousands stays one screen or two.
TISSUE_ROWS = 40


@dataclass(frozen=True)
class Problem:
    """One thing that would stop or spoil the run: ``subject`` is a slide (or slides) or a config key."""

    subject: str
    message: str
    hint: str

    def lines(self) -> str:
        return f"{self.subject}: {self.message}\n      hint: {self.hint}"


@dataclass(frozen=True)
class SlideShape:
    """How one slide will be read: its level, mpp, region shape (H, W, padded to the stride) and its bucket."""

    slide: str  # the file name, as problems name it
    path: Path
    level: int
    mpp: float | None
    shape: tuple[int, int]
    bucket: tuple[int, int]
    # data.mask_background: which of TISSUE_CELLS x TISSUE_CELLS cells of the read hold (dilated) tissue, for the
    # predicted step time (wsitrain.train.balance.cost); None when masking is off, no tissue was found, the region is
    # fixed, or --shapes-only skipped tissue detection
    tissue_cells: np.ndarray | None = field(default=None, compare=False, repr=False)
    # what tissue detection kept and dropped (``slides.tissue.summary.tissue_record``); None when it did not run
    tissue: dict[str, Any] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket shape (H, W), the slides padded into it, and the engine's plan for it (None: planning failed)."""

    bucket: tuple[int, int]
    slides: tuple[str, ...]
    plan: Plan | None

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.plan.fits


@dataclass
class PreflightReport:
    """What the preflight found; ``problems`` empty means the run can start."""

    device: str
    budget_bytes: int
    shapes_only: bool
    slides: list[SlideShape] = field(default_factory=list)
    buckets: list[BucketPlan] = field(default_factory=list)
    host_needed_bytes: int = 0
    host_available_bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # worth a look, but no reason to stop
    stream_read: StreamRead | None = None  # data.stream_tiles: decoded bytes per step against the measured reader

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line for the log: slides, buckets, the budget, host memory, time."""
        n, k = len(self.slides), len(self.buckets)
        return (
            f"preflight: {n} slide{'s' if n != 1 else ''} in {k} shape bucket{'s' if k != 1 else ''}"
            f"{self._buckets_said()}, each planned "
            f"within {format_bytes(self.budget_bytes)} ({self.device}); host memory for the largest "
            f"{format_bytes(self.host_needed_bytes)} of {format_bytes(self.host_available_bytes)} available "
            f"({self.seconds:.1f} s{', whole slides' if self.shapes_only else ''})"
        )

    def _buckets_said(self) -> str:
        """What a bucket is, when data.augment.rot90 planned turned buckets too (one slide is then in two, and
        "8 slides in 13 shape buckets" needs saying); empty otherwise."""
        own = len({s.bucket for s in self.slides})
        turned = len(self.buckets) - own
        if turned <= 0:
            return ""
        return (f" (a bucket is an input shape slides are padded up to, planned once for all of them: {own} as the "
                f"slides are read and {turned} turned a quarter by data.augment.rot90)")

    def table(self) -> Table:
        """Buckets, their slide counts and planned peaks, for ``wsitrain validate``."""
        t = Table(
            title=f"shape buckets, budget {format_bytes(self.budget_bytes)} ({self.device})", title_justify="left"
        )
        for col in ("bucket (H x W)", "slides", "planned peak", "tiles", "fits"):
            t.add_column(col, justify="left" if col == "bucket (H x W)" else "right")
        for b in self.buckets:
            p = b.plan
            tiles = sum(s.n_tiles for s in p.tiled_segments) if p is not None else 0
            t.add_row(
                f"{b.bucket[0]} x {b.bucket[1]}", str(len(b.slides)),
                format_bytes(p.estimated_peak_bytes) if p is not None else "-", str(tiles),
                "[green]yes[/]" if b.fits else "[red]no[/]",
            )  # fmt: skip
        return t

    def tissue_records(self) -> dict[str, dict[str, Any]]:
        """Each slide's tissue record (kept and dropped pieces) and its path, by file name: data.json's ``tissue``."""
        return {s.slide: {**s.tissue, "path": str(s.path)} for s in self.slides if s.tissue is not None}

    def tissue_table(self) -> Table | None:
        """Per slide: kept and dropped pieces (count, mm²), the largest dropped one and the doubts (marked "unusual"
        where the warning names them), slides with doubts first, at most TISSUE_ROWS of them; None without
        detection."""
        from wsitrain.slides.tissue.cohort import unusual_doubts
        from wsitrain.slides.tissue.summary import describe_dropped

        records = self.tissue_records()
        if not records:
            return None
        unusual = unusual_doubts(records)
        # unusual doubts first, then typical ones, then none; stable: CSV order within each group
        order = sorted(records, key=lambda n: (n not in unusual, not records[n]["doubts"]))
        more = len(order) - TISSUE_ROWS
        t = Table(title="tissue pieces (data.tissue.min_fragment_mm2)", title_justify="left",
                  caption=f"and {more} more slides (data.json's tissue lists every slide)" if more > 0 else None)
        for col in ("slide", "kept", "kept mm²", "dropped", "largest dropped", "doubts"):
            t.add_column(col, justify="left" if col in ("slide", "dropped", "largest dropped") else "right")
        for name in order[:TISSUE_ROWS]:
            r = records[name]
            big = r["dropped"]["largest"]
            scale = " (mpp assumed)" if r["mpp_assumed"] else ""
            t.add_row(
                name + scale, str(r["kept"]["count"]), f"{r['kept']['area_mm2']:.4g}", describe_dropped(r),
                f"{big['area_mm2']:.4g} mm² {big['kind']}" if big else "-",
                f"[yellow]{len(r['doubts'])} unusual[/]" if name in unusual else str(len(r["doubts"])),
            )  # fmt: skip
        return t


def tissue_warnings(slides: Sequence[SlideShape]) -> list[str]:
    """One line for the slides where a dropped piece may be tissue (``summary.doubts``) and that is unusual for the
    cohort (``slides.tissue.cohort``: specks are on nearly every slide, so a warning for every doubt is read by
    nobody), naming them and why; and one for the slides measured at an assumed mpp."""
    from wsitrain.slides.tissue.cohort import unusual_doubts

    records = {s.slide: s.tissue for s in slides if s.tissue is not None}
    unusual = unusual_doubts(records)
    typical = sum(bool(r["doubts"]) for n, r in records.items() if n not in unusual)
    assumed = [s.slide for s in slides if s.tissue is not None and s.tissue["mpp_assumed"]]
    out = []
    if unusual:
        named = list(unusual)
        if len(set(unusual.values())) == 1:  # one reason for all (few doubts, or a small cohort): said once
            which = f"{_names(named)} ({unusual[named[0]]})"
        else:
            which = "; ".join(f"{n} ({unusual[n]})" for n in named[:NAMES_SHOWN])
            which += f"; and {len(named) - NAMES_SHOWN} more" if len(named) > NAMES_SHOWN else ""
        rest = (f"; {typical} other slide{'s' if typical != 1 else ''} have doubts typical of this cohort, listed in "
                "the tissue table (validate) and the report") if typical else ""  # fmt: skip
        out.append(f"tissue: on {len(named)} slide{'s' if len(named) != 1 else ''}, a dropped piece may be tissue "
                   f"(larger than a tenth of data.tissue.min_fragment_mm2, or darker than the kept tissue) and is "
                   f"unusual for this cohort: {which}; data.json's tissue lists them and the report marks them; lower "
                   f"data.tissue.min_fragment_mm2 to keep them{rest}")  # fmt: skip
    if assumed:
        mpp = next(s.tissue["mpp"] for s in slides if s.tissue is not None and s.tissue["mpp_assumed"])
        out.append(f"tissue: {_names(assumed)} state no mpp; piece areas were measured at {mpp:g} um/px "
                   "(data.fallback_mpp, or 1.0 when unset, which overestimates areas so no tissue is dropped "
                   "for it)")  # fmt: skip
    return out


def random_batchnorm_warnings(cfg: WsiTrainConfig, model: nn.Module) -> list[str]:
    """One line when BatchNorm is frozen (``model.freeze_bn``, the default) on random weights (``model.weights``
    unset): frozen layers keep their initial statistics and normalise nothing, so nothing holds the trunk's
    activations in range while the weights move. ResNet-18 on the learning benchmark's 1024 px slides (AdamW lr 1e-3)
    starts near a loss of 5 and averaged 37 to 290,000 over its first epoch, then gave a constant output, every seed
    (measured on an H200, docs/benchmarks/bench_learning/h200_resnet18.md)."""
    m = cfg.model
    n = sum(is_frozen_bn(mod) for mod in model.modules())
    if m.weights is not None or not m.freeze_bn or n == 0:
        return []
    return [f"model: {m.name}'s {n} BatchNorm layers are frozen (model.freeze_bn: true, the default) at the initial "
            "statistics of random weights (model.weights is unset): they normalise nothing while the weights move "
            "(ResNet-18 at lr 1e-3: a mean first-epoch loss of 37 to 290,000, then a constant output, measured); "
            "start from pretrained weights (model.weights: imagenet, or a checkpoint) or set "
            "model.freeze_bn: false with model.bn_stats: slide"]  # fmt: skip


def running_batchnorm_warnings(cfg: WsiTrainConfig, model: nn.Module) -> list[str]:
    """One line when BatchNorm trains (``model.freeze_bn: false``) and predicts with running averages
    (``model.bn_stats: running``, the default): a step holds one slide, so training normalises every slide with its
    own statistics, and prediction with averages over slides, another normalisation. On the learning benchmark's
    cohort four trained tiny_bn models ranked held-out slides at ROC AUC 0.40-0.65 with the averages and 0.79-0.94
    with each slide's own, on the same reads (measured, docs/research/plateau.md section 14)."""
    m = cfg.model
    n = sum(isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.running_mean is not None and not is_frozen_bn(mod)
            for mod in model.modules())  # fmt: skip
    if m.freeze_bn or m.bn_stats != RUNNING or n == 0:
        return []
    return [f"model: {m.name}'s {n} BatchNorm layers train on each slide's own statistics (model.freeze_bn: false, "
            "one slide per step) but predict with their running averages (model.bn_stats: running, the default), "
            "another normalisation: four trained models ranked held-out slides at ROC AUC 0.40-0.65 with the "
            "averages and 0.79-0.94 with each slide's own (measured); set model.bn_stats: slide"]  # fmt: skip


class PreflightError(WsiTrainError):
    """The preflight found problems; ``problems`` lists every one, ``report`` holds what was found."""

    def __init__(self, problems: Sequence[Problem], report: PreflightReport | None = None) -> None:
        n = len(problems)
        message = f"preflight found {n} problem{'s' if n != 1 else ''} before training:\n" + "\n".join(
            f"  - {p.lines()}" for p in problems
        )
        super().__init__(
            message,
            hint="fix the problems above; `wsitrain validate CONFIG` repeats this check without training "
            "(--shapes-only skips tissue detection)",
        )
        self.problems = list(problems)
        self.report = report


def check_run(
    cfg: WsiTrainConfig,
    device: torch.device | None = None,
    *,
    shapes_only: bool = False,
    console: Console | None = None,
    budget_bytes: int | None = None,
    warn: Console | None = None,
) -> PreflightReport | None:
    """The preflight of ``wsitrain fit`` and ``validate``: the run's device (``engine.device`` when not given) and
    budget; None when the config names no slides yet (``data.labels`` unset, which fit reports by itself).
    ``console`` gets the summary, ``warn`` (``console`` when None) the warnings: fit's ``--quiet`` keeps those."""
    if device is None:
        device = resolve_device(cfg.engine.device)
    check_device_precision(cfg.train.precision, torch.device(device))  # bf16 before Ampere: before anything else
    if cfg.data.labels is None and cfg.data.synthetic is None:
        return None
    if budget_bytes is None:  # validate: the budget fit would resolve at its start
        budget_bytes = run_budget(cfg.engine.memory_budget, torch.device(device)).bytes
    report = run_preflight(cfg, budget_bytes, device, shapes_only=shapes_only, progress=console)
    if console is not None:
        console.print(report.summary(), markup=False)
    warnings_to = warn if warn is not None else console
    if warnings_to is not None:
        for w in report.warnings:
            warnings_to.print(f"[yellow]warning: {escape(w)}[/]", soft_wrap=True)
    if console is not None and report.stream_read is not None:
        console.print(report.stream_read.text(), markup=False, highlight=False, soft_wrap=True)
    return report


def run_preflight(
    cfg: WsiTrainConfig,
    budget_bytes: int,
    device: torch.device | str,
    *,
    shapes_only: bool = False,
    progress: Console | None = None,
) -> PreflightReport:
    """Check every slide and every bucket's plan; return the report, or raise ``PreflightError`` listing all problems.

    ``device`` is the training device (its type decides whether the image is staged on the host). ``progress``:
    a console to show a progress bar on when the slide loop takes more than a moment.
    """
    from wsitrain.tasks.columns import load_task_records
    from wsitrain.train.data import resolve_labels

    dev = torch.device(device).type
    report = PreflightReport(device=dev, budget_bytes=int(budget_bytes), shapes_only=shapes_only)
    report.problems += _file_problems(cfg)
    labels_csv, slides_dir = resolve_labels(cfg)  # generates data.synthetic's slides on first use, as fit would
    t0 = time.perf_counter()
    # the task's columns (times, events, targets, labels) are checked here too, each problem naming its line
    records, class_names = load_task_records(labels_csv, slides_dir, cfg.task, check_readable=False)
    model = _meta_model(cfg, cfg.model.num_classes or max(2, len(class_names)))
    stride = int(getattr(model, "stride", 1))

    with _DelayedProgress(progress, len(records), "preflight: reading slides") as bar:
        for rec in records:
            shape_or_problem = slide_shape(cfg, rec.path, stride, shapes_only=shapes_only)
            if isinstance(shape_or_problem, Problem):
                report.problems.append(shape_or_problem)
            else:
                report.slides.append(shape_or_problem)
            bar.advance()

    report.warnings += (random_batchnorm_warnings(cfg, model) + running_batchnorm_warnings(cfg, model)
                        + tissue_warnings(report.slides))  # fmt: skip
    report.buckets = _group(report.slides, transposed=cfg.data.augment.rot90)
    report.problems += _plan_buckets(cfg, model, report, dev)
    report.problems += _host_problems(cfg, report, dev)
    if cfg.data.stream_tiles and not shapes_only and not report.problems:
        report.stream_read = _stream_read(cfg, model, report)
    report.seconds = time.perf_counter() - t0
    if report.problems:
        raise PreflightError(report.problems, report)
    return report


def _stream_read(cfg: WsiTrainConfig, model: nn.Module, report: PreflightReport) -> StreamRead | None:
    """data.stream_tiles: what the largest bucket's streamed step decodes, and the reader's rate measured on one of
    its slides with the run's read settings (None when its first segment is not tiled: the image is read whole)."""
    from wsitrain.train.data import read_kwargs

    planned = [b for b in report.buckets if b.plan is not None]
    if not planned:
        return None
    big = max(planned, key=lambda b: b.bucket[0] * b.bucket[1])
    assert big.plan is not None
    passes = 1 + int(segment_trains(model, big.plan.segments[0]))  # the forward, and the recompute
    nbytes = stream_read_bytes(big.plan, passes, cfg.data.stream_cache_bytes)
    if not nbytes:
        return None
    path = next(s.path for s in report.slides if s.slide in big.slides)
    rate = measure_read_rate(path, big.plan, read_kwargs(cfg, int(getattr(model, "stride", 1))))
    return StreamRead(nbytes, passes, rate)


# --------------------------------------------------------------------------------------------------- slides


def slide_shape(cfg: WsiTrainConfig, path: Path, stride: int, *, shapes_only: bool = False) -> SlideShape | Problem:
    """How ``path`` will be read under ``cfg`` (the same arithmetic as ``read_slide_region``), or its problem."""
    from wsitrain.slides.readers import open_slide
    from wsitrain.slides.resolution import choose_resolution
    from wsitrain.slides.stream import _tissue
    from wsitrain.slides.tissue import region_mask
    from wsitrain.slides.tissue.summary import tissue_record

    d = cfg.data
    name = path.name
    cells, record = None, None
    try:
        with open_slide(path, tuple(d.background)) as reader:
            info = reader.info
            res = choose_resolution(
                info, level=d.level, mpp=d.mpp, magnification=d.magnification, fallback_mpp=d.fallback_mpp
            )
            if d.region == "fixed":
                assert d.size is not None  # the config's own validator requires it
                h, w = (d.size, d.size) if isinstance(d.size, int) else tuple(d.size)
            else:
                # Tissue detections go through the reader's per-process cache, so fit does not detect them twice.
                detect = (d.region == "tissue" or d.mask_background) and not shapes_only
                tissue = _tissue(reader, d.tissue_settings()) if detect else None
                record = tissue_record(tissue) if tissue is not None else None
                box = tissue.box if tissue is not None and d.region == "tissue" else None
                bx, by, bw, bh = (0, 0, *info.dimensions) if box is None else box
                w, h = max(1, round(bw / res.downsample)), max(1, round(bh / res.downsample))
                padded = (-(-h // stride) * stride, -(-w // stride) * stride)
                if tissue is not None and d.mask_background:
                    mask = region_mask(tissue, info.dimensions, (bx, by), res.downsample, padded, reader.background)
                    cells = None if mask is None else mask.cells(min(TISSUE_CELLS, padded[0]),
                                                                 min(TISSUE_CELLS, padded[1]))  # fmt: skip
    except SlideError as e:
        return Problem(name, _without_name(e.message, name), e.hint or "check the slide file")
    shape = (-(-h // stride) * stride, -(-w // stride) * stride)
    bucket = bucket_shape(shape, multiple=stride, steps=d.bucket)
    return SlideShape(name, path, res.level, res.mpp, shape, bucket, cells, record)


def _without_name(message: str, name: str) -> str:
    # Slide errors start with the file name; the problem line names the slide already.
    return message[len(name) + 2 :] if message.startswith(f"{name}: ") else message


def _group(slides: Iterable[SlideShape], *, transposed: bool) -> list[BucketPlan]:
    """Slides by bucket, smallest area first. With 90-degree turns on, a (W, H) bucket is met too and is planned."""
    members: dict[tuple[int, int], list[str]] = {}
    for s in slides:
        members.setdefault(s.bucket, []).append(s.slide)
        if transposed and s.bucket[0] != s.bucket[1]:
            members.setdefault((s.bucket[1], s.bucket[0]), []).append(s.slide)
    order = sorted(members, key=lambda hw: (hw[0] * hw[1], hw))
    return [BucketPlan(hw, tuple(members[hw]), None) for hw in order]


def _names(slides: Sequence[str]) -> str:
    shown = ", ".join(slides[:NAMES_SHOWN])
    return shown + (f" and {len(slides) - NAMES_SHOWN} more" if len(slides) > NAMES_SHOWN else "")


# --------------------------------------------------------------------------------------------------- plans


def _meta_model(cfg: WsiTrainConfig, num_classes: int) -> nn.Module:
    """The run's model on the meta device, in training mode: shapes and modes only, no memory, no weights read."""
    from wsitrain.train.engine import build_model

    with torch.device("meta"):
        model = build_model(cfg.model, num_classes, with_weights=False)
    return model.train()


def _plan_bucket(cfg: WsiTrainConfig, model: nn.Module, bucket: tuple[int, int], budget: int, dev: str) -> Plan:
    """The plan fit runs on a bucket. On CPU the whole uint8 image is process memory inside the budget, unless
    data.stream_tiles reads it tile by tile into a tiled first segment (then it is planned as host input, outside)."""
    from wsitrain.sft import plan

    e = cfg.engine

    def planned(on_host: bool) -> Plan:
        p = plan(
            model, (1, 3, *bucket), budget, activation_dtype(cfg.train.precision), tile_size=e.tile_size,
            checkpoints=e.checkpoints, optimizer=cfg.train.optimizer, input_dtype=torch.uint8,
            input_on_host=on_host, device=dev, fold_bn=e.fold_bn,
        )  # fmt: skip
        return place_host(p, host_memory_per_rank(e))  # host checkpoints past engine.host_memory go to disk

    if dev == "cuda" or not cfg.data.stream_tiles:
        return planned(dev == "cuda")
    p = planned(True)
    # a first segment that does not tile reads the whole image after all: plan it inside the budget, as without
    return p if p.fits and p.segments and p.segments[0].mode == "tiled" else planned(False)


def _plan_buckets(cfg: WsiTrainConfig, model: nn.Module, report: PreflightReport, dev: str) -> list[Problem]:
    """Plan every bucket as fit will run it (uint8 image, staged on the host for CUDA); problems for those that fail.

    The same planning error on several buckets (a bad ``engine.checkpoints`` name, an untileable layer) is one
    problem naming all their slides.
    """

    e, budget = cfg.engine, report.budget_bytes
    errors: dict[str, tuple[PlanError, list[str]]] = {}
    problems: list[Problem] = []
    for i, b in enumerate(report.buckets):
        try:
            p = _plan_bucket(cfg, model, b.bucket, budget, dev)
        except PlanError as err:
            _, named = errors.setdefault(err.message, (err, []))
            named.extend(s for s in b.slides if s not in named)
            continue
        report.buckets[i] = BucketPlan(b.bucket, b.slides, p)
    for message, (err, slides) in errors.items():
        problems.append(_plan_error_problem(cfg, err, message, slides))
    failing = [b for b in report.buckets if b.plan is not None and not b.plan.fits]
    if failing:
        fixed = _fixed_bytes(failing[0].plan)
        if fixed >= budget:
            # Nothing can fit, whatever the slide: one problem about the budget, not one per bucket, naming the
            # least budget every bucket fits (each plan's own least budget, as `wsitrain plan` prints it).
            least = [b.plan.min_budget_bytes for b in failing if b.plan.min_budget_bytes is not None]
            to = f" to at least {format_bytes(max(least))}" if len(least) == len(failing) else ""
            return problems + [
                Problem(
                    "engine.memory_budget",
                    f"{format_bytes(budget)} is less than the model alone needs before any activation "
                    f"({format_bytes(fixed)}: parameters, gradients, optimizer state, runtime)",
                    hint=f"raise engine.memory_budget{to} (or remove it to use the device's free memory)",
                )
            ]
    rest = (
        "read at a coarser resolution (data.mpp or data.level), train in bf16 (train.precision), or remove the slide "
        "from the labels"
    )
    if e.tile_size is not None or e.checkpoints is not None:
        rest += "; engine.tile_size and engine.checkpoints force the plan: remove them to let the planner choose"
    if report.shapes_only and cfg.data.region == "tissue":
        rest += "; --shapes-only planned whole slides, without it only the tissue box is read"
    for b in failing:
        assert b.plan is not None
        # the least budget that fits, not the best plan's estimated peak: plans keep headroom above it, so a budget
        # of the peak would fail again (and a plan worth running may need larger tiles still)
        least = b.plan.min_budget_bytes
        at_least = f" to at least {format_bytes(least)}" if least else ""
        problems.append(
            Problem(
                _names(b.slides),
                f"{'whole-slide ' if report.shapes_only else ''}region padded to {b.bucket[0]} x {b.bucket[1]} px "
                f"does not fit engine.memory_budget {format_bytes(budget)}"
                + (f": it needs at least {format_bytes(least)}" if least else ""),
                _stream_hint(cfg, model, b.bucket, budget, dev) + f"raise engine.memory_budget{at_least}, {rest}",
            )
        )
    return problems


def _stream_hint(cfg: WsiTrainConfig, model: nn.Module, bucket: tuple[int, int], budget: int, dev: str) -> str:
    """On CPU the whole uint8 image counts inside the budget; read tile by tile (data.stream_tiles) it does not. When
    that plan fits, the hint's first fix names it with its planned peak ("" otherwise: on CUDA the image is on the host
    already, and a plan that still does not fit, or whose first segment is not tiled, would read it whole anyway).
    A hint, not a silent switch: streaming decodes each tile again in the backward recompute
    (docs/benchmarks/host_memory.md measured it faster and leaner on CPU, but the read rate is the slide's own) and it
    excludes train.head_warmup."""
    if dev == "cuda" or cfg.data.stream_tiles:
        return ""
    with_stream = cfg.model_copy(update={"data": cfg.data.model_copy(update={"stream_tiles": True})})
    try:
        p = _plan_bucket(with_stream, model, bucket, budget, dev)
    except PlanError:
        return ""
    if not (p.fits and p.segments and p.segments[0].mode == "tiled" and p.input_on_host):
        return ""
    also = " (and remove train.head_warmup, which reads slides whole)" if cfg.train.head_warmup is not None else ""
    return (f"set data.stream_tiles: true{also}: the slide is then read tile by tile and the image leaves the budget; "
            f"this region plans within it at a planned peak of {format_bytes(p.estimated_peak_bytes)}; or ")


def _fixed_bytes(p: Plan | None) -> int:
    """Memory a plan needs whatever the image: parameters, gradients, optimizer state, runtime."""
    if p is None:
        return 0
    return sum(p.breakdown.get(k, 0) for k in ("parameters", "gradients", "optimizer", "runtime"))


def _plan_error_problem(cfg: WsiTrainConfig, err: PlanError, message: str, slides: list[str]) -> Problem:
    """A planning error as a problem naming the config key behind it."""
    e, m = cfg.engine, cfg.model
    if e.checkpoints is not None and "not cut points" in message:
        return Problem("engine.checkpoints", message, err.hint or "name layers every path passes through")
    if "cannot be tiled" in message or "cannot be tiled" in (err.hint or "") or "no plan exists" in message:
        hints = []
        if "BatchNorm" in message and not m.freeze_bn:
            hints.append("set model.freeze_bn: true (BatchNorm then uses its running statistics and tiles exactly)")
        if e.tile_size is not None:
            hints.append("remove engine.tile_size: it forces every segment to be tiled, even where plain would fit")
        hints.append("or raise engine.memory_budget so this layer can run untiled")
        return Problem(f"{_names(slides)}", message, "; ".join(hints))
    return Problem(_names(slides), message, err.hint or "see the message")


# --------------------------------------------------------------------------------------------------- host memory


def host_bytes_needed(cfg: WsiTrainConfig, bucket: BucketPlan, dev: str, ranks: int = 1) -> int:
    """Host RAM the bucket takes while training on this node (``wsitrain.host_need``: slides, host checkpoints,
    staging buffers and their pinned rounding on CUDA, the plan's peak on CPU; times the ranks on the node)."""
    return _host_need(cfg, bucket, dev, ranks).total


def _host_need(cfg: WsiTrainConfig, bucket: BucketPlan, dev: str, ranks: int) -> HostNeed:
    # images: the slide being trained, the next one read ahead (data.prefetch), and a 90-degree turn of a
    # non-square slide, which fills a new buffer before the old one is freed
    h, w = bucket.bucket
    images = 1 + int(cfg.data.prefetch) + int(cfg.data.augment.rot90 and h != w)
    if not cfg.data.stream_tiles and bucket.plan is not None and image_on_disk(bucket.plan):
        # whole slides decoded into engine.spill_dir (train.engine.slide_spill): RAM holds an augmented copy only
        aug = cfg.data.augment
        images = int(aug.flips or aug.rot90 or aug.color_jitter != "none")
    # data.stream_tiles into a tiled first segment: no whole image, only the regions read ahead (slides/tile_source)
    streamed = streamed_bytes(bucket.plan, READ_AHEAD) if cfg.data.stream_tiles and bucket.plan is not None else 0
    if streamed:  # and data.stream_cache's decoded regions, at most the image
        streamed += min(cfg.data.stream_cache_bytes, 3 * h * w)
    return host_need(bucket.plan, 3 * h * w, images, dev, ranks, streamed)  # uint8 (3, H, W) images


def _host_problems(cfg: WsiTrainConfig, report: PreflightReport, dev: str) -> list[Problem]:
    if not report.buckets:
        return []
    ranks = ranks_per_node()
    need = {b.bucket: _host_need(cfg, b, dev, ranks) for b in report.buckets}
    largest = max(report.buckets, key=lambda b: need[b.bucket].total)
    report.host_needed_bytes = need[largest.bucket].total
    report.host_available_bytes = available_host_bytes()
    if report.host_needed_bytes <= report.host_available_bytes:
        return []
    where = "host memory (slides, host checkpoints, page-locked staging)" if dev == "cuda" else "memory"
    return [
        Problem(
            _names(largest.slides),
            f"the largest region, {largest.bucket[0]} x {largest.bucket[1]} px, needs "
            f"{need[largest.bucket].describe()} of {where} while training; "
            f"{format_bytes(report.host_available_bytes)} is available",
            hint=("" if cfg.data.stream_tiles else "set data.stream_tiles: true (the slide read tile by tile), ")
            + "read at a coarser resolution (data.mpp or data.level), set data.prefetch: false, turn off "
            "data.augment.rot90 for non-square slides, lower engine.host_memory so host checkpoints and whole "
            "slides spill to engine.spill_dir (on CUDA), run fewer processes per node, or train on a machine with "
            "more RAM",
        )
    ]


# --------------------------------------------------------------------------------------------------- progress


class _DelayedProgress:
    """A rich progress bar that shows itself only once the loop has run for ``PROGRESS_DELAY_S``."""

    def __init__(self, console: Console | None, total: int, description: str) -> None:
        self.console, self.total, self.description = console, total, description
        self.done = 0
        self.t0 = time.perf_counter()
        self.bar: Progress | None = None

    def __enter__(self) -> _DelayedProgress:
        return self

    def advance(self) -> None:
        self.done += 1
        if self.console is None:
            return
        if self.bar is None and time.perf_counter() - self.t0 >= PROGRESS_DELAY_S and self.done < self.total:
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=self.console, transient=True,
            )  # fmt: skip
            self.bar.start()
            self.task = self.bar.add_task(self.description, total=self.total, completed=self.done)
        elif self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _file_problems(cfg: WsiTrainConfig) -> list[Problem]:
    """Files the config names that must exist before training (the labels CSV is checked by load_labels)."""
    w = cfg.model.weights
    if w is not None and not Path(w).is_file():
        return [Problem("model.weights", f"{w} does not exist", "give the path of a local weights file, or remove "
                        "model.weights to start from random weights")]  # fmt: skip
    return []
