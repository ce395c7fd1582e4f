"""GPU profiling kit: where a whole-slide step's time goes, on one GPU, in one command (at most 8 minutes).

    python benchmarks/gpu_session.py                    # an H100 or H200: the table of issue 36 and a profile
    python benchmarks/gpu_session.py --device cpu --size 512 --quick --models tiny --budget 64MiB --out /tmp/x
                                                     # the same code path on a CPU (the test runs this)

Cases per model (``--models``, default resnet50, vgg16, darknet19), each 2 classes, batch 1, bf16 autocast, cross
entropy, AdamW (foreach), one warm-up step then ``--steps`` timed steps with a device synchronize around each:

- ``plain patches``: plain PyTorch on ``--patches`` patches of 224 px (channels_last), what patch pipelines run: the
  model as torchvision or timm builds it, BatchNorm in training mode (issue 57's reference; nothing to fold);
- ``plain NCHW`` / ``plain channels_last``: plain PyTorch on one ``--size`` px image on the device;
- ``SFT uncapped``: ``SFT(model)`` planning for the card, the image uint8 in pinned host memory (as fit feeds it);
- ``SFT capped``: ``SFT(model, memory_budget=--budget)`` with the allocator capped there
  (``set_per_process_memory_fraction``), ``cudnn.benchmark`` off (as fit runs) and, for the first model, on. SFT
  plans with the constants fit uses on the card (``run_time_model``); for the first model once more with the
  planner's default constants, whose plan may differ (ResNet-50 at 8192 px: one tiled segment in one pass).
- with ``--fold-compare``, for every model with BatchNorm: ``SFT capped`` once more with ``fold_bn=False`` (and the
  earlier copies, ``ExecHooks.copy_free`` off: the executor before issue 57), and for the first model ``SFT
  uncapped`` too; the tables then hold a section with and without the fold: step, Mpx/s, share of patch training's
  Mpx/s, peak.

Then one capped SFT step of the first model runs under ``torch.profiler`` and its time is broken down (``breakdown``):
convolution forward and backward, recompute, copies, crops, pads, joins and overlap-adds, host staging, optimizer,
other kernels, and the device's idle time between kernels (from the kernel timeline). Every case is bounded: timed
steps stop after ``--case-seconds``, and an out-of-memory marks the case and moves on. Writes
``gpu_session.md`` and ``gpu_session.jsonl`` (a line per case, then the breakdown) into ``--out`` (default
docs/benchmarks/).
Figures are *measured* on the device that ran them. Each row also records what a replay on the simulated clock needs
(the case's shapes, the plan's budget and time model, the plan it ran); the clock runs afterwards, on any machine,
so it costs no GPU time:

    PYTHONPATH=. python benchmarks/fit_clock.py --kit docs/benchmarks/gpu_session.jsonl   # measured against simulated
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import gzip
import json
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wsitrain.memory import cap_cuda_allocator
from wsitrain.models import build
from wsitrain.sft import SFT
from wsitrain.sft.execution.tile_io import STAGE
from wsitrain.sft.execution.tiled import JOIN, OVERLAP_ADD, RECOMPUTE, TILE_BACKWARD
from wsitrain.sft.planning.calibration import device_name, run_time_model
from wsitrain.sft.target import target_for
from wsitrain.units import format_bytes, parse_bytes

REPO = Path(__file__).resolve().parents[1]
NUM_CLASSES = 2
BUDGET = "10.47GiB"  # the 2080 Ti preset's budget (issue 36's capped runs)
FORWARD, BACKWARD, OPTIMIZER = "step.forward", "step.backward", "step.optimizer"
CATEGORIES = (
    "conv forward", "conv backward", "recompute", "copies", "crops", "pads", "joins", "overlap-adds",
    "host staging", "optimizer", "other kernels", "idle between kernels",
)  # fmt: skip

PAGE = "docs/benchmarks/gpu_session.md and docs/benchmarks/gpu_time_breakdown.md"  # named in --help


@dataclass(frozen=True)
class Case:
    model: str
    name: str  # the table's "run" column
    sft: bool
    channels_last: bool = False
    budget: str | None = None  # SFT memory_budget (and the allocator cap on CUDA)
    patches: int = 0  # plain PyTorch on this many patches of ``patch`` px instead of one image
    benchmark: bool = False  # cudnn.benchmark
    # the constants SFT plans with: "run", as fit does on this card (run_time_model: a calibration, else the clock's
    # constants of its speed preset, bf16), or "default" (the planner's defaults)
    time_model: str = "run"
    # frozen BatchNorm folded into its convolution and tiles without copies (issue 57); False: the executor before it
    fold_bn: bool = True


FOLD_OFF = "fold_bn off, earlier copies"


def _has_batchnorm(model: str) -> bool:
    """Whether the model holds a BatchNorm (built on the meta device: free); an unknown name is left to its case."""
    try:
        with torch.device("meta"):
            return any(isinstance(m, nn.BatchNorm2d) for m in build(model, NUM_CLASSES).modules())
    except Exception:  # noqa: BLE001 - the case itself reports what is wrong with the model
        return False


def cases(models: list[str], budget: str, patches: int, patch: int = 224, fold_compare: bool = False) -> list[Case]:
    out: list[Case] = []
    for k, m in enumerate(models):
        if fold_compare and _has_batchnorm(m):
            off = [Case(m, f"SFT, capped at {budget}, cudnn.benchmark off, {FOLD_OFF}", True, budget=budget,
                        fold_bn=False)]  # fmt: skip
            if k == 0:
                off.insert(0, Case(m, f"SFT, no budget (plans for the card), {FOLD_OFF}", True, fold_bn=False))
        else:
            off = []
        out += [
            Case(m, f"plain, {patches} patches of {patch} px, channels_last", False, True, patches=patches),
            Case(m, "plain, one image, NCHW", False),
            Case(m, "plain, one image, channels_last", False, True),
            Case(m, "SFT, no budget (plans for the card)", True),
            Case(m, f"SFT, capped at {budget}, cudnn.benchmark off", True, budget=budget),
            *off,
        ]
        if k == 0:  # the first step with benchmark on searches algorithms for every tile shape (a minute on an H200)
            out.append(Case(m, f"SFT, capped at {budget}, cudnn.benchmark on", True, budget=budget, benchmark=True))
            # the plan the default constants choose: for ResNet-50 at 8192 px on an H200, one tiled segment in one
            # pass (+14.7% extra compute against +25.1%, planned), which the clock's tile penalty ranks 3% slower
            # (simulated): the measurement that settles it (docs/research/simulated-clock.md)
            out.append(Case(m, f"SFT, capped at {budget}, default constants' plan", True, budget=budget,
                            time_model="default"))  # fmt: skip
            # the model and its tiles channels_last: a 1x1 layer is then a matrix product over rows of channels, which
            # needs no alignment of the tile's pixel count (the NCHW tiles' 1x1 layers ran 4-12x slower on an H200)
            out.append(Case(m, f"SFT, capped at {budget}, channels_last", True, True, budget=budget))
    return out


@dataclass(frozen=True)
class Profile:
    """The profiled step of ``case``."""

    case: Case


def session_order(all_cases: list[Case], profile_all: bool = False) -> list[Case | Profile]:
    """The order a session runs in, most telling first, so a session cut short keeps what matters most.

    The first model's cases (less its cudnn.benchmark case), the profile of its capped step, the other models' cases
    (``profile_all``: each followed by the profiles of its capped and plain NCHW steps, whose convolutions by shape
    are what a per-shape convolution rate is fitted on), and last the benchmark case, whose first step searches
    algorithms for every tile shape (61.6 s on an H200, measured).
    """
    first = all_cases[0].model
    bench = [c for c in all_cases if c.benchmark]
    head = [c for c in all_cases if c.model == first and not c.benchmark]
    rest = [c for c in all_cases if c.model != first and not c.benchmark]
    capped = next(c for c in head if c.sft and c.budget and c.time_model == "run" and c.fold_bn)
    # the plain step and the default constants' plan profiled too: the same convolutions on whole images and on
    # other tiles, kernel by kernel (what a tile's convolution costs against the whole image's)
    others = [c for c in head if (not c.sft and not c.patches and not c.channels_last)
              or c.time_model == "default"]  # fmt: skip
    order: list[Case | Profile] = [*head, Profile(capped), *[Profile(c) for c in others]]
    for model in dict.fromkeys(c.model for c in rest):
        mine = [c for c in rest if c.model == model]
        order += mine
        if profile_all:
            order += [Profile(c) for c in mine if not c.patches and not c.channels_last and c.time_model == "run"
                      and (not c.sft or c.budget) and c.fold_bn]  # fmt: skip
    return [*order, *bench]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    """After a case: free its memory, lift the allocator cap and turn cudnn.benchmark off for the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        cap_cuda_allocator(device, None)
        torch.backends.cudnn.benchmark = False


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e).lower()


