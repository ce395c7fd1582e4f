"""Multi-pass tiled segments: train-mode BatchNorm inside tiles equals plain autograd (float64).

Each case copies a model: one copy runs plain PyTorch, the other through SFT with forced tiles, on
the same input. Outputs, every parameter gradient, the input gradient and every buffer (running
mean, running variance, num_batches_tracked) must agree after one step.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torchvision.models import efficientnet_b0, mobilenet_v3_large, regnet_y_800mf, resnet18
from torchvision.models.resnet import BasicBlock
from torchvision.ops import SqueezeExcitation, StochasticDepth

from wsitrain.sft import SFT
from wsitrain.sft.execution.multipass import MultiPassSegment
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph

F64 = {"rtol": 1e-10, "atol": 1e-11}


def _head(c: int) -> list[tuple[str, nn.Module]]:
    return [("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)), ("fc", nn.Linear(c, 3))]


def bn_chain() -> nn.Module:
    """conv-BN-ReLU three times with a stride-2 conv between; one BN with momentum=None (cumulative)."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8, momentum=None),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8, momentum=0.3),
        nn.ReLU(),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *_head(8)]))


def bn_blocks() -> nn.Module:
    """torchvision BasicBlocks with train BN: an identity block and one with a stride-2 1x1 downsample,
    whose BN reads only even positions of the block input (the odd ones still get a gradient)."""
    down = nn.Sequential(nn.Conv2d(8, 12, 1, 2, bias=False), nn.BatchNorm2d(12))
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        BasicBlock(8, 8),
        BasicBlock(8, 12, 2, down),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *_head(12)]))


class MBConv(nn.Module):
    """An MBConv-like block (expand, depthwise, squeeze-excitation, project) with a residual."""

    def __init__(self, c: int, e: int, stride: int = 1) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(c, e, 1, bias=False),
            nn.BatchNorm2d(e),
            nn.SiLU(),
            nn.Conv2d(e, e, 3, stride, 1, groups=e, bias=False),
            nn.BatchNorm2d(e),
            nn.SiLU(),
            SqueezeExcitation(e, max(1, e // 4)),
            nn.Conv2d(e, c, 1, bias=False),
            nn.BatchNorm2d(c),
        )
        self.residual = stride == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class MeanGate(nn.Module):
    """Squeeze-excitation written as timm does: a mean over (H, W) keeping dims, a 1x1 conv, a sigmoid."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.fc(x.mean((2, 3), keepdim=True)))


def se_blocks() -> nn.Module:
    trunk = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.SiLU(), MBConv(8, 16), MBConv(8, 24, 2))
    return nn.Sequential(OrderedDict([("features", trunk), *_head(8)]))


def _randomize_bn(model: nn.Module) -> None:
    """Non-trivial affine parameters and running statistics, so a wrong update shows."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d) and m.running_mean is not None:
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            m.num_batches_tracked.fill_(3)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)


def step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, list, torch.Tensor, list]:
    """One training step's results: output, parameter gradients, input gradient, buffers after it."""
    xr = x.detach().clone().requires_grad_()
    y = model(xr)
    torch.nn.functional.mse_loss(y, target).backward()
    inner = model.model if isinstance(model, SFT) else model
    return y.detach(), [p.grad for p in inner.parameters()], xr.grad, [b.clone() for b in inner.buffers()]


def check(make, shape: tuple[int, ...], seed: int = 0, train: bool = True, **sft_kw) -> SFT:
    torch.manual_seed(seed)
    model = make().double().train(train)
    _randomize_bn(model)
    twin = copy.deepcopy(model)
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(copy.deepcopy(model)(x))
    ref = step(model, x, target)
    sft = SFT(twin, **sft_kw)
    var = step(sft, x, target)
    torch.testing.assert_close(var[0], ref[0], **F64)
    names = [n for n, _ in model.named_parameters()]
    for n, a, b in zip(names, ref[1], var[1], strict=True):
        torch.testing.assert_close(b, a, **F64, msg=lambda m, n=n: f"{n}: {m}")
    torch.testing.assert_close(var[2], ref[2], **F64)
    bnames = [n for n, _ in model.named_buffers()]
    for n, a, b in zip(bnames, ref[3], var[3], strict=True):
        torch.testing.assert_close(b, a, **F64, msg=lambda m, n=n: f"{n}: {m}")
    return sft


def multipass_segments(sft: SFT) -> list[MultiPassSegment]:
    compiled = next(iter(sft._cache.values()))  # the plan the training step ran
    return [s for s in compiled.segments if isinstance(s, MultiPassSegment)]


