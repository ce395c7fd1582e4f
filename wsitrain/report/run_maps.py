"""Heatmaps of a run's validation slides, for the report: the run's checkpoint, its config's way of reading slides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from wsitrain.report.heatmap_files import HeatmapWriter
from wsitrain.report.runlog import VALIDATION, read_json


def validation_heatmaps(run_dir: Path, out_dir: Path, console: Any = None) -> str | None:
    """Write ``out_dir`` (heatmaps.json, PNGs, .npy) for the slides in validation.json; return a note saying why
    not when the run folder lacks what that needs (None when written)."""
    from wsitrain.config import load_config
    from wsitrain.sft import SFT
    from wsitrain.slides.tile_source import slide_read
    from wsitrain.train.checkpoint import load_checkpoint
    from wsitrain.train.data import read_kwargs
    from wsitrain.train.engine import build_model

    val = read_json(run_dir / VALIDATION)
    if not val or not val.get("slides"):
        return f"no heatmaps: {VALIDATION} (the validation slides) is missing or empty"
    missing = [r["slide"] for r in val["slides"] if not r.get("path") or not Path(r["path"]).is_file()]
    if missing:
        return f"no heatmaps: the slide files of {', '.join(missing[:5])} are not where validation.json says"
    ckpt_path = next((p for p in (run_dir / "best.pt", run_dir / "last.pt") if p.is_file()), None)
    if ckpt_path is None:
        return "no heatmaps: the run folder has no best.pt or last.pt"
    cfg = load_config(run_dir / "config.yaml")
    ckpt = load_checkpoint(ckpt_path)
    classes = [str(c) for c in ckpt.get("class_names") or val["classes"]]
    model = build_model(cfg.model, len(classes), classes, with_weights=False)
    model.load_state_dict(ckpt["model"])
    device = "cuda" if cfg.engine.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    e = cfg.engine
    engine = SFT(model.to(device), memory_budget=e.memory_budget, tile_size=e.tile_size, checkpoints=e.checkpoints,
                 fold_bn=e.fold_bn)
    rk = read_kwargs(cfg, int(getattr(model, "stride", 1)))
    writer = HeatmapWriter(out_dir, classes, viewer=False)  # the page shows PNGs; viewer files are predict's
    for r in val["slides"]:
        label = classes.index(r["label"]) if r.get("label") in classes else None
        with slide_read(r["path"], cfg.data.stream_tiles, **rk) as read:  # data.stream_tiles: tile by tile, as fit
            writer.add(r["path"], read, engine, label=label)
        if console is not None:
            console.print(f"heatmap {out_dir / r['slide']}", markup=False, highlight=False)
    writer.close()
    return None
