"""Reference-vs-variant: SFT must give plain autograd's outputs and gradients (float64: to round-off)."""

from __future__ import annotations

import copy

import pytest
import torch
from sft_models import MODELS
from torch import nn

from wsitrain.sft import SFT
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph

F64 = {"rtol": 1e-10, "atol": 1e-11}
# odd_ops uses padding="same" with an even kernel on purpose; PyTorch warns that it pads a copy
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


def reference(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, list, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    y = model(xr)
    torch.nn.functional.mse_loss(y, target).backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad


def variant(
    model: nn.Module, x: torch.Tensor, target: torch.Tensor, **kw
) -> tuple[torch.Tensor, list, torch.Tensor | None, SFT]:
    model.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    m = SFT(model, **kw)
    y = m(xr)
    torch.nn.functional.mse_loss(y, target).backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad, m


def assert_same(ref, var, tol=F64) -> None:
    y0, g0, gx0 = ref
    y1, g1, gx1 = var[:3]
    torch.testing.assert_close(y1, y0, **tol)
    assert len(g0) == len(g1)
    for a, b in zip(g0, g1, strict=True):
        torch.testing.assert_close(b, a, **tol)
    if gx0 is not None:
        assert gx1 is not None, "SFT returned no input gradient"
        torch.testing.assert_close(gx1, gx0, **tol)


def make(name: str, shape: tuple[int, ...], seed: int = 0, grad_x: bool = True):
    torch.manual_seed(seed)
    model = MODELS[name]().double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=grad_x)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    return model, x, target


CASES = [(name, tile) for name in sorted(MODELS) for tile in (16, 24)] + [("vgg_chain", 32), ("odd_ops", 12)]


@pytest.mark.parametrize(("name", "tile"), CASES)
def test_forced_tiles_exact(name: str, tile: int) -> None:
    """Every model, odd non-square sizes with ragged last tiles, several tile edges (batch 2 for some)."""
    batch = 2 if name in ("vgg_chain", "odd_ops", "gated") else 1
    model, x, t = make(name, (batch, 3, 45, 62))
    ref = reference(model, x, t)
    var = variant(model, x, t, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    p = var[3].plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert any(s.n_tiles > 1 for s in p.segments), "the test must really tile"


@pytest.mark.parametrize("name", ["vgg_chain", "resnet_basic", "dense"])
def test_forced_segmentations_exact(name: str) -> None:
    """Different checkpoint placements (every cut, a few cuts) give the same gradients."""
    model, x, t = make(name, (1, 3, 53, 41), seed=1)
    ref = reference(model, x, t)
    facts = annotate(ModelGraph(model), tuple(x.shape), torch.float64, torch.float64, True)
    names = [facts.name(i) for i in facts.candidates[1:-1]]
    assert len(names) >= 2
    for cps in (names, names[::2], names[-1:]):
        var = variant(model, x, t, tile_size=16, checkpoints=cps, memory_budget="4GiB")
        assert_same(ref, var)
        assert len(var[3].plan_for(tuple(x.shape), input_dtype=torch.float64).segments) == len(cps) + 1


@pytest.mark.parametrize("name", ["vgg_chain", "resnet_basic", "odd_ops"])
def test_budget_driven_plans_exact(name: str) -> None:
    """Small budgets force more tiling and checkpoints; every plan stays exact and fits its budget."""
    model, x, t = make(name, (1, 3, 128, 112), seed=2, grad_x=False)
    ref = reference(model, x, t)
    plain = SFT(model, memory_budget="4GiB").plan_for(tuple(x.shape))
    fixed = plain.breakdown["parameters"] + plain.breakdown["runtime"]
    seen_modes = set()
    # 0.5 left resnet_basic only 16 px tiles (+562%) once CPU headroom became 12%; 0.6 left it only 20 px tiles once
    # its frozen BatchNorm folded into the convolutions (plain's activations 17% smaller, the least plan's the same)
    for frac in (2.0, 0.75, 0.65):
        budget = int(fixed + frac * (plain.baseline_peak_bytes - fixed))
        var = variant(model, x, t, memory_budget=budget)
        assert_same(ref, var)
        p = var[3].plan_for(tuple(x.shape))
        assert p.fits and p.estimated_peak_bytes <= budget
        seen_modes.add(tuple(s.mode for s in p.segments))
        if frac >= 2.0:
            assert all(s.mode == "plain" for s in p.segments), "a plan that fits untiled must not tile"
    assert len(seen_modes) >= 2, f"budgets did not change the plan: {seen_modes}"


def test_input_gradient_and_uint8_input() -> None:
    model, x, t = make("vgg_chain", (1, 3, 40, 33), seed=3)
    ref = reference(model, x, t)
    assert_same(ref, variant(model, x, t, tile_size=16, memory_budget="1GiB"))
    # uint8 images (no input gradient) through a normalizing first layer
    norm_model = nn.Sequential(_Scale(), *MODELS["vgg_chain"]().double())
    torch.manual_seed(4)
    xu = torch.randint(0, 256, (2, 3, 37, 50), dtype=torch.uint8)
    with torch.no_grad():
        t2 = torch.randn_like(norm_model(xu))
    ref2 = reference(norm_model, xu, t2)
    assert_same(ref2, variant(norm_model, xu, t2, tile_size=16, memory_budget="1GiB"))


class _Scale(nn.Module):
    """A pointwise first layer that accepts uint8 (like wsitrain's InputNormalization)."""

    sft_pointwise = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float64) / 255.0 - 0.5