class Runner:
    """One case's model, optimizer, input and step; ``step()`` runs one synchronized training step."""

    def __init__(self, case: Case, device: torch.device, size: int, patch: int) -> None:
        self.case, self.device = case, device
        torch.manual_seed(0)
        # patch training as users run it: BatchNorm as torchvision or timm builds it, in training mode (issue 57)
        model = build(case.model, NUM_CLASSES, freeze_bn=not case.patches).train().to(device)
        if case.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), foreach=True)
        if case.sft:
            tm = run_time_model(device.type, device_name(device), True)[0] if case.time_model == "run" else None
            # planned for the AdamW it trains with, as fit plans (without it, the H200's plan of 2026-11-27 left out
            # the optimizer's state and differed from every replay)
            self.sft: SFT | None = SFT(model, memory_budget=case.budget, time_model=tm, optimizer="adamw",
                                       fold_bn=case.fold_bn)  # fmt: skip
            self.sft._hooks.copy_free = case.fold_bn  # the executor before issue 57 with the fold off
            x = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8)  # (B, C, H, W) on the host, as fit
            self.x = x.pin_memory() if device.type == "cuda" else x
            self.forward: Callable[[torch.Tensor], torch.Tensor] = self.sft
        else:
            self.sft = None
            n, edge = (case.patches, patch) if case.patches else (1, size)
            x = torch.randint(0, 256, (n, 3, edge, edge), dtype=torch.uint8, device=device)
            self.x = x.contiguous(memory_format=torch.channels_last) if case.channels_last else x
            self.forward = model
        self.target = torch.zeros(self.x.shape[0], dtype=torch.long, device=device)

    def step(self, ranges: bool = False) -> float:
        def part(name: str) -> contextlib.AbstractContextManager[Any]:
            return torch.autograd.profiler.record_function(name) if ranges else contextlib.nullcontext()

        _sync(self.device)
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with part(FORWARD), torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.forward(self.x)
        loss = nn.functional.cross_entropy(logits.float(), self.target)
        with part(BACKWARD):
            loss.backward()
        with part(OPTIMIZER):
            self.opt.step()
        _sync(self.device)
        return time.perf_counter() - t0


