"""The planner's time model: FLOPs, memory traffic and per-call costs, and what the plan reports from it."""

from __future__ import annotations

import torch
from sft_models import MODELS
from torch import nn

from wsitrain.sft import SFT
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.planning.costs import BYTE_FLOPS, CALL_FLOPS, TILE_CALL_FLOPS, default_time_model, node_terms
from wsitrain.sft.planning.search import CHEAPEST, State, prune

SHAPE = (1, 3, 64, 80)
CPU = default_time_model("cpu")


def test_plain_fit_predicts_plain_time() -> None:
    p = SFT(MODELS["vgg_chain"](), memory_budget="4GiB").plan_for(SHAPE)
    assert not p.tiled_segments
    assert p.slowdown == 1.0 and p.time_plain > 0
    assert p.time_plain > p.flops_plain  # traffic and calls cost beyond the FLOPs


def test_more_tiles_predict_more_time_than_flops_alone() -> None:
    """Each tile pays every layer's call costs again: the time model's slowdown grows with the tile count,
    and faster than the FLOPs' (the halos alone)."""
    model = MODELS["resnet_basic"]()
    shape = (1, 3, 128, 160)
    plans = [SFT(model, tile_size=t, memory_budget="4GiB", checkpoints=[]).plan_for(shape) for t in (128, 64, 32)]
    assert [p.recomputed_tiles for p in plans] == sorted({p.recomputed_tiles for p in plans})
    slow = [p.slowdown for p in plans]
    assert 1.0 < slow[0] < slow[1] < slow[2], slow
    grow_time = slow[2] / slow[0]
    grow_flops = (1 + plans[2].overhead) / (1 + plans[0].overhead)
    assert grow_time > grow_flops, (slow, [p.overhead for p in plans])


def test_traffic_bound_layers_cost_more_than_their_flops() -> None:
    """A depthwise convolution moves as many bytes as a dense one of the same width but does a fraction of
    its FLOPs: in the time model, bytes make most of its cost."""
    model = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(32, 32, 3, padding=1, groups=32))
    facts = annotate(ModelGraph(model), (1, 32, 64, 64), torch.float32, torch.float32, False)
    dense, depthwise = (node_terms(facts, i, 32 * 64 * 64, 32 * 64 * 64, 1) for i in (1, 2))
    assert dense.traffic == depthwise.traffic
    assert depthwise.flops * 16 < dense.flops * 1.01
    share = BYTE_FLOPS["cpu"] * depthwise.traffic / depthwise.time(CPU)
    assert share > 0.3, share
    assert dense.time(CPU) - dense.flops < dense.flops  # the dense one is FLOP-bound


def test_executor_calls_cost_more_than_plain_calls() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 1))
    facts = annotate(ModelGraph(model), (1, 3, 8, 8), torch.float32, torch.float32, False)
    plain = node_terms(facts, 1, 4 * 64, 3 * 64, 10)
    tiled = node_terms(facts, 1, 4 * 64, 3 * 64, 10, tiled=True)
    extra = tiled.time(CPU) - plain.time(CPU)
    assert extra == TILE_CALL_FLOPS["cpu"] * plain.calls > 0
    assert plain.time(CPU) >= CALL_FLOPS["cpu"] * plain.calls


def test_plan_reports_its_predicted_time() -> None:
    p = SFT(MODELS["vgg_chain"](), tile_size=16, memory_budget="4GiB", checkpoints=[]).plan_for(SHAPE)
    assert p.to_dict()["slowdown"] == p.slowdown > 1.0
    assert f"predicted step time vs plain: {p.slowdown:.2f}x" in str(p)


def test_prune_keeps_the_state_that_retains_least() -> None:
    """Cheaper states must not crowd out the one that retains least: it may be the only one whose later
    segments still fit."""
    cheap = [State(float(k), 1000 + k, 2000, ()) for k in range(10)]
    frugal = State(100.0, 10, 2000, ())
    kept = prune([*cheap, frugal], CHEAPEST)
    assert frugal in kept
    assert kept[0] == cheap[0]
