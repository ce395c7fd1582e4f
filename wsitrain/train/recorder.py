"""Everything a fit writes while it runs: metrics.jsonl, tiles.jsonl, plans, TensorBoard scalars, summary facts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from wsitrain.config import LogConfig
from wsitrain.precision import activation_dtype
from wsitrain.sft import SFT, Plan
from wsitrain.sft.ops.patch_grid import is_patch_module
from wsitrain.sft.planning.tissue_share import tissue_tile_share
from wsitrain.sft.source import is_source
from wsitrain.slides.dataset import SlideRecord
from wsitrain.slides.stream import ReadResult
from wsitrain.train.loop import OptimizerStep, SlideStep
from wsitrain.train.runfolder import JsonlWriter
from wsitrain.train.state import FitState
from wsitrain.units import format_bytes
from wsitrain.write_errors import named_write_errors


class RunRecorder:
    """Appends to the run folder's logs (``run_dir`` None: a non-main rank, nothing is written)."""

    def __init__(self, run_dir: Path | None, log: LogConfig, precision: str, engine: SFT, console: Console) -> None:
        self.run_dir = run_dir
        self.engine = engine
        trunk = next((m for m in engine.model.modules() if is_patch_module(m)), None)
        self._patch: int | None = None if trunk is None else int(trunk.patch)  # a patch encoder: shares per patch
        self.console = console
        self.tiles_mode = log.tiles
        self.full_plans = log.plans == "full"
        self.dtype = activation_dtype(precision)
        self.metrics = JsonlWriter(run_dir / "metrics.jsonl" if run_dir else None)
        self.tiles = JsonlWriter(run_dir / "tiles.jsonl" if run_dir and self.tiles_mode != "off" else None)
        self.plans = JsonlWriter(run_dir / "plans.jsonl" if run_dir else None)
        self._plans: dict[tuple[int, ...], Plan] = {}
        self._times: dict[str, list[float]] = {k: [] for k in ("read_s", "wait_s", "forward_s", "backward_s",
                                                               "optimizer_s", "step_s", "read_mpx_per_s",
                                                               "tissue_fraction", "computed_tile_share")}
        self._peak = 0
        self._last_val: dict[str, float] = {}
        self._last_train_loss = math.nan
        self.tb = _tensorboard(run_dir, log, console)

    # ---- plans
    def plan_for(self, image: torch.Tensor) -> Plan:
        """The plan the engine runs for this slide: its shape, its dtype (uint8) and where it lives (the host)."""
        shape = (1, *image.shape[-3:])
        if shape not in self._plans:
            x = image if is_source(image) else image.reshape(shape)  # a slide read tile by tile is (1, 3, H, W)
            self._plans[shape] = self.engine.plan_of(x, self.dtype)  # type: ignore[arg-type]
        return self._plans[shape]

    def forget_plans(self) -> None:
        """The engine re-planned (a lowered budget): each shape's new plan is logged when it next appears."""
        self._plans.clear()

    def plan_if_new(self, image: torch.Tensor, slide: str) -> None:
        """Print and log the engine's plan the first time a slide shape appears (each shape has its own plan)."""
        shape = (1, *image.shape[-3:])
        if shape in self._plans:
            return
        plan = self.plan_for(image)
        # markup=False: the plan's "[conv1 .. pool4]" layer ranges are not rich markup tags.
        self.console.print(f"engine plan for {tuple(shape)} (first seen on slide {slide}):"
                           + (f"\n{plan}" if self.full_plans else f" {plan_line(plan, self.run_dir)}"),
                           markup=False, highlight=False)  # fmt: skip
        self.plans.write({"slide": slide, "shape": list(shape), "plan": plan.to_dict()})
        if self.run_dir is not None:
            with named_write_errors(self.run_dir / "plan.txt"), open(self.run_dir / "plan.txt", "a") as f:
                f.write(f"# input {tuple(shape)}, first seen on slide {slide}\n{plan}\n\n")

    def tiles_total(self, image: torch.Tensor) -> int:
        """Forward plus backward tiles of a training step on this slide (tiled segments only)."""
        plan = self.plan_for(image)
        return int(sum(s.n_forward_tiles + s.n_tiles for s in plan.segments if s.mode == "tiled"))

    # ---- per slide
    def slide(
        self, epoch: int, step: int, index: int, record: SlideRecord, res: SlideStep, read: ReadResult,
        wait_s: float, lr: float, opt: OptimizerStep | None,
    ) -> None:
        """One training slide's row; ``opt`` is the optimizer step it closed (None inside an accumulation window)."""
        sid = record.slide_id
        read_s = read.seconds
        optimizer_s = opt.seconds if opt is not None else None
        step_s = res.forward_s + res.backward_s + (optimizer_s or 0.0) + wait_s
        self._peak = max(self._peak, res.peak_bytes)
        self._last_train_loss = res.loss
        for key, value in (("read_s", read_s), ("wait_s", wait_s), ("forward_s", res.forward_s),
                           ("backward_s", res.backward_s), ("optimizer_s", optimizer_s), ("step_s", step_s),
                           ("read_mpx_per_s", read.mpx_per_s), ("tissue_fraction", read.tissue_fraction)):
            if value is not None and math.isfinite(value):
                self._times[key].append(value)
        stats = res.stats
        visits = stats.tile_count
        reused = stats.reused_forward + stats.reused_backward
        computed_share = (visits - reused - stats.skipped_backward) / visits if visits else None
        # the time model's step over plain training's at this slide's share of tiles holding tissue (the rest is
        # flat background, computed once): counted on the image at the first tiled segment's tiles
        plan = self._plans.get((1, *read.image.shape[-3:]))
        # (not counted on a slide read tile by tile: that would decode the whole slide once more)
        tile_share = (tissue_tile_share(read.image, plan, self._patch) if plan is not None
                      and not is_source(read.image) else None)  # fmt: skip
        predicted = plan.slowdown_at(1.0 if tile_share is None else tile_share) if plan is not None else None
        if computed_share is not None:
            self._times["computed_tile_share"].append(computed_share)
        self.metrics.write({
            "kind": "train", "epoch": epoch + 1, "step": step, "index": index, "slide": sid, "label": record.label,
            "loss": res.loss, "probs": [float(v) for v in res.probs.tolist()], "lr": lr, "step_s": step_s,
            "read_s": read_s, "wait_s": wait_s,
            "read_mb_per_s": read.mb_per_s, "read_mpx_per_s": read.mpx_per_s, "read_threads": read.threads,
            # data.mask_background: kept share of the input (null: masking off or no tissue found) and chunks
            # never decoded because they lie wholly outside the tissue mask.
            "tissue_fraction": read.tissue_fraction, "chunks_decoded": read.chunks_decoded,
            "chunks_skipped": read.chunks_skipped,
            "forward_s": res.forward_s,
            "backward_s": res.backward_s, "optimizer_s": optimizer_s,
            "grad_norm": opt.grad_norm if opt is not None else None,
            "peak_bytes": res.peak_bytes, "shape": list(read.image.shape[-2:]),
            "tiles": len(stats.tiles), "recomputed_tiles": stats.recomputed_tiles,
            # background tiles whose cached work was added, and tiles max pooling gives no gradient (not computed)
            "tiles_reused_forward": stats.reused_forward, "tiles_reused_backward": stats.reused_backward,
            "tiles_skipped_backward": stats.skipped_backward, "computed_tile_share": computed_share,
            "tissue_tile_share": tile_share, "predicted_slowdown": predicted,
        })
        if self.tiles_mode == "all":
            for t in stats.tiles:
                self.tiles.write({"epoch": epoch + 1, "step": step, "slide": sid, "segment": t.segment,
                                  "row": t.row, "col": t.col, "phase": t.phase, "ms": t.ms, "bytes": t.peak_bytes})
        elif self.tiles_mode == "summary":
            self.tiles.write({"epoch": epoch + 1, "step": step, "slide": sid, **stats.summary()})
        if self.tb is not None and opt is not None:
            self.tb.add_scalar("train/loss", res.loss, step)
            self.tb.add_scalar("train/lr", lr, step)
            self.tb.add_scalar("time/step_s", step_s, step)

    def head_slide(self, row: dict[str, Any], optimizer_s: float | None, wait_s: float) -> None:
        """A training slide's row on the feature cache (wsitrain.train.cached_head: no read, no tiles); ``wait_s``
        includes reading (or embedding) its bag."""
        step_s = row["forward_s"] + row["backward_s"] + (optimizer_s or 0.0) + wait_s
        row = {**row, "optimizer_s": optimizer_s, "wait_s": wait_s, "step_s": step_s}
        for key in ("forward_s", "backward_s", "optimizer_s", "step_s", "wait_s"):
            if row[key] is not None:
                self._times[key].append(row[key])
        self._last_train_loss = row["loss"]
        self.metrics.write(row)
        if self.tb is not None and optimizer_s is not None:
            self.tb.add_scalar("train/loss", row["loss"], row["step"])
            self.tb.add_scalar("train/lr", row["lr"], row["step"])
            self.tb.add_scalar("time/step_s", step_s, row["step"])

    def validation(self, epoch: int, step: int, metrics: dict[str, float]) -> None:
        self._last_val = dict(metrics)
        self.metrics.write({"kind": "val", "epoch": epoch + 1, "step": step, **metrics})
        if self.tb is not None:
            for k in ("loss", "accuracy", "balanced_accuracy", "roc_auc"):
                if not math.isnan(metrics.get(k, math.nan)):
                    self.tb.add_scalar(f"val/{k}", metrics[k], step)

    @property
    def last_validation(self) -> dict[str, float]:
        return dict(self._last_val)

    # ---- end
    def summary(self, run_dir: Path, state: FitState, wall_s: float) -> dict[str, Any]:
        def mean(key: str) -> float:
            v = self._times[key]
            return float(np.mean(v)) if v else math.nan

        hist = state.history
        return {
            "run_folder": str(run_dir),
            "epochs": state.epoch,
            "optimizer_steps": state.global_step,
            "first_epoch_train_loss": hist[0]["train_loss"] if hist else math.nan,
            "last_epoch_train_loss": hist[-1]["train_loss"] if hist else math.nan,
            "val_loss": self._last_val.get("loss", math.nan),
            "val_accuracy": self._last_val.get("accuracy", math.nan),
            "val_balanced_accuracy": self._last_val.get("balanced_accuracy", math.nan),
            "val_roc_auc": self._last_val.get("roc_auc", math.nan),
            # near 0: every validation slide got about the same output (wsitrain.train.plateau)
            "val_output_spread": self._last_val.get("output_spread", math.nan),
            "best_val_loss": state.best if self._last_val else math.nan,
            "mean_read_s": mean("read_s"),
            # Per-slide rates averaged (not total px / total s): the figure a slow slide or format stands out in.
            "mean_read_mpx_per_s": mean("read_mpx_per_s"),
            # Over the slides that were masked (data.mask_background on and tissue found); NaN when none was.
            "mean_tissue_fraction": mean("tissue_fraction"),
            # tile visits that computed (not reused background, not skipped under max pooling), per step averaged
            "mean_computed_tile_share": mean("computed_tile_share"),
            "mean_wait_for_read_s": mean("wait_s"),
            "mean_forward_s": mean("forward_s"),
            "mean_backward_s": mean("backward_s"),
            "mean_optimizer_s": mean("optimizer_s"),
            "mean_slide_s": mean("step_s"),
            "peak_bytes": self._peak or None,
            "wall_s": wall_s,
        }

    def close(self) -> None:
        for w in (self.metrics, self.tiles, self.plans):
            w.close()
        if self.tb is not None:
            self.tb.close()


def plan_line(plan: Plan, run_dir: Path | None) -> str:
    """A plan in one line, for the log of a fit (log.plans: line): its segments, its peak against the budget, its
    predicted slowdown and its notes' count, and where the full plan is."""
    fits = "fits" if plan.fits else "DOES NOT FIT"
    notes = f", {len(plan.notes)} note{'s' if len(plan.notes) != 1 else ''}" if plan.notes else ""
    where = f"; full plan in {run_dir / 'plan.txt'}" if run_dir is not None else ""
    return (f"{plan.brief}; {fits}, estimated peak {format_bytes(plan.estimated_peak_bytes)} of "
            f"{format_bytes(plan.budget_bytes)}, step {plan.slowdown:.2f}x plain (planned){notes}{where} "
            "(log.plans: full prints it here)")


def _tensorboard(run_dir: Path | None, log: LogConfig, console: Console) -> Any:
    if run_dir is None or not log.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is optional: say so once and carry on
        console.print("[yellow]log.tensorboard is on but tensorboard is not installed; skipping its scalars "
                      "(pip install tensorboard)[/yellow]")
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))