def run_case(case: Case, device: torch.device, size: int, patch: int, steps: int, case_seconds: float) -> dict:
    row: dict[str, Any] = {"model": case.model, "run": case.name, "size": size, "device": _device_name(device),
                           "patches": case.patches, "patch": patch, "channels_last": case.channels_last,
                           "cudnn_benchmark": case.benchmark, "constants": case.time_model,
                           "budget": case.budget, "torch": torch.__version__, "fold_bn": case.fold_bn,
                           "copy_free": case.fold_bn, "patch_bn_train": bool(case.patches)}  # fmt: skip
    budget = parse_bytes(case.budget, "--budget") if case.budget else None
    if device.type == "cuda":
        cap_cuda_allocator(device, budget)
        torch.backends.cudnn.benchmark = case.benchmark
        torch.cuda.reset_peak_memory_stats(device)
    runner: Runner | None = None
    try:
        runner = Runner(case, device, size, patch)
        row["first_step_s"] = runner.step()
        before = _allocator_calls(device)
        times: list[float] = []
        started = time.perf_counter()
        while len(times) < steps and (not times or time.perf_counter() - started < case_seconds):
            times.append(runner.step())
        row.update(status="ok", step_s=min(times), steps=len(times))
        # the caching allocator per timed step: a retry frees its cached blocks after a synchronization (the capped
        # ResNet-50 step of 2026-11-27 idled 22 ms at one), device allocations and frees are cudaMalloc / cudaFree
        after = _allocator_calls(device)
        row["allocator_per_step"] = {k: (after[k] - before[k]) / len(times) for k in after}
        pixels = runner.x.shape[0] * runner.x.shape[2] * runner.x.shape[3]
        row["mpx_per_s"] = pixels / row["step_s"] / 1e6
        if device.type == "cuda":
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        if runner.sft is not None:
            plan = runner.sft.plan_of(runner.x, torch.bfloat16)
            row["plan"] = plan.brief
            row["planned_overhead"] = plan.slowdown - 1.0
            # what the clock's replay (benchmarks/fit_clock.py --kit) plans with: the same budget, constants and target
            row["budget_bytes"] = plan.budget_bytes
            row["plan_optimizer"] = runner.sft.optimizer  # whose state the plan holds (fit_clock.py replays it)
            # one-pass segments that recomputed after their pass in the last step (fit_clock.py replays that too)
            row["one_pass_fallbacks"] = runner.sft.last_stats.one_pass_fallbacks
            tm = runner.sft.time_model
            row["time_model"] = None if tm is None else dataclasses.asdict(tm)
            target = target_for(device)
            row["large_conv"] = target.large_conv
            # the whole target the card planned for: a replay that plans for the preset's can choose another plan
            # (2026-11-27: every capped case's replay on the h200 preset differed from the H200's own plan)
            row["target"] = dataclasses.asdict(target)
    except Exception as e:  # one case's failure is its row; the session goes on
        row["status"] = "oom" if _is_oom(e) else "error"
        row["note"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if row["status"] == "error":
            row["traceback"] = traceback.format_exc()[-3000:]
    finally:
        del runner
        _release(device)
    return row


# the caching allocator's counters a row records per timed step (torch.cuda.memory_stats keys)
ALLOCATOR_CALLS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _per_step(calls: dict[str, float] | None) -> str:
    if not calls:
        return ""
    return " / ".join(f"{calls.get(k, 0):.3g}" for k in ALLOCATOR_CALLS)


def _allocator_calls(device: torch.device) -> dict[str, int]:
    """The caching allocator's retries, device allocations and frees so far (CUDA; zeros elsewhere)."""
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_CALLS}


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---- the profile and its breakdown --------------------------------------------------------------
def profile_step(case: Case, device: torch.device, size: int, patch: int, trace: Path | None = None
                 ) -> dict[str, Any]:  # fmt: skip
    """One step of ``case`` under ``torch.profiler`` (after a warm-up step), broken down by ``breakdown``.

    ``trace``: also write the profiler's Chrome trace there, gzipped (every kernel with its launching operator and
    input shapes, for reading offline).
    """
    budget = parse_bytes(case.budget, "--budget") if case.budget else None
    if device.type == "cuda":
        cap_cuda_allocator(device, budget)
    runner: Runner | None = None
    try:
        runner = Runner(case, device, size, patch)
        runner.step()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
            seconds = runner.step(ranges=True)
        out = breakdown(prof.events(), device.type == "cuda")
        out.update(model=case.model, run=case.name, size=size, step_s=seconds, device=_device_name(device))
        if trace is not None:
            raw = trace.with_suffix("")  # trace is NAME.json.gz
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
            out["trace"] = trace.name
        return out
    finally:
        del runner
        _release(device)


