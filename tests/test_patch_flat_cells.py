"""Flat (background) patches of a chunk encoded once (wsitrain/patch/flat_cells.py): exact against plain autograd
encoding every patch of the whole bag, and the encoder really sees only the tissue patches and one background patch.

Float64, batch 2, a ragged slide (rows and columns past the last whole patch), a masked slide whose background is
one colour, tiled in chunks that are partly tissue; the reference is the same weights with every patch encoded.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_patch_exact import SHAPE, P, assert_same_output_and_grads, build, tissue, vit
from torch import nn

from wsitrain.patch.flat_cells import couples_patches, encode_distinct
from wsitrain.patch.trunk import PatchTrunk
from wsitrain.sft import SFT
from wsitrain.sft.execution.reuse import has_content
from wsitrain.sft.planning.tissue_share import tissue_tile_share

BACKGROUND = torch.tensor([0.9, 0.8, 0.85], dtype=torch.float64)  # a masked slide's colour outside the tissue


def masked_slide(seed: int) -> torch.Tensor:
    """(2, 3, 5P + 7, 3P + 11): random tissue where ``tissue()`` says, the background colour everywhere else."""
    torch.manual_seed(seed)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    cells = tissue().repeat_interleave(P, 2).repeat_interleave(P, 3)  # (2, 1, 5P, 3P)
    keep = torch.zeros(SHAPE[0], 1, *SHAPE[2:], dtype=torch.bool)
    keep[:, :, : 5 * P, : 3 * P] = cells
    return torch.where(keep, x, BACKGROUND.view(1, 3, 1, 1).expand_as(x))


def every_patch(trunk: PatchTrunk, x: torch.Tensor) -> torch.Tensor:
    """The plain reference: the encoder on every patch, flat or not. (B, 3, H, W) -> (B, D, gh, gw)."""
    b, c, h, w = x.shape
    p = trunk.patch
    gh, gw = h // p, w // p
    cells = x[:, :, : gh * p, : gw * p].reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)
    emb = trunk.encoder(cells.reshape(b * gh * gw, c, p, p))
    return emb.reshape(b, gh, gw, -1).permute(0, 3, 1, 2)


def step(model: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    """Output and parameter gradients of one step (the slide needs no gradient, as in training)."""
    inner = model.model if isinstance(model, SFT) else model
    inner.zero_grad(set_to_none=True)
    with inner.pool.masked(mask):
        y = model(x)
    y = y[0] if isinstance(y, tuple) else y
    (y * torch.arange(1.0, 1.0 + y.shape[-1], dtype=y.dtype)).square().sum().backward()
    return y.detach(), [p.grad for p in inner.parameters()]


@pytest.mark.parametrize(("head", "masked"), [("max", True), ("avg", True), ("attention", True), ("gated", True),
                                              ("clam_mb", True), ("avg", False)])  # fmt: skip
def test_flat_patches_encoded_once_are_exact(head: str, masked: bool) -> None:
    torch.manual_seed(0)
    model = build(vit(depth=1), head)
    ref_model = copy.deepcopy(model)
    trunk = ref_model.features
    trunk.forward = lambda x: every_patch(trunk, x)  # the reference encodes every patch
    x = masked_slide(1)
    mask = tissue() if masked else None
    ref = step(ref_model, x, mask)
    sft = SFT(model, tile_size=2 * P, memory_budget="1GiB")
    seen: list[int] = []
    # real chunks only: the plan's shape and cost probes run on the meta device and fake tensors (no content)
    model.features.encoder.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]) if has_content(i[0])
                                                 else None)  # fmt: skip
    got = step(sft, x, mask)
    assert_same_output_and_grads(model, got, ref)
    seg = sft.plan_for(tuple(x.shape), input_dtype=torch.float64).segments[-1]
    assert seg.mode == "tiled" and seg.n_tiles > 1, "the patch grid must really be tiled"
    # chunks of 2 x 2 patches (batch 2: 8 cells): none encodes more than its tissue patches and one background patch
    assert seen and max(seen) < 8, seen


def test_the_encoder_sees_the_tissue_patches_and_one_background_patch() -> None:
    torch.manual_seed(2)
    model = build(vit(depth=1), "gated")
    rows: list[torch.Tensor] = []
    model.features.encoder.register_forward_hook(lambda m, i, o: rows.append(i[0].detach()))
    x = masked_slide(3)
    with torch.no_grad():
        fmap = model.features(model.normalize(x))  # the whole bag, untiled
    assert fmap.shape == (2, 48, 5, 3)
    n_tissue = int(tissue().sum())
    assert [r.shape[0] for r in rows] == [n_tissue + 1]  # of 2 x 15 patches
    flat = (rows[0] == rows[0][:, :, :1, :1]).flatten(1).all(1)
    assert int(flat.sum()) == 1  # one background patch, the rest tissue
    # every background cell holds that one patch's embedding; the tissue cells are the encoder's on their own patch
    torch.testing.assert_close(fmap, every_patch(model.features, model.normalize(x)), rtol=0, atol=1e-12)


def test_patches_stay_apart_where_sharing_would_not_be_exact() -> None:
    """An input needing its gradient, and an encoder whose patches see each other (BatchNorm on batch statistics,
    dropout in training): every patch encoded."""
    torch.manual_seed(4)
    cells = torch.zeros(6, 3, 4, 4)
    cells[0] = torch.randn(3, 4, 4)  # one tissue patch, five flat ones
    count: list[int] = []

    def counted(enc: nn.Module) -> nn.Module:
        enc.register_forward_hook(lambda m, i, o: count.append(i[0].shape[0]))
        return enc

    plain = counted(nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(1)))
    assert encode_distinct(plain, cells).shape == (6, 4) and count.pop() == 2
    encode_distinct(plain, cells.clone().requires_grad_(True))
    assert count.pop() == 6
    bn = counted(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(1)))
    assert couples_patches(bn)
    encode_distinct(bn, cells)
    assert count.pop() == 6
    bn.eval()  # running statistics: each patch on its own again
    assert not couples_patches(bn)
    encode_distinct(bn, cells)
    assert count.pop() == 2
    drop = counted(nn.Sequential(nn.Flatten(1), nn.Dropout(0.1), nn.Linear(48, 4)))
    assert couples_patches(drop)
    encode_distinct(drop, cells)
    assert count.pop() == 6


def test_two_flat_colours_are_two_rows() -> None:
    """Flat patches of different colours are not confused: one row per colour, each cell its own colour's."""
    enc = nn.Sequential(nn.Flatten(1), nn.Linear(48, 5)).double()
    cells = torch.zeros(5, 3, 4, 4, dtype=torch.float64)
    cells[1] = 0.5
    cells[3] = 0.5
    cells[2] = torch.randn(3, 4, 4, dtype=torch.float64)
    seen: list[int] = []
    enc.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    torch.testing.assert_close(encode_distinct(enc, cells), enc(cells), rtol=0, atol=0)
    assert seen[0] == 3  # the tissue patch, colour 0 and colour 0.5


