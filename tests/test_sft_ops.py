"""Operators that are pointwise in space (channels-last, channel shuffles, arithmetic): SFT equals plain autograd.

Reference vs variant as in test_sft_exact.py: float64, forced tiles on a ragged non-square image,
outputs, every parameter gradient and the input gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from sft_models_modern import MODELS, convnext_like, dropout_net
from test_sft_exact import assert_same, reference, variant

from wsitrain.errors import PlanError
from wsitrain.sft import SFT
from wsitrain.sft.facts import GraphFacts, annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.registry import CONST, POINTWISE, SHAPE, OpSpec, user_name
from wsitrain.sft.ops.report import tiling_report
from wsitrain.sft.ops.space import check_tile_extent, crop


def make(name: str, shape: tuple[int, ...], seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name]().double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    return model, x, target


@dataclass(frozen=True)
class Ctx:
    """The annotating pass's facts, seen as specs by node index."""

    graph: ModelGraph
    facts: GraphFacts

    @property
    def specs(self) -> list[OpSpec]:
        return [n.spec for n in self.facts.nodes]

    @property
    def trunk_end(self) -> int:
        return self.facts.trunk_end

    def name(self, i: int) -> str:
        return self.facts.name(i)


def context(model: torch.nn.Module, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> Ctx:
    graph = ModelGraph(model)
    return Ctx(graph, annotate(graph, shape, dtype, dtype, dtype == torch.float64))


@pytest.mark.parametrize("tile", [16, 24])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_forced_tiles_exact(name: str, tile: int) -> None:
    """Batch 2, 45 x 62 (ragged last tiles), every trunk node in a tiled segment."""
    model, x, t = make(name, (2, 3, 45, 62))
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    p = var[3].plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert all(s.mode == "tiled" for s in p.segments)
    assert any(s.n_tiles > 1 for s in p.segments), "the test must really tile"


def test_layouts_resolved() -> None:
    """Channels-last tensors hold H, W at dims (1, 2); ShuffleNet's 5-D view at (3, 4); ints and constants at none."""
    ctx = context(convnext_like().double(), (1, 3, 45, 62))
    by_type = {}
    for i, s in enumerate(ctx.specs[: ctx.trunk_end + 1]):
        by_type.setdefault(s.type_name, set()).add(s.spatial_dims)
        assert s.tileable, f"{ctx.name(i)} {s.why_not}"
    assert ctx.specs[-1].type_name == "Linear" and ctx.specs[-1].spatial_dims is None  # the head's Linear
    assert by_type["LayerNorm"] == {(1, 2)} and by_type["Linear"] == {(1, 2)}
    assert by_type["layer_norm"] == {(1, 2)}  # inside LayerNorm2d (torchvision and timm)
    assert by_type["permute"] == {(1, 2), (2, 3)}
    assert by_type["GELU"] == {(1, 2)}
    ctx = context(MODELS["shuffle_like"]().double(), (1, 3, 45, 62))
    dims = {s.spatial_dims for s in ctx.specs if s.type_name in ("view", "transpose", "reshape")}
    assert dims == {(3, 4), (2, 3)}
    assert {s.kind for s in ctx.specs if s.type_name in ("size", "getattr", "floordiv")} == {SHAPE}
    ctx = context(MODELS["arith"]().double(), (1, 3, 45, 62))
    assert any(s.kind == CONST for s in ctx.specs)  # scale.view(1, -1, 1, 1)


def test_tensor_varying_over_the_image_is_refused() -> None:
    """A tensor with H, W extents (a positional embedding) cannot be tiled; the error names the module."""

    class PosEmbed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = torch.nn.Parameter(torch.randn(1, 6, 45, 62))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.pos

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3, padding=1), PosEmbed(), torch.nn.Conv2d(6, 6, 3, padding=1))
    model = torch.nn.Sequential(model, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(6, 2))
    ctx = context(model.double(), (1, 3, 45, 62))
    bad = [s for s in ctx.specs[: ctx.trunk_end + 1] if not s.tileable]
    assert len(bad) == 1 and "varies over the image axes" in bad[0].why_not
    report = tiling_report(ctx.specs, ctx.trunk_end, lambda i: user_name(ctx.graph.nodes[i].fx_node, ctx.graph.gm))
    assert [name for name, _ in report.untileable] == ["0.1 (PosEmbed): add"]
    with pytest.raises(PlanError, match="cannot be tiled"):
        SFT(model.double(), tile_size=16, memory_budget="4GiB")(torch.randn(1, 3, 45, 62, dtype=torch.float64))