MATMULS = ("aten::mm", "aten::bmm")
_RANGES = (STAGE, JOIN, OVERLAP_ADD, RECOMPUTE, TILE_BACKWARD, OPTIMIZER, FORWARD, BACKWARD)


def classify(name: str, ranges: Iterable[str]) -> str:
    """The category of an operator (or of the kernels it launched) named ``name`` inside the profiler ``ranges``
    (innermost first)."""
    inner = set(ranges)
    n = name.lower()
    if OPTIMIZER in inner:
        return "optimizer"
    if STAGE in inner or "memcpy" in n or "htod" in n or "dtoh" in n:
        return "host staging"
    if JOIN in inner:
        return "joins"
    if OVERLAP_ADD in inner:
        return "overlap-adds"
    if RECOMPUTE in inner:
        return "recompute"
    if "conv" in n and "backward" in n or "wgrad" in n or "dgrad" in n:
        return "conv backward"
    if "conv" in n:
        return "conv forward" if BACKWARD not in inner or TILE_BACKWARD in inner else "recompute"
    if "pad" in n:
        return "pads"
    if "slice" in n or "narrow" in n or "as_strided" in n:
        return "crops"
    if "copy" in n or "clone" in n or "contiguous" in n or "to_copy" in n:
        return "copies"
    return "other kernels"


