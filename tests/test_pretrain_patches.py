"""benchmarks/pretrain_patches.py: a trunk trained on a disjoint lesion cohort's patch labels, saved so that
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


def test_nt_xent_is_simclr_s_loss() -> None:
    """Orthogonal projections whose two views agree: each view's partner has similarity 1/T and the 2B - 2 others 0,
    so the loss is -log(e^(1/T) / (e^(1/T) + 2B - 2)); a shuffled partner makes it larger."""
    pre = load_script("pretrain_patches")
    z = torch.eye(4, 8) * 3.0  # normalised inside
    t = 0.5
    expected = -np.log(np.exp(1 / t) / (np.exp(1 / t) + 2 * 4 - 2))
    torch.testing.assert_close(pre.nt_xent(z, z, t), torch.tensor(expected, dtype=torch.float32))
    assert pre.nt_xent(z, z[[1, 0, 3, 2]], t) > pre.nt_xent(z, z, t) + 1


def test_views_are_random_windows_of_each_crop_seeded_by_the_generator() -> None:
    pre = load_script("pretrain_patches")
    x = torch.randint(0, 256, (5, 3, 24, 24), dtype=torch.uint8)
    a = pre.views(x, 20, torch.Generator().manual_seed(1))
    b = pre.views(x, 20, torch.Generator().manual_seed(1))
    c = pre.views(x, 20, torch.Generator().manual_seed(2))
    assert a.shape == (5, 3, 20, 20) and a.dtype == torch.float32 and 0 <= a.min() and a.max() <= 1
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_tissue_crops_fall_on_tissue() -> None:
    """Crops are centred on the tissue mask's cells: on an image whose only tissue is one pink square, every crop
    holds part of it."""
    pre = load_script("pretrain_patches")
    rgb = np.full((256, 256, 3), 240, dtype=np.uint8)  # background
    rgb[160:224, 32:96] = (200, 120, 170)  # tissue
    crops = pre.tissue_crops(rgb, 12, 48, np.random.default_rng(0))
    assert len(crops) == 12 and all(c.shape == (48, 48, 3) for c in crops)
    assert all((c[..., 1] < 200).any() for c in crops)
    assert pre.tissue_crops(np.full((64, 64, 3), 240, dtype=np.uint8), 3, 32, np.random.default_rng(0)) == []


def test_the_probe_counts_held_out_hits_per_kind_and_draws_nothing() -> None:
    """A trunk whose pooled features tell the kinds apart by colour scores every held-out patch right; the probe
    leaves the global random state as it found it (the training after it draws the same)."""
    pre = load_script("pretrain_patches")
    model = build("tiny_ln", 2)
    folds = []
    for _ in range(4):
        kinds = torch.tensor([0, 0, 1, 2, 0, 1])
        x = torch.zeros(6, 3, 32, 32, dtype=torch.uint8)
        x[kinds == 1] = 250  # lesions bright, the rest dark: any trunk tells them apart
        x[kinds != 1] = torch.randint(0, 40, (int((kinds != 1).sum()), 3, 32, 32), dtype=torch.uint8)
        folds.append((x, kinds))
    state = torch.get_rng_state()
    report = pre.probe(model, folds)
    assert report.startswith("tissue 12/12, lesions 8/8, look-alikes 4/4; lesion vs look-alike: ")
    assert report.endswith("sd apart, best channel AUC 1.00")
    assert torch.equal(torch.get_rng_state(), state)


def test_the_contrastive_trunk_loads_into_a_head(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pre = load_script("pretrain_patches")
    out = tmp_path / "trunk.pt"
    args = ["--out", str(out), "--cohort", str(tmp_path / "c"), "--n", "4", "--size", "512", "--epochs", "1",
            "--threads", "1", "--objective", "contrastive", "--crops", "8", "--batch", "16"]  # fmt: skip
    assert pre.main(args) == 0
    text = capsys.readouterr().out
    assert "the tiny_ln trunk (contrastive), 32 unlabelled tissue crops from 4 slides" in text
    assert text.count("held-out linear probe: tissue ") == 2  # before and after
    model = build("tiny_ln", 2, pool="attention", weights=out)
    trunk = torch.load(out, weights_only=True)
    assert all(torch.equal(v, trunk[k]) for k, v in model.features.state_dict().items())
    assert pre.main([*args, "--batch", "64"]) == 2
    assert "32 tissue crops, fewer than --batch 64" in capsys.readouterr().err


def test_probe_mode_trains_nothing_and_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--probe random|FILE`` prints the probe of that trunk and writes no trunk; a missing file, both or neither of
    --out and --probe are exit 2 with a message."""
    pre = load_script("pretrain_patches")
    common = ["--cohort", str(tmp_path / "c"), "--n", "4", "--size", "512", "--threads", "1"]
    assert pre.main([*common, "--probe", "random"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("random: the tiny_ln trunk's features, held-out linear probe: tissue ") and "sd apart" in out
    assert not list(tmp_path.glob("*.pt"))
    assert pre.main([*common, "--probe", str(tmp_path / "none.pt")]) == 2
    err = capsys.readouterr().err
    assert "--probe" in err and "no such file" in err
    assert pre.main([*common, "--probe", "random", "--out", str(tmp_path / "t.pt")]) == 2
    assert pre.main(common) == 2
    assert capsys.readouterr().err.count("give --out (train a trunk) or --probe TRUNK") == 2


def test_separation_and_best_channel_auc() -> None:
    pre = load_script("pretrain_patches")
    a = torch.tensor([[10.0, 0.0], [12.0, 1.0], [11.0, -1.0]])
    b = torch.tensor([[0.0, 0.0], [2.0, 1.0], [1.0, -1.0]])
    assert pre.best_auc(a, b) == 1.0 and pre.best_auc(b, a) == 1.0  # either way round
    assert pre.separation(a, b) == pytest.approx(10 / torch.tensor([-1.0, 1, 0, -1, 1, 0]).std().item(), rel=1e-5)
    assert pre.best_auc(a[:, 1:], b[:, 1:]) == 0.5


def test_a_vit_patch_encoder_pretrains_contrastively_and_loads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--model-patch``: a ViT's views are its own patch size; the file (``encoder.*`` keys) loads with
    ``model.weights`` into the same patch model."""
    pre = load_script("pretrain_patches")
    out = tmp_path / "vit.pt"
    args = ["--out", str(out), "--cohort", str(tmp_path / "c"), "--n", "4", "--size", "512", "--epochs", "1",
            "--threads", "1", "--objective", "contrastive", "--crops", "8", "--batch", "16",
            "--model", "python:tests.fake_hub:tiny_vit", "--model-patch", "16", "--patch", "20"]  # fmt: skip
    assert pre.main(args) == 0
    assert "the python:tests.fake_hub:tiny_vit trunk (contrastive)" in capsys.readouterr().out
    trunk = torch.load(out, weights_only=True)
    assert trunk and all(k.startswith("encoder.") for k in trunk)
    model = build("python:tests.fake_hub:tiny_vit", 2, pool="attention", weights=out, patch=16)
    assert all(torch.equal(v, trunk[f"encoder.{k}"]) for k, v in model.features.encoder.state_dict().items())
    assert pre.main([*args[:-2], "--patch", "16"]) == 2
    assert "--model-patch 16 must be below --patch 16" in capsys.readouterr().err
