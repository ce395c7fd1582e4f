"""The fit's data: labels (or synthetic slides), the train/val split, datasets and the per-epoch slide order."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wsitrain.config import WsiTrainConfig
from wsitrain.errors import ConfigError, SlideError
from wsitrain.slides.augment import AugmentConfig
from wsitrain.slides.dataset import SlideRecord, split_records
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.slides.tissue import MASK_DILATION_PX
from wsitrain.tasks.columns import load_task_records
from wsitrain.tasks.kinds import TEST_SPLITS
from wsitrain.tasks.objective import Objective
from wsitrain.tasks.splits import grouped_holdout


@dataclass
class FitData:
    train: list[SlideRecord]
    val: list[SlideRecord]
    class_names: list[str]
    labels_csv: Path
    slides_dir: Path | None
    # split "test" rows: never trained on nor used to choose best.pt; evaluated once with best.pt at the end
    test: list[SlideRecord] = field(default_factory=list)
    # regression, survival, multilabel: the head, loss and metrics (None: classification, its path unchanged)
    objective: Objective | None = None


def resolve_labels(cfg: WsiTrainConfig) -> tuple[Path, Path | None]:
    """The labels CSV and slides folder: the config's, or a synthetic dataset generated (once) into its cache."""
    d = cfg.data
    if d.synthetic is not None:
        s = d.synthetic
        labels = write_synthetic_dataset(
            Path(s.cache_dir), n=s.n, size=s.size, seed=s.seed, positive_fraction=s.positive_fraction
        )
        return Path(labels), None
    if d.labels is None:
        raise ConfigError(
            ["data.labels: not set; give a CSV of slide,label rows (or set data.synthetic for generated slides)"]
        )
    return Path(d.labels), Path(d.slides_dir) if d.slides_dir is not None else None


def load_fit_data(cfg: WsiTrainConfig) -> FitData:
    """Read and check every slide's label (missing/unreadable slides fail here, before training), then split."""
    labels_csv, slides_dir = resolve_labels(cfg)
    records, class_names = load_task_records(labels_csv, slides_dir, cfg.task)
    class_names = list(class_names)
    n_cls = cfg.model.num_classes
    classify = cfg.task.kind == "classification"
    if classify and n_cls is not None and n_cls != len(class_names):
        raise ConfigError(
            [
                f"model.num_classes is {n_cls} but {labels_csv} has {len(class_names)} classes "
                f"({', '.join(map(str, class_names))}); set model.num_classes: {len(class_names)} or leave it unset"
            ]
        )
    if classify and len(class_names) < 2:
        raise ConfigError([f"data.labels: {labels_csv} has only one class ({class_names}); a classifier needs two"])
    train, val = split_fit(records, cfg.data.val_fraction, cfg.seed)
    if not train and any(r.split is not None for r in records):
        counts = Counter(r.split for r in records)
        raise SlideError(
            f"{labels_csv}: the split column puts no slide in train "
            f"({', '.join(f'{n} {split}' for split, n in sorted(counts.items()))}); data.val_fraction is not used "
            "when the CSV has a split column",
            hint="mark the training slides with split 'train' in the CSV, or remove the split column to let "
            "data.val_fraction choose the validation slides",
        )
    if not train:
        raise ConfigError(
            [f"data.val_fraction: {cfg.data.val_fraction} leaves no training slides out of {len(records)}"]
        )
    test = [r for r in records if r.split in TEST_SPLITS]
    objective = None if classify else Objective.from_training(cfg.task, train)
    if objective is not None and objective.kind == "survival":
        events = sum(int(r.target[1]) for r in train)
        if events < cfg.task.bins:
            raise SlideError(
                f"{labels_csv}: column {cfg.task.event}: {events} events among the {len(train)} training slides, "
                f"fewer than task.bins ({cfg.task.bins})",
                hint="lower task.bins, or lower data.val_fraction so more slides with events train",
            )
    return FitData(list(train), list(val), class_names, labels_csv, slides_dir, test, objective)


def split_fit(records: list[SlideRecord], val_fraction: float, seed: int) -> tuple[list[SlideRecord], ...]:
    """(train, val): the CSV's split column when it has one; else a seeded split stratified by label (the event
    for survival) that, when a patient column is given, never divides a patient."""
    if any(r.split is not None for r in records) or not any(r.patient is not None for r in records):
        return split_records(records, val_fraction, seed)
    groups = [r.patient if r.patient is not None else f"#{r.line}" for r in records]
    is_val = grouped_holdout([str(r.label) for r in records], groups, val_fraction, seed)
    return ([r for r, v in zip(records, is_val, strict=True) if not v],
            [r for r, v in zip(records, is_val, strict=True) if v])  # fmt: skip


def read_kwargs(cfg: WsiTrainConfig, stride: int) -> dict[str, Any]:
    """Arguments for the slide reader: scale, region and padding to the model's stride (whole output pixels)."""
    d = cfg.data
    size = tuple(d.size) if isinstance(d.size, (list, tuple)) else d.size
    return dict(
        level=d.level,
        mpp=d.mpp,
        magnification=d.magnification,
        fallback_mpp=d.fallback_mpp,
        region=d.region,
        size=size,
        background=tuple(d.background),
        pad_multiple=stride,
        read_threads=d.read_threads,
        mask_background=d.mask_background,
        tissue_settings=d.tissue_settings(),
    )


def masking_note(cfg: WsiTrainConfig) -> str:
    """The start-of-run line on data.mask_background: what it does and how to turn it off (or that it is off)."""
    d = cfg.data
    if not d.mask_background:
        return "background masking: off (data.mask_background: false); slides are read as they are"
    return (
        f"background masking: on; pixels outside the detected tissue (grown by {MASK_DILATION_PX} thumbnail px) "
        f"become data.background {list(d.background)} and chunks wholly outside it are not decoded; "
        "turn it off with data.mask_background: false"
    )


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The epoch's slide order: a permutation that depends only on (seed, epoch), so a resume reproduces it."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(n, generator=g).tolist()


def augment_settings(cfg: WsiTrainConfig) -> AugmentConfig | None:
    """data.augment as the slide reader's AugmentConfig; None when every augmentation is off."""
    a = cfg.data.augment
    jitter = None if a.color_jitter in (None, "none") else a.color_jitter
    if not (a.flips or a.rot90 or jitter):
        return None
    return AugmentConfig(flips=a.flips, rot90=a.rot90, color_jitter=jitter, strength=a.jitter_strength)