def breakdown(events: Any, device_timeline: bool, top: int = 40) -> dict[str, Any]:
    """Seconds per category of one profiled step, the idle time between kernels, and the costliest work.

    ``device_timeline``: attribute the device's kernel time to the operator that launched each kernel (the kernels
    the profiler links to each operator; CUDA); else the operators' own CPU time (a CPU step). Idle: the step's span
    on that timeline minus the union of its busy intervals (kernels on CUDA, top-level operators on a CPU); the
    device's copies of the profiler's ranges (user annotations) are not kernels. ``top``: how many rows of
    ``kernels`` (seconds by category, operator and kernel name) and ``convolutions`` (seconds by category and input
    shapes) to keep, costliest first.
    """
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    by_kernel: dict[tuple[str, str, str], list[float]] = {}
    by_shape: dict[tuple[str, str], list[float]] = {}
    busy: list[tuple[float, float]] = []

    def count(table: dict, key: tuple, s: float) -> None:
        acc = table.setdefault(key, [0.0, 0])
        acc[0] += s
        acc[1] += 1

    for e in events:
        if _is_device(e):
            if device_timeline and not getattr(e, "is_user_annotation", False) and e.name not in _RANGES:
                busy.append((e.time_range.start, e.time_range.end))
            continue
        if e.name in _RANGES or not e.name.startswith("aten::"):
            continue
        ranges = _enclosing_ranges(e)
        # a tile's 1x1 layers run as matrix products (wsitrain/sft/ops/pointwise_conv.py) count as convolutions
        as_conv = "" if e.name not in MATMULS else " conv backward" if _in_autograd(e) else " conv"
        if device_timeline:
            for k in getattr(e, "kernels", []):
                cat = classify(f"{k.name} {e.name}{as_conv}", ranges)
                s = k.duration / 1e6
                seconds[cat] += s
                count(by_kernel, (cat, e.name, k.name[:120]), s)
                if e.name == "aten::cudnn_convolution" or e.name.startswith("aten::convolution_backward") or as_conv:
                    count(by_shape, (cat, f"{e.name} {_shapes(e)}"), s)
        else:
            cat = classify(e.name, ranges)
            s = e.self_cpu_time_total / 1e6
            seconds[cat] += s
            count(by_kernel, (cat, e.name, ""), s)
            if e.name in ("aten::convolution", "aten::convolution_backward"):
                count(by_shape, (cat, f"{e.name} {_shapes(e)}"), s)
        if not device_timeline and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
            busy.append((e.time_range.start, e.time_range.end))
    span, union = _span_and_union(busy)
    seconds["idle between kernels"] = max(0.0, span - union) / 1e6

    def rows(table: dict, names: tuple[str, ...]) -> list[dict[str, Any]]:
        ranked = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        return [{**dict(zip(names, key, strict=True)), "seconds": v[0], "calls": v[1]} for key, v in ranked]

    return {"seconds": seconds, "span_s": span / 1e6, "busy_s": union / 1e6, "intervals": len(busy),
            "kernels": rows(by_kernel, ("part", "op", "kernel")),
            "convolutions": rows(by_shape, ("part", "op_shapes"))}  # fmt: skip


def _shapes(e: Any) -> str:
    return str([list(x) for x in (getattr(e, "input_shapes", None) or [])[:2]])


