"""Reference-vs-variant for background reuse and zero-gradient skipping (wsitrain/sft/execution/reuse.py).

Every case runs one training step three ways on the same weights and the same masked image (flat background,
textured tissue): plain autograd, SFT computing every tile (``reuse_tiles=False``) and SFT with reuse. Reuse must be
bitwise the unskipped engine (output, every parameter gradient, input gradient, buffers) and both must equal plain
autograd in float64. The images put background against tile borders, the image border and ragged last tiles.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
from test_sft_multipass import _randomize_bn, bn_blocks, multipass_segments, se_blocks
from torch import nn
from torchvision.models.resnet import BasicBlock

from wsitrain.models.normalize import InputNormalization
from wsitrain.sft import SFT
from wsitrain.sft.execution.reuse import ReuseCache, all_zero, is_flat, zero_tiles
from wsitrain.sft.planning.tissue_share import tissue_tile_share

F64 = {"rtol": 1e-10, "atol": 1e-11}
BACKGROUND = 0.7  # the masked colour, normalized: any constant works


def masked_image(shape: tuple[int, ...], blobs: list[tuple[int, int, int, int]], seed: int = 0) -> torch.Tensor:
    """A flat background with random-texture tissue in ``blobs`` (row0, row1, col0, col1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.full(shape, BACKGROUND, dtype=torch.float64)
    h, w = shape[-2:]
    for r0, r1, c0, c1 in blobs:
        r1, c1 = min(r1, h), min(c1, w)  # a blob may run past a smaller image's border
        if r1 <= r0 or c1 <= c0:
            continue
        x[..., r0:r1, c0:c1] = torch.rand(*shape[:-2], r1 - r0, c1 - c0, generator=g, dtype=torch.float64)
    return x


# tissue inside, against the bottom-right image corner, and a sliver on the left border
BLOBS = [(40, 90, 30, 100), (150, 200, 200, 232), (100, 120, 0, 6)]
# tissue all around the image border (a frame), background inside: max pooling sees no tie at the border (below)
FRAME = [(0, 12, 0, 232), (188, 200, 0, 232), (0, 200, 0, 12), (0, 200, 220, 232), (80, 110, 90, 130)]


def vgg(pool: str = "avg", inner: type[nn.Module] = nn.AvgPool2d) -> nn.Module:
    heads = {"avg": nn.AdaptiveAvgPool2d(1), "max": nn.AdaptiveMaxPool2d(1)}
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), inner(2),
        nn.Conv2d(8, 12, 3, padding=1), nn.ReLU(), nn.Conv2d(12, 12, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(12, 12, 3, padding=1), nn.ReLU(),
    )  # fmt: skip
    return nn.Sequential(OrderedDict([("features", trunk), ("pool", heads[pool]), ("flat", nn.Flatten(1)),
                                      ("fc", nn.Linear(12, 3))]))  # fmt: skip


class AmaxHead(nn.Module):
    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk, self.fc = trunk, nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.amax(self.trunk(x), dim=(2, 3)))


def amax_net() -> nn.Module:
    return AmaxHead(vgg().features)


def basic_blocks() -> nn.Module:
    """A ResNet block stack: stem, an identity BasicBlock and a stride-2 one with a 1x1 downsample."""
    down = nn.Sequential(nn.Conv2d(8, 12, 1, 2, bias=False), nn.BatchNorm2d(12))
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        BasicBlock(8, 8), BasicBlock(8, 12, 2, down),
    )  # fmt: skip
    return nn.Sequential(OrderedDict([("features", trunk), ("pool", nn.AdaptiveAvgPool2d(1)),
                                      ("flat", nn.Flatten(1)), ("fc", nn.Linear(12, 3))]))  # fmt: skip


Result = tuple[torch.Tensor, list[torch.Tensor | None], torch.Tensor | None, list[torch.Tensor]]


def _step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Result:
    xr = x.detach().clone().requires_grad_(x.is_floating_point())
    y = model(xr)
    torch.nn.functional.mse_loss(y, target).backward()
    inner = model.model if isinstance(model, SFT) else model
    return y.detach(), [p.grad for p in inner.parameters()], xr.grad, [b.clone() for b in inner.buffers()]


