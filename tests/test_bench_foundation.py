"""benchmarks/bench_foundation.py: its table from recorded rows (``--write-only``), the CNN rows beside them, the
note on a reduced run, and its input errors (exit 2). The runs themselves are the benchmark's, not a test's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_foundation", ROOT / "benchmarks" / "bench_foundation.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_foundation"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_write_only_makes_the_table(tmp_path: Path) -> None:
    bf = _bench()
    setup = {"kind": "setup", "n": 48, "size": 1024, "n_train": 24, "seeds": [1, 2], "epochs": 12, "lr": 3e-4,
             "threads": 1, "augmentations": 8, "argv": "--out X", "encoder": "e.pt", "pretrained_here": False,
             "machine": {"nproc": 2, "cpu": "x86_64", "torch": "2", "date": "2026-12-01"}}  # fmt: skip
    rows = [{"kind": "run", "row": row, "seed": seed, "roc_auc": auc, "accuracy": 0.5, "val_loss": 0.7,
             "chance_loss": 0.69, "pointing_game": 0.25, "wall_s": 100.0}
            for row, auc in ((bf.ALL, 0.75), (bf.FROZEN, 0.5)) for seed in (1, 2)]  # fmt: skip
    (tmp_path / "foundation-models.jsonl").write_text("\n".join(json.dumps(r) for r in [setup, *rows]) + "\n")
    assert bf.main(["--out", str(tmp_path), "--write-only"]) == 0
    page = (tmp_path / "foundation-models.md").read_text()
    lines = [ln for ln in page.splitlines() if ln.startswith("| ")]
    assert lines[2].startswith(f"| {bf.FROZEN} | 0.500 ± 0.000 | 0.50, 0.50 |")  # the protocol's order
    assert lines[3].startswith(f"| {bf.ALL} | 0.750 ± 0.000 | 0.75, 0.75 | 0.50 | 0.70 / 0.69 | 0.25 | 100 s |")
    assert "**A reduced run** (2 seed(s)" in page
    if bf.cnn_rows():  # docs' bench_learning runs are in this checkout: their CNN rows stand beside
        assert "CNN tiny_ln (labels-pretrained): whole slide, attention | 1.000" in page


def test_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bf = _bench()
    assert bf.main(["--out", str(tmp_path), "--write-only"]) == 2
    assert "run the benchmark first" in capsys.readouterr().err
    assert bf.main(["--out", str(tmp_path), "--rows", "all,everything"]) == 2
    assert "--rows everything: choose from frozen, all, last2, lora, lpft" in capsys.readouterr().err
    assert bf.main(["--out", str(tmp_path), "--encoder", str(tmp_path / "none.pt")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_the_scripts_it_runs_are_beside_it() -> None:
    """The pretraining and the learning benchmark are loaded by path: a move that leaves them behind fails here, not
    six minutes into the documented run (it did once, after scripts/ became benchmarks/)."""
    bf = _bench()
    assert bf.PRETRAIN.is_file() and bf.BENCH_LEARNING.is_file()
    assert callable(bf.bench_learning().run_one)
