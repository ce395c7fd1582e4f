"""A fit on the real shared slides (CMU-1 small region and the TCGA slide, labels invented) runs end to end."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.train.fit import run_fit


def test_fit_on_real_slides_end_to_end(shared_slides: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\ncmu-1-small-region.svs,benign\ntcga-cr-7395-01a-01-ts1.svs,tumour\n")
    cfg = WsiTrainConfig.model_validate({
        "name": "real",
        # 8 µm/px on the tissue box: about 140x185 px (CMU-1) and 280x220 px (TCGA, which has no mpp: 0.5 assumed).
        "data": {"labels": str(labels), "slides_dir": str(shared_slides), "mpp": 8.0, "fallback_mpp": 0.5,
                 "region": "tissue", "val_fraction": 0.0},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": "1GiB", "tile_size": 96, "device": "cpu"},
        "train": {"epochs": 1, "optimizer": "adamw", "lr": 1e-3, "accumulate": 2},
        "log": {"dir": str(tmp_path / "runs"), "tiles": "summary"},
    })
    buf = io.StringIO()
    run = run_fit(cfg, console=Console(file=buf, width=200), quiet=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1]  # 2 slides per optimizer step
    assert all(math.isfinite(r["loss"]) and r["read_s"] > 0 for r in rows)
    # Read throughput per slide: output megapixels over the read's seconds, and the decoder threads it used.
    for r in rows:
        assert r["read_threads"] >= 1
        assert r["read_mpx_per_s"] == pytest.approx(r["shape"][0] * r["shape"][1] / 1e6 / r["read_s"])
        # data.mask_background is on by default: both slides have tissue, so each row says how much was kept.
        assert 0 < r["tissue_fraction"] <= 1 and r["chunks_skipped"] >= 0 and r["chunks_decoded"] >= 1
        # the engine's tile counts: what computed, what was reused background, what max pooling skipped
        assert r["tiles_reused_forward"] >= 0 and r["tiles_reused_backward"] >= 0 and r["tiles_skipped_backward"] == 0
        assert 0 < r["computed_tile_share"] <= 1 and r["predicted_slowdown"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mean_read_mpx_per_s"] == pytest.approx(sum(r["read_mpx_per_s"] for r in rows) / len(rows))
    assert summary["mean_computed_tile_share"] == pytest.approx(sum(r["computed_tile_share"] for r in rows) / 2)
    assert summary["mean_tissue_fraction"] == pytest.approx(sum(r["tissue_fraction"] for r in rows) / len(rows))
    assert "background masking: on" in buf.getvalue() and "data.mask_background: false" in buf.getvalue()
    assert {r["slide"] for r in rows} == {"cmu-1-small-region", "tcga-cr-7395-01a-01-ts1"}
    plans = [json.loads(line) for line in (run / "plans.jsonl").read_text().splitlines()]
    assert len(plans) == 2 and any(s["mode"] == "tiled" for p in plans for s in p["plan"]["segments"])
    assert (run / "best.pt").is_file() and (run / "last.pt").is_file()
    assert "tcga-cr-7395-01a-01-ts1" in buf.getvalue()
