"""`wsitrain fit`: train a slide-level classifier through the SFT engine and leave a trustworthy run folder."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape

from wsitrain.config import config_to_dict, diff_configs
from wsitrain.errors import WsiTrainError
from wsitrain.report.curves import write_curves
from wsitrain.report.roc import write_validation_figures
from wsitrain.train import distributed as D
from wsitrain.train.checkpoint import load_checkpoint, rng_states, save_checkpoint, set_rng_states
from wsitrain.train.data import FitData, augment_settings, epoch_order, load_fit_data, read_kwargs
from wsitrain.train.engine import batchnorm_note, build_model, resolve_device, seed_everything, wrap_engine
from wsitrain.train.loop import Trainer
from wsitrain.train.metrics import classification_metrics
from wsitrain.train.optim import build_optimizer, build_scheduler
from wsitrain.train.progress import FitProgress, summary_table
from wsitrain.train.recorder import RunRecorder
from wsitrain.train.recorder import slide_id as _slide_id
from wsitrain.train.runfolder import create_run_dir, library_versions, read_yaml, write_json, write_yaml

# Test hook: raise KeyboardInterrupt once this many optimizer steps are done (after any checkpoint of that step),
# to simulate a kill at a known point without timing.
STOP_ENV = "WSITRAIN_STOP_AFTER_STEPS"


def run_fit(
    cfg: Any,
    *,
    resume: Path | None = None,
    force: bool = False,
    name: str | None = None,
    console: Console | None = None,
    quiet: bool = False,
) -> Path:
    """Train as ``cfg`` says; return the run folder. Input errors are raised before anything is trained or written."""
    console = console or Console()
    info = D.init_distributed(cfg.distributed.backend, "cuda" if _wants_cuda(cfg) else "cpu")
    try:
        return _fit(cfg, resume=resume, force=force, name=name, console=console, quiet=quiet, info=info)
    finally:
        D.cleanup(info)


def _wants_cuda(cfg: Any) -> bool:
    return cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and torch.cuda.is_available())


def _fit(
    cfg: Any, *, resume: Path | None, force: bool, name: str | None, console: Console, quiet: bool, info: D.DistInfo
) -> Path:
    t_start = time.perf_counter()
    main = info.is_main
    out = console if main else Console(quiet=True)
    device = resolve_device(cfg.engine.device, info)

    # ---- everything that can fail on the user's input, before training starts or a folder is made
    data = load_fit_data(cfg)
    cfg_dict = config_to_dict(cfg)
    ckpt, resume_dir = None, None
    if resume is not None:
        ckpt, resume_dir = _load_resume(Path(resume), cfg_dict, force)

    seed_everything(cfg.seed, cfg.deterministic)
    model = build_model(cfg, len(data.class_names))
    engine = wrap_engine(model, cfg, device)
    t = cfg.train
    optimizer = build_optimizer(model.parameters(), t.optimizer, t.lr, t.momentum, t.weight_decay)
    steps_per_epoch = _steps_per_epoch(len(D.shard(list(range(len(data.train))), info)), t.accumulate)
    scheduler = build_scheduler(optimizer, t.schedule, steps_per_epoch * t.epochs, t.warmup_steps)
    trainer = Trainer(
        engine, optimizer, scheduler, device=device, precision=t.precision, loss=t.loss,
        clip_grad_norm=t.clip_grad_norm, dist=info, bucket_mb=cfg.distributed.bucket_mb,
    )

    # ---- run folder: a new one, or the resumed one (only rank 0 writes)
    run_dir = resume_dir
    if main and run_dir is None:
        run_dir, note = create_run_dir(Path(cfg.log.dir), name or cfg.name)
        if note:
            out.print(f"[yellow]{escape(note)}[/yellow]")
    run_dir = Path(D.broadcast_object(str(run_dir), info))
    if main:
        _write_run_files(run_dir, cfg_dict, ckpt, force, device, data)

    state = {"epoch": 0, "next_index": 0, "global_step": 0, "best": math.inf, "history": []}
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        trainer.load_state_dict(ckpt)
        state.update({k: ckpt[k] for k in state if k in ckpt})
        set_rng_states(ckpt["rng"])
        out.print(
            f"resuming {escape(str(run_dir))} at epoch {state['epoch'] + 1}, slide {state['next_index'] + 1}, "
            f"step {state['global_step']} (lr {trainer.lr:.3g})"
        )

    out.print(f"run folder: {run_dir}", markup=False)
    out.print(
        f"model {cfg.model.name}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{len(data.class_names)} classes ({escape(', '.join(map(str, data.class_names)))}); "
        f"{batchnorm_note(model, cfg.model.freeze_bn)}"
    )
    out.print(
        f"data: {len(data.train)} training and {len(data.val)} validation slides; device {device}"
        + (f"; {info.world_size} ranks" if info.enabled else "")
    )

    recorder = RunRecorder(run_dir if main else None, cfg, engine, out)
    if ckpt is not None:
        # Rows after this marker redo the steps a killed run had logged past its last checkpoint.
        recorder.metrics.write({"kind": "resume", "epoch": state["epoch"] + 1, "index": state["next_index"],
                                "step": state["global_step"], "forced": bool(force)})
    try:
        with FitProgress(out, quiet or not main, t.epochs, engine) as progress:
            _train(cfg, data, trainer, engine, state, recorder, progress, info, run_dir, cfg_dict, model)
    except KeyboardInterrupt:
        out.print(
            f"[yellow]interrupted; the last checkpoint is {escape(str(run_dir / 'last.pt'))}; continue with "
            f"`wsitrain fit CONFIG --resume {escape(str(run_dir))}`[/yellow]"
        )
        raise
    finally:
        recorder.close()

    summary = recorder.summary(run_dir, state, time.perf_counter() - t_start)
    if main:
        write_json(run_dir / "summary.json", summary)
        out.print(summary_table(summary))
    return run_dir


def _steps_per_epoch(n_slides: int, accumulate: int) -> int:
    return max(1, -(-n_slides // accumulate))


def _load_resume(resume: Path, cfg_dict: dict[str, Any], force: bool) -> tuple[dict[str, Any], Path]:
    """The checkpoint to continue from (a run folder means its last.pt); refuse a changed config unless forced."""
    path = resume / "last.pt" if resume.is_dir() else resume
    if not resume.exists():
        raise WsiTrainError(f"--resume {resume}: no such run folder", hint="pass a folder under runs/ written by fit")
    if not path.is_file():
        raise WsiTrainError(
            f"--resume {resume}: no last.pt in it (the run stopped before its first checkpoint)",
            hint="start a new run instead, or set train.checkpoint_every to checkpoint within an epoch",
        )
    ckpt = load_checkpoint(path)
    old = ckpt.get("config", {})
    changed = [k for k in diff_configs(old, cfg_dict) if k != "name"]
    if changed and not force:
        details = "; ".join(f"{k}: {_get(old, k)!r} -> {_get(cfg_dict, k)!r}" for k in changed)
        raise WsiTrainError(
            f"--resume {resume}: the config differs from the run's in {len(changed)} key(s): {details}",
            hint="resume with the run's own config (its config.yaml), or add --force to continue with the new one",
        )
    return ckpt, path.parent


def _get(d: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _write_run_files(
    run_dir: Path, cfg_dict: dict[str, Any], ckpt: dict[str, Any] | None, force: bool, device: torch.device,
    data: FitData,
) -> None:
    """config.yaml and versions.json; on a forced resume with a changed config, config.resume-N.yaml instead."""
    if ckpt is None:
        write_yaml(run_dir / "config.yaml", cfg_dict)
        write_json(run_dir / "versions.json", library_versions(device))
        write_json(run_dir / "data.json", {
            "labels": str(data.labels_csv), "classes": data.class_names,
            "train": [_slide_id(r) for r in data.train], "val": [_slide_id(r) for r in data.val],
        })
        return
    saved = run_dir / "config.yaml"
    if saved.exists() and not diff_configs(read_yaml(saved), cfg_dict):
        return
    i = 1
    while (run_dir / f"config.resume-{i}.yaml").exists():
        i += 1
    write_yaml(run_dir / f"config.resume-{i}.yaml", cfg_dict)
    write_json(run_dir / f"versions.resume-{i}.json", library_versions(device))


def _train(
    cfg: Any, data: FitData, trainer: Trainer, engine: torch.nn.Module, state: dict[str, Any], recorder: RunRecorder,
    progress: FitProgress, info: D.DistInfo, run_dir: Path, cfg_dict: dict[str, Any], model: torch.nn.Module,
) -> None:
    """The epochs: slides in a seeded order, optimizer steps every ``accumulate`` slides, checkpoints, validation."""
    from wsitrain.slides.dataset import PrefetchLoader, SlideDataset

    t = cfg.train
    stop_after = int(os.environ.get(STOP_ENV, "0") or 0)
    rk = read_kwargs(cfg, int(getattr(model, "stride", 1)))
    train_ds = SlideDataset(data.train, rk, augment_settings(cfg), cfg.seed)
    val_ds = SlideDataset(data.val, rk, None, cfg.seed) if data.val else None

    def checkpoint(path_name: str, epoch: int, next_index: int) -> None:
        if not info.is_main:
            return
        save_checkpoint(
            run_dir / path_name, model=model.state_dict(), **trainer.state_dict(), epoch=epoch, next_index=next_index,
            global_step=state["global_step"], best=state["best"], history=state["history"], rng=rng_states(),
            config=cfg_dict, class_names=data.class_names,
        )

    for epoch in range(state["epoch"], t.epochs):
        _set_epoch(train_ds, epoch)
        order = D.shard(epoch_order(len(data.train), cfg.seed, epoch), info)
        start = state["next_index"] if epoch == state["epoch"] else 0
        progress.start_epoch(epoch, len(order), start)
        losses: list[float] = []
        window_start = start
        todo = order[start:]
        loader = PrefetchLoader(train_ds, todo) if cfg.data.prefetch else _plain_loader(train_ds, todo)
        t_wait = time.perf_counter()
        for j, item in enumerate(loader, start=start):
            image, label, record, read = item
            wait_s = time.perf_counter() - t_wait
            window = min(t.accumulate, len(order) - window_start)
            recorder.plan_if_new(image, trainer, _slide_id(record))
            tiles_total = recorder.tiles_total(image, trainer)
            progress.start_slide(_slide_id(record), tiles_total)
            step = trainer.train_slide(image, label, 1.0 / window)
            losses.append(step.loss)
            lr = trainer.lr
            closes = j + 1 - window_start == window
            step_no = state["global_step"] + 1  # the optimizer step this slide's gradient goes into (1-based)
            opt = trainer.optimizer_step() if closes else {"optimizer_s": None, "grad_norm": None}
            if closes:
                state["global_step"] += 1
                window_start = j + 1
            recorder.slide(epoch, step_no, j, record, label, step, read, wait_s, lr, opt,
                           tuple(image.shape[-2:]))
            progress.end_slide(step.loss, step.peak_bytes)
            if closes and state["global_step"] % cfg.log.every == 0:
                progress.step_line(epoch, j, len(order), state["global_step"], step.loss, lr, step.peak_bytes)
            if closes:
                every = t.checkpoint_every
                if every and state["global_step"] % every == 0 and j + 1 < len(order):
                    checkpoint("last.pt", epoch, j + 1)
                if stop_after and state["global_step"] >= stop_after:
                    raise KeyboardInterrupt(f"{STOP_ENV}={stop_after}")
            t_wait = time.perf_counter()
        train_loss = _mean_over_ranks(losses, info)
        state["history"].append({"epoch": epoch + 1, "train_loss": train_loss})
        progress.end_epoch(epoch, train_loss, trainer.lr)
        improved = False
        if val_ds is not None and ((epoch + 1) % t.val_every == 0 or epoch + 1 == t.epochs):
            metrics = _validate(val_ds, data.val, trainer, info, run_dir if info.is_main else None, data.class_names)
            recorder.validation(epoch, state["global_step"], metrics)
            progress.validation(epoch, metrics)
            state["history"][-1].update({f"val_{k}": v for k, v in metrics.items()})
            improved = metrics["loss"] < state["best"]
            state["best"] = min(state["best"], metrics["loss"])
        elif val_ds is None and train_loss < state["best"]:
            improved, state["best"] = True, train_loss  # no validation slides: best by training loss
        state["epoch"], state["next_index"] = epoch + 1, 0
        if info.is_main:
            write_curves(run_dir)
        checkpoint("last.pt", epoch + 1, 0)
        if improved:
            checkpoint("best.pt", epoch + 1, 0)
        D.barrier(info)


def _set_epoch(ds: Any, epoch: int) -> None:
    # Augmentations must depend on (seed, epoch, slide) only, so a resume draws the same ones.
    if hasattr(ds, "set_epoch"):
        ds.set_epoch(epoch)


def _plain_loader(ds: Any, order: list[int]) -> Any:
    for i in order:
        yield ds[i]


def _mean_over_ranks(values: list[float], info: D.DistInfo) -> float:
    gathered = D.gather_objects(values, info)
    flat = [v for part in gathered for v in part]
    return float(np.mean(flat)) if flat else math.nan


def _validate(
    ds: Any, records: list[Any], trainer: Trainer, info: D.DistInfo, run_dir: Path | None, class_names: list[str]
) -> dict[str, float]:
    """Loss, accuracy, balanced accuracy and ROC AUC over the validation slides (split across ranks)."""
    mine = list(range(len(records)))[info.rank :: info.world_size]
    results = []
    t0 = time.perf_counter()
    for i in mine:
        image, label, record, _read = ds[i]
        r = trainer.eval_slide(image, label)
        results.append((int(label), r.loss, r.probs.numpy(), _slide_id(record), str(getattr(record, "path", ""))))
    results = [x for part in D.gather_objects(results, info) for x in part]
    labels = np.array([r[0] for r in results])
    probs = np.stack([r[2] for r in results])
    metrics = {"loss": float(np.mean([r[1] for r in results]))}
    metrics.update(classification_metrics(labels, probs))
    metrics["n"] = len(results)
    metrics["seconds"] = time.perf_counter() - t0
    if run_dir is not None:  # roc.png, confusion.png and validation.json of this validation
        write_validation_figures(run_dir, labels, probs, class_names, [r[3] for r in results], [r[4] for r in results])
    return metrics
