"""Slide heatmaps: class activation maps and block-summed saliency equal their plain computations in float64."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.testing import assert_close

from wsitrain.errors import WsiTrainError
from wsitrain.models import build
from wsitrain.report.cam import BlockSumAccumulator, CamAccumulator, block_sum, cam_of_features, find_head
from wsitrain.report.heatmap import slide_maps
from wsitrain.report.overlay import shrink_image


def _model(pool: str, classes: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return build("tiny", classes, pool=pool).double().eval()


def _image(h: int = 96, w: int = 80, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((1, 3, h, w), generator=g, dtype=torch.float64) * 255


def _features(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    return model.features(model.normalize(x))  # (1, C, h, w): what the pooling head sees


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_plain_cam_is_the_classifier_at_every_position(pool: str) -> None:
    model, x = _model(pool), _image()
    with torch.no_grad():
        f = _features(model, x)
        logits = model(x)
    maps = slide_maps(model, x)
    w, b = model.classifier.weight, model.classifier.bias
    expected = torch.einsum("kc,chw->khw", w, f[0]) + b[:, None, None]
    assert maps.cam.dtype == torch.float64 and maps.cam.shape == (3, 6, 5)
    assert_close(maps.cam, expected)
    assert_close(maps.logits, logits[0])
    assert_close(maps.probs.double(), torch.softmax(logits, 1)[0], atol=1e-6, rtol=1e-6)
    assert maps.stride == 16
    if pool == "avg":  # average pooling: the logit is the CAM's mean
        assert_close(maps.cam.mean(dim=(1, 2)), logits[0])
        assert maps.decisive is None
    else:
        assert maps.decisive is not None and maps.decisive.shape == (3, 2)


def test_max_head_contributions_sum_to_the_logit_and_mark_the_decisive_position() -> None:
    model, x = _model("max"), _image()
    with torch.no_grad():
        f = _features(model, x)[0]  # (C, h, w)
        logits = model(x)[0]
    head = find_head(model)
    acc = CamAccumulator(head, 1, tuple(f.shape[-2:]))
    acc(f[None], (0, f.shape[1]), (0, f.shape[2]))
    parts = acc.max_contributions()[0]  # (K, h*w)
    assert_close(parts.sum(dim=1) + head.bias, logits)
    # By hand: channel c's max sits at argmax_c; its weight times the max goes to that position.
    flat = f.flatten(1)
    where = flat.argmax(dim=1)
    for k in range(3):
        by_hand = torch.zeros(flat.shape[1], dtype=torch.float64)
        by_hand.index_add_(0, where, head.weight[k] * flat.max(dim=1).values)
        assert_close(parts[k], by_hand)
        r, c = acc.decisive_positions()[0, k].tolist()
        held = torch.full_like(by_hand, float("-inf"))
        held[where] = by_hand[where]  # only positions holding some channel's maximum take part
        assert r * f.shape[2] + c == int(held.argmax())


def _ragged(n: int, edges: list[int]) -> list[tuple[int, int]]:
    cuts = [0, *edges, n]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_cam_from_ragged_tiles_equals_the_whole_map(pool: str) -> None:
    model = _model(pool)
    with torch.no_grad():
        f = _features(model, _image(112, 144))  # (1, 32, 7, 9)
    head = find_head(model)
    whole = cam_of_features(head, f)
    acc = CamAccumulator(head, 1, (7, 9))
    for r0, r1 in _ragged(7, [3, 4]):
        for c0, c1 in _ragged(9, [5]):
            acc(f[:, :, r0:r1, c0:c1], (r0, r1), (c0, c1))
    assert_close(acc.result(), whole)
    if pool == "max":
        ref = CamAccumulator(head, 1, (7, 9))
        ref(f, (0, 7), (0, 9))
        assert_close(acc.max_contributions(), ref.max_contributions())


def test_cam_accumulator_refuses_an_incomplete_map() -> None:
    head = find_head(_model("avg"))
    acc = CamAccumulator(head, 1, (4, 4))
    acc(torch.zeros((1, 32, 2, 4), dtype=torch.float64), (0, 2), (0, 4))
    with pytest.raises(RuntimeError, match="8 of 16 map positions unseen"):
        acc.result()


@pytest.mark.parametrize("block", [1, 5, 16])
def test_block_sum_from_ragged_overlapping_shares_is_exact(block: int) -> None:
    g = torch.Generator().manual_seed(3)
    full = torch.randn((1, 3, 37, 29), generator=g, dtype=torch.float64)
    # Overlapping tiles whose shares add up to ``full`` (as halos of adjacent tiles do).
    tiles = [((0, 20), (0, 17)), ((12, 37), (0, 17)), ((0, 20), (11, 29)), ((12, 37), (11, 29))]
    weights = torch.rand((len(tiles), 1, 3, 37, 29), generator=g, dtype=torch.float64)
    masks = torch.zeros_like(weights)
    for i, ((r0, r1), (c0, c1)) in enumerate(tiles):
        masks[i, ..., r0:r1, c0:c1] = 1
    shares = weights * masks / (weights * masks).sum(dim=0)
    acc = BlockSumAccumulator((1, 3, 37, 29), block, torch.float64)
    for i, ((r0, r1), (c0, c1)) in enumerate(tiles):
        acc((shares[i] * full)[..., r0:r1, c0:c1], (r0, r1), (c0, c1))
    expected = torch.zeros((1, 3, -(-37 // block), -(-29 // block)), dtype=torch.float64)
    for i in range(37):
        for j in range(29):
            expected[..., i // block, j // block] += full[..., i, j]
    assert_close(acc.sum, expected)
    assert_close(block_sum(full, block), expected)


def test_plain_saliency_is_the_block_summed_input_gradient() -> None:
    model, x = _model("avg"), _image()
    xr = x.clone().requires_grad_(True)
    logits = model(xr)
    k = int(logits.argmax())
    (grad,) = torch.autograd.grad(logits[0, k], xr)
    maps = slide_maps(model, x, saliency_block=8)
    assert maps.predicted == k and maps.block == 8
    assert_close(maps.saliency, block_sum(grad, 8)[0])


def test_find_head_names_what_is_missing() -> None:
    with pytest.raises(WsiTrainError, match="global pooling.*top-level modules are: 0, 1"):
        find_head(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))
    with pytest.raises(WsiTrainError, match="exactly one Linear after the pooling module '1'"):
        find_head(nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4),
                                nn.ReLU(), nn.Linear(4, 2)))


def test_shrink_image_is_a_box_filter() -> None:
    g = torch.Generator().manual_seed(4)
    img = torch.randint(0, 256, (3, 50, 70), generator=g, dtype=torch.uint8)
    small, f = shrink_image(img, 16, rows_per_chunk=10)  # bands of 10 rows: exercises the band loop
    assert f == 5 and small.shape == (10, 14, 3)
    expected = img.double().reshape(3, 10, 5, 14, 5).mean(dim=(2, 4)).round().to(torch.uint8).permute(1, 2, 0)
    np.testing.assert_array_equal(small, expected.numpy())


@pytest.mark.parametrize("saliency", [False, True])
def test_heatmap_files_for_a_synthetic_slide(tmp_path: Path, saliency: bool) -> None:
    from wsitrain.report.heatmap_files import HeatmapWriter
    from wsitrain.sft import SFT
    from wsitrain.slides.stream import read_slide_region
    from wsitrain.slides.synth import write_synthetic_slide

    slide = write_synthetic_slide(tmp_path / "s.svs", size=(384, 320), positive=True, seed=5)
    torch.manual_seed(0)
    model = build("tiny", 2, pool="max").eval()
    read = read_slide_region(slide, pad_multiple=16)
    writer = HeatmapWriter(tmp_path / "maps", ["negative", "positive"], saliency=saliency)
    rec = writer.add(slide, read, SFT(model, tile_size=128), label=1)
    index = json.loads(writer.close().read_text())
    assert index["slides"] == [rec] and rec["label"] == "positive"
    cam = np.load(tmp_path / "maps" / "s.cam.npy")
    h, w = read.image.shape[-2] // 16, read.image.shape[-1] // 16
    assert h != w and cam.shape == (2, h, w) == tuple(rec["cam_shape"])
    with torch.no_grad():
        f = model.features(model.normalize(read.image[None]))  # uint8, as predict feeds it
    expected = cam_of_features(find_head(model), f)[0].numpy()
    np.testing.assert_allclose(cam, expected, rtol=1e-5, atol=1e-5)
    png = Image.open(io.BytesIO((tmp_path / "maps" / "s.png").read_bytes()))
    png.load()
    assert png.format == "PNG" and png.size[0] > png.size[1]
    sal = tmp_path / "maps" / "s.saliency.npy"
    assert sal.exists() == saliency
    if saliency:
        assert np.load(sal).shape == (3, h, w) and rec["saliency_block"] == 16
        x = (read.image[None].float() / 255).requires_grad_(True)
        logits = model(x)
        assert rec["predicted"] == ["negative", "positive"][int(logits.argmax())]
        (grad,) = torch.autograd.grad(logits[0, int(logits.argmax())], x)
        np.testing.assert_allclose(np.load(sal), block_sum(grad, 16)[0].numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_engine_cam_equals_the_plain_cam_with_ragged_tiles(pool: str) -> None:
    from wsitrain.sft import SFT

    model, x = _model(pool), _image(208, 176, seed=6)  # trunk map 13 x 11
    engine = SFT(model, tile_size=48)  # 48 px tiles: 3 px of the map, ragged at the far edges (13 = 3+3+3+3+1)
    last = engine.plan_for(tuple(x.shape)).segments[-1]
    assert last.mode == "tiled" and last.n_tiles > 1 and 13 % last.tile_edge != 0
    calls: list[tuple[tuple[int, int], tuple[int, int]]] = []
    head = find_head(model)
    acc = CamAccumulator(head, 1, (13, 11))

    def spy(tile: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        calls.append((rows, cols))
        acc(tile, rows, cols)

    with torch.no_grad(), engine.observe_trunk(spy):
        engine(x)
    assert len(calls) == last.n_tiles
    plain = slide_maps(model, x)
    tiled = slide_maps(engine, x)
    assert_close(acc.result()[0], plain.cam)
    assert_close(tiled.cam, plain.cam)
    assert_close(tiled.logits, plain.logits)
    if pool == "max":
        assert_close(tiled.decisive, plain.decisive)


def test_engine_saliency_equals_the_block_summed_plain_input_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    import wsitrain.report.heatmap as heatmap
    from wsitrain.sft import SFT

    shares: list[tuple[int, int]] = []

    class Counting(BlockSumAccumulator):
        def __call__(self, grad: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
            shares.append(tuple(grad.shape[-2:]))
            super().__call__(grad, rows, cols)

    monkeypatch.setattr(heatmap, "BlockSumAccumulator", Counting)

    model, x = _model("avg"), _image(208, 176, seed=7)
    engine = SFT(model, tile_size=48)
    assert engine.plan_for(tuple(x.shape)).segments[0].mode == "tiled"
    xr = x.clone().requires_grad_(True)
    logits = model(xr)
    k = int(logits.argmax())
    (grad,) = torch.autograd.grad(logits[0, k], xr)
    for block in (8, 13):  # 13 does not divide the image or the tiles: cells straddle tile borders
        tiled = slide_maps(engine, x, saliency_block=block)
        assert tiled.predicted == k
        assert_close(tiled.saliency, block_sum(grad, block)[0])
    # The engine handed over tile shares (never one full-size gradient).
    assert len(shares) > 2 and all(s != (208, 176) for s in shares)


def _levels_read(reader: object) -> list[int]:
    """Wrap ``reader.read_region`` to record which pyramid levels are read."""
    levels: list[int] = []
    original = reader.read_region  # type: ignore[attr-defined]

    def spy(level: int, *args: int) -> np.ndarray:
        levels.append(level)
        return original(level, *args)

    reader.read_region = spy  # type: ignore[attr-defined]
    return levels


def test_thumbnail_comes_from_a_pyramid_level_or_the_image_in_memory(tmp_path: Path) -> None:
    from wsitrain.report.overlay import Placement, slide_thumbnail
    from wsitrain.slides.readers import open_slide
    from wsitrain.slides.synth import write_synthetic_slide

    pyramid = write_synthetic_slide(tmp_path / "big.svs", size=1024, seed=8)
    with open_slide(pyramid) as reader:
        assert reader.info.level_count > 1
        image = torch.zeros((3, 1024, 1024), dtype=torch.uint8)  # stands for the level-0 read predict already did
        levels = _levels_read(reader)
        thumb = slide_thumbnail(reader, image, Placement((0, 0, 1024, 1024), 1.0, (1024, 1024)), max_side=256)
        assert levels and min(levels) > 0  # never level 0 again
        assert max(thumb.rgb.shape[:2]) <= 256 and thumb.extent == (0.0, 1024.0, 1024.0, 0.0)
        # Read at the coarsest level already: no level is coarser, so the image in memory is shrunk, nothing read.
        ds = reader.info.level_downsamples[-1]
        levels.clear()
        side = int(1024 / ds)
        small = torch.randint(0, 255, (3, side, side), dtype=torch.uint8)
        thumb = slide_thumbnail(reader, small, Placement((0, 0, 1024, 1024), ds, (1024, 1024)), max_side=side // 2)
        assert levels == [] and thumb.rgb.shape == (side // 2, side // 2, 3)
        assert thumb.extent == (0.0, 1024.0, 1024.0, 0.0)
