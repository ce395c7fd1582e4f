"""`wsitrain fit`: train a slide-level classifier through the SFT engine and leave a trustworthy run folder."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.train import distributed as D
from wsitrain.train.progress import summary_table
from wsitrain.train.recipe import FitCallback, FitRecipe
from wsitrain.train.runfolder import write_json


def run_fit(
    cfg: WsiTrainConfig,
    *,
    resume: Path | None = None,
    force: bool = False,
    name: str | None = None,
    console: Console | None = None,
    quiet: bool = False,
    callbacks: Sequence[FitCallback] = (),
    shapes_only: bool = False,
    brief: bool = False,
) -> Path:
    """Train as ``cfg`` says; return the run folder. Input errors are raised before anything is trained or written."""
    console = console or Console()
    dc = cfg.distributed
    # `wsitrain cv` joins the process group once for all its folds: a fit inside it leaves the group open
    owned = not torch.distributed.is_available() or not torch.distributed.is_initialized()
    info = D.init_distributed(dc.backend, "cuda" if _wants_cuda(cfg) else "cpu", dc.collective_timeout_minutes)
    try:
        t_start = time.perf_counter()
        recipe = FitRecipe(cfg, console=console, quiet=quiet, dist=info, callbacks=callbacks, shapes_only=shapes_only,
                           brief=brief)
        run_dir = recipe.setup(resume=resume, force=force, name=name)
        recipe.train()
        summary = recipe.summary(time.perf_counter() - t_start)
        if info.is_main:
            write_json(run_dir / "summary.json", summary)
            console.print(summary_table(summary))
        return run_dir
    finally:
        if owned:
            D.cleanup(info)


def _wants_cuda(cfg: WsiTrainConfig) -> bool:
    return cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and torch.cuda.is_available())
