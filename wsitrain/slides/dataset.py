"""Slide-level labels, a reproducible split, a dataset that streams one slide per item, and a prefetching loader.

``load_labels`` checks everything up front (columns, missing and unreadable slides, empty labels, duplicates)
and raises one ``SlideError`` listing every problem, so a run fails before its first epoch, not in its tenth.
"""

from __future__ import annotations

import csv
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wsitrain.errors import SlideError
from wsitrain.sft.execution.spill import HostAllocator
from wsitrain.slides.augment import AugmentConfig, augment_from_config, geometry_of
from wsitrain.slides.info import slide_info
from wsitrain.slides.stream import ReadResult, read_slide_region
from wsitrain.slides.suffixes import SLIDE_SUFFIXES
from wsitrain.slides.tile_source import open_tile_source

TRAIN_SPLITS = ("train", "training")
VAL_SPLITS = ("val", "valid", "validation")
OTHER_SPLITS = ("test", "holdout", "exclude")


@dataclass(frozen=True)
class SlideRecord:
    """One labelled slide. ``label`` indexes ``class_names``; ``split`` is the CSV's split column (or None).

    ``line`` is the CSV line (for messages), ``patient`` the optional patient column, ``target`` the task's values
    (wsitrain.tasks.columns; empty for classification).
    """

    slide_id: str
    path: Path
    label: int
    label_name: str
    split: str | None = None
    line: int = 0
    patient: str | None = None
    target: tuple[float, ...] = ()


def _find_slide(value: str, csv_dir: Path, slides_dir: Path | None) -> Path | None:
    """A path (absolute, or relative to the slides folder or the CSV), or an id matched by file stem."""
    p = Path(value)
    candidates = [p] if p.is_absolute() else [d / p for d in (slides_dir, csv_dir) if d is not None]
    for c in candidates:
        if c.is_file():
            return c
    if p.suffix == "" and slides_dir is not None and slides_dir.is_dir():
        for suffix in SLIDE_SUFFIXES:
            c = slides_dir / f"{value}{suffix}"
            if c.is_file():
                return c
    return None


def _label_spellings(rows: list[dict[str, str]]) -> list[str]:
    """Labels that differ only in case or surrounding spaces ("Positive", "positive "): surely one class, refused
    rather than guessed, with every spelling and its lines shown."""
    spellings: dict[str, dict[str, list[int]]] = {}
    for line, row in enumerate(rows, start=2):
        raw = row.get("label", "")
        if raw.strip():
            spellings.setdefault(raw.strip().casefold(), {}).setdefault(raw, []).append(line)
    problems = []
    for forms in spellings.values():
        if len(forms) > 1:
            shown = " and ".join(f"{raw!r} (line{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls[:5]))})"
                                 for raw, ls in forms.items())  # fmt: skip
            problems.append(f"labels {shown} differ only in case or spaces; write one spelling for one class")
    return problems


def _sort_classes(names: set[str]) -> list[str]:
    # Numeric labels sort as numbers (2 < 10); others alphabetically ("negative" < "positive").
    try:
        return sorted(names, key=float)
    except ValueError:
        return sorted(names)


