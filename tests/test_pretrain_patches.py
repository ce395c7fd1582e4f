"""scripts/pretrain_patches.py: a trunk trained on a disjoint lesion cohort's patch labels, saved so that
``model.weights`` loads it into any head; the benchmark's own cohort is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from script_module import load_script

from wsitrain.models import build
from wsitrain.slides.readers import read_whole
from wsitrain.slides.synth import write_synthetic_dataset


def test_patches_are_the_structures_and_tissue_away_from_them(tmp_path: Path) -> None:
    pre = load_script("pretrain_patches")
    labels = write_synthetic_dataset(tmp_path, n=2, size=512, seed=1, lesions="small")
    truth = json.loads((tmp_path / "lesions.json").read_text())["slides"]
    for name, t in truth.items():
        rgb = read_whole(labels.parent / name)
        xs, ys = pre.slide_patches(rgb, t["boxes"], 96, 3, np.random.default_rng(0))
        n = len(t["boxes"])
        assert ys[:n] == [int(b["kind"] == "lesion") for b in t["boxes"]] and ys[n:] == [0] * (len(ys) - n)
        assert 0 < len(ys) - n <= 3 and all(x.shape == (96, 96, 3) for x in xs)
        b = t["boxes"][0]  # the first patch is centred on the first box
        cy, cx = (b["y0"] + b["y1"]) // 2, (b["x0"] + b["x1"]) // 2
        assert np.array_equal(xs[0], rgb[cy - 48 : cy + 48, cx - 48 : cx + 48])
    edge = pre.crop(np.zeros((100, 120, 3)), 0, 119, 64)  # moved inside at a corner
    assert edge.shape == (64, 64, 3)


def test_the_saved_trunk_loads_into_a_head(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pre = load_script("pretrain_patches")
    out = tmp_path / "trunk.pt"
    args = ["--out", str(out), "--cohort", str(tmp_path / "c"), "--n", "4", "--size", "512", "--epochs", "1",
            "--threads", "1"]  # fmt: skip
    assert pre.main(args) == 0
    assert "the tiny_ln trunk" in capsys.readouterr().out
    trunk = torch.load(out, weights_only=True)
    model = build("tiny_ln", 2, pool="attention", weights=out)
    for k, v in model.features.state_dict().items():
        assert torch.equal(v, trunk[k]), k
    assert not all(torch.equal(v, build("tiny_ln", 2).features.state_dict()[k]) for k, v in trunk.items())
    assert pre.main([*args, "--cohort-seed", "0"]) == 2
    assert "the learning benchmark's cohort" in capsys.readouterr().err
