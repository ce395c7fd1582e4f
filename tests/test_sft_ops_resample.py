"""Upsampling and space/depth regroupings (``wsitrain.sft.ops.resample``) tiled: SFT equals plain autograd.

float64, forced tiles on odd, non-square images with ragged last tiles, batch 2: outputs, every parameter
gradient and the input gradient. Each model downsamples, resamples and merges with a skip branch, as HRNet's
fuse layers and TResNet's stem do, so the resampled map is cut into tiles whose crops start inside the image.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sft_models import seeded_case
from test_sft_exact import assert_same, reference, variant
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.sft import SFT
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.registry import OPAQUE, WINDOW
from wsitrain.sft.ops.resample import RESIZE, Upscale, interpolate_spec


class SpaceToDepth(nn.Module):
    """timm's TResNet stem regrouping, as timm writes it (view / permute / view), block size ``bs``."""

    def __init__(self, bs: int) -> None:
        super().__init__()
        self.bs = bs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.size()
        x = x.view(n, c, h // self.bs, self.bs, w // self.bs, self.bs)  # (N, C, H/bs, bs, W/bs, bs)
        x = x.permute(0, 3, 5, 1, 2, 4).contiguous()  # (N, bs, bs, C, H/bs, W/bs)
        return x.view(n, c * self.bs * self.bs, h // self.bs, w // self.bs)


class UpFuse(nn.Module):
    """HRNet-like fuse: a stride-s branch upsampled back by s and added to the full-resolution branch."""

    def __init__(self, up: nn.Module | None, s: int, functional: dict[str, object] | None = None) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.down = nn.Sequential(nn.Conv2d(6, 8, 3, stride=s, padding=1), nn.ReLU(), nn.Conv2d(8, 6, 3, padding=1))
        self.up = up
        self.functional = functional or {}
        self.post = nn.Sequential(nn.ReLU(), nn.Conv2d(6, 5, 3, padding=1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))  # (B, 6, H, W)
        z = self.down(y)  # (B, 6, H/s, W/s)
        z = self.up(z) if self.up is not None else F.interpolate(z, **self.functional)  # type: ignore[arg-type]
        return self.post(y + z)


class Regroup(nn.Module):
    """Space-to-depth stem (block 2 or 4), convs, then depth-to-space back and a conv."""

    def __init__(self, s2d: nn.Module, d2s: nn.Module, bs: int) -> None:
        super().__init__()
        self.s2d = s2d
        c = bs * bs
        self.body = nn.Sequential(nn.Conv2d(3 * c, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4 * c, 3, padding=1))
        self.d2s = d2s
        self.post = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.d2s(self.body(self.s2d(x))))


class GhostGate(nn.Module):
    """GhostNetV2's DFC attention as timm writes it: a gate from an average-pooled map, resized to the map's
    own size measured at run time (``out.shape``), multiplies the map."""

    def __init__(self, mode: str = "nearest") -> None:
        super().__init__()
        self.mode = mode
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.short = nn.Sequential(
            nn.Conv2d(6, 6, 1),
            nn.Conv2d(6, 6, (1, 5), padding=(0, 2), groups=6),
            nn.Conv2d(6, 6, (5, 1), padding=(2, 0), groups=6),
        )
        self.primary = nn.Conv2d(6, 8, 3, padding=1)
        # a halo after the product: tiles need the resized gate from odd positions, where a crop resized to the
        # tile's own size would be off by one
        self.post = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 5, 1))  # halo 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))  # (B, 6, H, W)
        res = self.short(F.avg_pool2d(x, kernel_size=2, stride=2))  # (B, 6, H // 2, W // 2)
        out = self.primary(x)  # (B, 8, H, W)
        kw = {"align_corners": False} if self.mode == "bilinear" else {}
        gate = F.interpolate(torch.sigmoid(res), size=(out.shape[-2], out.shape[-1]), mode=self.mode, **kw)
        return self.post(out[:, :6, :, :] * gate)


