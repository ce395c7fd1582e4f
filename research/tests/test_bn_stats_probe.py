"""research/bn_stats_probe.py: a finished run's validation slides scored with BatchNorm's running averages and with
each slide's own statistics, on the same read; bad input is exit 2 naming the folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from script_module import load_script
from tiny_runs import config_file, finished_run, synthetic_slides


def test_a_run_is_scored_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    probe = load_script("bn_stats_probe", "research")
    cfg = config_file(tmp_path, synthetic_slides(tmp_path / "synth"))
    model = "model: {name: tiny_bn, pool: max, freeze_bn: false}"
    cfg.write_text(cfg.read_text().replace("model: {name: tiny}", model))
    run = finished_run(cfg)
    scores = probe.probe(run)
    assert set(scores) == {"running", "slide"}
    # two validation slides, one per class: an AUC of 0, 0.5 or 1, the same slides both ways
    assert all(s["roc_auc"] in (0.0, 0.5, 1.0) and s["accuracy"] in (0.0, 0.5, 1.0) for s in scores.values())
    assert probe.main([str(run)]) == 0
    assert "running averages AUC" in capsys.readouterr().out
    assert probe.main([str(tmp_path / "synth")]) == 2
    assert "is not a finished run folder" in capsys.readouterr().err
    frozen = shutil.copytree(run, tmp_path / "frozen")
    (frozen / "config.yaml").write_text((frozen / "config.yaml").read_text().replace("freeze_bn: false",
                                                                                     "freeze_bn: true"))  # fmt: skip
    with pytest.raises(SystemExit, match="model.freeze_bn is true"):
        probe.probe(frozen)
