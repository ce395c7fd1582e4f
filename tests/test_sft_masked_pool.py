"""Max, amax and average pooling over the tissue mask only (wsitrain/sft/ops/masked_pool.py), plain and fused.

The plain modules are checked against the definition (the maximum / mean over the kept positions, computed by
indexing), then the fused engine against the plain module on the whole map in float64: outputs, every parameter
gradient and the input gradient, with forced ragged tiles, batch 2 with a different mask per sample, background
reuse and zero-gradient skipping on (bitwise the engine without them), and torchvision / timm trunks.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from contextlib import ExitStack

import pytest
import torch
import torch.nn.functional as F
from sft_models import tied_trunk
from test_tile_reuse import assert_bitwise, assert_plain, masked_image
from torch import nn

from wsitrain.models import build
from wsitrain.sft import SFT
from wsitrain.sft.ops.masked_pool import MaskedAmax, MaskedAvgPool2d, MaskedMaxPool2d, masked_global_pool

F64 = {"rtol": 1e-10, "atol": 1e-11}
POOLS = {"avg": MaskedAvgPool2d, "max": MaskedMaxPool2d, "amax": MaskedAmax}


def random_mask(b: int, h: int, w: int, seed: int, share: float = 0.4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b, 1, h, w, generator=g) < share
    m[:, :, 0, 0] = False  # the corner (zero padding's artefact in the demo) is off the tissue
    return m


# ---- the plain modules against the definition -------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["avg", "max", "amax"])
def test_plain_masked_pool_is_the_reduction_over_kept_positions(kind: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 7, 9, dtype=torch.float64)
    mask = random_mask(2, 7, 9, seed=1)
    x[:, :, 0, 0] = 100.0  # the largest value sits off the tissue: it must not win
    pool = POOLS[kind]()
    with pool.masked(mask):
        got = pool(x).flatten(1)  # (B, C)
    for b in range(2):
        kept = x[b][:, mask[b, 0]]  # (C, n kept)
        want = kept.mean(1) if kind == "avg" else kept.amax(1)
        torch.testing.assert_close(got[b], want, rtol=0, atol=1e-14)
    assert bool((got < 100).all()), "an off-tissue position won"
    assert torch.equal(pool(x).flatten(1), masked_global_pool(kind, x, None)), "no mask: the torch pool itself"


@pytest.mark.parametrize("kind", ["avg", "max", "amax"])
def test_off_tissue_positions_get_no_gradient(kind: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 6, 5, dtype=torch.float64, requires_grad=True)
    mask = random_mask(2, 6, 5, seed=2)
    pool = POOLS[kind]()
    with pool.masked(mask):
        pool(x).sum().backward()
    assert x.grad is not None
    assert float(x.grad.masked_select(~mask.expand_as(x)).abs().max()) == 0.0
    if kind == "avg":  # 1 / (kept positions) on every kept position
        n = mask.flatten(1).sum(1).double()
        torch.testing.assert_close(x.grad[:, 0][mask[:, 0]], (1 / n).repeat_interleave(mask.flatten(1).sum(1)))


def test_a_sample_without_tissue_is_pooled_over_its_whole_map() -> None:
    """Defined, not -inf or 0 / 0: a read with no tissue position is pooled as if unmasked (the reader masks nothing
    when it finds no tissue); the other sample of the batch stays masked."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    mask = random_mask(2, 4, 6, seed=3)
    mask[1] = False
    for kind, pool in POOLS.items():
        m = pool()
        with m.masked(mask):
            got = m(x).flatten(1)
        assert bool(torch.isfinite(got).all()), kind
        torch.testing.assert_close(got[1], masked_global_pool(kind, x[1:], None)[0], rtol=0, atol=0)
        torch.testing.assert_close(got[0], masked_global_pool(kind, x[:1], mask[:1])[0], rtol=0, atol=0)


