"""The task's columns of the labels CSV: read, checked and attached to the slide records before anything is written.

Every problem names the CSV, the line and the column, and all are reported at once (one ``SlideError``, exit 2):
a missing column, an empty or non-numeric value, an event that is not 0/1, a label that is not 0/1, too few events
for the survival bins, a column with one value only, a patient whose slides disagree on the outcome.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from wsitrain.config import TaskConfig
from wsitrain.errors import SlideError
from wsitrain.slides.dataset import SlideRecord, load_labels
from wsitrain.tasks.kinds import TEST_SPLITS

# Problems listed before "and N more": a CSV with a broken column stays readable.
SHOWN = 12


def task_columns(task: TaskConfig) -> list[str]:
    """The CSV columns the task reads, in the order of ``SlideRecord.target``."""
    if task.kind == "survival":
        return [task.time, task.event]
    if task.kind in ("regression", "multilabel"):
        return list(task.columns or [])
    return []


def load_task_records(
    labels_csv: Path, slides_dir: Path | None, task: TaskConfig, *, check_readable: bool = True
) -> tuple[list[SlideRecord], list[str]]:
    """``load_labels`` for any task: (records with ``target`` filled in, output names).

    Classification returns ``load_labels``'s records and class names unchanged. Other tasks: the label column is
    optional, each record's ``target`` holds the task's columns as floats, its ``label`` is the stratum splits
    balance (the event for survival, 0 otherwise), and the names are the head's outputs.
    """
    if task.kind == "classification":
        return load_labels(labels_csv, slides_dir, check_readable=check_readable)
    records, _ = load_labels(labels_csv, slides_dir, check_readable=check_readable, needs_label=False)
    columns = task_columns(task)
    rows = _rows_by_line(labels_csv)
    fields = set(next(iter(rows.values()), {}))
    missing = [c for c in columns if c.strip().lower() not in fields]
    if missing:
        plural = "s" if len(missing) > 1 else ""
        raise SlideError(
            f"{labels_csv}: no column{plural} {', '.join(missing)} for task {task.kind} "
            f"(found: {', '.join(sorted(fields)) or 'none'})",
            hint=_column_hint(task),
        )
    problems: list[str] = []
    out: list[SlideRecord] = []
    for rec in records:
        row = rows[rec.line]
        values: list[float] = []
        for c in columns:
            raw = row.get(c.strip().lower(), "")
            value, problem = _number(raw)
            if problem is None and task.kind == "survival" and c == task.event and value not in (0.0, 1.0):
                problem = f"event {raw!r} is not 0 or 1 (1: the event happened, 0: censored)"
            if problem is None and task.kind == "survival" and c == task.time and value < 0:
                problem = f"time {raw!r} is negative"
            if problem is None and task.kind == "multilabel" and value not in (0.0, 1.0):
                problem = f"{raw!r} is not 0 or 1"
            if problem is not None:
                problems.append(f"line {rec.line}, column {c}: {problem}")
            values.append(value)
        label = int(values[1] == 1.0) if task.kind == "survival" else 0
        out.append(dataclasses.replace(rec, target=tuple(values), label=label, label_name=""))
    if not problems:
        problems += _cohort_problems(out, task)
    if problems:
        n = len(problems)
        shown = problems[:SHOWN] + ([f"... and {n - SHOWN} more"] if n > SHOWN else [])
        raise SlideError(
            f"{labels_csv}: {n} problem{'s' if n != 1 else ''} with the {task.kind} columns:\n"
            + "\n".join(f"  - {p}" for p in shown),
            hint=_column_hint(task),
        )
    return out, output_names(task)


def output_names(task: TaskConfig) -> list[str]:
    """The head's outputs: one per target column or label, or one hazard per survival bin (named later by bin)."""
    if task.kind == "survival":
        return ["risk"]
    return list(task.columns or [])


def _rows_by_line(labels_csv: Path) -> dict[int, dict[str, str]]:
    with Path(labels_csv).open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        return {
            line: {(k or "").strip().lower(): (v or "").strip() for k, v in row.items()}
            for line, row in enumerate(reader, start=2)
        }


def _number(raw: str) -> tuple[float, str | None]:
    if not raw:
        return math.nan, "empty"
    try:
        value = float(raw)
    except ValueError:
        return math.nan, f"{raw!r} is not a number"
    if not math.isfinite(value):
        return math.nan, f"{raw!r} is not a finite number"
    return value, None


def _cohort_problems(records: Sequence[SlideRecord], task: TaskConfig) -> list[str]:
    """Whole-column problems, over the rows that can be trained on (test rows are never seen in training)."""
    problems: list[str] = []
    trainable = [r for r in records if r.split not in TEST_SPLITS]
    columns = task_columns(task)
    if task.kind == "survival":
        events = sum(int(r.target[1]) for r in trainable)
        if events < task.bins:
            problems.append(
                f"column {task.event}: {events} events outside the test rows, fewer than task.bins ({task.bins}); "
                "the time bins are the event times' quantiles, so each bin needs at least one event"
            )
    else:
        for j, c in enumerate(columns):
            values = {r.target[j] for r in trainable}
            if len(values) == 1:
                problems.append(f"column {c}: every row outside the test set has the value {values.pop():g}; "
                                "a target with one value teaches nothing")  # fmt: skip
    # A patient's slides share one outcome: per-patient metrics average the slides' outputs against it.
    first: dict[str, SlideRecord] = {}
    for r in records:
        if r.patient is None:
            continue
        seen = first.setdefault(r.patient, r)
        for j, c in enumerate(columns):
            if r.target[j] != seen.target[j]:
                problems.append(f"line {r.line}, column {c}: patient {r.patient} has {r.target[j]:g} here but "
                                f"{seen.target[j]:g} on line {seen.line}; a patient has one outcome")  # fmt: skip
                break
    return problems


def _column_hint(task: TaskConfig) -> str:
    if task.kind == "survival":
        return (f"task survival reads column {task.time} (time >= 0) and {task.event} (1 event, 0 censored); "
                "set task.time / task.event to other column names, or fix the rows above")  # fmt: skip
    what = "numbers" if task.kind == "regression" else "0 or 1"
    return f"task {task.kind} reads columns {', '.join(task.columns or [])} ({what} on every row); fix the rows above"
