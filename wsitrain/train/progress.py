"""What people see during `wsitrain fit`: a live rich display in a terminal; plain lines otherwise (Slurm logs, CI,
a pipe): one every ``log.every`` optimizer steps and one per epoch. ``brief`` (the CLI's --quiet): epoch lines only."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from wsitrain.sft import SFT
from wsitrain.units import format_bytes


class LiveTilesColumn(ProgressColumn):
    """Tiles done in the current slide, read live from the engine's stats (which it fills tile by tile) at each
    refresh, so a slide that takes minutes still shows movement."""

    def __init__(self, engine: SFT) -> None:
        super().__init__()
        self.engine = engine

    def render(self, task: Task) -> Text:
        total = task.fields.get("tiles_total", 0)
        done = self.engine.last_stats.tile_count  # reads no CUDA timing mid-step
        return Text(f"tiles {min(done, total) if total else done}/{total}" if total else "tiles -")


class FitProgress:
    """Epoch and slide bars with loss, tiles and peak memory, when ``console`` is a terminal and not ``quiet``;
    otherwise plain step lines (not with ``brief``) and epoch lines."""

    def __init__(self, console: Console | None, quiet: bool, epochs: int, engine: SFT, brief: bool = False) -> None:
        self.console = console or Console()
        # A batch job's log is a file: redrawn bars would fill it with control codes, so plain lines there.
        self.live = not quiet and not brief and self.console.is_terminal
        self.quiet = not self.live  # kept for callers that read it: True means plain lines
        self.brief = brief
        self.epochs = epochs
        self.engine = engine
        # CUDA: the step's peak of allocated tensors (what the engine's budget bounds); CPU: the whole process's
        # resident high-water mark (Python, libraries and the slide included), so it says so
        self.peak_label = "peak" if engine.device.type == "cuda" else "peak RSS"
        self._progress: Progress | None = None
        self._task: Any = None
        self._epoch_start = 0.0
        self._resumed_at = 0
        self._slides = 0  # this epoch's slides, tiles and memory high-water mark, for the plain lines
        self._tiles = 0
        self._peak: int | None = None
        self._slide_tiles = 0

    def __enter__(self) -> FitProgress:
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]epoch {task.fields[epoch]}/{task.fields[epochs]}"),
                BarColumn(),
                TextColumn("slide {task.completed:.0f}/{task.total:.0f}"),
                LiveTilesColumn(self.engine),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn(self.peak_label + " {task.fields[peak]}"),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Messages that belong in every log (plan, notes, validation), live display or not."""
        self.console.print(*args, **kwargs)

    def start_epoch(self, epoch: int, n_slides: int, done: int) -> None:
        self._epoch_start = time.perf_counter()
        self._slides, self._tiles, self._peak = 0, 0, None
        self._resumed_at = done  # slides of this epoch trained before a resume: the counts below start after them
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(
            "train", total=n_slides, completed=done, epoch=epoch + 1, epochs=self.epochs, tiles_total=0, loss="-",
            peak="-",
        )

    def start_slide(self, slide: str, tiles_total: int) -> None:
        """``tiles_total``: forward plus backward tiles of this slide's plan."""
        self._slide_tiles = tiles_total
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, tiles_total=tiles_total)

    def end_slide(self, loss: float, peak_bytes: int | None) -> None:
        self._slides += 1
        self._tiles += self._slide_tiles
        if peak_bytes is not None:
            self._peak = max(self._peak or 0, peak_bytes)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, advance=1, loss=f"{loss:.4f}", peak=format_bytes(peak_bytes))

    def step_line(self, epoch: int, index: int, n: int, step: int, loss: float, lr: float, peak: int | None) -> None:
        """Without the live display, one plain line per ``log.every`` optimizer steps for batch logs: the step's own
        loss and peak, then the tiles and seconds of the epoch so far, labelled so (they grow through the epoch)."""
        if not self.live and not self.brief:
            secs = time.perf_counter() - self._epoch_start
            self.print(
                f"epoch {epoch + 1}/{self.epochs} slide {index + 1}/{n} step {step}: loss {loss:.4f}, lr {lr:.3g}, "
                f"{self.peak_label} {format_bytes(peak)} (this step); epoch so far: {self._tiles} tiles, {secs:.1f} s",
                markup=False, highlight=False,
            )

    def end_epoch(self, epoch: int, train_loss: float, lr: float, wait_share: float | None = None) -> None:
        """``wait_share``: the share of rank-time spent waiting for the slowest rank (None: one process)."""
        secs = time.perf_counter() - self._epoch_start
        waited = "" if wait_share is None else f", ranks waited {100 * wait_share:.1f}% of their time"
        # the loss covers the whole epoch (the checkpoint carries the losses before the resume); the counts do not
        since = f" since the resume at slide {self._resumed_at + 1}" if self._resumed_at else ""
        self.print(f"epoch {epoch + 1}/{self.epochs}: train loss {train_loss:.4f}, lr {lr:.3g}, "
                   f"{self._slides} slides{since}, {self._tiles} tiles, {self.peak_label} {format_bytes(self._peak)}, "
                   f"{secs:.1f} s{waited}",
                   markup=False, highlight=False)

    def validation(self, epoch: int, metrics: dict[str, float]) -> None:
        if "accuracy" not in metrics:  # a task's metrics (c_index, r2 ..., macro_auc and per label)
            shown = ", ".join(f"{k} {_fmt(v)}" for k, v in metrics.items() if k not in ("n", "n_patients", "seconds"))
            self.print(f"epoch {epoch + 1}/{self.epochs} validation: {shown}")
            return
        self.print(
            f"epoch {epoch + 1}/{self.epochs} validation: loss {_fmt(metrics.get('loss'))}, "
            f"accuracy {_fmt(metrics.get('accuracy'))}, balanced accuracy {_fmt(metrics.get('balanced_accuracy'))}, "
            f"ROC AUC {_fmt(metrics.get('roc_auc'))}"
        )


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def summary_table(summary: dict[str, Any]) -> Table:
    """The end-of-run table: one row per fact (run folder, epochs, best metrics, timings, peak memory)."""
    table = Table(title="wsitrain fit: summary", show_header=True, header_style="bold")
    table.add_column("", style="bold")
    table.add_column("value")
    for key, value in summary.items():
        if isinstance(value, float):
            text = _fmt(value)
        elif key.endswith("bytes") and isinstance(value, int):
            text = format_bytes(value)
        else:
            text = "-" if value is None else str(value)
        table.add_row(key.replace("_", " "), text)
    return table