def test_a_mask_of_the_wrong_size_or_type_is_refused() -> None:
    pool = MaskedMaxPool2d()
    x = torch.randn(1, 3, 4, 6)
    with pool.masked(torch.ones(1, 1, 4, 5, dtype=torch.bool)), pytest.raises(ValueError, match="map is"):
        pool(x)
    with pytest.raises(ValueError, match="bool tensor"), pool.masked(torch.ones(1, 1, 4, 6)):
        pass


def test_the_built_models_pool_is_maskable_unless_asked_not_to() -> None:
    assert isinstance(build("tiny", 2, pool="max").pool, MaskedMaxPool2d)
    assert isinstance(build("tiny", 2, pool="avg").pool, MaskedAvgPool2d)
    plain = build("tiny", 2, pool="max", mask_pool=False).pool
    assert type(plain) is nn.AdaptiveMaxPool2d


# ---- fused against plain ----------------------------------------------------------------------------------------
class AmaxNet(nn.Module):
    """A library user's amax head, masked through ``MaskedAmax``."""

    def __init__(self, trunk: nn.Module, c: int) -> None:
        super().__init__()
        self.trunk, self.pool, self.fc = trunk, MaskedAmax(), nn.Linear(c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.trunk(x)))


def small_net(kind: str) -> nn.Module:
    """Convs with a constant channel (weights 0, bias 0.3, after ReLU): its maximum ties at every position."""
    trunk = tied_trunk()
    if kind == "amax":
        return AmaxNet(trunk, 5).double()
    return nn.Sequential(OrderedDict([("trunk", trunk), ("pool", POOLS[kind]()), ("flat", nn.Flatten(1)),
                                      ("fc", nn.Linear(5, 3))])).double()  # fmt: skip


def step(model: nn.Module, x: torch.Tensor, mask: torch.Tensor, sft: SFT | None = None
         ) -> tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor | None, list[torch.Tensor]]:  # fmt: skip
    model.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    with model.pool.masked(mask):  # type: ignore[union-attr]
        y = (sft or model)(xr)
        (y * torch.arange(1.0, 4.0, dtype=y.dtype)).sum().backward()
    return y.detach(), [p.grad for p in model.parameters()], xr.grad, []


@pytest.mark.parametrize("kind", ["avg", "max", "amax"])
@pytest.mark.parametrize("tile", [16, 24])
def test_fused_masked_pool_is_exact(kind: str, tile: int) -> None:
    model = small_net(kind)
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)  # ragged tiles, non-square, batch 2
    mask = random_mask(2, 22, 31, seed=tile)  # the trunk's map; a different mask per sample
    x[:, :, :2, :2] = 50.0  # a bright corner: off the tissue, it would win every channel unmasked
    ref = step(model, x, mask)
    sft = SFT(model, tile_size=tile, memory_budget="1GiB", reuse_tiles=False)
    got = step(model, x, mask, sft)
    p = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert p.segments[-1].mode == "tiled" and p.segments[-1].fused_pool == ("amax" if kind == "amax" else kind)
    assert p.segments[-1].n_tiles > 1, "the test must really tile"
    assert_plain(got, ref)
    unmasked = step(model, x, torch.ones_like(mask))
    assert not torch.allclose(unmasked[0], ref[0]), "the mask must change the result"


def pixel_to_map(pixels: torch.Tensor, factor: int) -> torch.Tensor:
    """(B, 1, H, W) bool pixel mask -> map cells holding any kept pixel (as ``RegionMask.cells``)."""
    return F.max_pool2d(pixels.double(), factor, factor, ceil_mode=True) > 0


def reuse_vgg(kind: str) -> nn.Module:
    trunk = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
    )  # fmt: skip
    if kind == "amax":
        return AmaxNet(trunk, 6)
    return nn.Sequential(OrderedDict([("features", trunk), ("pool", POOLS[kind]()), ("flat", nn.Flatten(1)),
                                      ("fc", nn.Linear(6, 3))]))  # fmt: skip


