"""Small models with the operators of modern backbones: channels-last, channel shuffles, arithmetic, drop path.

Each exercises operators that are pointwise in space but are not convs or activations: ConvNeXt's
permute / LayerNorm / Linear / layer scale, ShuffleNetV2's chunk / cat / channel shuffle built from
``x.size()``, ``(x - mean) / std`` with buffers, and per-sample stochastic depth.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.convnext import CNBlock, LayerNorm2d
from torchvision.ops import StochasticDepth


def head(channels: int, classes: int = 3) -> list[tuple[str, nn.Module]]:
    return [("pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten(1)), ("fc", nn.Linear(channels, classes))]


class ChannelsLastBlock(nn.Module):
    """ConvNeXt block written out, layer scale in channels-last (timm style), a per-sample drop on the branch."""

    def __init__(self, dim: int, drop: nn.Module) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.empty(dim).uniform_(0.5, 1.5))  # non-trivial, so a wrong broadcast shows
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x)
        y = y.permute(0, 2, 3, 1)  # (B, H, W, C)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        y = y * self.gamma
        y = y.permute(0, 3, 1, 2)  # (B, C, H, W)
        return x + self.drop(y)


def convnext_like(timm_layers: bool = False) -> nn.Sequential:
    """Stem, a hand-written block, torchvision's CNBlock, LayerNorm2d + stride-2 downsample, another CNBlock.

    With ``timm_layers`` the hand-written block drops with timm's DropPath and the downsample norm is
    timm's LayerNorm2d (timm is an optional extra).
    """
    if timm_layers:
        from timm.layers import DropPath
        from timm.layers import LayerNorm2d as DownNorm

        drop: nn.Module = DropPath(0.0)
    else:
        DownNorm, drop = LayerNorm2d, StochasticDepth(0.0, "row")
    cn1 = CNBlock(8, layer_scale=1.0, stochastic_depth_prob=0.0)
    cn2 = CNBlock(12, layer_scale=1.0, stochastic_depth_prob=0.0)
    for blk in (cn1, cn2):
        with torch.no_grad():
            blk.layer_scale.uniform_(0.5, 1.5)
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        LayerNorm2d(8),
        ChannelsLastBlock(8, drop),
        cn1,
        DownNorm(8),
        nn.Conv2d(8, 12, 2, stride=2),
        cn2,
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(12)]))


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    """torchvision's ShuffleNetV2 channel shuffle: sizes from x.size(), a 5-D view, transpose, view back."""
    batchsize, num_channels, height, width = x.size()
    channels_per_group = num_channels // groups
    x = x.view(batchsize, groups, channels_per_group, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, num_channels, height, width)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit: split the channels (stride 1) or run two branches (stride 2), concatenate, shuffle."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        half = cout // 2
        b_in = cin if stride > 1 else cin // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(cin, cin, 3, stride, 1, groups=cin), nn.Conv2d(cin, half, 1), nn.ReLU()
            )
        self.branch2 = nn.Sequential(
            nn.Conv2d(b_in, half, 1),
            nn.ReLU(),
            nn.Conv2d(half, half, 3, stride, 1, groups=half),
            nn.Conv2d(half, half, 1),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class SplitShuffle(nn.Module):
    """Other channel regroupings: split, a channel slice, flatten(1, 2) of a 5-D view, reshape with -1."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, [4, x.shape[1] - 4], dim=1)
        b, c = b[:, :2], b[:, 2:]
        y = torch.cat([c, a * 0.5, b], 1)
        n, ch, h, w = y.shape
        y = y.reshape(n, 2, -1, h, w).transpose(1, 2).flatten(1, 2)
        return y + y.mean(1, keepdim=True)


def shuffle_like() -> nn.Sequential:
    trunk = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        ShuffleUnit(8, 8, 1),
        ShuffleUnit(8, 12, 2),
        ShuffleUnit(12, 12, 1),
        SplitShuffle(),
        nn.Conv2d(12, 12, 3, padding=1),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(12)]))


class Standardize(nn.Module):
    """``(x - mean) / std`` with per-channel buffers, traced (not a declared leaf), then scalar arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.2, -0.1, 0.3]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.9, 1.1, 1.3]).view(1, 3, 1, 1))
        self.scale = nn.Parameter(torch.tensor([1.5, 0.7, 1.2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / self.std
        x = x * self.scale.view(1, -1, 1, 1)  # a parameter reshaped: computed whole in every tile
        return 2.0 * x - 1.0


class Arith(nn.Module):
    """Scalar and element-wise arithmetic on a feature map: pow, neg, sub from a scalar, division, sqrt."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.pow(2) + 1.0
        return -x / torch.sqrt(y) + (1.0 - torch.sigmoid(x)) ** 2


def arith_net() -> nn.Sequential:
    trunk = nn.Sequential(
        Standardize(),
        nn.Conv2d(3, 6, 3, padding=1),
        Arith(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 6, 3, padding=1),
        Arith(),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(6)]))


class TransformInput(nn.Module):
    """GoogLeNet's transform_input: channels picked with x[:, k] (an int index), unsqueezed, rescaled, concatenated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = torch.unsqueeze(x[:, 0], 1) * (0.229 / 0.5) + (0.485 - 0.5) / 0.5
        x1 = torch.unsqueeze(x[:, 1], 1) * (0.224 / 0.5) + (0.456 - 0.5) / 0.5
        x2 = x[:, 2:3] * (0.225 / 0.5) + (0.406 - 0.5) / 0.5
        return torch.cat((x0, x1, x2), 1)


class InceptionReduction(nn.Module):
    """Inception's functional pools: a stride-2 unpadded conv beside F.max_pool2d, then F.avg_pool2d."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.conv(x), F.max_pool2d(x, kernel_size=3, stride=2)], 1)
        return F.avg_pool2d(y, kernel_size=3, stride=1, padding=1) + F.relu(y)


def functional_net() -> nn.Sequential:
    trunk = nn.Sequential(
        TransformInput(),
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        InceptionReduction(6),
        nn.Conv2d(12, 6, 3, padding=1),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(6)]))


class DropResidual(nn.Module):
    """A residual branch behind a per-sample drop (torchvision's StochasticDepth or timm's DropPath)."""

    def __init__(self, c: int, drop: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.act = nn.SiLU()
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.act(self.conv(x)))


def drop_net(p: float, mode: str = "row", timm_layers: bool = False) -> nn.Sequential:
    """Three dropped residual branches; with ``timm_layers`` the middle one uses timm's DropPath."""
    if timm_layers:
        from timm.layers import DropPath

        middle: nn.Module = DropPath(p)
    else:
        middle = StochasticDepth(p, mode)
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        DropResidual(6, StochasticDepth(p, mode)),
        nn.MaxPool2d(2),
        DropResidual(6, middle),
        DropResidual(6, StochasticDepth(p, mode)),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(6)]))


