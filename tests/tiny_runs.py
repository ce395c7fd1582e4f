"""A tiny fit's config and CLI runner, shared by the tests that need a real run folder (checkpoint loading, write
errors): the tiny model on four 128 px synthetic slides, one epoch by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.slides.synth import write_synthetic_dataset

runner = CliRunner()


def invoke(*args: str) -> Any:
    """``wsitrain ARGS`` in this process, wide and uncoloured so messages are matched whole."""
    return runner.invoke(app, list(args), env={"COLUMNS": "300", "NO_COLOR": "1"})


def config_file(tmp: Path, synth_dir: Path, epochs: int = 1, schedule: str | None = None) -> Path:
    """``tmp/cfg.yaml``: tiny, sgd, on the four slides in ``synth_dir``, runs under ``tmp/runs``."""
    sched = f", schedule: {schedule}" if schedule else ""
    path = tmp / "cfg.yaml"
    path.write_text(
        f"name: exp\nseed: 0\ndata:\n  synthetic: {{n: 4, size: 128, seed: 0, positive_fraction: 0.5, "
        f"cache_dir: {synth_dir}}}\n  region: whole\n  val_fraction: 0.5\n"
        f"model: {{name: tiny}}\nengine: {{memory_budget: 1GiB, device: cpu}}\n"
        f"train: {{epochs: {epochs}, optimizer: sgd, lr: 0.003{sched}}}\n"
        f"log: {{dir: {tmp / 'runs'}, tiles: 'off'}}\n"
    )
    return path


def synthetic_slides(out: Path) -> Path:
    """The four 128 px synthetic slides ``config_file`` trains on, written to ``out``."""
    write_synthetic_dataset(out, n=4, size=128, seed=0, positive_fraction=0.5)
    return out


def finished_run(config: Path) -> Path:
    """Fit ``config`` (from ``config_file``) to the end; its run folder (config.yaml, best.pt, last.pt, ...)."""
    result = invoke("--quiet", "fit", str(config))
    assert result.exit_code == 0, result.output
    return config.parent / "runs" / "exp"
