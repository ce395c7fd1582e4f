"""The slide's tissue mask at the attention map's resolution: from the read's separable mask, moved with the image's
flips and turns, and through fit and predict."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from wsitrain.slides.augment import AugmentConfig, augment_from_config, geometry_of
from wsitrain.slides.pixels import RegionMask
from wsitrain.slides.stream import ReadResult


def region_mask(h: int, w: int, seed: int) -> RegionMask:
    rng = np.random.default_rng(seed)
    gh, gw = 7, 5
    grid = np.zeros((gh + 1, gw + 1), dtype=bool)
    grid[:gh, :gw] = rng.random((gh, gw)) < 0.35
    rows = np.arange(h) * gh // h
    cols = np.arange(w) * gw // w
    rows[-3:] = -1  # past the slide's edge: never tissue
    return RegionMask(grid=grid, rows=rows, cols=cols, background=(255, 255, 255))


def cells_of(full: np.ndarray, h: int, w: int) -> np.ndarray:
    """Brute force: cell i holds rows y with y * h // H == i; True when any pixel is."""
    big_h, big_w = full.shape
    out = np.zeros((h, w), dtype=bool)
    ys, xs = np.nonzero(full)
    out[ys * h // big_h, xs * w // big_w] = True
    return out


@pytest.mark.parametrize(("h", "w"), [(4, 3), (8, 6), (5, 7), (64, 48)])
def test_cells_equal_brute_force(h: int, w: int) -> None:
    m = region_mask(64, 48, seed=h * w)
    full = np.take(m.grid[m.rows], m.cols, axis=1)  # (64, 48): the mask the read applied
    assert np.array_equal(m.cells(h, w), cells_of(full, h, w))


@pytest.mark.parametrize("seed", range(8))
def test_map_mask_follows_the_augmentation(seed: int) -> None:
    """The mask moved by the drawn flips and turns equals the mask of the augmented image."""
    m = region_mask(64, 48, seed=seed)
    full = np.take(m.grid[m.rows], m.cols, axis=1)
    image = torch.from_numpy(np.repeat(full[None].astype(np.uint8) * 200, 3, axis=0)).contiguous()  # (3, 64, 48)
    cfg = AugmentConfig(flips=True, rot90=True)
    rng_seed = [0, 1, seed]
    read = ReadResult(image=image, path="x", level=0, scale=1.0, downsample=1.0, box=(0, 0, 48, 64), mpp=None,
                      bytes=0, seconds=0.0, mask=m)  # fmt: skip
    read.geometry = geometry_of(np.random.default_rng(rng_seed), cfg)
    out = augment_from_config(image, np.random.default_rng(rng_seed), cfg)
    hh, ww = out.shape[1] // 8, out.shape[2] // 8
    got = read.map_mask(hh, ww)
    assert got is not None and got.shape == (1, 1, hh, ww)
    want = cells_of(out[0].numpy() > 0, hh, ww)
    assert np.array_equal(got[0, 0].numpy(), want)


def test_no_mask_no_attention_mask() -> None:
    read = ReadResult(image=torch.zeros(3, 8, 8, dtype=torch.uint8), path="x", level=0, scale=1.0, downsample=1.0,
                      box=(0, 0, 8, 8), mpp=None, bytes=0, seconds=0.0)  # fmt: skip
    assert read.map_mask(2, 2) is None


def test_fit_and_predict_with_a_per_class_gated_attention_head(tmp_path: Path) -> None:
    """fit trains a CLAM-MB head; predict's probabilities equal the plain model's under the slide's tissue mask,
    and its heatmaps carry each branch's attention (0 off the tissue) into the .npy, the GeoJSON and the TIFF."""
    import csv
    import io
    import json

    from rich.console import Console

    from wsitrain.config import WsiTrainConfig
    from wsitrain.models import build
    from wsitrain.models.heads import AttentionSpec
    from wsitrain.slides.stream import read_slide_region
    from wsitrain.train.attention_mask import tissue_masked
    from wsitrain.train.checkpoint import load_checkpoint
    from wsitrain.train.data import read_kwargs
    from wsitrain.train.fit import run_fit
    from wsitrain.train.predict import run_predict

    quiet = Console(file=io.StringIO())
    cfg = WsiTrainConfig.model_validate({
        "name": "att",
        "data": {"synthetic": {"n": 4, "size": 256, "cache_dir": str(tmp_path / "synth")}, "region": "whole",
                 "val_fraction": 0.5},
        "model": {"name": "tiny", "pool": "gated_attention", "attention": {"branches": "per_class", "dim": 16}},
        "engine": {"memory_budget": "1GiB", "tile_size": 128, "device": "cpu"},
        "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.01},
        "log": {"dir": str(tmp_path / "runs"), "tiles": "off"},
    })  # fmt: skip
    run = run_fit(cfg, console=quiet, quiet=True)
    ckpt = load_checkpoint(run / "best.pt")
    maps = tmp_path / "maps"
    out = run_predict(cfg, checkpoint=run / "best.pt", slides=tmp_path / "synth", out=tmp_path / "p.csv",
                      console=quiet, heatmaps=maps)  # fmt: skip
    model = build("tiny", 2, pool="gated_attention", attention=AttentionSpec(dim=16, per_class=True)).eval()
    model.load_state_dict(ckpt["model"])
    index = {r["slide"]: r for r in json.loads((maps / "heatmaps.json").read_text())["slides"]}
    masked_somewhere = False
    for row in csv.DictReader(out.open()):
        read = read_slide_region(Path(row["path"]), **read_kwargs(cfg, model.stride))
        with torch.no_grad(), tissue_masked(model, read):
            probs = torch.softmax(model(read.image[None]), 1)[0]
        torch.testing.assert_close(probs, torch.tensor([float(row["prob_negative"]), float(row["prob_positive"])]),
                                   atol=2e-6, rtol=0)  # fmt: skip
        rec = index[row["slide"]]
        att = torch.from_numpy(np.load(maps / rec["attention"]))  # (2, h, w)
        assert att.shape[0] == 2
        torch.testing.assert_close(att.sum((1, 2)), torch.ones(2), atol=1e-5, rtol=0)
        mask = read.map_mask(att.shape[1], att.shape[2])
        if mask is not None and not bool(mask.all()):
            masked_somewhere = True
            assert float(att[:, ~mask[0, 0]].abs().max()) == 0.0
        doc = json.loads((maps / rec["geojson"]).read_text())
        names = set(doc["features"][0]["properties"]["measurements"])
        assert {"attention negative", "attention positive", "cam negative", "cam positive"} <= names
        assert rec["heatmap_tif_map"] == f"attention {rec['predicted']}"
    assert masked_somewhere, "the synthetic slides have background: some map cells must be masked"
