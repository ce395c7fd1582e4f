"""A patch-encoder model end to end: ``wsitrain fit`` with a tiny timm ViT on every 32 px patch of the tiny synthetic
slides (1 epoch, tiled in chunks of patches), then ``predict --heatmaps`` gives one value per patch. Heavy: about
45 s on the 2-core machine (timm's import and the CLI's, a fit and a predict)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tiny_runs import config_file, finished_run, invoke, synthetic_slides

pytest.importorskip("timm", reason="the encoder is a timm ViT")


@pytest.mark.heavy
def test_fit_then_predict_heatmaps_one_value_per_patch(tmp_path: Path) -> None:
    cfg = config_file(tmp_path, synthetic_slides(tmp_path / "synth"))
    # tile_size 64 px: the 4 x 4 patch grid of a 128 px slide is trained in chunks of 2 x 2 patches, not whole
    text = cfg.read_text().replace("model: {name: tiny}", "model: {name: 'python:tiny_encoders:tiny_vit', patch: 32, "
                                   "pool: gated_attention}").replace("memory_budget: 1GiB", "memory_budget: 1GiB, "
                                   "tile_size: 64")  # fmt: skip
    cfg.write_text(text)
    run = finished_run(cfg)
    log = (run / "train.log").read_text() if (run / "train.log").exists() else ""
    assert "Traceback" not in log
    out = tmp_path / "p.csv"
    maps = tmp_path / "maps"
    res = invoke("--quiet", "predict", str(cfg), "--checkpoint", str(run / "last.pt"), "--slides",
                 str(tmp_path / "synth"), "--out", str(out), "--heatmaps", str(maps))  # fmt: skip
    assert res.exit_code == 0, res.output
    assert len(out.read_text().splitlines()) == 5  # a header and the four slides
    index = json.loads((maps / "heatmaps.json").read_text())
    assert index
    arrays = sorted(maps.glob("*.npy"))
    assert arrays, list(maps.iterdir())
    for path in arrays:
        a = np.load(path)
        assert a.shape[-2:] == (4, 4), (path.name, a.shape)  # 128 px / 32 px patches: one value per patch
        assert np.isfinite(a).all()
