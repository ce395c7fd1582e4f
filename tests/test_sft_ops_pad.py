"""Explicit padding (``wsitrain.sft.ops.pad``) tiled: SFT equals plain autograd.

float64, forced tiles on odd, non-square images with ragged last tiles, batch 2: outputs, every parameter
gradient and the input gradient. Each padding sits between convs, so tiles cut the padded map inside the image
(where the layer pads made-up values the interval map must drop) and at its border (where the padding is real);
asymmetric paddings (HGNetV2's stem pads right and bottom only) and every mode.
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
from wsitrain.sft.ops.pad import Pad
from wsitrain.sft.ops.registry import OPAQUE, WINDOW


class FPad(nn.Module):
    """``F.pad`` as a module-less call inside a forward (the form HGNetV2 writes)."""

    def __init__(self, pad: tuple[int, ...], mode: str = "constant", value: float | None = None) -> None:
        super().__init__()
        self.pad, self.mode, self.value = pad, mode, value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "constant":
            return F.pad(x, self.pad, value=self.value or 0.0)
        return F.pad(x, self.pad, mode=self.mode)


class PadNet(nn.Module):
    """conv, a padding, a strided valid conv, a padding, conv: both paddings are cut by tiles."""

    def __init__(self, pad1: nn.Module, pad2: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.pad1 = pad1
        self.down = nn.Conv2d(6, 8, 3, stride=2)  # valid: only the explicit padding pads it
        self.pad2 = pad2
        self.post = nn.Sequential(nn.ReLU(), nn.Conv2d(8, 5, 3), nn.ReLU(), nn.Conv2d(5, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.stem(x))  # (B, 6, H, W)
        z = self.down(self.pad1(y))  # (B, 8, H', W')
        return self.post(self.pad2(z))


class HGStem(nn.Module):
    """HGNetV2's stem as timm writes it: F.pad right and bottom by 1 before 2 x 2 convs and a ceil-mode pool."""

    def __init__(self) -> None:
        super().__init__()
        self.stem1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.stem2a = nn.Conv2d(8, 4, 2)
        self.stem2b = nn.Conv2d(4, 8, 2)
        self.stem3 = nn.Conv2d(16, 8, 3, stride=2, padding=1)
        self.pool = nn.MaxPool2d(kernel_size=2, stride=1, ceil_mode=True)
        self.post = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem1(x))
        x = F.pad(x, (0, 1, 0, 1))
        x2 = torch.relu(self.stem2a(x))
        x2 = F.pad(x2, (0, 1, 0, 1))
        x2 = torch.relu(self.stem2b(x2))
        x1 = self.pool(x)
        x = torch.cat([x1, x2], dim=1)
        return self.post(torch.relu(self.stem3(x)))


CASES = {
    "zero_sym": lambda: PadNet(nn.ZeroPad2d(1), nn.ZeroPad2d(2)),
    "zero_asym": lambda: PadNet(nn.ZeroPad2d((0, 1, 2, 0)), nn.ZeroPad2d((3, 1, 0, 2))),
    "constant_value": lambda: PadNet(nn.ConstantPad2d((2, 0, 1, 3), 0.75), nn.ConstantPad2d(1, -1.5)),
    "reflect_asym": lambda: PadNet(nn.ReflectionPad2d((1, 2, 3, 0)), nn.ReflectionPad2d((2, 0, 1, 2))),
    "replicate_asym": lambda: PadNet(nn.ReplicationPad2d((0, 3, 1, 2)), nn.ReplicationPad2d((2, 1, 0, 1))),
    "f_constant": lambda: PadNet(FPad((0, 1, 0, 1)), FPad((1, 2, 2, 1), value=0.5)),
    "f_w_only": lambda: PadNet(FPad((2, 1)), FPad((0, 1, 1, 0))),
    "f_reflect": lambda: PadNet(FPad((1, 2, 2, 1), "reflect"), FPad((0, 1, 1, 0), "reflect")),
    "f_replicate": lambda: PadNet(FPad((3, 0, 0, 2), "replicate"), FPad((1, 1, 2, 0), "replicate")),
}


