"""Top-k mean pooling (wsitrain/sft/ops/topk_pool.py, ``model.pool: topk``), plain and fused.

The plain module is checked against the definition (the mean of each channel's k largest kept values, computed by
indexing), then the fused engine against the plain module on the whole map in float64: outputs, every parameter
gradient and the input gradient, with ragged tiles, batch 2 with a different mask per sample, ties (a constant
channel), k above the kept positions, and background reuse and zero-gradient skipping on (bitwise the engine
without them).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from sft_models import tied_trunk
from test_sft_masked_pool import pixel_to_map, random_mask, step
from test_tile_reuse import assert_bitwise, assert_plain, masked_image
from torch import nn

from wsitrain.config import ModelConfig
from wsitrain.models import build
from wsitrain.report.cam import find_head
from wsitrain.report.heatmap import _plain_head
from wsitrain.sft import SFT
from wsitrain.sft.ops.topk_pool import MaskedTopKMean, TopKAccumulator


def definition(x: torch.Tensor, k: int, mask: torch.Tensor) -> torch.Tensor:
    """(B, C) by indexing: each channel's k largest kept values (all of them when fewer), averaged."""
    out = torch.empty(x.shape[:2], dtype=x.dtype)
    for b in range(x.shape[0]):
        kept = x[b][:, mask[min(b, mask.shape[0] - 1), 0]]  # (C, n kept)
        out[b] = kept.topk(min(k, kept.shape[1]), 1).values.mean(1)
    return out


@pytest.mark.parametrize("k", [1, 5, 40])
def test_plain_topk_mean_is_the_mean_of_the_k_largest_kept_values(k: int) -> None:
    """k = 1 is the masked max; k = 40 is above some samples' kept positions (their mean over all kept)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 7, 9, dtype=torch.float64)
    mask = random_mask(2, 7, 9, seed=1, share=0.5)
    x[:, :, 0, 0] = 100.0  # the largest value sits off the tissue: it must not count
    pool = MaskedTopKMean(k)
    with pool.masked(mask):
        got = pool(x).flatten(1)
    torch.testing.assert_close(got, definition(x, k, mask), rtol=0, atol=1e-13)
    assert bool((got < 100).all()), "an off-tissue position counted"


def test_gradient_goes_to_the_k_kept_positions_ties_to_the_lower_index() -> None:
    x = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    x[0, 0, 2, 3] = 5.0  # the one largest
    x[0, 0, 1, 1] = x[0, 0, 0, 2] = x[0, 0, 2, 0] = 1.0  # three tied for second place: the two first in row-major win
    x.requires_grad_(True)
    MaskedTopKMean(3)(x).sum().backward()
    assert x.grad is not None
    want = torch.zeros(3, 4, dtype=torch.float64)
    want[2, 3] = want[0, 2] = want[1, 1] = 1 / 3
    torch.testing.assert_close(x.grad[0, 0], want, rtol=0, atol=0)


def test_a_sample_without_tissue_is_pooled_over_its_whole_map() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    mask = random_mask(2, 4, 6, seed=3)
    mask[1] = False
    pool = MaskedTopKMean(4)
    with pool.masked(mask):
        got = pool(x).flatten(1)
    torch.testing.assert_close(got[1], MaskedTopKMean(4)(x[1:]).flatten()[:3], rtol=0, atol=0)
    torch.testing.assert_close(got[0], definition(x[:1], 4, mask[:1])[0], rtol=0, atol=1e-13)


def test_k_must_be_positive() -> None:
    with pytest.raises(ValueError, match="k >= 1"):
        MaskedTopKMean(0)


def topk_net(k: int) -> nn.Module:
    """Convs with a constant channel (weights 0, bias 0.3, after ReLU): every position ties in it."""
    trunk = tied_trunk()
    return nn.Sequential(OrderedDict([("trunk", trunk), ("pool", MaskedTopKMean(k)), ("flat", nn.Flatten(1)),
                                      ("fc", nn.Linear(5, 3))])).double()  # fmt: skip


@pytest.mark.parametrize(("k", "tile", "masked"), [(7, 16, True), (7, 24, False), (1, 16, True), (300, 24, True)])
def test_fused_topk_pool_is_exact(k: int, tile: int, masked: bool) -> None:
    """Against the plain module in float64; k = 300 is above the kept positions of both samples."""
    model = topk_net(k)
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)  # ragged tiles, non-square, batch 2
    mask = random_mask(2, 22, 31, seed=tile) if masked else torch.ones(1, 1, 22, 31, dtype=torch.bool)
    x[:, :, :2, :2] = 50.0  # a bright corner: off the tissue when masked
    ref = step(model, x, mask)
    sft = SFT(model, tile_size=tile, memory_budget="1GiB", reuse_tiles=False)
    got = step(model, x, mask, sft)
    p = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert p.segments[-1].mode == "tiled" and p.segments[-1].fused_pool == "topk"
    assert p.segments[-1].n_tiles > 1, "the test must really tile"
    assert_plain(got, ref)


def test_the_accumulator_keeps_the_plain_modules_positions_across_tiles() -> None:
    """Tile by tile in an order that is not row-major: the same value and the same per-tile gradient as the plain
    module's autograd; tiles holding no kept position say so (they skip backward)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 9, dtype=torch.float64, requires_grad=True)
    mask = random_mask(2, 7, 9, seed=4, share=0.6)
    pool = MaskedTopKMean(2)
    with pool.masked(mask):
        y = pool(x).flatten(1)
    g = torch.randn(2, 3, dtype=torch.float64)
    y.backward(g)
    assert x.grad is not None
    tiles = [((r0, r1), (c0, c1)) for r0, r1 in ((4, 7), (0, 4)) for c0, c1 in ((5, 9), (0, 5))]
    acc = TopKAccumulator(2, 7, 9, mask)
    for (r0, r1), (c0, c1) in tiles:
        acc.add(x.detach()[:, :, r0:r1, c0:c1], (r0, r1), (c0, c1))
    assert torch.equal(acc.result(), y.detach())
    for (r0, r1), (c0, c1) in tiles:
        share = acc.tile_grad(g, x.detach()[:, :, r0:r1, c0:c1], (r0, r1), (c0, c1))
        assert torch.equal(share, x.grad[:, :, r0:r1, c0:c1])
        assert acc.holds_gradient((r0, r1), (c0, c1)) == bool(share.ne(0).any())