def _functional_pixel(fn: object, factor: int) -> nn.Module:
    class Call(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return fn(x, factor)  # type: ignore[operator]

    return Call()


UP_CASES = {
    "nearest2": lambda: UpFuse(nn.Upsample(scale_factor=2, mode="nearest"), 2),
    "nearest4": lambda: UpFuse(nn.Upsample(scale_factor=4), 4),
    "bilinear2": lambda: UpFuse(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), 2),
    "bilinear3": lambda: UpFuse(nn.Upsample(scale_factor=3, mode="bilinear"), 3),
    "f_bilinear2": lambda: UpFuse(None, 2, {"scale_factor": 2, "mode": "bilinear", "align_corners": False}),
    "f_nearest_pair": lambda: UpFuse(None, 2, {"scale_factor": (2.0, 2.0), "mode": "nearest"}),
    # an output size that is a whole multiple of the input: the factor, whatever the size's form
    "size_nearest2": lambda: UpFuse(nn.Upsample(size=(44, 60)), 2),
    "size_bilinear3": lambda: UpFuse(None, 3, {"size": (45, 63), "mode": "bilinear", "align_corners": False}),
}
REGROUP_CASES = {
    "timm_s2d4_pixel_shuffle": lambda: Regroup(SpaceToDepth(4), nn.PixelShuffle(4), 4),
    "pixel_unshuffle2": lambda: Regroup(nn.PixelUnshuffle(2), nn.PixelShuffle(2), 2),
    "f_pixel2": lambda: Regroup(_functional_pixel(F.pixel_unshuffle, 2), _functional_pixel(F.pixel_shuffle, 2), 2),
}


def _really_tiles(engine: SFT, shape: tuple[int, ...]) -> None:
    p = engine.plan_for(shape, input_dtype=torch.float64)
    assert any(s.n_tiles > 1 for s in p.segments), "the test must really tile"


@pytest.mark.parametrize(
    ("name", "tile"), [(n, 12) for n in sorted(UP_CASES)] + [("bilinear3", 23), ("bilinear2", 9), ("nearest2", 23)]
)
def test_upsample_tiles_exact(name: str, tile: int) -> None:
    """Odd sizes (a stride-s map of ceil(H/s) upsampled needs H divisible by s: 48 x 66 / 3, 44 x 60 / 2, 4)."""
    s = 3 if name.endswith("3") else 4 if name.endswith("4") else 2
    shape = (2, 3, 45, 63) if s == 3 else (2, 3, 44, 60)
    model, x, t = seeded_case(UP_CASES[name], shape)
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    _really_tiles(var[3], shape)


@pytest.mark.parametrize(("name", "tile"), [(n, 12) for n in sorted(REGROUP_CASES)] + [("pixel_unshuffle2", 20)])
def test_space_depth_regroupings_tile_exact(name: str, tile: int) -> None:
    bs = 4 if "4" in name else 2
    shape = (2, 3, 13 * bs, 17 * bs)  # odd numbers of blocks: ragged tiles in block units
    model, x, t = seeded_case(REGROUP_CASES[name], shape, seed=1)
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    _really_tiles(var[3], shape)


@pytest.mark.parametrize("factor", [2, 3, 4])
@pytest.mark.parametrize("bilinear", [False, True])
def test_upscale_intervals_cover_what_the_layer_reads(factor: int, bilinear: bool) -> None:
    """Every output interval of an upscaling, computed on the crop the map gives, equals the untiled output."""
    n_in = 11
    x = torch.randn(1, 1, 1, n_in, dtype=torch.float64)
    mode = "bilinear" if bilinear else "nearest"
    kw = {"align_corners": False} if bilinear else {}
    full = F.interpolate(x, scale_factor=(1, factor), mode=mode, **kw)  # (1, 1, 1, n_in * factor)
    up = Upscale(factor, bilinear)
    n_out = n_in * factor
    for a in range(n_out):
        for b in range(a + 1, n_out + 1):
            lo, hi = up.input_interval(a, b, n_in)
            assert 0 <= lo < hi <= n_in
            assert up.first_output(lo) <= a and up.first_output(lo) + up.output_count(lo, hi) >= b
            got = F.interpolate(x[..., lo:hi], scale_factor=(1, factor), mode=mode, **kw)
            g0 = up.first_output(lo)
            torch.testing.assert_close(got[..., a - g0 : b - g0], full[..., a:b], rtol=1e-14, atol=1e-15)