def _tiled_pads(engine: SFT, shape: tuple[int, ...]) -> None:
    """The plan really tiles, and every padding is a WINDOW operator inside a tiled segment."""
    p = engine.plan_for(shape, input_dtype=torch.float64)
    assert any(s.n_tiles > 1 for s in p.segments), "the test must really tile"
    facts = annotate(ModelGraph(engine.model), shape, torch.float64, torch.float64, True)
    pads = [n for n in facts.nodes if "pad" in n.name.lower() or n.spec.type_name.endswith("Pad2d")]
    assert pads and all(n.spec.kind == WINDOW and n.spec.tileable for n in pads)
    tiled = {i for s in p.segments if s.n_tiles > 1 for i in range(s.start + 1, s.end + 1)}
    assert all(n.index in tiled for n in pads), "every padding must run on tiles"


@pytest.mark.parametrize(("name", "tile"), [(n, 8) for n in sorted(CASES)] + [("zero_asym", 13), ("f_reflect", 5)])
def test_padding_tiles_exact(name: str, tile: int) -> None:
    shape = (2, 3, 37, 29)  # odd, non-square: ragged last tiles on both axes
    model, x, t = seeded_case(CASES[name], shape)
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    _tiled_pads(var[3], shape)


@pytest.mark.parametrize(("shape", "tile"), [((2, 3, 45, 61), 8), ((2, 3, 45, 61), 16), ((1, 3, 32, 48), 12)])
def test_hgnetv2_stem_tiles_exact(shape: tuple[int, ...], tile: int) -> None:
    model, x, t = seeded_case(HGStem, shape, seed=2)
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    _tiled_pads(var[3], shape)


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
@pytest.mark.parametrize(("before", "after"), [(0, 1), (1, 0), (2, 3), (3, 1), (0, 0)])
def test_pad_intervals_cover_what_the_layer_reads(mode: str, before: int, after: int) -> None:
    """Every output interval of a padding, computed on the crop the map gives, equals the untiled output."""
    n_in = 9
    x = torch.randn(1, 1, n_in, dtype=torch.float64)  # 3-D: reflect and replicate pad its last dim
    full = F.pad(x, (before, after), mode=mode)  # (1, 1, 1, n_in + before + after)
    pad = Pad(before, after, max(before, after) + 1 if mode == "reflect" else 1)
    n_out = n_in + before + after
    for a in range(n_out):
        for b in range(a + 1, n_out + 1):
            lo, hi = pad.input_interval(a, b, n_in)
            assert 0 <= lo < hi <= n_in and hi - lo >= pad.min_crop
            g0 = pad.first_output(lo)
            assert g0 <= a and g0 + pad.output_count(lo, hi) >= b
            got = F.pad(x[..., lo:hi], (before, after), mode=mode)
            assert got.shape[-1] == pad.output_count(lo, hi)
            torch.testing.assert_close(got[..., a - g0 : b - g0], full[..., a:b], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("pad", "words"),
    [
        (FPad((1, -1, 0, 0)), ["negative padding", "features (PadNet): pad"]),
        (FPad((1, 1, 1, 1), "circular"), ["'circular'", "wraps the image"]),
    ],
)
def test_untileable_padding_says_why(pad: nn.Module, words: list[str]) -> None:
    model = PadNet(pad, nn.ZeroPad2d(1)).double()
    spec = next(
        n.spec
        for n in annotate(ModelGraph(model), (1, 3, 32, 32), torch.float64, torch.float64).nodes
        if n.name.startswith("pad1")
    )
    assert spec.kind == OPAQUE and not spec.tileable
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    with pytest.raises(PlanError) as err:
        SFT(model, tile_size=8, memory_budget="4GiB")(x)
    for w in words[:1]:
        assert w in str(err.value)