def run_three(
    make: Callable[[], nn.Module], x: torch.Tensor, train: bool = False, **sft_kw: object
) -> tuple[Result, Result, Result, SFT]:
    """Plain autograd, SFT without reuse and SFT with reuse, each from the same weights and buffers."""
    torch.manual_seed(1)
    model = make().double().train(train)
    _randomize_bn(model)
    twins = [copy.deepcopy(model) for _ in range(2)]
    xf = x.double() if x.is_floating_point() else x  # uint8: the model's InputNormalization converts it
    with torch.no_grad():
        target = torch.randn_like(copy.deepcopy(model)(xf))
    plain = _step(model, xf, target)
    off = _step(SFT(twins[0], reuse_tiles=False, **sft_kw), x, target)
    sft = SFT(twins[1], **sft_kw)
    on = _step(sft, x, target)
    return plain, off, on, sft


def assert_bitwise(on: Result, off: Result) -> None:
    assert torch.equal(on[0], off[0]), "forward output differs with reuse"
    for k, (a, b) in enumerate(zip(on[1], off[1], strict=True)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"parameter gradient {k} differs"
    assert (on[2] is None) == (off[2] is None) and (on[2] is None or torch.equal(on[2], off[2])), "input gradient"
    for k, (a, b) in enumerate(zip(on[3], off[3], strict=True)):
        assert torch.equal(a, b), f"buffer {k} differs"


def assert_plain(var: Result, plain: Result) -> None:
    torch.testing.assert_close(var[0], plain[0], **F64)
    for a, b in zip(var[1], plain[1], strict=True):
        torch.testing.assert_close(a, b, **F64)
    if plain[2] is not None:
        torch.testing.assert_close(var[2], plain[2], **F64)
    for a, b in zip(var[3], plain[3], strict=True):
        torch.testing.assert_close(a, b, **F64)


@pytest.mark.parametrize(
    ("make", "shape", "tile", "train"),
    [
        (vgg, (1, 3, 200, 232), 32, False),  # ragged last row and column
        (vgg, (2, 3, 168, 200), 24, False),  # batch 2 (the second sample shifted), another grid
        (basic_blocks, (1, 3, 200, 232), 32, False),  # ResNet blocks, BN frozen: plain tiled segments
        (bn_blocks, (1, 3, 200, 232), 32, True),  # train-mode BN: multi-pass segments
        (se_blocks, (1, 3, 200, 232), 40, True),  # squeeze-excitation and train BN: multi-pass
    ],
    ids=["vgg", "vgg-batch2", "resnet-blocks", "multipass-bn", "multipass-se"],
)
def test_reuse_is_bitwise_and_exact(make: Callable[[], nn.Module], shape: tuple[int, ...], tile: int, train: bool):
    x = masked_image(shape, BLOBS)
    if shape[0] == 2:
        x[1] = masked_image(shape[1:], [(20, 60, 100, 160)], seed=1)
    plain, off, on, sft = run_three(make, x, train=train, memory_budget="1GiB", tile_size=tile)
    assert_bitwise(on, off)
    assert_plain(on, plain)
    s = sft.last_stats
    assert s.reused_forward > 0 and s.reused_backward > 0, s.summary()
    if train:  # multi-pass backward ticks count statistics sweeps too
        assert multipass_segments(sft), "the case is meant to run multi-pass segments"
    else:
        assert s.recomputed_tiles + s.reused_backward + s.skipped_backward == s.summary()["tiles_backward"]


def test_reuse_from_a_uint8_image_staged_per_tile() -> None:
    """A uint8 slide is cut and converted per tile through the stager: a cached region must be a copy."""
    x = (masked_image((1, 3, 200, 232), BLOBS) * 255).round().to(torch.uint8)

    def make() -> nn.Module:
        net = vgg()
        net.features.insert(0, InputNormalization())
        return net

    plain, off, on, sft = run_three(make, x, memory_budget="1GiB", tile_size=32)
    assert_bitwise(on, off)
    torch.testing.assert_close(on[0], plain[0], **F64)
    assert sft.last_stats.reused_forward > 0


@pytest.mark.parametrize("make", [lambda: vgg("max", nn.MaxPool2d), amax_net], ids=["max", "amax"])
def test_max_pooling_skips_tiles_without_a_maximum(make: Callable[[], nn.Module]) -> None:
    x = masked_image((1, 3, 200, 232), FRAME)
    plain, off, on, sft = run_three(make, x, memory_budget="1GiB", tile_size=32)
    assert_bitwise(on, off)
    assert_plain(on, plain)
    s = sft.last_stats
    assert s.skipped_backward > 0, s.summary()
    assert s.recomputed_tiles + s.reused_backward + s.skipped_backward == s.summary()["tiles_backward"]


def test_max_pool_ties_at_the_image_border_are_bitwise_the_unskipped_engine() -> None:
    """Flat background against the image border: max pooling's tie there is broken by the conv's rounding, which
    differs in the last bit between a tile and the whole map (docs/engine/background.md);
    reuse still changes nothing."""
    x = masked_image((1, 3, 200, 232), BLOBS)
    _, off, on, sft = run_three(lambda: vgg("max", nn.MaxPool2d), x, memory_budget="1GiB", tile_size=32)
    assert_bitwise(on, off)
    assert sft.last_stats.skipped_backward > 0


def test_a_tile_near_tissue_within_its_halo_is_never_reused() -> None:
    """One tissue pixel just outside a tile's own output region, inside its halo: that tile computes. Reuse counts
    exactly the flat tiles with the first flat tile's key, less the one that filled the entry."""
    x = masked_image((1, 3, 160, 160), [(0, 160, 0, 8)])  # a tissue strip on the left border
    x[0, :, 64, 47] = 0.1  # column 47: outside tile column 1's output [16, 32) x 2... inside neighbours' halos
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(4, 2)).double()  # fmt: skip
    plain, off, on, sft = run_three(lambda: model, x, memory_budget="1GiB", tile_size=16, checkpoints=[])
    assert_bitwise(on, off)
    assert_plain(on, plain)
    compiled = next(iter(sft._cache.values()))
    (seg,) = [s for s in compiled.segments if s is not None]
    reg = seg.regions
    first_key, flat_same = None, 0
    near = 0
    for r, c in seg.tiles():
        rows, cols = reg.rows[r].need[seg.start], reg.cols[c].need[seg.start]
        region = x[:, :, rows[0] : rows[1], cols[0] : cols[1]]
        key = seg.tile_key(r, c)
        if key is None or not is_flat(region, (2, 3)):
            out_r, out_c = reg.rows_out[r], reg.cols_out[c]
            core_has_pixel = out_r[0] <= 64 < out_r[1] and out_c[0] <= 47 < out_c[1]
            near += int(rows[0] <= 64 < rows[1] and cols[0] <= 47 < cols[1] and not core_has_pixel)
            continue
        first_key = first_key or key
        flat_same += int(key == first_key)
    assert near >= 1, "the pixel must sit in some tile's halo only"
    assert sft.last_stats.reused_forward == flat_same - 1
    # the fit log's prediction counts the same tiles on the image: all but the flat interior ones compute
    n = len(reg.rows) * len(reg.cols)
    share = tissue_tile_share(x[0], compiled.plan)
    assert share is not None and share * n == n - flat_same
    assert tissue_tile_share(torch.rand(1, 3, 160, 160, dtype=torch.float64), compiled.plan) == 1.0