def test_the_planned_share_counts_the_patches_the_sweep_encodes() -> None:
    """``tissue_tile_share`` for a patch encoder counts patches: on an 8 x 8 grid in chunks of 2 x 2, four tissue
    patches in four border chunks. Each of those chunks encodes its tissue patch and one background patch, each other
    border chunk one background patch, and the four interior chunks, all background, are the sweep's cached chunk:
    16 of 64 patches (the tile count says 12 of 16 chunks). The forward sweep encodes those 16 patches and the one
    interior chunk that fills the cache."""
    torch.manual_seed(6)
    model = build(vit(depth=1), "gated")
    cells = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    for r, c in ((0, 0), (1, 5), (6, 6), (7, 2)):
        cells[0, 0, r, c] = True
    pixels = cells.repeat_interleave(P, 2).repeat_interleave(P, 3)  # (1, 1, 8P, 8P)
    x = torch.where(pixels, torch.randn(1, 3, 8 * P, 8 * P, dtype=torch.float64), BACKGROUND.view(1, 3, 1, 1))
    sft = SFT(model, tile_size=2 * P, memory_budget="1GiB")
    swept: list[int] = []
    model.features.encoder.register_forward_hook(
        lambda m, i, o: swept.append(i[0].shape[0]) if has_content(i[0]) and not torch.is_grad_enabled() else None
    )
    step(sft, x, cells)
    plan = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert plan.reuse_tiles and plan.tiled_segments[0].tile_grid == (4, 4)
    assert tissue_tile_share(x[0], plan, P) == 16 / 64
    assert tissue_tile_share(x[0], plan) == 12 / 16
    assert sft.last_stats.reused_forward == 3
    assert sum(swept) == 16 + 1, swept
    all_tissue = torch.randn(3, 8 * P, 8 * P, dtype=torch.float64)
    assert tissue_tile_share(all_tissue, plan, P) == 1.0


def test_the_balance_costs_count_the_patches_on_the_preflight_grid() -> None:
    """Reference vs variant: ``distributed.balance: time`` ranks slides by the share counted on the preflight's coarse
    tissue grid (``wsitrain.train.balance.cost``); for a patch encoder it counts patches, as the pixels' count does,
    wherever the grid's cells fall within patches (1, 2 or 4 cells a side per patch). Counted per chunk instead it
    would be 12 of 16 here; per patch it is 16 of 64, on a ragged slide (9 x 8 patches) too."""
    from wsitrain.train.balance.cost import tile_share

    torch.manual_seed(6)
    model = build(vit(depth=1), "gated")
    for rows in (8, 9):
        cells = torch.zeros(rows, 8, dtype=torch.bool)
        for r, c in ((0, 0), (1, 5), (6, 6), (7, 2)):
            cells[r, c] = True
        pixels = cells.repeat_interleave(P, 0).repeat_interleave(P, 1)  # (rows P, 8 P)
        x = torch.where(pixels, torch.rand(3, rows * P, 8 * P, dtype=torch.float64) + 2, BACKGROUND.view(3, 1, 1))
        plan = SFT(model, tile_size=2 * P, memory_budget="1GiB").plan_for((1, *x.shape), input_dtype=torch.float64)
        expected = tissue_tile_share(x, plan, P)
        assert expected is not None and expected < tissue_tile_share(x, plan)  # type: ignore[operator]
        for per_patch in (1, 2, 4):
            grid = cells.repeat_interleave(per_patch, 0).repeat_interleave(per_patch, 1).numpy()
            assert tile_share(grid, plan, P) == expected, (rows, per_patch)
            assert tile_share(grid, plan) == tissue_tile_share(x, plan)  # chunks, for a CNN's tiles
