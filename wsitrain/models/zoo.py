"""Model builders: every model is one plain ``nn.Sequential`` chain the SFT engine can trace.

Layout: ``normalize -> features (trunk) -> pool -> flatten -> classifier``. A plain Sequential (not a
subclass) so slicing ``model[:2]`` works and torch.fx sees a straight chain; ``model.name`` and
``model.stride`` (the trunk's total downsampling) are plain attributes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models.darknet import darknet19_features
from wsitrain.models.frozen_bn import freeze_batchnorm
from wsitrain.models.normalize import InputNormalization
from wsitrain.models.weights import load_weights

MODEL_NAMES = ("tiny", "vgg16", "vgg19", "darknet19", "resnet18", "resnet34", "resnet50")
POOLS = ("avg", "max")


def _tiny_features() -> nn.Sequential:
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    widths = (3, 8, 16, 32, 32)
    for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:], strict=True), start=1):
        layers[f"conv{i}"] = nn.Conv2d(cin, cout, 3, padding=1)
        layers[f"relu{i}"] = nn.ReLU(inplace=True)
        layers[f"pool{i}"] = nn.MaxPool2d(2, 2)
    return nn.Sequential(layers)


def _torchvision(name: str) -> nn.Module:
    # Imported here: torchvision takes seconds to import, and tiny/darknet19 (tests, bench workers) don't need it.
    import torchvision.models

    return getattr(torchvision.models, name)(weights=None)  # never download: weights come only from a local file


def _resnet_features(name: str) -> nn.Sequential:
    net = _torchvision(name)
    names = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
    return nn.Sequential(OrderedDict((n, getattr(net, n)) for n in names))


def _vgg_features(cfg: str) -> nn.Sequential:
    # torchvision's own feature layers, built without its 120M-parameter classifier: allocating and
    # dropping that raises the process's peak memory by ~470 MiB before training even starts.
    from torchvision.models.vgg import cfgs, make_layers

    return make_layers(cfgs[cfg], batch_norm=False)


# name -> (trunk builder, trunk output channels, trunk stride)
_TRUNKS: dict[str, tuple[Callable[[], nn.Sequential], int, int]] = {
    "tiny": (_tiny_features, 32, 16),
    "vgg16": (lambda: _vgg_features("D"), 512, 32),
    "vgg19": (lambda: _vgg_features("E"), 512, 32),
    "darknet19": (darknet19_features, 1024, 32),
    "resnet18": (lambda: _resnet_features("resnet18"), 512, 32),
    "resnet34": (lambda: _resnet_features("resnet34"), 512, 32),
    "resnet50": (lambda: _resnet_features("resnet50"), 2048, 32),
}


def build(
    name: str,
    num_classes: int,
    weights: str | Path | None = None,
    pool: str = "avg",
    freeze_bn: bool = True,
) -> nn.Sequential:
    """Build model ``name`` with a ``num_classes``-way linear head.

    ``weights``: a local state-dict file (as saved by ``torch.save(model.state_dict(), path)``) for this
    exact architecture; nothing is ever downloaded. ``pool``: global "avg" or "max" pooling before the
    head. ``freeze_bn``: BatchNorm layers keep their running statistics even in ``model.train()``.
    """
    if name not in _TRUNKS:
        raise WsiTrainError(f"unknown model {name!r}", hint=f"choose one of: {', '.join(MODEL_NAMES)}")
    if pool not in POOLS:
        raise WsiTrainError(f"unknown pool {pool!r} for model {name!r}", hint=f"choose one of: {', '.join(POOLS)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise WsiTrainError(
            f"num_classes must be a positive integer, got {num_classes!r}", hint="set it to the number of labels"
        )
    make_trunk, channels, stride = _TRUNKS[name]
    model = nn.Sequential(
        OrderedDict(
            normalize=InputNormalization(),
            features=make_trunk(),
            pool=nn.AdaptiveAvgPool2d(1) if pool == "avg" else nn.AdaptiveMaxPool2d(1),
            flatten=nn.Flatten(1),
            classifier=nn.Linear(channels, num_classes),
        )
    )
    model.name = name
    model.stride = stride
    if weights is not None:
        load_weights(model, weights)
    if freeze_bn:
        freeze_batchnorm(model)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes the parameters occupy in their current dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