def dropout_net() -> nn.Sequential:
    """Element-wise Dropout inside the trunk: refused in training mode when tiling is needed."""
    trunk = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Dropout(0.3), nn.Conv2d(6, 6, 3, padding=1))
    return nn.Sequential(OrderedDict([("features", trunk), *head(6)]))


MODELS = {
    "convnext_like": convnext_like,
    "shuffle_like": shuffle_like,
    "arith": arith_net,
    "functional": functional_net,
}


class SELayer(nn.Module):
    """Squeeze-excitation as the SENet reference code writes it: pool, ``view(b, c)``, 2-D Linear layers,
    ``view(b, c, 1, 1)``, and ``x * y.expand_as(x)``, with the sizes read from ``x.size()``."""

    def __init__(self, c: int, reduction: int = 2) -> None:
        super().__init__()
        self.avg_pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Sequential(
            nn.Linear(c, c // reduction, bias=False),
            nn.ReLU(inplace=True),
            nn.Linear(c // reduction, c, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, _, _ = x.size()
        y = self.avg_pool(x).view(b, c)
        y = self.fc(y).view(b, c, 1, 1)
        return x * y.expand_as(x)


class MeanLinearSE(nn.Module):
    """Squeeze-excitation on (B, C): ``x.mean((2, 3))``, Linear layers, back with ``[:, :, None, None]``."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c, 3)
        self.fc2 = nn.Linear(3, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean((2, 3))))))
        return x * y[:, :, None, None]


class FlattenSE(nn.Module):
    """Squeeze-excitation on (B, C): ``adaptive_avg_pool2d(x, 1).flatten(1)``, back with two ``unsqueeze``,
    the scale on the left of the multiply."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c, 3)
        self.fc2 = nn.Linear(3, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.adaptive_avg_pool2d(x, 1).flatten(1)
        y = torch.sigmoid(self.fc2(F.relu(self.fc1(y))))
        return y.unsqueeze(-1).unsqueeze(-1) * x


class AddGate(nn.Module):
    """Not squeeze-excitation: the pooled (B, C) comes back by an add (a global context bias), which ends tiling."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, _, _ = x.size()
        return x + self.fc(x.mean((2, 3))).view(b, c, 1, 1)


SE_FORMS = {"selayer": SELayer, "mean_linear": MeanLinearSE, "flatten": FlattenSE}


def se_form_net(form: str) -> nn.Sequential:
    """Two squeeze-excitation blocks of one hand-written form, one before and one after a stride-2 conv."""
    se = SE_FORMS[form]
    trunk = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        se(6),
        nn.Conv2d(6, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        se(8),
        nn.Conv2d(8, 8, 3, padding=1),
    )
    return nn.Sequential(OrderedDict([("features", trunk), *head(8)]))


class ShuffledSE(nn.Module):
    """Squeeze-excitation whose ``b, c`` (from ``x.size()``) also shape a channel shuffle after it: the chain and
    the tiles both read them (the tiles' ``h, w`` are the tile's, the chain's ``b, c`` the image's)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc = nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.size()
        x = x * torch.sigmoid(self.fc(x.mean((2, 3)))).view(b, c, 1, 1)
        return x.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)


SE_FORMS["shuffled"] = ShuffledSE
