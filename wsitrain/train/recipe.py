"""The training recipe of `wsitrain fit`: setup, train, validate, save (in the style of a torchtune recipe).

``setup`` does everything that can fail on the user's input before the run folder exists: data, resume
checkpoint, model, memory budget (resolved once for the whole run), engine, optimizer. ``train`` runs the epochs:
slides in a seeded order, an optimizer step every ``train.accumulate`` slides, checkpoints, validation.
Callbacks (``FitCallback``) see every optimizer step; tests use them to stop a run at a known point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from torch import nn

from wsitrain.config import WsiTrainConfig, check_run_name, config_to_dict
from wsitrain.errors import PlanError, WsiTrainError
from wsitrain.gpus import Budget, run_budget
from wsitrain.memory import tune_owned_process
from wsitrain.patch.plan_summary import patch_trunk
from wsitrain.preflight import PreflightReport, check_run
from wsitrain.report.curves import write_curves
from wsitrain.report.decision import DecisionWatch
from wsitrain.report.roc import write_validation_figures
from wsitrain.slides.dataset import PrefetchLoader, SlideDataset, SlideRecord
from wsitrain.slides.stream import ReadResult
from wsitrain.tasks.objective import Objective, per_patient
from wsitrain.train import distributed as D
from wsitrain.train.attention_mask import tissue_masked
from wsitrain.train.balance.cost import slide_costs
from wsitrain.train.balance.deal import Balance
from wsitrain.train.balance.waiting import RankWaits
from wsitrain.train.cached_head import CachedHead, why_end_to_end
from wsitrain.train.checkpoint import load_checkpoint, rng_states, save_checkpoint, set_rng_states
from wsitrain.train.class_balance import class_weights, loss_weight, sampled_slides
from wsitrain.train.class_balance import describe as describe_balance
from wsitrain.train.data import FitData, augment_settings, load_fit_data, masking_note, read_kwargs
from wsitrain.train.engine import (
    batchnorm_note,
    build_model,
    check_spill_room,
    host_memory_per_rank,
    one_pass_loss,
    resolve_device,
    seed_everything,
    slide_spill,
    wrap_engine,
)
from wsitrain.train.head_warmup import (
    MAP,
    bags_over_budget,
    head_modules,
    split_held_out,
    trunk_channels,
    warm_up_head,
)
from wsitrain.train.instance_loss import InstanceLoss, instance_loss_spec
from wsitrain.train.loop import Trainer, as_batch
from wsitrain.train.metrics import classification_metrics
from wsitrain.train.oom import OomRetry
from wsitrain.train.optim import build_optimizer, build_scheduler, parameter_groups
from wsitrain.train.plateau import flat_outputs_note
from wsitrain.train.preempt import Preempted, SafePoint, StopSignals, find_job_run, parse_signal, write_job_file
from wsitrain.train.progress import FitProgress
from wsitrain.train.recorder import RunRecorder
from wsitrain.train.runfolder import (
    check_log_dir,
    create_run_dir,
    discard_run_dir,
    drop_rows_after_step,
    load_resume,
    write_json,
    write_run_files,
)
from wsitrain.train.state import FitState
from wsitrain.units import format_bytes

Item = tuple[torch.Tensor, int, SlideRecord, ReadResult]  # (image (3, H, W) uint8, label, record, how it was read)


def _check_head_warmup(cfg: WsiTrainConfig, objective: Objective | None, stride: int) -> None:
    """``train.head_warmup`` needs a classifier, whole reads and patches at least one map cell wide."""
    w = cfg.train.head_warmup
    assert w is not None
    if objective is not None:
        raise WsiTrainError(f"train.head_warmup trains a classifier head, but the task is {objective.kind}",
                            hint="remove train.head_warmup for this task")  # fmt: skip
    if cfg.data.stream_tiles:
        raise WsiTrainError("train.head_warmup reads each training slide whole once, but data.stream_tiles is on",
                            hint="remove train.head_warmup, or set data.stream_tiles: false")  # fmt: skip
    if w.patch < stride:
        raise WsiTrainError(f"train.head_warmup.patch is {w.patch} px, smaller than the model's stride ({stride} px)",
                            hint=f"set train.head_warmup.patch to {stride} or more (a multiple of it)")  # fmt: skip
    if w.layout == MAP and w.patch % stride:
        raise WsiTrainError(f"train.head_warmup.layout: map puts each patch's cells in the slide's map, but patch "
                            f"{w.patch} px is not a multiple of the model's stride ({stride} px)",
                            hint=f"set train.head_warmup.patch to {-(-w.patch // stride) * stride}")  # fmt: skip


def _check_warmup_hold_out(cfg: WsiTrainConfig, labels: list[int]) -> None:
    """``train.head_warmup.hold_out`` leaves every class slides on both sides of its split."""
    w = cfg.train.head_warmup
    assert w is not None
    if w.hold_out > 0:
        try:
            split_held_out(labels, w.hold_out, cfg.seed)
        except ValueError as e:
            raise WsiTrainError(f"train.head_warmup.hold_out: {e}",
                                hint="lower train.head_warmup.hold_out, or set it to 0") from e  # fmt: skip


def _check_warmup_bags(cfg: WsiTrainConfig, shapes: list[tuple[int, int]], channels: int, stride: int) -> None:
    """The warm-up's bags (every training slide's patch vectors, in host memory) within engine.host_memory."""
    w = cfg.train.head_warmup
    assert w is not None
    host = host_memory_per_rank(cfg.engine)
    over = bags_over_budget(shapes, w.patch, channels, stride, host, w.layout) if shapes else None
    if over is None:
        return
    need, fits = over
    raise WsiTrainError(
        f"train.head_warmup: the patch bags of {len(shapes)} training slide{'s' * (len(shapes) != 1)} need "
        f"{format_bytes(need)} of host memory "
        f"({channels} channels per {w.patch} px patch, float32), over the {format_bytes(host)} of engine.host_memory",
        hint=(f"set train.head_warmup.patch to {fits} or more" if fits
              else "set train.head_warmup.layout: patches" if w.layout == MAP else "remove train.head_warmup")
        + " (or raise engine.host_memory, if the node has the RAM)",
    )


class FitCallback(Protocol):
    """Called after every optimizer step, once that step's checkpoint (if any) is written."""

    def on_step_end(self, state: FitState) -> None: ...


