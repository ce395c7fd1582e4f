"""Frozen BatchNorm folded into its convolution (wsitrain/sft/ops/fold_bn.py): the step equals plain autograd on the
unfolded model (float64: outputs, every parameter gradient, the input gradient), no BatchNorm kernel runs, checkpoints
keep the original parameters, and train-mode BatchNorm is left alone."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torchvision
from sft_models import small_resnet
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from wsitrain.models import build, freeze_batchnorm
from wsitrain.models.freeze import FreezeSpec, apply_freeze
from wsitrain.sft import SFT
from wsitrain.sft.graph import ModelGraph

F64 = {"rtol": 1e-10, "atol": 1e-11}


class OpCounter(TorchDispatchMode):
    """Counts the aten operators a block runs on real tensors (forward and backward; planning's shape propagation
    on meta tensors runs the unfolded layers and is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if not any(a.device.type == "meta" for a in flat):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def batch_norms(self) -> int:
        return sum(n for op, n in self.ops.items() if "batch_norm" in op)


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial statistics and affine parameters, so a wrong fold (or border) shows."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 1.5)
                if m.affine:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
    return model


def _step(net: nn.Module, params: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple:
    """One step of ``net`` (the model or its SFT); returns the output, every parameter's gradient and the input's."""
    params.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_()
    y = net(xr)
    nn.functional.mse_loss(y, target).backward()
    return y.detach(), {n: p.grad for n, p in params.named_parameters()}, xr.grad


def _assert_same(ref: tuple, var: tuple) -> None:
    torch.testing.assert_close(var[0], ref[0], **F64)
    assert ref[1].keys() == var[1].keys()
    for n, g in ref[1].items():
        if g is None:
            assert var[1][n] is None, f"{n} got a gradient plain autograd does not give"
        else:
            assert var[1][n] is not None, f"{n} got no gradient"
            torch.testing.assert_close(var[1][n], g, **F64, msg=lambda m, n=n: f"{n}: {m}")
    torch.testing.assert_close(var[2], ref[2], **F64)


def _check(model: nn.Module, shape: tuple[int, ...], tile: int) -> SFT:
    """The folded SFT step equals plain autograd on the unfolded model, really tiled, with no BatchNorm kernel."""
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    ref = _step(model, model, x, target)
    sft = SFT(model, memory_budget="4GiB", tile_size=tile)
    assert sft._graph.fold_pairs(), "the model must hold folding pairs"
    with OpCounter() as ops:
        var = _step(sft, model, x, target)
    _assert_same(ref, var)
    assert ops.batch_norms() == 0, f"a BatchNorm kernel ran with the fold on: {ops.ops}"
    plan = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert any(s.n_tiles > 1 for s in plan.segments), "the test must really tile"
    return sft


@pytest.mark.parametrize(("tile", "shape"), [(16, (2, 3, 45, 62)), (24, (1, 3, 53, 41)), (32, (2, 3, 90, 75))])
def test_small_resnet_bottleneck_exact(tile: int, shape: tuple[int, ...]) -> None:
    """Bottleneck blocks with downsampling shortcuts (conv -> BatchNorm inside a shortcut Sequential), several grids,
    ragged last tiles, batch 1 and 2."""
    torch.manual_seed(0)
    _check(freeze_batchnorm(small_resnet(bottleneck=True).double()), shape, tile)


def test_torchvision_resnet18_exact() -> None:
    """torchvision's ResNet-18 as it builds it (eval-mode BatchNorm, not frozen by wsitrain), batch 2, ragged tiles."""
    torch.manual_seed(0)
    model = _randomize_bn(torchvision.models.resnet18(num_classes=3)).double().eval()
    sft = _check(model, (2, 3, 97, 131), 32)
    assert len(sft._graph.fold_pairs()) == 20  # every convolution of ResNet-18 is followed by its BatchNorm


def test_builtin_darknet19_exact() -> None:
    """wsitrain's built-in DarkNet-19 (frozen BatchNorm after each convolution, LeakyReLU in place after it)."""
    torch.manual_seed(0)
    model = _randomize_bn(build("darknet19", 2)).double()
    _check(model, (1, 3, 150, 97), 48)


def test_timm_batchnorm_act_exact() -> None:
    """timm's MobileNetV3 (BatchNormAct2d: the activation stays after the folded convolution; squeeze-excitation
    segments run in sweeps), frozen, batch 2."""
    pytest.importorskip("timm", reason="timm is an optional extra; the `test` extra installs it")
    torch.manual_seed(0)
    model = _randomize_bn(build("timm/mobilenetv3_small_050", 2)).double()
    assert any(type(m).__name__.endswith("BatchNormAct2d") for m in model.modules())
    _check(model, (2, 3, 80, 112), 32)


def test_fold_off_runs_batchnorm_and_agrees() -> None:
    """``fold_bn=False``: every BatchNorm runs (the comparison the engine.fold_bn key offers), the same step."""
    torch.manual_seed(0)
    model = freeze_batchnorm(small_resnet().double())
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)
    target = torch.randn_like(model(x))
    ref = _step(model, model, x, target)
    sft = SFT(model, memory_budget="4GiB", tile_size=16, fold_bn=False)
    assert sft._graph.fold_pairs() == {}
    with OpCounter() as ops:
        var = _step(sft, model, x, target)
    _assert_same(ref, var)
    assert ops.batch_norms() > 0


def test_plain_segments_and_predict_fold() -> None:
    """Untiled plans fold too (a plain segment runs the folded convolution through autograd), and so does a forward
    without gradients (predict)."""
    torch.manual_seed(0)
    model = freeze_batchnorm(small_resnet(bottleneck=True).double())
    x = torch.randn(1, 3, 45, 62, dtype=torch.float64)
    target = torch.randn_like(model(x))
    ref = _step(model, model, x, target)
    sft = SFT(model, memory_budget="4GiB")
    assert all(s.mode == "plain" for s in sft.plan_for(tuple(x.shape), input_dtype=torch.float64).segments)
    with OpCounter() as ops:
        var = _step(sft, model, x, target)
    _assert_same(ref, var)
    assert ops.batch_norms() == 0
    tiled = SFT(model, memory_budget="4GiB", tile_size=16)
    with torch.no_grad(), OpCounter() as ops:
        torch.testing.assert_close(tiled(x), model(x), **F64)
    assert ops.ops["native_batch_norm"] + ops.ops["_native_batch_norm_legit_no_training"] > 0  # the model's own
    with torch.no_grad(), OpCounter() as ops:
        tiled(x)
    assert ops.batch_norms() == 0


def test_state_dict_keeps_original_parameters() -> None:
    """The fold never writes into the model: after a step and an optimizer update the state dict has the same keys,
    the BatchNorm statistics are untouched and the update is plain PyTorch's."""
    torch.manual_seed(0)
    model = freeze_batchnorm(small_resnet().double())
    twin = copy.deepcopy(model)
    x = torch.randn(1, 3, 45, 62, dtype=torch.float64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for net, params in ((SFT(model, memory_budget="4GiB", tile_size=16), model), (twin, twin)):
        opt = torch.optim.SGD(params.parameters(), lr=0.1)
        net(x).square().sum().backward()
        opt.step()
    after, plain = model.state_dict(), twin.state_dict()
    assert after.keys() == before.keys()
    for k in after:
        if "running" in k or "num_batches" in k:
            assert torch.equal(after[k], before[k]), k
        torch.testing.assert_close(after[k], plain[k], **F64)


def test_train_mode_batchnorm_untouched() -> None:
    """A BatchNorm normalising with batch statistics never folds (and then nothing in the model folds): the step,
    its running statistics included, is plain PyTorch's and BatchNorm kernels run."""
    torch.manual_seed(0)
    model = small_resnet().double().train()
    twin = copy.deepcopy(model)
    assert ModelGraph(model).fold_pairs() == {}
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)
    target = torch.randn_like(copy.deepcopy(model)(x))
    ref = _step(twin, twin, x, target)
    sft = SFT(model, memory_budget="4GiB")
    with OpCounter() as ops:
        var = _step(sft, model, x, target)
    _assert_same(ref, var)
    assert ops.batch_norms() > 0
    for (n, a), b in zip(twin.named_buffers(), model.buffers(), strict=True):
        torch.testing.assert_close(b, a, **F64, msg=n)
    model.eval()  # the same model in eval mode folds: plans and folds follow the modes
    assert len(ModelGraph(model).fold_pairs()) == len(sft._graph.fold_pairs()) > 0


def test_batchnorm_before_convolution_left() -> None:
    """DenseNet's norm -> relu -> conv: a BatchNorm that reads a concatenation (or anything but a convolution read by
    it alone) stays; its convolution -> BatchNorm pairs fold."""
    model = torchvision.models.densenet121(num_classes=2).eval()
    graph = ModelGraph(model)
    pairs = graph.fold_pairs()
    names = {graph.nodes[b].name for b in pairs.values()}
    assert "features.norm0" in names and "features.denseblock1.denselayer1.norm2" in names
    assert "features.denseblock1.denselayer1.norm1" not in names and "features.transition1.norm" not in names
    bns = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert len(pairs) == 1 + 58  # norm0 and every dense layer's norm2; the 58 + 3 + 1 others read concatenations
    assert bns == 1 + 58 * 2 + 3 + 1


def test_shared_output_not_folded() -> None:
    """A convolution whose output another layer also reads (its pre-BatchNorm value escapes) is left unfolded."""

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.conv(x)
            return self.bn(y) + y

    assert ModelGraph(Branch().eval()).fold_pairs() == {}


def test_model_freeze_folds_without_gradients() -> None:
    """model.freeze: a frozen stem (convolution and BatchNorm without gradients) folds under no gradient, the rest
    trains exactly as plain autograd with the same layers frozen."""
    torch.manual_seed(0)
    model = _randomize_bn(build("resnet18", 2)).double()
    apply_freeze(model, FreezeSpec(modules=("features.conv1", "features.bn1")))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen, "the spec must freeze something"
    torch.manual_seed(1)
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    target = torch.randn_like(model(x))
    ref = _step(model, model, x, target)
    sft = SFT(model, memory_budget="4GiB", tile_size=16)
    var = _step(sft, model, x, target)
    _assert_same(ref, var)
    assert all(var[1][n] is None for n in frozen)


def test_engine_fold_bn_key_reaches_the_engine() -> None:
    """``engine.fold_bn`` (default true) is what fit's and predict's engine runs with; an unknown value is refused."""
    from pydantic import ValidationError

    from wsitrain.config import EngineConfig
    from wsitrain.train.engine import wrap_engine

    assert EngineConfig().fold_bn is True
    model = freeze_batchnorm(small_resnet())
    for on in (True, False):
        sft = wrap_engine(model, EngineConfig(fold_bn=on), torch.device("cpu"), 1 << 30, None)
        assert sft.fold_bn is on and bool(sft._graph.fold_pairs()) is on
    with pytest.raises(ValidationError):
        EngineConfig(fold_bn="sometimes")
