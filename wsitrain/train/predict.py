"""`wsitrain predict`: slide-level class probabilities from a fit checkpoint, through the same engine (no backward)."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from wsitrain.config import config_to_dict, diff_configs
from wsitrain.errors import SlideError, WsiTrainError
from wsitrain.report.heatmap_files import HeatmapWriter
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.data import read_kwargs
from wsitrain.train.engine import resolve_device, wrap_engine
from wsitrain.train.loop import Trainer
from wsitrain.train.optim import build_optimizer, build_scheduler

# What OpenSlide and tifffile open; other files in a slides folder (CSV, txt, thumbnails) are ignored.
SLIDE_SUFFIXES = (".svs", ".tif", ".tiff", ".ndpi", ".mrxs", ".scn", ".vms", ".vmu", ".bif", ".svslide", ".ome.tif")


def list_slides(slides: Path) -> list[Path]:
    """The slide files to predict: ``slides`` itself if it is a file, else the slide files in the folder (sorted)."""
    slides = Path(slides)
    if slides.is_file():
        return [slides]
    if not slides.is_dir():
        raise SlideError(f"--slides {slides}: no such file or folder", hint="pass a folder of slides or one slide file")
    found = sorted(p for p in slides.iterdir() if p.is_file() and p.suffix.lower() in SLIDE_SUFFIXES)
    if not found:
        raise SlideError(
            f"--slides {slides}: no slide files in it (looked for {', '.join(SLIDE_SUFFIXES)})",
            hint="pass the folder that holds the slides",
        )
    return found


def _check_readable(paths: list[Path]) -> None:
    """Open every slide first, so a bad file fails the command before any prediction is spent."""
    from wsitrain.slides.readers import open_slide

    problems = []
    for p in paths:
        try:
            open_slide(p).close()
        except SlideError as e:
            problems.append(e.message)
    if problems:
        raise SlideError(
            f"{len(problems)} of {len(paths)} slides cannot be read:\n" + "\n".join(f"  - {m}" for m in problems),
            hint="remove or re-export these files, or point --slides at a folder without them",
        )


def run_predict(
    cfg: Any, *, checkpoint: Path, slides: Path, out: Path, console: Console | None = None,
    heatmaps: Path | None = None, saliency: bool = False,
) -> Path:
    """Write ``out`` (CSV: slide, path, one probability column per class, predicted class); return its path."""
    from wsitrain.models import build
    from wsitrain.slides.stream import read_slide_region

    console = console or Console()
    ckpt = load_checkpoint(Path(checkpoint))
    class_names = [str(c) for c in ckpt.get("class_names") or []]
    trained = ckpt.get("config") or {}
    model_cfg = trained.get("model") or config_to_dict(cfg)["model"]
    if not class_names:
        raise WsiTrainError(f"checkpoint {checkpoint} has no class names", hint="use a checkpoint written by fit")
    paths = list_slides(Path(slides))
    _check_readable(paths)
    out = Path(out)
    if out.parent and not out.parent.exists():
        raise WsiTrainError(f"--out {out}: folder {out.parent} does not exist", hint="create it or choose another path")

    # The architecture comes from the checkpoint (what the weights fit); how to read slides comes from cfg.
    read_changed = [k for k in diff_configs(trained.get("data", {}), config_to_dict(cfg)["data"])
                    if k.split(".")[0] in ("level", "mpp", "magnification", "fallback_mpp", "region", "size")]
    if trained and read_changed:
        console.print(f"[yellow]note: data.{', data.'.join(read_changed)} differ from the training config; "
                      "predictions read slides differently from training[/yellow]")
    model = build(model_cfg["name"], len(class_names), weights=None, pool=model_cfg.get("pool", "avg"),
                  freeze_bn=model_cfg.get("freeze_bn", True))
    model.load_state_dict(ckpt["model"])
    device = resolve_device(cfg.engine.device)
    engine = wrap_engine(model, cfg, device)
    opt = build_optimizer(model.parameters(), "sgd", lr=1.0)  # unused; Trainer needs one, prediction never steps
    runner = Trainer(engine, opt, build_scheduler(opt, "constant", 1), device=device,
                     precision=cfg.train.precision, loss=cfg.train.loss)
    rk = read_kwargs(cfg, int(getattr(model, "stride", 1)))

    maps = HeatmapWriter(Path(heatmaps), class_names, saliency, runner.autocast) if heatmaps is not None else None
    rows = []
    t0 = time.perf_counter()
    for i, p in enumerate(paths, 1):
        read = read_slide_region(p, **rk)
        res = runner.eval_slide(read.image, None)
        probs = res.probs.tolist()
        pred = class_names[int(max(range(len(probs)), key=probs.__getitem__))]
        rows.append([p.name, str(p), *(f"{v:.6f}" for v in probs), pred])
        console.print(f"[{i}/{len(paths)}] {p.name}: {pred} ({max(probs):.3f}), "
                      f"{tuple(read.image.shape[1:])} px, read {read.seconds:.2f} s, forward {res.forward_s:.2f} s",
                      markup=False, highlight=False)
        if maps is not None:
            maps.add(p, read, engine)
    if maps is not None:
        console.print(f"wrote heatmaps of {len(paths)} slides to {maps.close().parent}", markup=False)
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["slide", "path", *(f"prob_{c}" for c in class_names), "predicted"])
        w.writerows(rows)
    secs = time.perf_counter() - t0
    console.print(
        f"wrote {out}: {len(rows)} slides in {secs:.1f} s ({secs / max(1, len(rows)):.2f} s per slide)",
        markup=False, highlight=False,
    )
    return out