def test_cache_holds_one_entry_and_compares_content() -> None:
    cache: ReuseCache[int] = ReuseCache(True, (2, 3))
    flat = torch.full((1, 2, 5, 5), 0.5)
    assert cache.wants(("k",), flat)
    cache.keep(("k",), flat, None, 7, staged=False)
    assert not cache.wants(("k",), flat), "one entry per sweep"
    assert cache.find(("k",), flat.clone()) is not None
    other = flat.clone()
    other[0, 1, 4, 4] = 0.25  # one pixel at the halo's edge
    assert cache.find(("k",), other) is None
    assert cache.find(("j",), flat) is None, "another geometry never matches"
    assert not ReuseCache(True, (2, 3)).wants(("k",), other), "a textured tile never fills the entry"
    assert not ReuseCache(False, (2, 3)).wants(("k",), flat), "off: nothing cached"


def test_zero_gradient_tiles_are_read_together() -> None:
    """The zero-gradient check of a sweep: the tiles whose share is all zero, exactly those a per-tile check finds,
    read with one synchronization for every tile on a device (none on the host)."""
    g = torch.randn(2, 3, 10, 12)
    rows, cols = [(0, 4), (4, 8), (8, 10)], [(0, 5), (5, 12)]
    g[:, :, 4:8, 0:5] = 0.0
    g[:, :, 8:10, :] = 0.0
    g[1, 2, 9, 11] = -0.0  # a negative zero is zero
    tiles = [(r, c) for r in range(3) for c in range(2)]
    reads: list[str] = []
    zero = zero_tiles(g, tiles, rows, cols, reads.append)
    want = {(r, c) for r, c in tiles if not g[:, :, rows[r][0] : rows[r][1], cols[c][0] : cols[c][1]].any()}
    assert zero == want == {(1, 0), (2, 0), (2, 1)}
    assert reads == [], "a host tensor is read without a synchronization"
    on_device = zero_tiles(g.to("meta"), tiles, rows, cols, reads.append)
    assert on_device == set() and reads == ["the zero-gradient check"], "one read for the sweep; meta: none zero"


