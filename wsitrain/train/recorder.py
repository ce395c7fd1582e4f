"""Everything a fit writes while it runs: metrics.jsonl, tiles.jsonl, plans, TensorBoard scalars, summary facts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from wsitrain.memory import peak_rss_bytes
from wsitrain.train.runfolder import JsonlWriter

_PLAN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RunRecorder:
    """Appends to the run folder's logs (``run_dir`` None: a non-main rank, nothing is written)."""

    def __init__(self, run_dir: Path | None, cfg: Any, engine: Any, console: Console) -> None:
        self.run_dir = run_dir
        self.engine = engine
        self.console = console
        self.tiles_mode = cfg.log.tiles
        self.dtype = _PLAN_DTYPES.get(cfg.train.precision, torch.float32)
        self.metrics = JsonlWriter(run_dir / "metrics.jsonl" if run_dir else None)
        self.tiles = JsonlWriter(run_dir / "tiles.jsonl" if run_dir and self.tiles_mode != "off" else None)
        self.plans = JsonlWriter(run_dir / "plans.jsonl" if run_dir else None)
        self._plans: dict[tuple[int, ...], Any] = {}
        self._times: dict[str, list[float]] = {k: [] for k in ("read_s", "wait_s", "forward_s", "backward_s",
                                                               "optimizer_s", "step_s")}
        self._peak = 0
        self._last_val: dict[str, float] = {}
        self._last_train_loss = math.nan
        self.tb = _tensorboard(run_dir, cfg, console)

    # ---- plans
    def plan_for(self, image: torch.Tensor) -> Any:
        shape = (1, *image.shape[-3:])
        if shape not in self._plans:
            self._plans[shape] = self.engine.plan_for(shape, self.dtype)
        return self._plans[shape]

    def plan_if_new(self, image: torch.Tensor, trainer: Any, slide: str) -> None:
        """Print and log the engine's plan the first time a slide shape appears (each shape has its own plan)."""
        shape = (1, *image.shape[-3:])
        if shape in self._plans:
            return
        plan = self.plan_for(image)
        # markup=False: the plan's "[conv1 .. pool4]" layer ranges are not rich markup tags.
        self.console.print(f"engine plan for {tuple(shape)} (first seen on slide {slide}):\n{plan}", markup=False,
                           highlight=False)
        if not getattr(plan, "fits", True):
            self.console.print(
                "[yellow]warning: the estimated peak exceeds engine.memory_budget; the run may run out of memory "
                "(lower data.size/mpp or set engine.tile_size smaller)[/yellow]"
            )
        self.plans.write({"slide": slide, "shape": list(shape), "plan": plan.to_dict()})
        if self.run_dir is not None:
            with open(self.run_dir / "plan.txt", "a") as f:
                f.write(f"# input {tuple(shape)}, first seen on slide {slide}\n{plan}\n\n")

    def tiles_total(self, image: torch.Tensor, trainer: Any) -> int:
        """Forward plus backward tiles of a training step on this slide (tiled segments only)."""
        plan = self.plan_for(image)
        return 2 * int(sum(s.n_tiles for s in plan.segments if s.mode == "tiled"))

    # ---- per slide
    def slide(
        self, epoch: int, step: int, index: int, record: Any, label: int, res: Any, read: Any, wait_s: float,
        lr: float, opt: dict[str, Any], shape: tuple[int, ...] = (),
    ) -> None:
        sid = slide_id(record)
        read_s = float(getattr(read, "seconds", math.nan))
        step_s = res.forward_s + res.backward_s + (opt["optimizer_s"] or 0.0) + wait_s
        rss = peak_rss_bytes()
        self._peak = max(self._peak, res.peak_bytes or 0)
        self._last_train_loss = res.loss
        for key, value in (("read_s", read_s), ("wait_s", wait_s), ("forward_s", res.forward_s),
                           ("backward_s", res.backward_s), ("optimizer_s", opt["optimizer_s"]), ("step_s", step_s)):
            if value is not None and not math.isnan(value):
                self._times[key].append(value)
        stats = res.stats
        self.metrics.write({
            "kind": "train", "epoch": epoch + 1, "step": step, "index": index, "slide": sid, "label": label,
            "loss": res.loss, "probs": [float(v) for v in res.probs.tolist()], "lr": lr, "step_s": step_s,
            "read_s": read_s, "wait_s": wait_s,
            "read_mb_per_s": getattr(read, "mb_per_s", None), "forward_s": res.forward_s,
            "backward_s": res.backward_s, "optimizer_s": opt["optimizer_s"], "grad_norm": opt["grad_norm"],
            "peak_bytes": res.peak_bytes, "rss_peak_bytes": rss, "shape": list(shape),
            "tiles": len(stats.tiles) if stats is not None else 0,
            "recomputed_tiles": getattr(stats, "recomputed_tiles", None),
        })
        if stats is not None and self.tiles_mode == "all":
            for t in stats.tiles:
                self.tiles.write({"epoch": epoch + 1, "step": step, "slide": sid, "segment": t.segment,
                                  "row": t.row, "col": t.col, "phase": t.phase, "ms": t.ms, "bytes": t.peak_bytes})
        elif stats is not None and self.tiles_mode == "summary":
            self.tiles.write({"epoch": epoch + 1, "step": step, "slide": sid, **stats.summary()})
        if self.tb is not None and opt["optimizer_s"] is not None:
            self.tb.add_scalar("train/loss", res.loss, step)
            self.tb.add_scalar("train/lr", lr, step)
            self.tb.add_scalar("time/step_s", step_s, step)

    def validation(self, epoch: int, step: int, metrics: dict[str, float]) -> None:
        self._last_val = dict(metrics)
        self.metrics.write({"kind": "val", "epoch": epoch + 1, "step": step, **metrics})
        if self.tb is not None:
            for k in ("loss", "accuracy", "balanced_accuracy", "roc_auc"):
                if not math.isnan(metrics.get(k, math.nan)):
                    self.tb.add_scalar(f"val/{k}", metrics[k], step)

    # ---- end
    def summary(self, run_dir: Path, state: dict[str, Any], wall_s: float) -> dict[str, Any]:
        def mean(key: str) -> float:
            v = self._times[key]
            return float(np.mean(v)) if v else math.nan

        hist = state.get("history") or []
        return {
            "run_folder": str(run_dir),
            "epochs": state["epoch"],
            "optimizer_steps": state["global_step"],
            "first_epoch_train_loss": hist[0]["train_loss"] if hist else math.nan,
            "last_epoch_train_loss": hist[-1]["train_loss"] if hist else math.nan,
            "val_loss": self._last_val.get("loss", math.nan),
            "val_accuracy": self._last_val.get("accuracy", math.nan),
            "val_balanced_accuracy": self._last_val.get("balanced_accuracy", math.nan),
            "val_roc_auc": self._last_val.get("roc_auc", math.nan),
            "best_val_loss": state["best"] if self._last_val else math.nan,
            "mean_read_s": mean("read_s"),
            "mean_wait_for_read_s": mean("wait_s"),
            "mean_forward_s": mean("forward_s"),
            "mean_backward_s": mean("backward_s"),
            "mean_optimizer_s": mean("optimizer_s"),
            "mean_slide_s": mean("step_s"),
            "peak_bytes": self._peak or None,
            "rss_peak_bytes": peak_rss_bytes(),
            "wall_s": wall_s,
        }

    def close(self) -> None:
        for w in (self.metrics, self.tiles, self.plans):
            w.close()
        if self.tb is not None:
            self.tb.close()


def _tensorboard(run_dir: Path | None, cfg: Any, console: Console) -> Any:
    if run_dir is None or not cfg.log.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is optional: say so once and carry on
        console.print("[yellow]log.tensorboard is on but tensorboard is not installed; skipping its scalars "
                      "(pip install tensorboard)[/yellow]")
        return None
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def slide_id(record: Any) -> str:
    for attr in ("slide_id", "name", "id"):
        if hasattr(record, attr):
            return str(getattr(record, attr))
    path = getattr(record, "path", None)
    return Path(path).name if path is not None else str(record)