def test_recomputed_tiles_match_plan() -> None:
    """Work counting: each tiled segment recomputes each of its tiles exactly once per step."""
    model, x, t = make("resnet_basic", (1, 3, 70, 70), seed=5)
    var = variant(model, x, t, tile_size=16, memory_budget="1GiB")
    p = var[3].plan_for(tuple(x.shape), input_dtype=torch.float64)
    stats = var[3].last_stats
    assert p.recomputed_tiles == sum(s.n_tiles for s in p.segments if s.mode == "tiled") > 4
    assert stats.recomputed_tiles == p.recomputed_tiles
    assert sum(1 for s in stats.tiles if s.phase == "forward") == p.recomputed_tiles
    grid = {
        (sp.index, r, c)
        for sp in p.segments
        if sp.mode == "tiled"
        for r in range(sp.tile_grid[0])
        for c in range(sp.tile_grid[1])
    }
    for phase in ("forward", "backward"):
        seen = [(s.segment, s.row, s.col) for s in stats.tiles if s.phase == phase]
        assert sorted(seen) == sorted(grid), f"{phase}: every tile of the plan's grids exactly once"
    assert all(s.peak_bytes is None for s in stats.tiles), "per-tile peaks only when asked for (tile_peaks=True)"


def test_float32_and_autocast() -> None:
    torch.manual_seed(6)
    model = MODELS["resnet_basic"]()
    x = torch.randn(1, 3, 64, 72)
    t = torch.randn(1, 3)
    ref = reference(model, x, t)
    assert_same(ref, variant(model, x, t, tile_size=24, memory_budget="1GiB"), tol={"rtol": 1e-4, "atol": 1e-5})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_bf = reference(model, x, t)
        var_bf = variant(model, x, t, tile_size=24, memory_budget="1GiB")
    # bf16 has 8 bits of mantissa; tiles round the same values in a different order only at the sums
    assert_same(ref_bf, var_bf, tol={"rtol": 0.05, "atol": 0.02})
    assert var_bf[3].plan_for((1, 3, 64, 72), dtype=torch.bfloat16).dtype == "bfloat16"


def test_shapes_are_replanned_and_cached() -> None:
    model, x, t = make("vgg_chain", (1, 3, 32, 32), seed=7, grad_x=False)
    m = SFT(model, tile_size=16, memory_budget="1GiB")
    for shape in ((1, 3, 32, 32), (1, 3, 48, 40), (1, 3, 32, 32)):
        xi = torch.randn(shape, dtype=torch.float64)
        torch.testing.assert_close(m(xi), model(xi), **F64)
    assert len(m._cache) == 2


def test_eval_no_grad_forward() -> None:
    model, x, _ = make("dense", (1, 3, 50, 50), seed=8, grad_x=False)
    m = SFT(model, tile_size=16, memory_budget="1GiB")
    with torch.no_grad():
        torch.testing.assert_close(m(x), model(x), **F64)


def test_parameters_are_shared() -> None:
    model = MODELS["vgg_chain"]()
    m = SFT(model, memory_budget="1GiB")
    assert [id(p) for p in m.parameters()] == [id(p) for p in model.parameters()]
    clone = copy.deepcopy(m)  # a wrapped model can be copied (e.g. for EMA weights)
    cp = list(clone.parameters())
    assert {id(p) for p in cp}.isdisjoint(id(p) for p in model.parameters()), "the copy owns its weights"
    for a, b in zip(cp, model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    x = torch.randn(1, 3, 24, 24)
    torch.testing.assert_close(clone(x), model(x))  # and runs with them
