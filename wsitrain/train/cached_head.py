"""``train.feature_cache``: `wsitrain fit` with the encoder entirely frozen trains the head on cached embeddings.

With every trainable parameter in the head (a patch encoder, ``model.patch``, frozen whole by ``model.freeze``, no
LoRA) end-to-end training would run the frozen encoder over every patch of every slide each epoch to produce the same
embeddings again: the run is the CLAM / TRIDENT pipeline. ``auto`` (the default) then embeds each training slide once
per augmentation it is drawn in (and each validation / test slide once, un-augmented) into the frozen-feature cache
(wsitrain.train.feature_cache, under ``<log.dir>/feature_cache``, shared by every run of the same frozen weights,
patch size and read settings) and trains the head alone on the bags; ``off`` always trains end to end.

The same run, minus the encoder's repeated forward: the bag of a slide is its embedding map, (1, D, rows, cols) as
``PatchTrunk`` lays it out, pooled under the same tissue mask (``ReadResult.map_mask``, stored beside the bag), by the
model's own head modules; an epoch is every training slide once in the fit's seeded order, each in the flips and
turns ``data.augment`` draws for (seed, epoch, slide) (``DIHEDRAL`` views at most, so each is embedded once); the
optimizer, schedule, accumulation, class balance, checkpoints (the whole model's weights: ``predict`` and ``report``
read the run folder unchanged), resume and metrics.jsonl are the fit's own.

The bags are embedded in float32 whatever ``train.precision`` (the head's steps take it), with the encoder in eval
mode (as CLAM extracts features); so in bf16 / fp16, or with an encoder whose frozen layers behave differently in
training mode (dropout, stochastic depth), the cached run is not the end-to-end run's arithmetic, only its recipe.

Not cached (end to end, with a note saying why): colour jitter (a new image each draw), the instance loss,
``train.head_warmup``, tasks other than classification, ``data.stream_tiles`` and torchrun ranks.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from wsitrain.config import WsiTrainConfig
from wsitrain.sft import StepStats
from wsitrain.slides.augment import AugmentConfig, Geometry, geometry_of
from wsitrain.slides.dataset import SlideDataset, SlideRecord
from wsitrain.tasks.objective import Objective
from wsitrain.train.distributed import DistInfo
from wsitrain.train.feature_cache import DIHEDRAL, FeatureCache, dihedral
from wsitrain.train.head_warmup import Bag, bag_logits, head_modules, host_patch_features
from wsitrain.train.loop import Evaluator, SlideStep, Trainer

AUTO, OFF = "auto", "off"
MODES = (AUTO, OFF)
GRID = ".grid"  # the companion file of a bag: (rows, cols) int64, then the (rows, cols) tissue mask as 0/1 when any


def why_end_to_end(cfg: WsiTrainConfig, model: nn.Sequential, objective: Objective | None,
                   dist: DistInfo) -> str | None:  # fmt: skip
    """None when the fit trains on the cache; else why not (empty when the encoder trains: nothing to say)."""
    if cfg.train.feature_cache == OFF or cfg.model.patch is None:
        return ""
    head = {id(p) for m in head_modules(model) for p in m.parameters()}
    if any(p.requires_grad and id(p) not in head for p in model.parameters()):
        return ""  # the encoder (or LoRA on it) trains: end to end is the run
    a = cfg.data.augment
    for cause, what in ((a.color_jitter not in (None, "none"), "data.augment.color_jitter draws a new image each time"),
                        (cfg.model.attention.instance_loss > 0, "model.attention.instance_loss is set"),
                        (cfg.train.head_warmup is not None, "train.head_warmup is set"),
                        (objective is not None, f"the task is {objective.kind if objective else ''}"),
                        (cfg.data.stream_tiles, "data.stream_tiles is on"),
                        (dist.enabled, "the run has several ranks")):  # fmt: skip
        if cause:
            return f"the encoder is frozen, but {what}: training end to end (train.feature_cache: off hides this)"
    return None


def dihedral_index(g: Geometry) -> int:
    """The ``feature_cache.dihedral`` view that equals the flips and turns ``g``: the same element of the group."""
    probe = torch.arange(9).reshape(1, 1, 3, 3)  # no symmetry: each of the 8 views is distinct
    out = g.apply(probe)
    return next(k for k in range(DIHEDRAL) if torch.equal(dihedral(probe, k), out))


def slide_key(record: SlideRecord, read_kwargs: dict[str, Any]) -> str:
    """The slide's cache name: its id and a hash of its file (path, size, mtime) and the read settings that change
    its pixels (all but the decoder threads)."""
    st = Path(record.path).stat()
    reads = sorted((k, v) for k, v in read_kwargs.items() if k != "read_threads")  # plain values and dataclasses
    h = hashlib.sha256(f"{Path(record.path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{reads!r}".encode())
    return f"{record.slide_id}-{h.hexdigest()[:12]}"


class CachedHead:
    """The head of ``model`` trained and evaluated on cached bags; ``ds`` (training, un-augmented) reads misses."""

    def __init__(self, folder: Path, model: nn.Sequential, patch: int, read_kwargs: dict[str, Any],
                 train_ds: SlideDataset, augment: AugmentConfig | None, seed: int) -> None:  # fmt: skip
        self.model = model
        self.head = nn.ModuleList(head_modules(model))
        self.cache = FeatureCache(folder, model, patch)
        self.patch = patch
        self.read_kwargs = read_kwargs
        self.train_ds = train_ds
        self.augment = augment
        self.seed = seed

    def describe(self) -> str:
        return (f"feature cache: the encoder is frozen, so each slide is embedded once per augmentation into "
                f"{self.cache.folder} and the head trains on the cached bags (train.feature_cache: off trains end "
                "to end)")  # fmt: skip

    def view(self, epoch: int, i: int) -> int:
        """The augmentation ``data.augment`` draws for training slide ``i`` in ``epoch`` (SlideDataset's draw)."""
        if self.augment is None:
            return 0
        return dihedral_index(geometry_of(np.random.default_rng([self.seed, epoch, i]), self.augment))

    def bag(self, ds: SlideDataset, i: int, k: int) -> tuple[Bag, float | None]:
        """Slide ``i`` of ``ds`` in view ``k`` as its (1, D, rows, cols) map and mask, and the seconds reading and
        embedding it took (None: read back from the cache)."""
        key = slide_key(ds.records[i], self.read_kwargs)
        feats, grid = self.cache.load(key, k), self.cache.load(key, k, GRID)
        t0 = time.perf_counter()
        embed_s = None
        if feats is None or grid is None:
            image, _, _, read = ds[i]  # un-augmented: the view is taken here
            device = next(self.model.parameters()).device
            x = dihedral(image[None], k)  # (1, 3, H', W') uint8
            feats = host_patch_features(self.model, x, self.patch, device)  # (N, D), PatchTrunk's row-major order
            rows, cols = x.shape[2] // self.patch, x.shape[3] // self.patch
            h, w = (cols, rows) if k % 2 else (rows, cols)  # the un-augmented grid
            mask = read.map_mask(h, w) if read is not None else None
            grid = torch.tensor([rows, cols])
            if mask is not None:
                grid = torch.cat([grid, dihedral(mask, k).flatten().long()])
            self.cache.store(key, k, feats)
            self.cache.store(key, k, grid, GRID)
            embed_s = time.perf_counter() - t0
        rows, cols = int(grid[0]), int(grid[1])
        x = feats.t().reshape(1, -1, rows, cols)  # (1, D, rows, cols): the embedding map end to end pools
        mask = grid[2:].reshape(1, 1, rows, cols).bool() if len(grid) > 2 else None
        return Bag(x, mask), embed_s

    def train_bag(self, epoch: int, i: int) -> tuple[Bag, float | None]:
        return self.bag(self.train_ds, i, self.view(epoch, i))

    def train_step(self, trainer: Trainer, bag: Bag, target: int | torch.Tensor, scale: float) -> SlideStep:
        """The head's forward + backward on one bag; gradients accumulate as ``Trainer.train_slide``'s do."""
        self.head.train()
        t0 = time.perf_counter()
        with trainer.autocast():
            logits = self._logits(trainer, bag)
        loss = trainer._loss(logits, target)
        t1 = time.perf_counter()
        trainer.scaler.scale(loss * scale).backward()
        t2 = time.perf_counter()
        probs = trainer._outputs(logits.detach())[0].cpu()
        return SlideStep(float(loss.detach()), probs, t1 - t0, t2 - t1, 0, StepStats())

    @torch.no_grad()
    def eval_step(self, evaluator: Evaluator, ds: SlideDataset, i: int, target: int | torch.Tensor) -> SlideStep:
        """Slide ``i`` of ``ds`` (validation, test: un-augmented) through the head: loss and outputs."""
        self.head.eval()
        bag, _ = self.bag(ds, i, 0)
        t0 = time.perf_counter()
        with evaluator.autocast():
            logits = self._logits(evaluator, bag)
        loss = float(evaluator._loss(logits, target))
        probs = evaluator._outputs(logits)[0].cpu()
        return SlideStep(loss, probs, time.perf_counter() - t0, 0.0, 0, StepStats())

    def _logits(self, ev: Evaluator, bag: Bag) -> torch.Tensor:
        dtype = next(self.head.parameters()).dtype
        x = bag.x.to(ev.device, dtype)
        return bag_logits(list(self.head), Bag(x, None if bag.mask is None else bag.mask.to(ev.device)))

    def row(self, epoch: int, step: int, index: int, record: SlideRecord, res: SlideStep, view: int,
            embed_s: float | None, lr: float, grad_norm: float | None) -> dict[str, Any]:  # fmt: skip
        """One training slide's metrics.jsonl row (kind "train", the fields a bag has)."""
        return {"kind": "train", "epoch": epoch + 1, "step": step, "index": index, "slide": record.slide_id,
                "label": record.label, "loss": res.loss, "probs": [float(v) for v in res.probs.tolist()], "lr": lr,
                "forward_s": res.forward_s, "backward_s": res.backward_s, "grad_norm": grad_norm,
                "feature_cache": {"view": view, "embedded": embed_s is not None, "embed_s": embed_s}}  # fmt: skip
