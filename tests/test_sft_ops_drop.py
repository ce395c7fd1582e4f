"""Stochastic depth (torchvision StochasticDepth, timm DropPath) in tiled segments follows the module's current mode.

In train mode with 0 < p < 1 one decision per sample is drawn once per step and replayed by every
tile, in forward and in the recomputation: with the same random state SFT equals plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from sft_models_modern import drop_net
from test_sft_exact import assert_same, reference, variant

from wsitrain.sft import SFT

SHAPE = (4, 3, 45, 62)


def make(p: float, mode: str = "row", timm_layers: bool = False):
    torch.manual_seed(0)
    model = drop_net(p, mode, timm_layers).double()
    x = torch.randn(*SHAPE, dtype=torch.float64, requires_grad=True)
    t = torch.randn(SHAPE[0], 3, dtype=torch.float64)
    return model, x, t


@pytest.mark.parametrize(("p", "train"), [(0.3, False), (0.0, True), (1.0, True)])
def test_eval_and_trivial_rates_equal_plain(p: float, train: bool) -> None:
    """Eval, p = 0 and p = 1: deterministic, equal to plain autograd."""
    model, x, t = make(p)
    model.train(train)
    assert_same(reference(model, x, t), variant(model, x, t, tile_size=16, memory_budget="4GiB"))


@pytest.mark.parametrize(("mode", "timm_layers"), [("row", False), ("batch", False), ("row", True)])
def test_train_mask_replayed_per_sample(mode: str, timm_layers: bool) -> None:
    """0 < p < 1: the same random state gives plain's decisions; every tile and the recompute use them."""
    if timm_layers:
        pytest.importorskip("timm", reason="timm is an optional extra")
    model, x, t = make(0.5, mode, timm_layers)
    model.train()
    torch.manual_seed(11)
    ref = reference(model, x, t)
    torch.manual_seed(11)
    var = variant(model, x, t, tile_size=16, memory_budget="4GiB")
    assert_same(ref, var)  # a tile or a recompute drawing its own mask would differ from plain
    sft = var[3]
    masks = sft._runner.masks.current
    assert masks is not None and len(masks.drawn()) == 3  # one draw per drop node and step
    drawn = torch.cat([m.flatten() for m in masks.drawn()])
    if mode == "row":
        assert (drawn == 0).any() and (drawn != 0).any(), "seed must give both dropped and kept samples"
    model.eval()
    with torch.no_grad():
        assert not torch.allclose(ref[0], model(x)), "dropping must change the output"


def test_mode_followed_after_build() -> None:
    """Built in eval then trained, it drops; built in train then evaluated, it equals plain eval."""
    model, x, t = make(0.5)
    model.eval()
    sft = SFT(model, tile_size=16, memory_budget="4GiB")
    with torch.no_grad():
        torch.testing.assert_close(sft(x), model(x))
        model.train()
        torch.manual_seed(3)
        y_plain = model(x)
        torch.manual_seed(3)
        y_sft = sft(x)
        torch.testing.assert_close(y_sft, y_plain)
        model.eval()
        assert not torch.allclose(y_sft, model(x))
        torch.testing.assert_close(sft(x), model(x))


def test_two_forwards_then_backwards() -> None:
    """Each backward recomputes with the masks of its own forward, also when two forwards come first."""
    model, x, t = make(0.5)
    model.train()
    sft = SFT(model, tile_size=16, memory_budget="4GiB")
    grads = []
    for seed in (5, 6):  # plain: one step per seed
        torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), t).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    y1 = sft(x)
    torch.manual_seed(6)
    y2 = sft(x)
    torch.nn.functional.mse_loss(y1, t).backward()
    torch.nn.functional.mse_loss(y2, t).backward()
    for p, a, b in zip(model.parameters(), *grads, strict=True):
        torch.testing.assert_close(p.grad, a + b)