@pytest.mark.parametrize("tile", [16, 24])
def test_bn_chain_forced_tiles(tile: int) -> None:
    sft = check(bn_chain, (2, 3, 45, 62), tile_size=tile, memory_budget="4GiB")
    segs = multipass_segments(sft)
    assert segs and all(s.regions.grid[0] * s.regions.grid[1] > 1 for s in segs), "must really tile"


def test_bn_chain_one_segment_three_levels() -> None:
    """All three BatchNorms in one tiled segment: three statistics sweeps, each needing the one before."""
    torch.manual_seed(0)
    names = [f"features.{i}" for i in (2,)]
    sft = check(bn_chain, (2, 3, 45, 62), tile_size=16, memory_budget="4GiB", checkpoints=names)
    levels = sorted(b.level for s in multipass_segments(sft) for b in s.barriers)
    assert levels == [1, 1, 2], levels


def test_basic_blocks_with_downsample() -> None:
    """Residual blocks with train BN, a stride-2 1x1 downsample, the whole trunk as one tiled segment."""
    torch.manual_seed(1)
    facts = annotate(ModelGraph(bn_blocks()), (2, 3, 45, 62), torch.float64, torch.float64, True)
    sft = check(bn_blocks, (2, 3, 45, 62), seed=1, tile_size=16, memory_budget="4GiB", checkpoints=[])
    (seg,) = multipass_segments(sft)
    assert len(seg.barriers) == 6 and seg.regions.grid == (3, 4)
    # the block's main-branch BN and its downsample BN do not depend on each other: one sweep
    by_level = {}
    for b in seg.barriers:
        by_level.setdefault(b.level, []).append(facts.name(b.node))
    assert "features.4.downsample.1" in by_level[4] and "features.4.bn1" in by_level[4], by_level
    sft = check(bn_blocks, (2, 3, 45, 62), seed=2, tile_size=24, memory_budget="4GiB")
    assert multipass_segments(sft)


def test_resnet18_train_bn_under_budget() -> None:
    """resnet18 with train-mode BatchNorm under a budget that forces tiling equals plain, running stats too."""
    shape = (1, 3, 160, 192)
    model = resnet18(num_classes=3).double().train()
    probe = SFT(model, memory_budget="4GiB").plan_for(shape)
    fixed = sum(probe.breakdown[k] for k in ("parameters", "runtime", "gradients"))
    budget = int(fixed + 0.95 * (probe.baseline_peak_bytes - fixed))
    sft = check(lambda: resnet18(num_classes=3), shape, seed=3, memory_budget=budget)
    plan = sft.plan_for(shape)
    assert plan.fits and plan.estimated_peak_bytes <= budget
    assert multipass_segments(sft), f"the budget must force tiling through BatchNorm:\n{plan}"


@pytest.mark.parametrize("train", [False, True])
def test_squeeze_excitation_blocks(train: bool) -> None:
    """Squeeze-excitation inside tiles (eval BN; and with train BN, whose statistics then interleave with it)."""
    sft = check(se_blocks, (2, 3, 45, 62), seed=4, train=train, tile_size=16, memory_budget="4GiB", checkpoints=[])
    (seg,) = multipass_segments(sft)
    kinds = [b.kind for b in seg.barriers]
    assert kinds.count("squeeze") == 2 and seg.regions.grid[0] * seg.regions.grid[1] > 1
    assert kinds.count("batchnorm") == (7 if train else 0)
    facts = annotate(ModelGraph(se_blocks()), (2, 3, 45, 62), torch.float32, torch.float32)
    assert facts.name(facts.trunk_end) == "features.4.block.8", "the SE pools do not end the trunk"


def _efficientnet_b0() -> nn.Module:
    """torchvision's EfficientNet-B0, StochasticDepth replaced by what it is in eval (identity).

    StochasticDepth is traced as a function the engine does not tile yet (another item of the same issue).
    """
    model = efficientnet_b0(num_classes=3)
    for mod in list(model.modules()):
        for k, child in list(mod.named_children()):
            if isinstance(child, StochasticDepth):
                setattr(mod, k, nn.Identity())
    return model


def _regnet_y_800mf() -> nn.Module:
    return regnet_y_800mf(num_classes=3)


def _mobilenet_v3_large() -> nn.Module:
    return mobilenet_v3_large(num_classes=3)