def test_content_checks_report_their_synchronizations() -> None:
    """Each check that reads a device tile tells ``on_sync`` (the simulated clock prices it), fake tiles too."""
    reads: list[str] = []
    cache: ReuseCache[int] = ReuseCache(True, (2, 3), reads.append)
    meta = torch.empty(1, 2, 5, 5, device="meta")
    assert not cache.wants(("k",), meta), "meta: no content, no tile flat (the host-time measurement's slide)"
    assert reads == ["a flatness check"]
    host = torch.full((1, 2, 5, 5), 0.5)
    assert cache.wants(("k",), host) and reads == ["a flatness check"], "a host tile: no synchronization"
    assert all_zero(torch.zeros(2, 3), reads.append) and not all_zero(host, reads.append)
    assert not all_zero(torch.zeros(2, 3, device="meta"), reads.append), "no content: computed"
    assert reads == ["a flatness check", "a zero-gradient check"]


def test_a_budget_the_entry_does_not_fit_plans_without_it() -> None:
    """The background entry counts in the plan; where it is what does not fit, the plan computes every tile instead
    (and says so), so the budget holds either way; with room, the plan keeps it and costs more than without."""
    from test_sft_least_budget import meta_model, planned

    model = meta_model("vgg16")
    # 600 MiB: with the entry only tiles past +300% extra compute fit (680 MiB did until forward sweeps got tiles of
    # their own, planning/forward.py, which made the entry's smaller tiles worth running there)
    tight, roomy = planned(model, 20480, "600MiB", "cuda"), planned(model, 20480, "2GiB", "cuda")
    assert tight.fits and not tight.reuse_tiles and "background reuse off" in tight.notes[0]
    assert tight.time_tiles == 0 and tight.slowdown_at(0.3) == tight.slowdown
    assert roomy.fits and roomy.reuse_tiles and roomy.slowdown_at(0.3) < roomy.slowdown


def test_reuse_off_computes_every_tile() -> None:
    """``reuse_tiles=False`` is the reference the bitwise tests compare against: nothing reused, nothing skipped."""
    x = masked_image((1, 3, 200, 232), FRAME)
    torch.manual_seed(1)
    sft = SFT(vgg("max", nn.MaxPool2d).double(), memory_budget="1GiB", tile_size=32, reuse_tiles=False)
    sft(x.clone().requires_grad_()).sum().backward()
    s = sft.last_stats
    assert (s.reused_forward, s.reused_backward, s.skipped_backward) == (0, 0, 0)
    assert s.recomputed_tiles == s.summary()["tiles_backward"] > 0