@pytest.mark.parametrize("kind", ["avg", "max", "amax"])
def test_with_reuse_and_skipping_bitwise_and_off_tissue_tiles_skip_backward(kind: str) -> None:
    """Background reuse and zero-gradient skipping on: bitwise the engine computing every tile, exact against plain;
    every tile wholly off the tissue skips its recompute and backward (counted in the step's stats)."""
    shape = (2, 3, 96, 112)
    x = masked_image(shape, [(10, 40, 12, 50), (80, 96, 104, 112)])  # inside, and against the bottom-right corner
    x[1] = masked_image(shape[1:], [(50, 90, 60, 100)], seed=1)
    pixels = (x != x[:, :, :1, :1]).any(1, keepdim=True)  # (B, 1, H, W): tissue where the image is not background
    mask = pixel_to_map(pixels, 4)  # the trunk's stride is 4: (B, 1, 24, 28)
    torch.manual_seed(1)
    model = reuse_vgg(kind).double()
    twins = [copy.deepcopy(model) for _ in range(2)]
    plain = step(model, x, mask)
    kw: dict[str, object] = {"memory_budget": "1GiB", "tile_size": 16, "checkpoints": []}  # one tiled segment
    off = step(twins[0], x, mask, SFT(twins[0], reuse_tiles=False, **kw))  # type: ignore[arg-type]
    sft = SFT(twins[1], **kw)  # type: ignore[arg-type]
    on = step(twins[1], x, mask, sft)
    assert_bitwise(on, off)
    assert_plain(on, plain)
    s = sft.last_stats
    compiled = next(iter(sft._cache.values()))
    (seg,) = [g for g in compiled.segments if g is not None]
    reg = seg.regions
    off_tissue = sum(not bool(mask[:, :, r0:r1, c0:c1].any()) for r0, r1 in reg.rows_out for c0, c1 in reg.cols_out)
    assert off_tissue > 0, "the case needs tiles wholly off the tissue"
    if kind == "avg":  # every tile on the tissue holds gradient: exactly the off-tissue ones skip
        assert s.skipped_backward == off_tissue, s.summary()
    else:  # max: the tiles without a maximum skip too
        assert s.skipped_backward >= off_tissue, s.summary()
    assert s.recomputed_tiles + s.reused_backward + s.skipped_backward == s.summary()["tiles_backward"]


def library_model(name: str, kind: str) -> nn.Module:
    pytest.importorskip("timm", reason="timm is an optional extra; the `test` extra installs it")
    torch.manual_seed(0)
    return build(name, 3, pool=kind).double().eval()


@pytest.mark.parametrize(("name", "kind"), [("torchvision/resnet18", "max"), ("timm/resnet10t", "avg")])
def test_library_trunks_with_a_masked_pool_are_exact(name: str, kind: str) -> None:
    model = library_model(name, kind)
    x = torch.rand(2, 3, 96, 128, dtype=torch.float64)
    mask = random_mask(2, 3, 4, seed=5, share=0.5)
    ref = step(model, x, mask)
    sft = SFT(model, tile_size=16, memory_budget="1GiB")
    got = step(model, x, mask, sft)
    p = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert p.segments[-1].fused_pool == kind and p.segments[-1].n_tiles > 1
    tol = {"rtol": 1e-9, "atol": 1e-11}
    torch.testing.assert_close(got[0], ref[0], **tol)
    for a, b in zip(got[1], ref[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(got[2], ref[2], **tol)


def test_the_mask_set_on_the_model_reaches_the_engine_through_the_sft_wrapper() -> None:
    """``with model.pool.masked(mask)`` on the wrapped model is what the engine's fused pool reads."""
    model = small_net("max")
    x = torch.randn(1, 3, 45, 62, dtype=torch.float64)
    sft = SFT(model, tile_size=16, memory_budget="1GiB")
    with ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        free = sft(x)
        stack.enter_context(model.pool.masked(random_mask(1, 22, 31, seed=9)))  # type: ignore[union-attr]
        masked = sft(x)
    assert not torch.equal(free, masked)