def load_labels(
    labels_csv: str | Path,
    slides_dir: str | Path | None = None,
    *,
    check_readable: bool = True,
    needs_label: bool = True,
) -> tuple[list[SlideRecord], list[str]]:
    """Read ``slide,label[,split][,patient]`` rows; return records and the sorted class names.

    ``needs_label`` False (tasks other than classification, whose targets are other columns): the label column
    may be absent and every record gets label 0, named "".

    ``slide`` is a file path (relative to ``slides_dir``, else to the CSV's folder) or a slide id (file stem in
    ``slides_dir``). With ``check_readable`` every slide is opened once to check it is a readable slide.
    """
    csv_path = Path(labels_csv)
    if not csv_path.is_file():
        raise SlideError(
            f"{csv_path}: labels file not found", hint="set data.labels to a CSV with columns slide,label[,split]"
        )
    sdir = Path(slides_dir) if slides_dir is not None else None
    if sdir is not None and not sdir.is_dir():
        raise SlideError(f"{sdir}: slide folder not found", hint="set data.slides_dir to the folder holding the slides")
    with csv_path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        fields = [c.strip().lower() for c in (reader.fieldnames or [])]
        missing = [c for c in ("slide", "label") if c not in fields and (needs_label or c != "label")]
        if missing:
            plural = "s" if len(missing) > 1 else ""
            raise SlideError(
                f"{csv_path}: missing column{plural} {', '.join(missing)} (found: {', '.join(fields) or 'none'})",
                hint="the first line must name the columns: slide,label and optionally split",
            )
        raw_rows = [{(k or "").strip().lower(): v or "" for k, v in row.items()} for row in reader]
    rows = [{k: v.strip() for k, v in row.items()} for row in raw_rows]
    problems: list[str] = _label_spellings(raw_rows) if needs_label else []
    found: list[tuple[int, str, Path, str, str | None, str | None]] = []
    seen: dict[Path, int] = {}
    for line, row in enumerate(rows, start=2):
        slide, label, split = row.get("slide", ""), row.get("label", ""), row.get("split") or None
        if not slide and not label:
            continue  # blank line
        if not slide:
            problems.append(f"line {line}: empty slide")
            continue
        if not needs_label:
            label = ""
        elif not label:
            problems.append(f"line {line}: {slide}: empty label")
            continue
        if split is not None and split.lower() not in TRAIN_SPLITS + VAL_SPLITS + OTHER_SPLITS:
            problems.append(f"line {line}: {slide}: split {split!r} is not train, val or test")
            continue
        path = _find_slide(slide, csv_path.parent, sdir)
        if path is None:
            where = sdir if sdir is not None else csv_path.parent
            problems.append(f"line {line}: {slide}: no such slide in {where}")
            continue
        key = path.resolve()
        if key in seen:
            problems.append(f"line {line}: {slide}: listed twice (also line {seen[key]})")
            continue
        seen[key] = line
        found.append((line, slide, path, label, split.lower() if split else None, row.get("patient") or None))
    if check_readable:
        for line, slide, path, *_rest in found:
            try:
                slide_info(path)
            except SlideError as e:
                problems.append(f"line {line}: {slide}: unreadable ({e.message})")
    if not problems and not found:
        problems.append("no labelled slides")
    if problems:
        n = len(problems)
        raise SlideError(
            f"{csv_path}: {n} problem{'s' if n != 1 else ''} with the labels:\n"
            + "\n".join(f"  - {p}" for p in problems),
            hint="fix or remove these rows; slide is a path relative to data.slides_dir (or the CSV) or a file stem",
        )
    class_names = _sort_classes({f[3] for f in found})
    index = {c: i for i, c in enumerate(class_names)}
    records = [
        SlideRecord(Path(slide).stem, path, index[label], label, split, line, patient)
        for line, slide, path, label, split, patient in found
    ]
    return records, class_names


def split_records(
    records: Sequence[SlideRecord], val_fraction: float = 0.25, seed: int = 0
) -> tuple[list[SlideRecord], list[SlideRecord]]:
    """(train, val). Uses the ``split`` column when any record has one (test rows go to neither); otherwise a
    seeded split stratified by label: ``round(n_class * val_fraction)`` per class, at least one when a class has
    two or more slides and ``val_fraction > 0``."""
    if not 0.0 <= val_fraction < 1.0:
        raise SlideError(f"val_fraction {val_fraction} must be within [0, 1)", hint="set data.val_fraction, e.g. 0.25")
    if any(r.split is not None for r in records):
        unsplit = [r.slide_id for r in records if r.split is None]
        if unsplit:
            raise SlideError(
                f"{len(unsplit)} slides have no split while others do (e.g. {', '.join(unsplit[:3])})",
                hint="fill the split column for every row (train, val or test), or leave it out entirely",
            )
        train = [r for r in records if r.split in TRAIN_SPLITS]
        val = [r for r in records if r.split in VAL_SPLITS]
        return train, val
    rng = np.random.default_rng(seed)
    val_ids: set[int] = set()
    for label in sorted({r.label for r in records}):
        idx = [i for i, r in enumerate(records) if r.label == label]
        rng.shuffle(idx)
        k = int(round(len(idx) * val_fraction))
        if val_fraction > 0 and len(idx) >= 2:
            k = min(max(k, 1), len(idx) - 1)
        val_ids.update(idx[:k])
    train = [r for i, r in enumerate(records) if i not in val_ids]
    val = [r for i, r in enumerate(records) if i in val_ids]
    return train, val


