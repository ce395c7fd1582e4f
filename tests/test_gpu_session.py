"""scripts/gpu_session.py on a CPU: the GPU kit's code path (cases, OOM guard, profiler, breakdown, tables)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_module import load_script


def _kit():
    return load_script("gpu_session")


def test_classify_names_the_parts_of_a_step() -> None:
    k = _kit()
    assert k.classify("aten::convolution", [k.FORWARD]) == "conv forward"
    assert k.classify("aten::convolution", [k.RECOMPUTE, k.BACKWARD]) == "recompute"
    assert k.classify("aten::convolution_backward", [k.TILE_BACKWARD, k.BACKWARD]) == "conv backward"
    assert k.classify("aten::copy_", [k.STAGE, k.FORWARD]) == "host staging"
    assert k.classify("aten::copy_", [k.JOIN, k.FORWARD]) == "joins"
    assert k.classify("aten::add_", [k.OVERLAP_ADD, k.BACKWARD]) == "overlap-adds"
    assert k.classify("aten::_foreach_mul_", [k.OPTIMIZER]) == "optimizer"
    assert k.classify("aten::constant_pad_nd", [k.FORWARD]) == "pads"
    assert k.classify("aten::slice", [k.FORWARD]) == "crops"
    assert k.classify("aten::clone", [k.FORWARD]) == "copies"
    assert k._span_and_union([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == (6.0, 4.0)  # idle: 6 - 4 = 2


def test_cpu_quick_session_writes_the_tables(tmp_path: Path) -> None:
    k = _kit()
    code = k.main(["--device", "cpu", "--size", "128", "--quick", "--models", "tiny", "--budget", "13MiB",
                   "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in (tmp_path / "gpu_session.jsonl").read_text().splitlines()]
    rows, prof = lines[:-1], lines[-1]["breakdown"]
    assert [r["run"] for r in rows][:2] == ["plain, 4 patches of 64 px, channels_last", "plain, one image, NCHW"]
    assert all(r["status"] == "ok" for r in rows), rows
    capped = [r for r in rows if "capped" in r["run"]]
    assert capped and all("tiled" in r["plan"] for r in capped)  # the cap makes it tile
    secs = prof["seconds"]
    assert set(secs) == set(k.CATEGORIES)
    assert secs["conv forward"] > 0 and secs["recompute"] > 0 and secs["conv backward"] > 0
    assert secs["joins"] > 0 and secs["optimizer"] > 0 and secs["overlap-adds"] > 0
    assert prof["span_s"] >= prof["busy_s"] > 0
    md = (tmp_path / "gpu_session.md").read_text()
    assert "| recompute |" in md and "idle between kernels" in md and "*Measured* on cpu" in md


@pytest.mark.parametrize("budget", ["1KiB"])
def test_a_case_that_cannot_fit_is_a_row_not_a_crash(tmp_path: Path, budget: str) -> None:
    k = _kit()
    import torch

    row = k.run_case(k.Case("tiny", "SFT capped", True, budget=budget), torch.device("cpu"), 128, 64, 1, 1.0)
    assert row["status"] in ("oom", "error") and "fit" in row["note"]
