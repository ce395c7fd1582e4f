"""What a fit prints per new plan and per step: one line per new engine plan unless ``log.plans: full`` (the full
plan is in the run folder's plan.txt either way), and step lines that say which figures are the step's own and which
count the epoch so far."""

from __future__ import annotations

import io
import re
from pathlib import Path

import torch
from rich.console import Console

from wsitrain.config import LogConfig
from wsitrain.models import build
from wsitrain.sft import SFT
from wsitrain.train.progress import FitProgress
from wsitrain.train.recorder import RunRecorder


def recorder(tmp_path: Path, plans: str) -> tuple[RunRecorder, io.StringIO]:
    buf = io.StringIO()
    engine = SFT(build("tiny", 2), memory_budget="64MiB", tile_size=64)
    log = LogConfig.model_validate({"dir": str(tmp_path), "tiles": "off", "plans": plans})
    return RunRecorder(tmp_path, log, "fp32", engine, Console(file=buf, width=300)), buf


def slide(h: int, w: int) -> torch.Tensor:
    return torch.zeros(3, h, w, dtype=torch.uint8)  # (3, H, W), as fit reads a slide


def test_one_line_per_new_plan_and_the_full_plan_in_plan_txt(tmp_path: Path) -> None:
    rec, buf = recorder(tmp_path, "line")
    rec.plan_if_new(slide(128, 160), "a.svs")
    rec.plan_if_new(slide(128, 160), "b.svs")  # the same shape: no new plan, nothing printed
    rec.plan_if_new(slide(192, 128), "c.svs")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("engine plan for (1, 3, 128, 160) (first seen on slide a.svs): ")
    assert lines[1].startswith("engine plan for (1, 3, 192, 128) (first seen on slide c.svs): ")
    for line in lines:
        assert re.search(r"tiled \dx\d.*; fits, estimated peak [0-9.]+ [KM]iB of 64.00 MiB, step [0-9.]+x plain", line)
        assert f"full plan in {tmp_path / 'plan.txt'}" in line and "log.plans: full" in line
    full = (tmp_path / "plan.txt").read_text()
    assert full.count("SFT plan for tiny") == 2 and "segment 0:" in full  # every plan, whole


def test_log_plans_full_prints_the_whole_plan(tmp_path: Path) -> None:
    rec, buf = recorder(tmp_path, "full")
    rec.plan_if_new(slide(128, 160), "a.svs")
    out = buf.getvalue()
    assert out.startswith("engine plan for (1, 3, 128, 160) (first seen on slide a.svs):\nSFT plan for tiny")
    assert "segment 0:" in out and "memory parts:" in out


def test_step_line_labels_the_step_and_the_epoch_so_far() -> None:
    buf = io.StringIO()
    engine = SFT(build("tiny", 2), memory_budget="64MiB")
    with FitProgress(Console(file=buf, width=300), quiet=True, epochs=2, engine=engine) as progress:
        progress.start_epoch(0, 4, 0)
        for i, tiles in enumerate((10, 14)):
            progress.start_slide(f"s{i}.svs", tiles)
            progress.end_slide(0.5, 2**20)
            progress.step_line(0, i, 4, i + 1, 0.5, 1e-3, 2**20)
    steps = [line for line in buf.getvalue().splitlines() if " step " in line]
    assert len(steps) == 2
    assert re.fullmatch(r"epoch 1/2 slide 1/4 step 1: loss 0\.5000, lr 0\.001, peak RSS 1\.00 MiB \(this step\); "
                        r"epoch so far: 10 tiles, [0-9.]+ s", steps[0]), steps[0]
    assert "epoch so far: 24 tiles" in steps[1]  # 10 + 14: the epoch's count, not the step's