@pytest.mark.parametrize(
    ("make", "min_squeezed"), [(_efficientnet_b0, 2), (_regnet_y_800mf, 2), (_mobilenet_v3_large, 0)]
)
def test_squeeze_excitation_nets_eval_at_45_percent(make, min_squeezed: int) -> None:
    """EfficientNet-B0, RegNetY-800MF and MobileNetV3-Large (squeeze-excitation blocks) at 240 x 272 px within
    45% of plain's activation memory fit with tiled segments and are exact. The first two need
    squeeze-excitation blocks inside tiled segments; MobileNetV3's plan cuts around them (its time model
    prefers running them plain at this budget: measured 1.5-1.7x plain's step against 3.0x with them tiled)."""
    shape = (1, 3, 240, 272)
    # BatchNorm unfolded: 45% of plain's activations with BatchNorm as it is (folded, the step also holds a copy of
    # every folded convolution's weight, which does not shrink with tiling: ops/fold_bn.py)
    probe = SFT(make().double(), memory_budget="8GiB", fold_bn=False).plan_for(shape)
    fixed = sum(probe.breakdown[k] for k in ("parameters", "runtime", "gradients"))
    budget = int(fixed + 0.45 * (probe.baseline_peak_bytes - fixed))
    sft = check(make, shape, seed=5, train=False, memory_budget=budget, fold_bn=False)
    plan = next(iter(sft._cache.values())).plan
    assert plan.fits and plan.estimated_peak_bytes <= budget
    squeezed = [b for s in multipass_segments(sft) for b in s.barriers if b.kind == "squeeze"]
    assert len(squeezed) >= min_squeezed, f"squeeze-excitation blocks must run tiled:\n{plan}"
    assert any(s.mode == "tiled" for s in plan.segments), f"the budget must force tiling:\n{plan}"


def gated_no_running_stats() -> nn.Module:
    """BatchNorm without running statistics (batch statistics even in eval) and a mean-based gate."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6, track_running_stats=False),
        nn.ReLU(),
        MeanGate(6),
        nn.Conv2d(6, 8, 3, stride=2, padding=1),
        nn.ReLU(),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *_head(8)]))


def test_batch_statistics_without_running_stats_and_mean_gate() -> None:
    sft = check(gated_no_running_stats, (2, 3, 45, 62), seed=6, train=False, tile_size=16, memory_budget="4GiB")
    kinds = sorted(b.kind for s in multipass_segments(sft) for b in s.barriers)
    assert kinds == ["batchnorm", "squeeze"], kinds


@pytest.mark.parametrize("make", [bn_chain, se_blocks])
def test_bf16_autocast_as_accurate_as_plain(make) -> None:
    """Under bf16 autocast the sweeps lose no more than plain autograd does against a float64 reference:
    BatchNorm's explicit gradient and its statistic's correction nearly cancel, so they must meet in float32."""
    torch.manual_seed(7)
    model = make().train()
    _randomize_bn(model)
    twin, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(2, 3, 45, 62)
    ref(x.double()).square().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().square().sum().backward()
        SFT(twin, tile_size=16, memory_budget="4GiB", checkpoints=[])(x).float().square().sum().backward()
    assert_bf16_no_worse(ref, model, twin)


def assert_bf16_no_worse(ref: nn.Module, plain: nn.Module, tiled: nn.Module) -> None:
    """Every parameter gradient of the tiled bf16 step is as close to the float64 reference's as plain bf16's."""
    for (n, r), a, b in zip(ref.named_parameters(), plain.parameters(), tiled.parameters(), strict=True):
        scale = r.grad.abs().max().item()
        if scale < 1e-6:  # a conv bias before BatchNorm: its true gradient is zero, both are round-off
            continue
        err_plain = (a.grad.double() - r.grad).abs().max().item() / scale
        err_sft = (b.grad.double() - r.grad).abs().max().item() / scale
        # bf16 round-off depends on summation order (tiles sum differently), so allow 2x; adding BatchNorm's
        # correction in bf16 instead of float32 made it 5.6x
        assert err_sft <= 2.0 * err_plain + 0.01, f"{n}: bf16 error {err_sft:.3g} against plain's {err_plain:.3g}"


def test_hooks_see_the_sweeps_output_and_input_gradient() -> None:
    """The trunk observer gets the output sweep's tiles and the input-gradient sink the last sweep's shares."""
    torch.manual_seed(8)
    model = bn_chain().double().train()
    _randomize_bn(model)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref_trunk = model.features(xr)
    model.fc(model.flatten(model.pool(ref_trunk))).square().sum().backward()
    sft = SFT(twin, tile_size=16, memory_budget="4GiB", checkpoints=[])
    trunk = torch.zeros_like(ref_trunk)
    grad = torch.zeros_like(x)

    def observe(t: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        trunk[:, :, rows[0] : rows[1], cols[0] : cols[1]] = t

    def sink(g: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        grad[:, :, rows[0] : rows[1], cols[0] : cols[1]] += g

    with sft.observe_trunk(observe), sft.input_gradient_sink(sink):
        sft(x.clone().requires_grad_()).square().sum().backward()
    assert multipass_segments(sft)
    torch.testing.assert_close(trunk, ref_trunk.detach(), **F64)
    torch.testing.assert_close(grad, xr.grad, **F64)
