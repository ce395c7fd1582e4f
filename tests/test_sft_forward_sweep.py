"""The forward sweep on its own, larger tiles (wsitrain/sft/planning/forward.py): reference vs variant in float64.

Budgets are chosen so that the planner gives a tiled segment a forward grid other than its recompute's; each test
asserts it did (a test that stopped widening would otherwise pass on the old path), and that the executor really
visited the forward grid's tiles in forward and the recompute's in backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from sft_models import MODELS
from test_sft_attention import net as attention_net
from test_sft_fused_pool import net as pooled_net
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.sft import SFT
from wsitrain.sft.plan_types import Plan

F64 = {"rtol": 1e-10, "atol": 1e-11}
SHAPE = (2, 3, 90, 124)  # batch 2, non-square, ragged tiles on every grid below
FRACTIONS = (0.9, 0.75, 0.6, 0.45, 0.3, 0.2)  # of plain training's activation memory, above weights and workspaces


def budget_at(model: nn.Module, frac: float) -> int:
    plain = SFT(model, memory_budget="4GiB").plan_for(SHAPE, input_dtype=torch.float64)
    fixed = plain.breakdown["parameters"] + plain.breakdown["runtime"]
    return int(fixed + frac * (plain.baseline_peak_bytes - fixed))


def widened(p: Plan) -> list[int]:
    """Indices of tiled segments whose forward sweep runs on another grid than their recompute."""
    return [s.index for s in p.segments if s.mode == "tiled" and s.forward_grid and s.forward_grid != s.tile_grid]


def step(model: nn.Module, x: torch.Tensor, engine: SFT | None) -> tuple:
    model.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    y = (engine or model)(xr)
    (y * torch.arange(1.0, 1.0 + y.shape[1], dtype=y.dtype)).square().sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad


def check(model: nn.Module, want_tiled_forward: bool = False, **sft_kw: object) -> list[Plan]:
    """Every budget of ``FRACTIONS`` that fits: exact against plain autograd, and the tiles visited per sweep are
    the plan's. Returns the plans that widened (at least one must). ``sft_kw``: more ``SFT`` arguments."""
    torch.manual_seed(1)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    ref = step(model, x, None)
    plans = []
    for frac in FRACTIONS:
        twin = copy.deepcopy(model)
        engine = SFT(twin, memory_budget=budget_at(model, frac), **sft_kw)  # type: ignore[arg-type]
        visits: dict[tuple[int, str], int] = {}

        def on_tile(seg: int, r: int, c: int, phase: str, seen: dict[tuple[int, str], int] = visits) -> None:
            seen[(seg, phase)] = seen.get((seg, phase), 0) + 1

        engine._hooks.on_tile = on_tile
        try:
            y, grads, gx = step(twin, x, engine)
        except PlanError:  # the smallest budgets do not fit every model
            continue
        p = next(reversed(engine._cache.values())).plan  # the plan the step ran (an input that wants its gradient)
        torch.testing.assert_close(y, ref[0], **F64)
        for name, a, b in zip([n for n, _ in model.named_parameters()], grads, ref[1], strict=True):
            torch.testing.assert_close(a, b, **F64, msg=lambda m, n=name, f=frac: f"{n} at {f}: {m}")
        torch.testing.assert_close(gx, ref[2], **F64)
        for s in p.segments:
            if s.mode == "tiled" and (s.index, "forward") in visits:
                assert visits[(s.index, "forward")] == s.n_forward_tiles, (frac, s.index, visits)
                assert visits.get((s.index, "backward"), 0) <= s.n_tiles
        if widened(p):
            plans.append(p)
    assert plans, "no budget gave a forward sweep its own tiles: the test must exercise them"
    if want_tiled_forward:
        assert any(p.segments[i].forward_grid != (1, 1) for p in plans for i in widened(p)), "only untiled forwards"
    return plans


@pytest.mark.parametrize("name", ["vgg_chain", "odd_ops", "resnet_basic"])
def test_widened_forward_is_exact(name: str) -> None:
    """Chains, residual blocks, strided, dilated, grouped and ceil-mode layers; forward grids tiled and untiled."""
    torch.manual_seed(0)
    check(MODELS[name]().double(), want_tiled_forward=name != "resnet_basic")


@pytest.mark.parametrize("pool", ["avg", "max", "mean"])
def test_widened_forward_with_a_fused_pool(pool: str) -> None:
    """The pool folds the forward's tiles; backward's shares come from the recompute's (avg, first-max index). One
    segment (``checkpoints=[]``): the pool fuses into it."""
    torch.manual_seed(0)
    plans = check(pooled_net(pool), want_tiled_forward=True, checkpoints=[])
    assert any(p.segments[i].fused_pool for p in plans for i in widened(p)), "no fused segment widened"


def test_widened_forward_with_attention() -> None:
    """The online softmax over the forward's tiles; each recomputed tile's share from its statistics. One segment
    (``checkpoints=[]``): the pool fuses into the tiled segment that ends the trunk."""
    torch.manual_seed(0)
    plans = check(attention_net(branches=3, gated=True).double(), want_tiled_forward=True, checkpoints=[])
    assert any(p.segments[i].fused_pool == "attention" for p in plans for i in widened(p))


def test_value_matched_pools_and_multipass_keep_one_grid() -> None:
    """``amax`` finds its tied maxima by equality with the forward's values, and barrier statistics (train-mode
    BatchNorm) are summed over one grid's owned parts: such segments never widen (a recompute of another shape may
    round differently)."""
    seen = {"amax": 0, "batchnorm": 0}
    for kind, model, kw in (("amax", pooled_net("amax"), {"checkpoints": []}),
                            ("batchnorm", attention_net(bn=True).double(), {})):  # fmt: skip
        for frac in FRACTIONS:
            try:
                p = SFT(model, memory_budget=budget_at(model, frac), **kw).plan_for(SHAPE, input_dtype=torch.float64)
            except PlanError:
                continue
            for s in p.segments:
                holds = s.fused_pool == "amax" if kind == "amax" else "features.4" in s.layers  # features.4: the BN
                if s.mode == "tiled" and s.n_tiles > 1 and holds:
                    seen[kind] += 1
                    assert not s.forward_grid, (kind, frac, s)
    assert all(seen.values()), f"the test must plan such segments tiled: {seen}"


def test_plan_reports_the_forward_grid() -> None:
    model = MODELS["vgg_chain"]().double()
    p = next(iter(check(model)))
    k = widened(p)[0]
    d = p.to_dict()["segments"][k]
    s = p.segments[k]
    assert d["forward_grid"] == list(s.forward_grid) and d["forward_tile_shape"] == list(s.forward_tile_shape)
    assert "forward sweep" in str(p)
    assert s.n_forward_tiles < s.n_tiles