def test_user_names() -> None:
    """Functions and methods are named by the module whose forward calls them, modules by path and class."""
    graph = ModelGraph(convnext_like())
    names = {user_name(g.fx_node, graph.gm) for g in graph.nodes}
    assert "features.2.pwconv1 (Linear)" in names
    assert "features.2 (ChannelsLastBlock): permute" in names
    assert "features.3.block.1 (Permute): permute" in names
    assert "features.1 (LayerNorm2d): layer_norm" in names
    assert "features.3 (CNBlock): mul" in names
    assert "input 'input'" in names


def test_dropout_in_training_refused() -> None:
    """Element-wise Dropout in training mode inside a tiled segment: a clear error naming the layer."""
    torch.manual_seed(0)
    model = dropout_net().double().train()
    x = torch.randn(1, 3, 40, 40, dtype=torch.float64)
    with pytest.raises(
        PlanError, match=r"features\.2.*Dropout.*Dropout in training mode draws position-dependent masks"
    ):
        SFT(model, tile_size=16, memory_budget="4GiB")(x)
    model.eval()  # in eval mode the same model tiles (the plan follows the current mode)
    torch.testing.assert_close(SFT(model, tile_size=16, memory_budget="4GiB")(x), model(x))


def test_tiling_report_names_what_ends_tiling() -> None:
    """The head's pooling ends the tiled trunk, named by module path (squeeze-excitation tiles, in sweeps)."""
    import torchvision

    model = torchvision.models.efficientnet_b0().eval()
    ctx = context(model, (1, 3, 64, 64), torch.float32)
    graph = ctx.graph
    report = tiling_report(ctx.specs, ctx.trunk_end, lambda i: user_name(graph.nodes[i].fx_node, graph.gm))
    assert report.stop is not None
    assert report.stop[0] == "avgpool (AdaptiveAvgPool2d)"
    assert report.trunk_nodes > 200 and report.nodes - report.trunk_nodes < 10
    ctx = context(convnext_like().double(), (1, 3, 45, 62))
    graph = ctx.graph
    report = tiling_report(ctx.specs, ctx.trunk_end, lambda i: user_name(graph.nodes[i].fx_node, graph.gm))
    assert report.stop == ("pool (AdaptiveAvgPool2d)", "global layers end the tiled part")
    assert report.trunk_nodes == ctx.trunk_end + 1 and not report.untileable
    assert str(report).startswith(f"{ctx.trunk_end + 1} of {len(ctx.specs)} graph nodes can run tiled")


def test_timm_layers_exact() -> None:
    """timm's LayerNorm2d (traced through: permute, layer_norm, permute) and DropPath (a leaf) tile exactly."""
    pytest.importorskip("timm", reason="timm is an optional extra")
    torch.manual_seed(0)
    model = convnext_like(timm_layers=True).double()
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64, requires_grad=True)
    t = torch.randn(2, 3, dtype=torch.float64)
    assert_same(reference(model, x, t), variant(model, x, t, tile_size=16, memory_budget="4GiB"))


def test_crop_and_extent_check() -> None:
    """Crops follow the node's image dims (channels-last, tuples); a tile of the wrong extent is a clear error."""
    t = torch.arange(2 * 5 * 7 * 3).view(2, 5, 7, 3)  # (B, H, W, C)
    torch.testing.assert_close(crop(t, (1, 2), (1, 3), (2, 6)), t[:, 1:3, 2:6, :])
    assert [c.shape for c in crop((t, t), (1, 2), (0, 1), (0, 2))] == [(2, 1, 2, 3)] * 2
    assert crop(7, None, (0, 1), (0, 1)) == 7  # ints from size() are never cropped
    spec = OpSpec(POINTWISE, "view", spatial_dims=(2, 3))
    check_tile_extent(torch.zeros(1, 2, 4, 8), spec, 4, 8, "ok")
    with pytest.raises(PlanError, match=r"layer features\.3 \(Foo\): view produced a tile of \(4, 6\) pixels"):
        check_tile_extent(torch.zeros(1, 2, 4, 6), spec, 4, 8, "features.3 (Foo): view")
