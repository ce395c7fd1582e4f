"""Small models for the engine's exactness tests: each exercises one structure the engine must tile."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck


def head(channels: int, classes: int = 3) -> list[tuple[str, nn.Module]]:
    return [("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)), ("fc", nn.Linear(channels, classes))]


def vgg_chain() -> nn.Sequential:
    """VGG-style: 3x3 convs with in-place ReLU (as torchvision defines them) and max pools."""
    layers: list[nn.Module] = []
    c = 3
    for v in (6, "M", 8, 8, "M", 12, 12, "M", 16):
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU(inplace=True)]
            c = int(v)
    return nn.Sequential(OrderedDict([("features", nn.Sequential(*layers)), *head(c)]))


def small_resnet(bottleneck: bool = False) -> nn.Sequential:
    """torchvision residual blocks (frozen BatchNorm) with a stride-2 stem and downsampling blocks."""

    def block(cin: int, planes: int, stride: int) -> nn.Module:
        cls = Bottleneck if bottleneck else BasicBlock
        cout = planes * cls.expansion
        down = None
        if stride != 1 or cin != cout:
            down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        return cls(cin, planes, stride, down)

    e = Bottleneck.expansion if bottleneck else 1
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 7, 2, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        block(8, 8, 1),
        block(8 * e, 8, 2),
        block(8 * e, 16, 2),
    )
    model = nn.Sequential(OrderedDict([("features", trunk), *head(16 * e)]))
    for m in model.modules():  # non-trivial frozen statistics, so a wrong border shows
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model.eval()


class DenseBlock(nn.Module):
    """Channel concatenation of every earlier output, as in DenseNet."""

    def __init__(self, cin: int, growth: int, n: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(cin + k * growth, growth, 3, padding=1) for k in range(n))
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [x]
        for conv in self.convs:
            feats.append(self.act(conv(torch.cat(feats, 1))))
        return torch.cat(feats, 1)


def dense_net() -> nn.Sequential:
    trunk = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GELU(),
        DenseBlock(4, 3, 3),
        nn.AvgPool2d(2),
        nn.Conv2d(13, 6, 1),
        nn.Tanh(),
        DenseBlock(6, 2, 2),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(10)]))


def odd_ops() -> nn.Sequential:
    """Stride-2, dilated, grouped, even and non-square kernels, 'same' and reflect padding, ceil-mode pools."""
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, (3, 5), stride=(1, 2), padding=(1, 2)),
        nn.LeakyReLU(0.1, inplace=True),
        nn.Conv2d(6, 6, 3, padding=2, dilation=2, groups=3),
        nn.Hardswish(),
        nn.MaxPool2d(3, 2, padding=1, ceil_mode=True),
        nn.Conv2d(6, 8, 2, padding="same"),
        nn.Sigmoid(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, padding_mode="reflect"),
        nn.ReLU6(),
        nn.AvgPool2d(3, 2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.Conv2d(8, 8, 5, padding=2, groups=8),
        nn.ELU(),
        nn.Dropout(0.0),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(8)]))


class MulGate(nn.Module):
    """Elementwise product of two aligned branches (squeeze-free gating)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * torch.sigmoid(self.b(x)) + x


def gated_net() -> nn.Sequential:
    trunk = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), MulGate(5), nn.MaxPool2d(2), MulGate(5))
    return nn.Sequential(OrderedDict([("features", trunk), *head(5)]))


MODELS = {
    "vgg_chain": vgg_chain,
    "resnet_basic": small_resnet,
    "resnet_bottleneck": lambda: small_resnet(bottleneck=True),
    "dense": dense_net,
    "odd_ops": odd_ops,
    "gated": gated_net,
}


def seeded_case(
    build: Callable[[], nn.Module], shape: tuple[int, ...], seed: int = 0
) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A float64 model from ``build`` with seeded weights, an input that wants its gradient, and a regression target
    of the output's shape: the reference-vs-variant tests' common start."""
    torch.manual_seed(seed)
    model = build().double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    return model, x, target


def weighted_step(model: nn.Module, net: nn.Module, x: torch.Tensor) -> tuple:
    """One backward of ``net`` (``model`` or an engine around it) under a fixed non-uniform output weighting: the
    output, every parameter gradient and the input gradient, cloned (the reference-vs-variant tests compare them)."""
    model.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    y = net(xr)
    (y * torch.linspace(0.5, 1.5, y.shape[-1], dtype=y.dtype)).sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad


def tied_trunk() -> nn.Sequential:
    """Convs with a constant channel (weights 0, bias 0.3, after ReLU): every position ties in it, the case where a
    max or top-k pool must pick positions exactly as plain PyTorch does. Seeded; float32 (call ``.double()``)."""
    torch.manual_seed(0)
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 5, 3, padding=1), nn.ReLU()
    )
    with torch.no_grad():
        trunk[3].weight[0].zero_()
        trunk[3].bias[0] = 0.3
    return trunk