class SlideDataset(torch.utils.data.Dataset):
    """``ds[i] -> (image uint8 (3, H, W), label, record, ReadResult)``; one whole region per item.

    ``read_kwargs`` go to ``read_slide_region`` (level/mpp/magnification, region, size, pad_multiple, ...).
    Augmentation draws from a generator seeded by (seed, epoch, index): reproducible, different each epoch
    (call ``set_epoch``). Holds only paths, so it pickles to worker processes; each read opens and closes its slide.
    """

    def __init__(
        self,
        records: Sequence[SlideRecord],
        read_kwargs: dict[str, Any] | None = None,
        augment: AugmentConfig | None = None,
        seed: int = 0,
        stream: bool = False,
        stream_cache: int = 0,
        spill: HostAllocator | None = None,
    ) -> None:
        self.stream = stream  # data.stream_tiles: items hold a SlideTileSource, decoded tile by tile when used
        self.stream_cache = stream_cache  # data.stream_cache: the bound on each source's cache of decoded regions
        self.spill = spill  # whole slides decoded into memory-mapped files (engine.spill_dir), not RAM; None: RAM
        self.records = list(records)
        self.read_kwargs = dict(read_kwargs or {})
        self.augment = augment
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, SlideRecord, ReadResult]:
        rec = self.records[i]
        if self.stream:
            rng = np.random.default_rng([self.seed, self.epoch, i]) if self.augment is not None else None
            res = open_tile_source(rec.path, augment=self.augment, rng=rng, cache_bytes=self.stream_cache,
                                   **self.read_kwargs)  # fmt: skip
            return res.image, rec.label, rec, res
        res = read_slide_region(rec.path, allocator=self.spill, **self.read_kwargs)
        image = res.image
        if self.augment is not None:
            rng = np.random.default_rng([self.seed, self.epoch, i])
            res.geometry = geometry_of(np.random.default_rng([self.seed, self.epoch, i]), self.augment)
            image = augment_from_config(image, rng, self.augment)
            res.image = image
        return image, rec.label, rec, res


_DONE = object()


class PrefetchLoader:
    """Iterate ``dataset`` in ``order`` while a background thread reads the next slide.

    At most ``depth`` items wait ready (default 1: the current slide plus the next one in host memory). Reading
    is I/O and C decoding (OpenSlide, libjpeg, PIL release the GIL), so a thread overlaps it with training.
    Errors in the reader thread are raised in the consumer at the item where they happened.
    """

    def __init__(self, dataset: Any, order: Sequence[int] | None = None, depth: int = 1) -> None:
        self.dataset = dataset
        self.order = list(range(len(dataset))) if order is None else list(order)
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.depth = depth

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[Any]:
        q: queue.Queue[Any] = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def work() -> None:
            for i in self.order:
                if stop.is_set():
                    return
                try:
                    item: Any = self.dataset[i]
                except BaseException as e:  # hand the error to the consumer
                    item = e
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if isinstance(item, BaseException):
                    return
            q.put(_DONE)

        t = threading.Thread(target=work, name="wsitrain-prefetch", daemon=True)
        t.start()
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                del item  # drop our reference so the slide's memory can go while the next one is read
        finally:
            stop.set()
            while t.is_alive():  # unblock a producer waiting on a full queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    pass
                t.join(timeout=0.05)