def test_with_reuse_and_skipping_bitwise_and_exact() -> None:
    shape = (2, 3, 96, 112)
    x = masked_image(shape, [(10, 40, 12, 50), (80, 96, 104, 112)])
    x[1] = masked_image(shape[1:], [(50, 90, 60, 100)], seed=1)
    pixels = (x != x[:, :, :1, :1]).any(1, keepdim=True)
    mask = pixel_to_map(pixels, 4)  # (B, 1, 24, 28)
    torch.manual_seed(1)
    trunk = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
    )  # fmt: skip
    model = nn.Sequential(OrderedDict([("features", trunk), ("pool", MaskedTopKMean(6)), ("flat", nn.Flatten(1)),
                                       ("fc", nn.Linear(6, 3))])).double()  # fmt: skip
    twins = [copy.deepcopy(model) for _ in range(2)]
    plain = step(model, x, mask)
    kw: dict[str, object] = {"memory_budget": "1GiB", "tile_size": 16, "checkpoints": []}
    off = step(twins[0], x, mask, SFT(twins[0], reuse_tiles=False, **kw))  # type: ignore[arg-type]
    sft = SFT(twins[1], **kw)  # type: ignore[arg-type]
    on = step(twins[1], x, mask, sft)
    assert_bitwise(on, off)
    assert_plain(on, plain)
    assert sft.last_stats.skipped_backward > 0, sft.last_stats.summary()


def test_the_built_model_and_its_config_key() -> None:
    model = build("tiny", 2, pool="topk", topk=8)
    assert isinstance(model.pool, MaskedTopKMean) and model.pool.k == 8
    assert ModelConfig(pool="topk").topk == 16
    assert ModelConfig(pool="topk", topk=4).topk == 4
    with pytest.raises(ValueError, match="model.topk applies to pool: topk"):
        ModelConfig(pool="max", topk=4)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        ModelConfig(pool="topk", topk=0)


def test_heatmap_head_scores_as_the_model() -> None:
    """The CAM path reads a top-k head: its plain logits are the model's."""
    torch.manual_seed(0)
    model = build("tiny", 2, pool="topk", topk=5).double().eval()
    x = torch.rand(1, 3, 96, 80, dtype=torch.float64)
    head = find_head(model)
    assert head.pool == "topk"
    with torch.no_grad():
        torch.testing.assert_close(_plain_head(head, head.trunk(x)), model(x), rtol=0, atol=1e-12)
