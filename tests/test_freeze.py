"""model.freeze: frozen layers get no gradient and run forward-only in the executor; the rest is exactly plain
autograd's with the same layers frozen (float64, forced tile grids)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models import build
from wsitrain.models.freeze import FreezeSpec, apply_freeze, frozen_paths
from wsitrain.sft import SFT

F64 = {"rtol": 1e-10, "atol": 1e-11}


def _plain(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
    model.zero_grad(set_to_none=True)
    y = model(x)
    nn.functional.mse_loss(y, target).backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    return y.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


def _tiled(model: nn.Module, x: torch.Tensor, target: torch.Tensor, **kw) -> tuple[torch.Tensor, dict, dict, SFT]:
    model.zero_grad(set_to_none=True)
    m = SFT(model, memory_budget="4GiB", **kw)
    y = m(x)
    nn.functional.mse_loss(y, target).backward()
    grads = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    return y.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}, m


def _same(ref: tuple, var: tuple, frozen: set[str]) -> None:
    torch.testing.assert_close(var[0], ref[0], **F64)
    for name, g in ref[1].items():
        if name in frozen:
            assert g is None and var[1][name] is None, f"{name} is frozen but got a gradient"
        else:
            assert g is not None and var[1][name] is not None, f"{name} is trainable but got no gradient"
            torch.testing.assert_close(var[1][name], g, **F64)
    for name, b in ref[2].items():
        torch.testing.assert_close(var[2][name], b, **F64)


@pytest.mark.parametrize(
    ("name", "spec", "freeze_bn", "shape", "tile"),
    [
        ("tiny", FreezeSpec("conv2"), True, (2, 3, 45, 62), 16),
        ("tiny", FreezeSpec(modules=("features.conv3",)), True, (1, 3, 61, 38), 24),
        # trainable BatchNorm in training mode after a frozen stem and layer1: multi-pass segments, changed buffers
        ("resnet18", FreezeSpec("layer1"), False, (2, 3, 70, 97), 48),
        ("resnet18", FreezeSpec("layer2"), True, (1, 3, 83, 64), 32),
    ],
)
def test_frozen_exact(name: str, spec: FreezeSpec, freeze_bn: bool, shape: tuple[int, ...], tile: int) -> None:
    torch.manual_seed(0)
    model = build(name, 2, freeze_bn=freeze_bn, freeze=spec).double().train()
    frozen = set(model.frozen.parameters)
    assert frozen and all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    reference = copy.deepcopy(model)
    x = torch.rand(*shape, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(copy.deepcopy(model).eval()(x))
    ref = _plain(reference, x, target)
    var = _tiled(model, x, target, tile_size=tile)
    _same(ref, var, frozen)
    plan = var[3].plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert any(s.n_tiles > 1 for s in plan.segments), "the test must really tile"


def _saved_shapes(m: SFT, x: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of every tensor autograd saved for backward during one forward of ``m``."""
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    y.sum().backward()
    return saved


def test_frozen_segment_runs_forward_only() -> None:
    """A segment of frozen layers only: its tiles run forward once, with no recompute, no backward, nothing saved;
    the trainable segment after it recomputes and back-propagates as before."""
    torch.manual_seed(0)
    x = torch.rand(1, 3, 64, 80, dtype=torch.float64)
    counts = {}
    for frozen in (False, True):
        model = build("tiny", 2, freeze=FreezeSpec("pool2") if frozen else None).double().train()
        m = SFT(model, memory_budget="4GiB", tile_size=16, checkpoints=["features.pool2"])
        saved = _saved_shapes(m, x)
        stats = m.last_stats
        plan = m.plan_for(tuple(x.shape), input_dtype=torch.float64)
        first = plan.segments[0]
        assert first.mode == "tiled" and first.n_tiles > 1 and plan.segments[1].n_tiles > 1
        by_phase = {ph: {t.segment for t in stats.tiles if t.phase == ph} for ph in ("forward", "backward")}
        assert first.index in by_phase["forward"]
        counts[frozen] = (first.index in by_phase["backward"], tuple(x.shape) in saved, stats.recomputed_tiles)
        if frozen:
            n_first = sum(1 for t in stats.tiles if t.segment == first.index)
            assert n_first == first.n_tiles, "a frozen segment's tiles run forward exactly once"
    # unfrozen: the first segment is recomputed and back-propagated, and its input (the image) saved for that
    assert counts[False][0] and counts[False][1]
    assert not counts[True][0] and not counts[True][1]
    assert counts[True][2] < counts[False][2]


def test_freeze_names_checked() -> None:
    model = build("tiny", 2)
    with pytest.raises(WsiTrainError) as e:
        apply_freeze(model, FreezeSpec("layer2"))
    assert "no module 'layer2'" in e.value.message and "conv1" in (e.value.hint or "")
    with pytest.raises(WsiTrainError, match="freezes every parameter"):
        apply_freeze(build("tiny", 2), FreezeSpec("classifier"))
    with pytest.raises(WsiTrainError, match="freezes no parameter"):
        apply_freeze(build("tiny", 2), FreezeSpec(modules=("relu1",)))
    assert all(p.requires_grad for p in model.parameters()), "a failed freeze changes nothing"


def test_until_covers_the_prefix() -> None:
    model = build("resnet18", 2, freeze_bn=False)
    paths = frozen_paths(model, FreezeSpec("layer1"))
    assert "features.conv1" in paths and "features.layer1.1.bn2" in paths
    assert "features" not in paths and not any(p.startswith(("features.layer2", "classifier")) for p in paths)
    frozen = apply_freeze(model, FreezeSpec("layer1"))
    assert frozen is not None and frozen.modules[-1] == "features.layer1"
    # a frozen stage's BatchNorm keeps its running statistics even in train(); the trainable ones do not
    model.train()
    assert not model.features.layer1[0].bn1.training and model.features.layer2[0].bn1.training