class FitRecipe:
    """One fit: ``setup()`` then ``train()``; ``save()`` and ``validate()`` are its checkpoint and evaluation."""

    def __init__(
        self,
        cfg: WsiTrainConfig,
        *,
        console: Console,
        quiet: bool,
        dist: D.DistInfo,
        callbacks: Sequence[FitCallback] = (),
        shapes_only: bool = False,
        brief: bool = False,
    ) -> None:
        self.cfg = cfg
        self.shapes_only = shapes_only  # preflight skips tissue detection
        self.dist = dist
        self.quiet = quiet or not dist.is_main
        # brief (the CLI's --quiet): only epoch summaries, validation and warnings (``self.say``), no setup chatter
        self.brief = brief
        self.say = console if dist.is_main else Console(quiet=True)
        self.out = console if dist.is_main and not brief else Console(quiet=True)
        self.callbacks = list(callbacks)
        self.state = FitState()
        # The stop-signal handlers, installed only while train() runs and restored after it (see preempt.py).
        self.signals = StopSignals(parse_signal(cfg.train.stop_signal))
        self.safe = SafePoint(self.signals, dist, cfg.train.checkpoint_minutes)
        self._resumed_losses: list[float] = []  # this epoch's losses before the checkpoint a resume starts from

    # ---- setup: every input check first, then the run folder
    def setup(self, *, resume: Path | None, force: bool, name: str | None) -> Path:
        """Check inputs, build everything, then create (or reopen) the run folder; return it.

        A failed start leaves no run folder: every rank finishes its checks and builds and all agree (one
        all_reduce) before rank 0 makes the folder, and a failure while the folder is being filled removes it.
        """
        if resume is not None and str(resume) == "auto":
            resume = self._auto_resume(name)
        try:
            ckpt, resume_dir = self._prepare(resume, force, name)
        except Exception:
            with contextlib.suppress(Exception):  # the others may be gone already; the first error is the news
                D.all_ok(False, self.dist)
            raise
        if not D.all_ok(True, self.dist):
            raise WsiTrainError(
                "another rank failed to start (its error is in its own output); no run folder was made",
                hint="fix what that rank reported and start again",
            )
        # after the agreement: it broadcasts, and a collective must not meet a failed rank's all_ok
        self.balance = self._balance(self._preflight, ckpt)
        return self._open_run_folder(ckpt, resume_dir, force, name)

    def _prepare(self, resume: Path | None, force: bool, name: str | None) -> tuple[dict[str, Any] | None, Path | None]:
        """Every check and build, nothing written: the checkpoint to resume from and its folder (None, None new)."""
        cfg, t = self.cfg, self.cfg.train
        if resume is None:
            _check_run_target(cfg, name)
        self.device = resolve_device(cfg.engine.device, self.dist)
        self.budget: Budget = run_budget(cfg.engine.memory_budget, self.device)
        # wsitrain owns this process: memory follows live tensors, and on CUDA the budget is the allocator's limit
        self.allocator_note = tune_owned_process(self.device, self.budget.bytes)
        # every slide and shape bucket planned within the budget, all problems at once, before any folder exists
        report = check_run(cfg, self.device, shapes_only=self.shapes_only, console=self.out,
                           budget_bytes=self.budget.bytes, warn=self.say)  # fmt: skip
        plans = [b.plan for b in report.buckets if b.plan is not None] if report is not None else []
        # whole slides past engine.host_memory are decoded into engine.spill_dir (one more with data.prefetch)
        self.slide_spill = slide_spill(cfg.engine, plans, cfg.data.stream_tiles)
        if report is not None:  # host checkpoints (and those slides) past engine.host_memory need room there
            held = 0 if self.slide_spill is None else 1 + int(cfg.data.prefetch)
            check_spill_room(cfg.engine, plans, held)
        self.data: FitData = load_fit_data(cfg)
        self.cfg_dict = config_to_dict(cfg)
        ckpt, resume_dir = None, None
        if resume is not None:
            ckpt, resume_dir = load_resume(Path(resume), self.cfg_dict, force)
            _check_same_classes(resume, ckpt, self.data)
        self._preflight: PreflightReport | None = report  # for the slide costs, once every rank has started (setup)

        self.objective: Objective | None = self.data.objective
        if self.objective is not None:
            self.objective.check_head(cfg.model.num_classes)
        n_outputs = self.objective.n_outputs if self.objective is not None else len(self.data.class_names)

        seed_everything(cfg.seed, cfg.deterministic)
        self.model = build_model(cfg.model, n_outputs, self.data.class_names if self.objective is None else None)
        softmax_loss = self.objective is None and str(t.loss) == "cross_entropy"
        self.engine = wrap_engine(
            self.model, cfg.engine, self.device, self.budget.bytes, t.optimizer, one_pass_loss(n_outputs, softmax_loss),
            low_precision=t.precision != "fp32",
        )  # fmt: skip
        if self.objective is not None and t.class_balance != "none":
            raise WsiTrainError(
                f"train.class_balance: {t.class_balance} balances classification classes, but the task is "
                f"{self.objective.kind}",
                hint="remove train.class_balance (or set it to none) for this task",
            )
        if t.head_warmup is not None:
            _check_head_warmup(cfg, self.objective, self.model.stride)
            _check_warmup_hold_out(cfg, [int(r.label) for r in self.data.train])
            if report is not None:
                train = {r.path for r in self.data.train}
                shapes = [s.shape for s in report.slides if s.path in train]
                _check_warmup_bags(cfg, shapes, trunk_channels(self.model, self.model.stride), self.model.stride)
        self.class_w = class_weights([r.label for r in self.data.train]) if self.objective is None else {}
        groups = parameter_groups(self.model, t.lr, t.backbone_lr_scale, t.layer_decay)
        optimizer = build_optimizer(groups, t.optimizer, t.lr, t.momentum, t.weight_decay)
        n_train = len(D.shard(list(range(len(self.data.train))), self.dist))
        steps_per_epoch = max(1, -(-n_train // t.accumulate))
        scheduler = build_scheduler(optimizer, t.schedule, steps_per_epoch * t.epochs, t.warmup_steps)
        self.trainer = Trainer(
            self.engine, optimizer, scheduler, device=self.device, precision=t.precision, loss=t.loss,
            clip_grad_norm=t.clip_grad_norm, dist=self.dist, bucket_mb=cfg.distributed.bucket_mb,
            objective=self.objective, instance=self._instance_loss(cfg),
        )  # fmt: skip
        rk = read_kwargs(cfg, self.model.stride)
        stream = cfg.data.stream_tiles
        spill = self.slide_spill
        self.train_ds = SlideDataset(self.data.train, rk, augment_settings(cfg), cfg.seed, stream=stream,
                                     stream_cache=cfg.data.stream_cache_bytes, spill=spill)  # fmt: skip
        self.val_ds = (
            SlideDataset(self.data.val, rk, None, cfg.seed, stream=stream, spill=spill) if self.data.val else None
        )
        self.test_ds = (
            SlideDataset(self.data.test, rk, None, cfg.seed, stream=stream, spill=spill) if self.data.test else None
        )
        # train.feature_cache: the encoder frozen whole, the head trains on cached bags (None: end to end)
        self.cached: CachedHead | None = None
        self.cache_note = why_end_to_end(cfg, self.model, self.objective, self.dist)
        if self.cache_note is None:
            plain = SlideDataset(self.data.train, rk, None, cfg.seed, spill=spill)  # misses read un-augmented
            assert cfg.model.patch is not None
            self.cached = CachedHead(Path(cfg.log.dir) / "feature_cache", self.model, cfg.model.patch, rk, plain,
                                     augment_settings(cfg), cfg.seed)  # fmt: skip
        self.test_metrics: dict[str, float] = {}
        self._best_weights: dict[str, torch.Tensor] | None = None  # best.pt's weights, for the test evaluation
        return ckpt, resume_dir

    def _instance_loss(self, cfg: WsiTrainConfig) -> InstanceLoss | None:
        """model.attention.instance_loss on the engine-wrapped model, checked against the run's classes."""
        a = cfg.model.attention
        if a.instance_loss <= 0:
            return None
        names = self.data.class_names if self.objective is None else None
        spec = instance_loss_spec(a.instance_loss, a.instance_cells, a.positive_class, a.branches == "per_class", names,
                                  a.instance_positive_cells)  # fmt: skip
        return InstanceLoss(self.engine, spec)

    def _open_run_folder(
        self, ckpt: dict[str, Any] | None, resume_dir: Path | None, force: bool, name: str | None
    ) -> Path:
        """A new run folder (rank 0 makes it, every rank learns its path) or the resumed one, with its files."""
        cfg, t = self.cfg, self.cfg.train
        made: Path | None = None  # the folder this start created: removed again if the start fails
        try:
            claim: tuple[str | None, str | None] = (str(resume_dir) if resume_dir else None, None)
            if self.dist.is_main and resume_dir is None:
                try:
                    made, note = create_run_dir(Path(cfg.log.dir), name or cfg.name)
                    claim = (str(made), None)
                    if note:
                        self.say.print(f"[yellow]{escape(note)}[/yellow]")
                except WsiTrainError as e:
                    claim = (None, str(e))
                    D.broadcast_object(claim, self.dist)  # the others stop with rank 0, not on a closed connection
                    raise
            folder, problem = D.broadcast_object(claim, self.dist)
            if folder is None:
                raise WsiTrainError(f"rank 0 could not create the run folder: {problem}",
                                    hint="see rank 0's message")  # fmt: skip
            self.run_dir = Path(folder)
            if self.dist.is_main:
                tissue = self._preflight.tissue_records() if self._preflight is not None else None
                write_run_files(self.run_dir, self.cfg_dict, ckpt is not None, self.device, self.data, tissue)
                if ckpt is None:
                    write_json(self.run_dir / "fine_tuning.json", self._fine_tuning())
                if ckpt is None:
                    write_job_file(self.run_dir)  # the Slurm job that started it, for `--resume auto` after a requeue

            if ckpt is not None:
                _check_same_frozen(resume_dir, ckpt, self.model)
                self.model.load_state_dict(ckpt["model"])
                self.trainer.load_state_dict(ckpt)
                self.state = FitState.from_checkpoint(ckpt)
                set_rng_states(ckpt["rng"])
                # rank 0 carries every rank's losses of the interrupted epoch: the epoch's mean covers all its slides
                self._resumed_losses = list(ckpt.get("epoch_losses") or []) if self.dist.is_main else []
                self.out.print(
                    f"resuming {escape(str(self.run_dir))} at epoch {self.state.epoch + 1}, slide "
                    f"{self.state.next_index + 1}, step {self.state.global_step} (lr {self.trainer.lr:.3g})"
                )
            if ckpt is not None and self.dist.is_main:
                # the steps logged after the checkpoint are redone: drop them so no step appears twice
                for log_name in ("metrics.jsonl", "tiles.jsonl"):
                    drop_rows_after_step(self.run_dir / log_name, self.state.global_step)
            self._print_setup()
            self.recorder = RunRecorder(self.run_dir if self.dist.is_main else None, cfg.log, t.precision,
                                        self.engine, self.out)  # fmt: skip
        except BaseException:
            if made is not None:
                discard_run_dir(made)
            raise
        self.oom = OomRetry(self.trainer, self.engine, self._log_replan, self.recorder.metrics.write)
        self.waits = RankWaits(self.dist, self.device)
        if ckpt is not None:
            # Rows a stopped run logged past its checkpoint were dropped above; the marker says where it resumed.
            self.recorder.metrics.write({"kind": "resume", "epoch": self.state.epoch + 1,
                                         "index": self.state.next_index, "step": self.state.global_step,
                                         "forced": bool(force)})  # fmt: skip
        return self.run_dir

    def _balance(self, report: PreflightReport | None, ckpt: dict[str, Any] | None) -> Balance:
        """distributed.balance over the ranks: "time" costs each slide from the preflight's plans, once, and takes
        rank 0's costs on every rank (budgets detected per GPU could plan differently) or the checkpoint's, so a
        resume runs the same steps as the run it continues."""
        cfg, n = self.cfg, len(self.data.train)
        mode = cfg.distributed.balance if self.dist.enabled else "round_robin"
        if ckpt is not None and "balance" not in ckpt:
            mode = "round_robin"  # written before balancing existed: the run goes on dealing slides as it did
        balance = Balance(mode, cfg.seed, self.dist.world_size, cfg.train.accumulate)
        if mode != "time":
            return balance
        saved = (ckpt or {}).get("balance") or {}
        if len(saved.get("costs") or ()) == n:
            costs, buckets = list(saved["costs"]), list(saved["buckets"])
        else:
            assert report is not None  # fit has slides, so the preflight ran
            trunk = patch_trunk(self.model)  # a patch encoder: its slides' costs count patches, not chunks
            patch = None if trunk is None else int(trunk.patch)
            costs, buckets = D.broadcast_object(slide_costs(report, self.data.train, patch), self.dist)
        return Balance(mode, cfg.seed, self.dist.world_size, cfg.train.accumulate, tuple(costs), tuple(buckets))

    def _fine_tuning(self) -> dict[str, Any]:
        """fine_tuning.json: what was frozen, each optimizer group's lr, and the class balance of this run."""
        t, frozen = self.cfg.train, getattr(self.model, "frozen", None)
        groups = self.trainer.optimizer.param_groups
        return {
            "frozen": None if frozen is None else {"modules": list(frozen.modules), "parameters": frozen.n_frozen,
                                                   "trainable": frozen.n_trainable},
            "lr_groups": [{"name": g.get("name", str(i)), "lr": g["initial_lr"] if "initial_lr" in g else g["lr"],
                           "parameters": sum(p.numel() for p in g["params"])} for i, g in enumerate(groups)],
            "class_balance": describe_balance(t.class_balance, [r.label for r in self.data.train],
                                              self.data.class_names) if self.objective is None else None,
        }  # fmt: skip

    def _auto_resume(self, name: str | None) -> Path | None:
        """``--resume auto``: the run this Slurm job started and checkpointed (rank 0 looks, every rank follows),
        else None: a new run."""
        found = find_job_run(Path(self.cfg.log.dir)) if self.dist.is_main else None
        found = D.broadcast_object(None if found is None else str(found), self.dist)
        if found is None:
            self.out.print("--resume auto: no checkpointed run of this job yet; starting a new run", markup=False)
            return None
        self.out.print(f"--resume auto: continuing {found}, started by this job", markup=False)
        return Path(found)

    def _print_setup(self) -> None:
        cfg, data = self.cfg, self.data
        self.out.print(f"run folder: {self.run_dir}", markup=False)
        head = (f"{len(data.class_names)} classes ({', '.join(map(str, data.class_names))})" if self.objective is None
                else f"task {self.objective.kind}, head {self.objective.describe_head()}")  # fmt: skip
        self.out.print(
            f"model {cfg.model.name}: {sum(p.numel() for p in self.model.parameters()):,} parameters, "
            f"{head}; {batchnorm_note(self.model, cfg.model.freeze_bn)}",
            markup=False,
        )
        frozen, t = getattr(self.model, "frozen", None), cfg.train
        if frozen is not None:
            self.out.print(frozen.describe(), markup=False)
        if len(self.trainer.optimizer.param_groups) > 1:
            self.out.print("learning rates: " + ", ".join(f"{g['name']} {g['initial_lr']:.3g}"
                           for g in self.trainer.optimizer.param_groups), markup=False)  # fmt: skip
        if t.class_balance != "none":
            w = ", ".join(f"{data.class_names[c]} {v:.3g}" for c, v in self.class_w.items())
            self.out.print(f"class balance: {t.class_balance} (class weights {w})", markup=False)
        allocator = f"; {self.allocator_note}" if self.device.type == "cuda" and self.allocator_note else ""
        self.out.print(f"memory budget: {self.budget.describe()}{allocator}", markup=False)
        self.out.print(
            f"data: {len(data.train)} training and {len(data.val)} validation slides"
            + (f", {len(data.test)} test slides (evaluated once, with best.pt, after training)" if data.test else "")
            + f"; device {self.device}"
            + (f"; {self.dist.world_size} ranks" if self.dist.enabled else ""),
            markup=False,
        )
        self.out.print(masking_note(cfg), markup=False, highlight=False)
        if self.cached is not None:
            self.out.print(self.cached.describe(), markup=False)
        elif self.cache_note:
            self.say.print(f"[yellow]{escape(self.cache_note)}[/yellow]")

    # ---- train
    def train(self) -> None:
        """The epochs from where the state stands; interrupted runs say how to continue."""
        try:
            progress_display = FitProgress(self.say, self.quiet, self.cfg.train.epochs, self.engine, self.brief)
            with self.signals, progress_display as progress:
                if self.cfg.train.head_warmup is not None and self.state == FitState():  # a new run, not a resume
                    self._warm_up_head()
                self.safe.saved()  # the time-based checkpoint clock starts with the training
                for epoch in range(self.state.epoch, self.cfg.train.epochs):
                    self._epoch(epoch, progress)
            if self.test_ds is not None:
                self.test()
        except KeyboardInterrupt:
            self.say.print(
                f"[yellow]interrupted; the last checkpoint is {escape(str(self.run_dir / 'last.pt'))}; continue with "
                f"`wsitrain fit CONFIG --resume {escape(str(self.run_dir))}`[/yellow]"
            )
            raise
        finally:
            self.recorder.close()

    def _warm_up_head(self) -> None:
        """``train.head_warmup``: rank 0 trains the head on every training slide's patch features, every rank takes
        its weights (the end-to-end optimizer has not stepped yet, so its state is untouched)."""
        w, t = self.cfg.train.head_warmup, self.cfg.train
        assert w is not None
        head = nn.ModuleList(head_modules(self.model))
        state = None
        if self.dist.is_main:
            rk = read_kwargs(self.cfg, self.model.stride)
            ds = SlideDataset(self.data.train, rk, None, self.cfg.seed, spill=self.slide_spill)
            # each slide read once, with the tissue mask end to end pools its map under (layout: map reads it)
            images = ((as_batch(image), read.map_mask if read is not None and read.mask is not None else None)
                      for image, _, _, read in (ds[i] for i in range(len(ds))))  # fmt: skip
            try:
                res = warm_up_head(self.model, images, [int(r.label) for r in self.data.train], steps=w.steps,
                                   patch=w.patch, lr=w.lr or t.lr, seed=self.cfg.seed, hold_out=w.hold_out,
                                   patience=w.patience, layout=w.layout)  # fmt: skip
            except ValueError as e:  # a read smaller than one patch (frozen_mil.patch_grid)
                hint = "set train.head_warmup.patch below the smallest read's edge"
                raise WsiTrainError(f"train.head_warmup: {e}", hint=hint) from e
            self.say.print(res.summary(), markup=False)
            self.recorder.metrics.write({"kind": "head_warmup", "steps": res.steps, "slides": res.slides,
                                         "first_loss": res.first_loss, "last_loss": res.last_loss, "kept": res.kept,
                                         "wall_s": round(res.wall_s, 2), "best_step": res.best_step,
                                         **({"held_out": res.held_out, "held_out_loss": res.held_out_loss}
                                            if res.held_out else {})})  # fmt: skip
            state = {k: v.cpu() for k, v in head.state_dict().items()}
        if self.dist.enabled:
            state = D.broadcast_object(state, self.dist)
            assert state is not None
            head.load_state_dict(state)

    def _epoch(self, epoch: int, progress: FitProgress) -> None:
        cfg, t, st, trainer = self.cfg, self.cfg.train, self.state, self.trainer
        self.train_ds.set_epoch(epoch)  # augmentations depend on (seed, epoch, slide) only: a resume redraws them
        order = self._epoch_slides(epoch)
        start = st.next_index if epoch == st.epoch else 0
        progress.start_epoch(epoch, len(order), start)
        losses: list[float] = list(self._resumed_losses) if epoch == st.epoch and start > 0 else []
        self._resumed_losses = []
        window_start = start
        todo = order[start:]
        if self.cached is not None:  # (bag, label, record, (view, seconds embedding it)) from the feature cache
            loader: Iterable[Any] = _cached_items(self.cached, self.data.train, epoch, todo)
        else:
            loader = PrefetchLoader(self.train_ds, todo) if cfg.data.prefetch else _in_order(self.train_ds, todo)
        self.waits.start_epoch()
        t_wait = time.perf_counter()
        for j, (image, label, record, read) in enumerate(loader, start=start):
            wait_s = time.perf_counter() - t_wait
            window = min(t.accumulate, len(order) - window_start)
            weight = loss_weight(t.class_balance, self.class_w, label)
            if self.cached is not None:  # image: the slide's cached bag (Bag)
                progress.start_slide(record.slide_id, 0)
                step = self.cached.train_step(trainer, image, label, weight / window)
            else:
                with self._plan_errors_named(record.slide_id):
                    self.recorder.plan_if_new(image, record.slide_id)
                    progress.start_slide(record.slide_id, self.recorder.tiles_total(image))
                    target = label if self.objective is None else self.objective.target(record)
                    with tissue_masked(self.model, read):
                        step = self.oom.train_slide(image, target, weight / window, record.slide_id)
                    self.recorder.plan_if_new(image, record.slide_id)  # the new plan after an out-of-memory re-plan
            losses.append(step.loss)
            lr = trainer.lr
            closes = j + 1 - window_start == window
            step_no = st.global_step + 1  # the optimizer step this slide's gradient goes into (1-based)
            if closes:
                self.waits.ready()  # this rank's compute for the step ends at the gradient all_reduce
            opt = trainer.optimizer_step() if closes else None
            if closes:
                st.global_step += 1
                window_start = j + 1
            if self.cached is not None:  # read: (the view drawn, the seconds embedding it took, None on a hit)
                row = self.cached.row(epoch, step_no, j, record, step, *read, lr, opt.grad_norm if opt else None)
                self.recorder.head_slide(row, opt.seconds if opt is not None else None, wait_s)
            else:
                self.recorder.slide(epoch, step_no, j, record, step, read, wait_s, lr, opt)
            progress.end_slide(step.loss, step.peak_bytes)
            if closes:
                if st.global_step % cfg.log.every == 0:
                    progress.step_line(epoch, j, len(order), st.global_step, step.loss, lr, step.peak_bytes)
                    self._log_waits(epoch, "steps")
                # The safe point: every rank agrees whether to stop (a signal) or checkpoint (the clock) here.
                stop, due = self.safe.poll()
                every = t.checkpoint_every
                periodic = bool(every and st.global_step % every == 0) or due
                if stop or (periodic and j + 1 < len(order)):  # an epoch's end writes last.pt anyway
                    self.save("last.pt", epoch, j + 1, epoch_losses=_gather_flat(losses, self.dist))
                if stop:
                    # No rank leaves before rank 0 has written last.pt: under torchrun a rank's exit ends its node's
                    # step, and srun --kill-on-bad-exit (scripts/slurm/) then kills the others mid-write.
                    D.barrier(self.dist)
                    raise Preempted(
                        f"preempted ({self.signals.requested or 'a signal to another rank'}) at epoch {epoch + 1} step "
                        f"{st.global_step}; resume with `wsitrain fit CONFIG --resume {self.run_dir}`",
                        hint=f"last.pt in {self.run_dir} holds step {st.global_step}; in a Slurm job, "
                        "`wsitrain fit CONFIG --resume auto` finds it after a requeue",
                    )
                for cb in self.callbacks:
                    cb.on_step_end(st)
                self.waits.start()
            t_wait = time.perf_counter()
        self._log_waits(epoch, "steps")
        train_loss = _mean_over_ranks(losses, self.dist)
        st.history.append({"epoch": epoch + 1, "train_loss": train_loss})
        wait_share = self._log_waits(epoch, "epoch")
        progress.end_epoch(epoch, train_loss, trainer.lr, wait_share)
        improved = False
        if self.val_ds is not None and ((epoch + 1) % t.val_every == 0 or epoch + 1 == t.epochs):
            metrics = self.validate()
            self.recorder.validation(epoch, st.global_step, metrics)
            progress.validation(epoch, metrics)
            flat = flat_outputs_note(metrics, epoch + 1, t.epochs, random_trunk=self.cfg.model.weights is None)
            if flat is not None:
                self.say.print(f"[yellow]{escape(flat)}[/yellow]")
            st.history[-1].update({f"val_{k}": v for k, v in metrics.items()})
            score = self._selection_score(metrics)
            improved = score < st.best
            st.best = min(st.best, score)
        elif self.val_ds is None and train_loss < st.best:
            improved, st.best = True, train_loss  # no validation slides: best by training loss
        st.epoch, st.next_index = epoch + 1, 0
        if self.dist.is_main:
            write_curves(self.run_dir)  # curves.png, redrawn every epoch from metrics.jsonl
        self.save("last.pt", epoch + 1, 0)
        if improved:
            self.save("best.pt", epoch + 1, 0)
            if self.test_ds is not None:  # every rank keeps them: the test pass runs on all ranks
                self._best_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        D.barrier(self.dist)

    def _epoch_slides(self, epoch: int) -> list[int]:
        """This rank's training slides for ``epoch``; with class_balance sampling, the epoch's class-balanced draw
        dealt out as the plain order would be (the slide costs follow the drawn slides)."""
        n = len(self.data.train)
        if self.cfg.train.class_balance != "sampling":
            return self.balance.rank_slides(n, epoch, self.dist.rank)
        drawn = sampled_slides([r.label for r in self.data.train], self.cfg.seed, epoch)
        b = self.balance
        if b.costs is not None and len(b.costs) == n:
            b = dataclasses.replace(b, costs=tuple(b.costs[i] for i in drawn),
                                    buckets=tuple(b.buckets[i] for i in drawn) if b.buckets else b.buckets)  # fmt: skip
        return [drawn[i] for i in b.rank_slides(n, epoch, self.dist.rank)]

    def _log_waits(self, epoch: int, scope: str) -> float | None:
        """scope "steps": gather the steps since the last gather (a collective) and log them; "epoch": log the epoch's
        tally. A metrics.jsonl "ranks" row each; returns the waiting share (None in one process)."""
        tally = self.waits.gather() if scope == "steps" else self.waits.epoch
        if tally is None or not tally.steps:
            return None
        self.recorder.metrics.write({"kind": "ranks", "scope": scope, "epoch": epoch + 1,
                                     "step": self.state.global_step, "balance": self.balance.mode, **tally.row()})
        return tally.share

    def _log_replan(self, text: str) -> None:
        self.say.print(f"[yellow]{escape(text)}[/yellow]")
        self.recorder.forget_plans()  # every shape is planned again within the lowered budget

    @contextlib.contextmanager
    def _plan_errors_named(self, slide: str) -> Iterator[None]:
        """Re-raise the engine's PlanError naming the slide and the config keys that caused it."""
        try:
            yield
        except PlanError as err:
            raise annotate_plan_error(err, self.cfg, slide, has_batchnorm(self.model)) from err

    def _selection_score(self, metrics: dict[str, float]) -> float:
        """What best.pt minimizes: the validation loss (classification), or the task's metric, negated when larger
        is better (an undefined metric, e.g. no comparable pairs, never counts as an improvement)."""
        if self.objective is None:
            return metrics["loss"]
        key, larger = self.objective.selection
        value = metrics.get(key, math.nan)
        return math.inf if math.isnan(value) else (-value if larger else value)

    # ---- validate
    def validate(self) -> dict[str, float]:
        """Loss, accuracy, balanced accuracy and ROC AUC over the validation slides (split across ranks)."""
        assert self.val_ds is not None
        if self.objective is not None or any(r.patient is not None for r in self.data.val):
            return self._evaluate(self.val_ds, self.objective, "val")
        mine = list(range(len(self.data.val)))[self.dist.rank :: self.dist.world_size]
        results = []
        t0 = time.perf_counter()
        watch = DecisionWatch(self.engine)  # max pooling: is each class decided on the tissue?
        for i in mine:
            if self.cached is not None:
                record = self.data.val[i]
                label, r = record.label, self.cached.eval_step(self.trainer, self.val_ds, i, record.label)
            else:
                image, label, record, read = self.val_ds[i]
                with (self._plan_errors_named(record.slide_id), tissue_masked(self.model, read),
                      watch.slide(image, read)):  # fmt: skip
                    r = self.trainer.eval_slide(image, label)
            results.append((int(label), r.loss, r.probs.numpy(), record.slide_id, str(record.path), watch.last))
        results = [x for part in D.gather_objects(results, self.dist) for x in part]
        labels = np.array([r[0] for r in results])
        probs = np.stack([r[2] for r in results])  # (N, K)
        metrics = {"loss": float(np.mean([r[1] for r in results]))}
        metrics.update(classification_metrics(labels, probs))
        metrics["n"] = len(results)
        metrics["seconds"] = time.perf_counter() - t0
        if self.dist.is_main:  # ROC, confusion matrix and per-slide probabilities of this validation
            write_validation_figures(self.run_dir, labels, probs, self.data.class_names,
                                     [r[3] for r in results], [r[4] for r in results],
                                     [r[5] for r in results] if watch.active else None)  # fmt: skip
        return metrics

    def test(self) -> dict[str, float]:
        """The test slides, once, with best.pt's weights (the last weights when no epoch improved): the figures no
        training or checkpoint choice has seen. Written to metrics.jsonl as kind "test" and to the summary."""
        assert self.test_ds is not None
        best = self._best_weights
        if best is None and (self.run_dir / "best.pt").is_file():  # resumed after the best epoch
            best = load_checkpoint(self.run_dir / "best.pt")["model"]
        if best is not None:
            self.model.load_state_dict(best)
        self.test_metrics = self._evaluate(self.test_ds, self.objective, "test")
        self.recorder.metrics.write({"kind": "test", "epoch": self.state.epoch, "step": self.state.global_step,
                                     "weights": "best.pt" if best is not None else "last", **self.test_metrics})
        shown = ", ".join(f"{k} {v:.4g}" for k, v in self.test_metrics.items() if k not in ("n", "seconds"))
        self.out.print(f"test ({len(self.data.test)} slides, held out, best.pt): {shown}", markup=False)
        return self.test_metrics

    def _evaluate(self, ds: SlideDataset, objective: Objective | None, kind: str) -> dict[str, float]:
        """Loss and the task's metrics over ``ds`` (split across ranks), per slide and, where the CSV names
        patients, per patient (each patient's slide outputs averaged); rank 0 writes the rows to {kind}.json
        (task_validation.json for validation, so classification's validation.json keeps its meaning)."""
        mine = list(range(len(ds)))[self.dist.rank :: self.dist.world_size]
        rows = []
        t0 = time.perf_counter()
        for i in mine:
            if self.cached is not None:  # classification only (cached_head.why_end_to_end)
                record = ds.records[i]
                label, r = record.label, self.cached.eval_step(self.trainer, ds, i, record.label)
            else:
                image, label, record, read = ds[i]
                target = label if objective is None else objective.target(record)
                with self._plan_errors_named(record.slide_id), tissue_masked(self.model, read):
                    r = self.trainer.eval_slide(image, target)
            truth = [float(label)] if objective is None else list(record.target)
            rows.append({"slide": record.slide_id, "path": str(record.path), "patient": record.patient,
                         "target": truth, "loss": r.loss, "outputs": [float(v) for v in r.probs.tolist()]})  # fmt: skip
        rows = [x for part in D.gather_objects(rows, self.dist) for x in part]
        y = np.array([r["target"] for r in rows], dtype=np.float64)
        out = np.array([r["outputs"] for r in rows], dtype=np.float64)
        metrics = {"loss": float(np.mean([r["loss"] for r in rows]))}
        metrics.update(_task_metrics(objective, y, out))
        metrics["n"] = len(rows)
        if any(r["patient"] is not None for r in rows):
            ids, py, pout = per_patient([r["patient"] for r in rows], y, out)
            metrics.update({f"patient_{k}": v for k, v in _task_metrics(objective, py, pout).items()})
            metrics["n_patients"] = len(ids)
        metrics["seconds"] = time.perf_counter() - t0
        if self.dist.is_main:
            names = self.data.class_names if objective is None else objective.names
            name = "task_validation.json" if kind == "val" else f"{kind}.json"
            write_json(self.run_dir / name, {"kind": kind, "task": objective.kind if objective else "classification",
                                             "outputs": names, "patients_averaged": "mean of the slides' outputs",
                                             "metrics": metrics, "slides": rows})  # fmt: skip
            if objective is not None:  # Kaplan-Meier, predicted against true, ROC per label
                from wsitrain.report.task_figures import write_task_figures

                write_task_figures(self.run_dir)
            if objective is None and kind == "val":  # the classification figures, as before
                labels = y[:, 0].astype(int)
                write_validation_figures(self.run_dir, labels, out, self.data.class_names,
                                         [r["slide"] for r in rows], [r["path"] for r in rows])  # fmt: skip
        return metrics

    # ---- save
    def save(self, file_name: str, epoch: int, next_index: int, epoch_losses: list[float] | None = None) -> None:
        """Write a checkpoint (rank 0 only) that resumes at slide ``next_index`` of epoch ``epoch``;
        ``epoch_losses``: the epoch's training losses so far (all ranks), for its mean after a resume."""
        if file_name == "last.pt":
            self.safe.saved()
        if not self.dist.is_main:
            return
        st = self.state
        save_checkpoint(
            self.run_dir / file_name, model=self.model.state_dict(), **self.trainer.state_dict(), epoch=epoch,
            next_index=next_index, global_step=st.global_step, best=st.best, history=st.history, rng=rng_states(),
            config=self.cfg_dict, class_names=self.data.class_names, epoch_losses=list(epoch_losses or []),
            balance=self.balance.state(), frozen=_frozen_names(self.model),
            **({"task": self.objective.state()} if self.objective is not None else {}),
        )  # fmt: skip

    def summary(self, wall_s: float) -> dict[str, Any]:
        out = self.recorder.summary(self.run_dir, self.state, wall_s)
        if self.objective is not None:  # the task's validation metrics replace classification's
            for key in ("val_accuracy", "val_balanced_accuracy", "val_roc_auc", "val_output_spread", "best_val_loss"):
                out.pop(key, None)
            last = self.recorder.last_validation
            out.update({f"val_{k}": v for k, v in last.items() if k not in ("loss", "seconds")})
            key, larger = self.objective.selection
            best = self.state.best
            out[f"best_val_{key}"] = (-best if larger else best) if last and math.isfinite(best) else math.nan
            out["task"] = self.objective.kind
        elif any(k.startswith("patient_") for k in self.recorder.last_validation):
            out.update({f"val_{k}": v for k, v in self.recorder.last_validation.items() if k.startswith("patient_")})
        if self.dist.enabled:  # the share of rank-time spent waiting at the gradient all_reduce (balance/waiting.py)
            out["balance"] = self.balance.mode
            out["rank_wait_share"] = self.waits.run.share if self.waits.run.share is not None else math.nan
        if self.test_metrics:  # held out: marked as test, never mixed with the validation figures
            out.update({f"test_{k}": v for k, v in self.test_metrics.items() if k != "seconds"})
        return out


def annotate_plan_error(err: PlanError, cfg: WsiTrainConfig, slide: str, batchnorm: bool) -> PlanError:
    """The engine's message (its text is the engine's), plus the slide and the config keys behind the situation."""
    hints = []
    # Training-mode BatchNorm cannot be tiled whatever the memory: the engine's "more memory" hint would mislead.
    bn_cause = batchnorm and not cfg.model.freeze_bn and "BatchNorm" in f"{err.message} {err.hint}"
    if bn_cause:
        hints.append("set model.freeze_bn: true (the default) so BatchNorm uses its running statistics and can be "
                     "tiled")  # fmt: skip
    if cfg.engine.tile_size is not None:
        hints.append(f"engine.tile_size is forced to {cfg.engine.tile_size}: remove it to let the planner choose the "
                     "tiles, or give a smaller one")  # fmt: skip
    if not bn_cause:
        hints.append(err.hint or "")
    return PlanError(f"slide {slide}: {err.message}", hint="; ".join(h for h in hints if h))


def has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _check_run_target(cfg: WsiTrainConfig, name: str | None) -> None:
    """The new run folder can be made: --name is one folder name and log.dir is (or can become) a folder."""
    if name is not None:
        problem = check_run_name(name, what="--name")
        if problem is not None:
            raise WsiTrainError(problem, hint="pass --name with a plain folder name, e.g. --name lr-1e-4")
    check_log_dir(Path(cfg.log.dir))


def _frozen_names(model: torch.nn.Module) -> list[str]:
    frozen = getattr(model, "frozen", None)
    return [] if frozen is None else list(frozen.parameters)


def _check_same_frozen(resume: Path | None, ckpt: dict[str, Any], model: torch.nn.Module) -> None:
    """A resume trains the parameters the run trained: its optimizer state holds exactly those."""
    old, new = list(ckpt.get("frozen") or []), _frozen_names(model)
    if old != new:
        raise WsiTrainError(
            f"--resume {resume}: the run froze {len(old)} parameters, this model freezes {len(new)}",
            hint="resume with the run's model.freeze (its config.yaml), or start a new run from its weights",
        )


def _check_same_classes(resume: Path, ckpt: dict[str, Any], data: FitData) -> None:
    """The classifier's rows are the run's classes: another class list cannot continue the run's weights."""
    old = [str(c) for c in ckpt.get("class_names") or []]
    new = [str(c) for c in data.class_names]
    if old and old != new:
        raise WsiTrainError(
            f"--resume {resume}: the run was trained on classes {old}, the labels now give {new}",
            hint="resume with the run's labels CSV (see data.json in the run folder), or start a new run",
        )


def _task_metrics(objective: Objective | None, targets: np.ndarray, outputs: np.ndarray) -> dict[str, float]:
    if objective is None:
        return classification_metrics(targets[:, 0].astype(int), outputs)
    return objective.metrics(targets, outputs)


def _in_order(ds: SlideDataset, order: list[int]) -> Iterator[Item]:
    for i in order:
        yield ds[i]


def _cached_items(cached: CachedHead, records: list[SlideRecord], epoch: int,
                  order: list[int]) -> Iterator[tuple[Any, int, SlideRecord, tuple[int, float | None]]]:  # fmt: skip
    """The epoch's training items from the feature cache: (bag, label, record, (view, seconds embedding it or None
    when read back))."""
    for i in order:
        bag, embed_s = cached.train_bag(epoch, i)
        yield bag, int(records[i].label), records[i], (cached.view(epoch, i), embed_s)


def _gather_flat(values: list[float], dist: D.DistInfo) -> list[float]:
    """Every rank's ``values``, concatenated in rank order (a collective: every rank calls it at the same step)."""
    return [v for part in D.gather_objects(values, dist) for v in part]


def _mean_over_ranks(values: list[float], dist: D.DistInfo) -> float:
    gathered = D.gather_objects(values, dist)
    flat = [v for part in gathered for v in part]
    return float(np.mean(flat)) if flat else math.nan
