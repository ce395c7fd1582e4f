"""No bare internal error for a user's model: unused layers (DLA's `project` shortcut) and engine slips.

A node nobody reads is dropped at trace time when running it changes nothing; one that changes state (a
BatchNorm's running statistics) is refused by name. An inconsistency inside planning or compiling becomes an
``InternalEngineError`` (a PlanError) naming the layer being processed, with the original error chained.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from sft_models import head
from torch import nn

from wsitrain.errors import InternalEngineError, PlanError
from wsitrain.sft import SFT, plan
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.trail import WHERE


class UnusedBranch(nn.Module):
    """A block that computes a shortcut and never reads it (timm's DlaTree does this with `project`)."""

    def __init__(self, c: int, unused: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.project = unused
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bottom = self.pool(x)
        shortcut = self.project(bottom)  # noqa: F841 - unused on purpose
        _ = bottom * 2  # an unused function call too
        return torch.relu(self.conv(bottom))


def _net(unused: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), UnusedBranch(6, unused), nn.Conv2d(6, 8, 3))
    return nn.Sequential(OrderedDict([("features", trunk), *head(8)])).double().eval()


@pytest.mark.parametrize("unused", [nn.Identity(), nn.Conv2d(6, 6, 1)], ids=["identity", "conv"])
def test_unused_layers_are_dropped_and_tiles_are_exact(unused: nn.Module) -> None:
    plain = _net(unused)
    tiled = copy.deepcopy(plain)
    x = torch.rand(2, 3, 40, 56, dtype=torch.float64, requires_grad=True)
    xt = x.detach().clone().requires_grad_(True)
    plain(x).square().sum().backward()
    engine = SFT(tiled, tile_size=16, memory_budget="1GiB")
    y = engine(xt)
    y.square().sum().backward()
    torch.testing.assert_close(y, plain(x), rtol=1e-13, atol=0)
    torch.testing.assert_close(xt.grad, x.grad, rtol=1e-13, atol=1e-15)
    for p, q in zip(plain.parameters(), tiled.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-14)
    assert any(s.mode == "tiled" and s.n_tiles > 1 for s in engine.plan_of(xt).segments)
    assert all("project" not in g.name for g in ModelGraph(plain).nodes)


def test_unused_layer_with_state_is_refused_by_name() -> None:
    """An unused BatchNorm still updates its running statistics in train mode: it is kept, and refused."""
    with pytest.raises(PlanError, match=r"features\.2\.project") as info:
        plan(_net(nn.BatchNorm2d(6)), (1, 3, 64, 64), "1GiB", tile_size=16)
    assert not isinstance(info.value, InternalEngineError)
    assert "nothing reads its output" in info.value.message


def test_internal_error_in_planning_names_the_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyError deep in the tile regions becomes a PlanError naming the layer, the original chained."""
    import wsitrain.sft.planning.tile_memory as tm

    model = _net(nn.Identity())
    graph = ModelGraph(model)
    target = next(g.index for g in graph.nodes if g.name == "features.2.conv")
    original = tm.axis_tile

    class Broken(dict):
        def __getitem__(self, u: int) -> object:
            if u == target:
                raise KeyError(u)
            return super().__getitem__(u)

    def broken(nodes, seg_input, inputs, specs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return original(nodes, seg_input, inputs, Broken(specs), *args, **kwargs)

    monkeypatch.setattr(tm, "axis_tile", broken)
    before = (WHERE.node, WHERE.segment)  # planning outside a guarded block (plan() in other tests) may leave one
    with pytest.raises(InternalEngineError, match=r"at layer 'features\.2\.conv'") as info:
        SFT(model, tile_size=16, memory_budget="1GiB").plan_for((1, 3, 64, 64))
    err = info.value
    assert isinstance(err, PlanError) and err.exit_code == 2
    assert isinstance(err.__cause__, KeyError)
    assert "bug in wsitrain" in (err.hint or "") and "in the segment after" in err.message
    assert (WHERE.node, WHERE.segment) == before, "the trail is restored after the error"
    with pytest.raises(InternalEngineError, match=r"features\.2\.conv"):
        plan(model, (1, 3, 64, 64), "1GiB", tile_size=16)


def test_internal_error_in_annotation_is_a_plan_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import wsitrain.sft.facts as facts

    def broken(*args: object) -> None:
        raise IndexError("list index out of range")

    monkeypatch.setattr(facts, "mark_barriers", broken)
    with pytest.raises(InternalEngineError, match=r"planning Sequential on input \(1, 3, 64, 64\)") as info:
        plan(_net(nn.Identity()), (1, 3, 64, 64), "1GiB")
    assert isinstance(info.value.__cause__, IndexError)


def test_user_errors_pass_through_unchanged() -> None:
    """A PlanError for the user (here a bad tile size) is not turned into an internal error."""
    with pytest.raises(PlanError, match="tile_size 0") as info:
        plan(_net(nn.Identity()), (1, 3, 64, 64), "1GiB", tile_size=0)
    assert not isinstance(info.value, InternalEngineError)


class Branchy(nn.Module):
    """Control flow on a traced value (timm's VGG ConvMlp compares x.shape[-2] with its input size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x


def test_untraceable_layer_is_named() -> None:
    model = _net(nn.Identity())
    model.features[2].project = Branchy()
    model.features[2].forward = lambda x: model.features[2].project(x)  # the branchy layer really runs
    with pytest.raises(PlanError, match=r"cannot trace Sequential with torch\.fx in layer features\.2\.project "
                       r"\(Branchy\): symbolically traced variables cannot be used as inputs to control flow"):
        ModelGraph(model)