def test_resample_specs_and_memory_facts() -> None:
    """Upsampling is a WINDOW operator that saves nothing for backward (autograd keeps only sizes)."""
    model = UP_CASES["bilinear2"]().double()
    facts = annotate(ModelGraph(model), (1, 3, 32, 32), torch.float64, torch.float64, True)
    up = next(n for n in facts.nodes if n.name == "up")
    assert up.spec.kind == WINDOW and up.spec.tileable and up.shape == (1, 6, 32, 32)
    assert not up.spec.saves_input and not up.spec.saves_output and up.spec.flops_per_output > 0
    reg = Regroup(SpaceToDepth(4), nn.PixelShuffle(4), 4).double()
    facts = annotate(ModelGraph(reg), (1, 3, 32, 32), torch.float64, torch.float64, True)
    s2d = next(n for n in facts.nodes if n.name == "s2d")
    assert s2d.spec.kind == WINDOW and s2d.spec.type_name == "SpaceToDepth" and s2d.shape == (1, 48, 8, 8)


@pytest.mark.parametrize(
    ("up", "words"),
    [
        (nn.Upsample(scale_factor=2, mode="bicubic"), ["'bicubic'", "up (Upsample)"]),
    ],
)
def test_untileable_resampling_says_why(up: nn.Module, words: list[str]) -> None:
    """Resamplings that no crop reproduces are refused where tiling is needed, naming the layer and the fix."""
    model = UpFuse(up, 3 if up.size else 2).double()  # a stride-3 branch: 11 x 11 for 32 x 32
    spec = next(n.spec for n in annotate(ModelGraph(model), (1, 3, 32, 32), torch.float64, torch.float64).nodes
                if n.name == "up")
    assert spec.kind == OPAQUE and not spec.tileable
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(PlanError) as err:
        SFT(model, tile_size=8, memory_budget="4GiB")(x)
    for w in words:
        assert w in str(err.value)


def test_fractional_scale_is_not_tiled() -> None:
    spec = interpolate_spec("Upsample", None, 1.5, "nearest", None)
    assert not spec.tileable and "whole-number" in spec.why_not and "recompute_scale_factor=True" in spec.why_not
    # with recompute_scale_factor=True the kernel sees only the output size: resolved against the plan's shapes
    assert RESIZE in interpolate_spec("Upsample", None, 1.5, "nearest", None, False, True).extra
    assert interpolate_spec("interpolate", None, (2, 3), "nearest", None).tileable


@pytest.mark.parametrize(
    ("mode", "tile", "one_segment"),
    [
        ("nearest", 8, True),
        ("nearest", 14, False),
        ("nearest", 10, True),
        ("bilinear", 10, False),
        ("bilinear", 16, True),
    ],
)
def test_resize_to_measured_size_tiles_exact(mode: str, tile: int, one_segment: bool) -> None:
    """GhostNetV2's gate: a size read from another map at run time, twice the pooled map's on this even image.

    ``one_segment``: checkpoints keep the product and the convs after it in one tiled segment, so tiles need the
    gate from odd positions with a halo (a segment ending at the product needs it on the stride-2 grid only).
    """
    shape = (2, 3, 44, 62)
    model, x, t = seeded_case(lambda: GhostGate(mode), shape, seed=3)
    ref = reference(model, x, t)
    cuts = {"checkpoints": ["relu", "post.2"]} if one_segment else {}
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB", **cuts)
    assert_same(ref, var)
    _really_tiles(var[3], shape)
    facts = annotate(ModelGraph(model), shape, torch.float64, torch.float64, True)
    spec = next(n.spec for n in facts.nodes if "interpolate" in n.name)
    assert spec.kind == WINDOW and spec.windows == (Upscale(2, mode == "bilinear"), Upscale(2, mode == "bilinear"))
    p = var[3].plan_for(shape, input_dtype=torch.float64)
    i = next(n.index for n in facts.nodes if "interpolate" in n.name)
    assert any(s.n_tiles > 1 and s.start < i <= s.end for s in p.segments), "the resize must run on tiles"