def _is_device(e: Any) -> bool:
    return str(getattr(e, "device_type", "")).endswith(("CUDA", "PrivateUse1")) and e.time_range.end > 0


def _in_autograd(e: Any) -> bool:
    """Whether ``e`` runs inside autograd's backward (an ``evaluate_function`` of some node encloses it)."""
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("autograd::engine::evaluate_function"):
            return True
        p = p.cpu_parent
    return False


def _enclosing_ranges(e: Any) -> list[str]:
    out = []
    p = e
    while p is not None:
        if p.name in _RANGES:
            out.append(p.name)
        p = p.cpu_parent
    return out


def _span_and_union(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(last end - first start, length of the union) of [start, end) intervals, in their unit."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    union, (cur_s, cur_e) = 0.0, intervals[0]
    for s, e in intervals[1:]:
        if s > cur_e:
            union += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    union += cur_e - cur_s
    return intervals[-1][1] - intervals[0][0] if intervals else 0.0, union


# ---- tables -------------------------------------------------------------------------------------
def write_tables(out: Path, rows: list[dict[str, Any]], profs: list[dict[str, Any]], argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gpu_session.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for prof in profs:
            f.write(json.dumps({"breakdown": prof}) + "\n")
    dev = next((r["device"] for r in rows if "device" in r), "?")
    lines = [
        "# GPU session: where a whole-slide step's time goes",
        "",
        f"*Measured* on {dev}, torch {torch.__version__}, by `python benchmarks/gpu_session.py {' '.join(argv)}`: "
        "batch 1, bf16 autocast, cross entropy, AdamW (foreach), one warm-up step, the fastest timed step. The "
        "simulated clock's figures for the same cases: `PYTHONPATH=. python benchmarks/fit_clock.py --kit "
        "gpu_session.jsonl`.",
        "",
        "| model | run | step | throughput | share of patch training | peak allocated | first step | plan | planned "
        "overhead | allocator retries / device allocs / frees per step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['run']} | {r['status']} | | | | | | {r.get('note', '')[:80]} | |")
            continue
        over = f"{r['planned_overhead']:+.1%}" if "planned_overhead" in r else ""
        lines.append(
            f"| {r['model']} | {r['run']} | {r['step_s']:.3f} s | {r['mpx_per_s']:.3g} Mpx/s | {_share(r, rows)} | "
            f"{_peak(r)} | {r['first_step_s']:.1f} s | {r.get('plan', '')} | {over} | "
            f"{_per_step(r.get('allocator_per_step'))} |"
        )
    lines += fold_table(rows)
    for prof in profs:
        total = sum(prof["seconds"].values()) or 1.0
        lines += [
            "",
            f"## One profiled step: {prof['model']}, {prof['run']} ({prof['step_s']:.3f} s with the profiler on)",
            "",
            "| part | seconds | share |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {k} | {v:.4f} | {v / total:.1%} |" for k, v in prof["seconds"].items()]
        lines.append("")
        lines.append(
            f"Timeline: span {prof['span_s']:.4f} s, busy {prof['busy_s']:.4f} s over {prof['intervals']} "
            "intervals (kernels on a GPU; top-level operators on a CPU)."
            + (f" Chrome trace: `{prof['trace']}`." if "trace" in prof else "")
        )
        lines += ["", "| part | operator | kernel | seconds | calls |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {r['part']} | {r['op']} | {r['kernel'][:60]} | {r['seconds']:.4f} | {r['calls']} |"
                  for r in prof["kernels"][:12]]  # fmt: skip
    (out / "gpu_session.md").write_text("\n".join(lines) + "\n")


def _peak(r: dict[str, Any]) -> str:
    return format_bytes(r["peak_allocated_bytes"]) if "peak_allocated_bytes" in r else "-"


def _share(r: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """A case's Mpx/s as a share of its model's patch training (issue 57's reference), when that case ran."""
    ref = next((x for x in rows if x["model"] == r["model"] and x.get("patches") and x.get("status") == "ok"), None)
    return f"{r['mpx_per_s'] / ref['mpx_per_s']:.2f}" if ref is not None and ref["mpx_per_s"] else "-"


def fold_table(rows: list[dict[str, Any]]) -> list[str]:
    """The SFT cases with the fold and without it (``--fold-compare``), side by side per model and run."""
    off = {(r["model"], r["run"].replace(f", {FOLD_OFF}", "")): r for r in rows
           if r.get("status") == "ok" and r.get("fold_bn") is False}  # fmt: skip
    if not off:
        return []
    lines = ["", "## With and without the BatchNorm fold (and the copy-free tiles)", "",
             "| model | run | fold | step | Mpx/s | share of patch training | peak allocated | plan |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for (model, run), r_off in off.items():
        r_on = next((x for x in rows if x["model"] == model and x["run"] == run and x.get("status") == "ok"), None)
        for label, r in (("off", r_off), ("on", r_on)):
            if r is not None:
                lines.append(f"| {model} | {run} | {label} | {r['step_s']:.3f} s | {r['mpx_per_s']:.3g} | "
                             f"{_share(r, rows)} | {_peak(r)} | {r.get('plan', '')} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (the code path, small)")
    ap.add_argument("--size", type=int, default=8192, help="image edge in px (default 8192)")
    ap.add_argument("--models", default="resnet50,vgg16,darknet19")
    ap.add_argument("--budget", default=BUDGET, help=f"the capped runs' budget (default {BUDGET}, the 2080 Ti's)")
    ap.add_argument("--patches", type=int, default=256, help="patches of 224 px in the patch case (default 256)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case (default 3)")
    ap.add_argument("--case-seconds", type=float, default=20.0, help="stop timing a case after this (default 20)")
    ap.add_argument("--quick", action="store_true", help="one timed step, 4 patches of 64 px: the code path only")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks")
    ap.add_argument("--deadline", type=float, default=420.0,
                    help="start no case after this many seconds (default 420: the whole kit within 8 minutes)")
    ap.add_argument("--trace", action="store_true", help="also write each profiled step's Chrome trace (gzipped)")
    ap.add_argument("--profile-all", action="store_true",
                    help="also profile every other model's capped and plain NCHW steps")  # fmt: skip
    ap.add_argument("--fold-compare", action="store_true",
                    help="also run the capped SFT steps (and the first model's uncapped one) without the BatchNorm "
                    "fold and the copy-free tiles: the tables with and without them (issue 57)")  # fmt: skip
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device here: run with --device cpu --size 512 --quick for the code path", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    steps, patches, patch = (1, 4, 64) if a.quick else (a.steps, a.patches, 224)
    rows: list[dict[str, Any]] = []
    profs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for item in session_order(cases(models, a.budget, patches, patch, a.fold_compare), a.profile_all):
        if time.perf_counter() - t0 > a.deadline:  # what ran is kept; what did not is a row that says so
            if isinstance(item, Case):
                rows.append({"model": item.model, "run": item.name, "size": a.size, "status": "skipped",
                             "note": f"past --deadline {a.deadline:.0f} s"})  # fmt: skip
            continue
        if isinstance(item, Case):
            row = run_case(item, device, a.size, patch, steps, a.case_seconds)
            rows.append(row)
            step = f"{row['step_s']:.3f} s" if row["status"] == "ok" else row["status"]
            print(f"[{time.perf_counter() - t0:6.1f} s] {item.model}: {item.name}: {step}", flush=True)
        else:
            try:
                trace = a.out / f"trace_{len(profs)}.json.gz" if a.trace else None
                profs.append(profile_step(item.case, device, a.size, patch, trace))
                print(f"[{time.perf_counter() - t0:6.1f} s] profile: {item.case.model}: {item.case.name}: "
                      f"{profs[-1]['step_s']:.3f} s", flush=True)  # fmt: skip
            except Exception as e:  # the table stands without the profile
                print(f"profile failed: {type(e).__name__}: {e}", file=sys.stderr)
        # written after every case: a session cut short (a lease's end, a timeout) keeps what it measured
        write_tables(a.out, rows, profs, argv)
    print(f"wrote {a.out / 'gpu_session.md'} and gpu_session.jsonl in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
