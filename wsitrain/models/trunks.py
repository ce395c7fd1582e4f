"""The built-in trunks and every model's input normalisation: what ``zoo.build`` assembles a whole-slide model from,
and what ``wsitrain.patch.encoders`` turns a CNN into a patch encoder with (kept apart from zoo, which builds patch
encoders through that module: one direction of import).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from torch import nn

from wsitrain.models.attention import CellNorm
from wsitrain.models.darknet import darknet19_features
from wsitrain.models.normalize import IMAGENET_MEAN, IMAGENET_STD
from wsitrain.models.registry import ModelSpec


def _tiny_features(norm: str | None = None) -> nn.Sequential:
    """``tiny``'s four conv stages; with ``norm`` each conv is followed by a normalisation and drops its bias (the
    norm's shift replaces it): "bn" (``tiny_bn``) a BatchNorm, as in the trunks users bring; "ln" (``tiny_ln``) a
    LayerNorm of each cell's channels (ConvNeXt's), which reads no statistics across the slide."""
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    widths = (3, 8, 16, 32, 32)
    for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:], strict=True), start=1):
        layers[f"conv{i}"] = nn.Conv2d(cin, cout, 3, padding=1, bias=norm is None)
        if norm == "bn":
            layers[f"bn{i}"] = nn.BatchNorm2d(cout)
        elif norm == "ln":
            layers[f"ln{i}"] = CellNorm(cout)
        layers[f"relu{i}"] = nn.ReLU(inplace=True)
        layers[f"pool{i}"] = nn.MaxPool2d(2, 2)
    return nn.Sequential(layers)


def _torchvision(name: str, imagenet: bool) -> nn.Module:
    # Imported here: torchvision takes seconds to import, and tiny/darknet19 (tests, bench workers) don't need it.
    from wsitrain.models.pretrained import torchvision_net

    return torchvision_net(name, imagenet)


def _resnet_features(name: str, imagenet: bool) -> nn.Sequential:
    net = _torchvision(name, imagenet)
    names = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
    return nn.Sequential(OrderedDict((n, getattr(net, n)) for n in names))


def _vgg_features(name: str, imagenet: bool) -> nn.Sequential:
    if imagenet:  # the pretrained file holds the classifier too; it is built once and dropped
        return _torchvision(name, imagenet).features
    # torchvision's own feature layers, built without its 120M-parameter classifier: allocating and
    # dropping that raises the process's peak memory by ~470 MiB before training even starts.
    from torchvision.models.vgg import cfgs, make_layers

    return make_layers(cfgs[{"vgg16": "D", "vgg19": "E"}[name]], batch_norm=False)


Norm = tuple[tuple[float, ...], tuple[float, ...]]  # the input normalization's (mean, std) per channel

# built-in name -> (trunk builder taking `imagenet`, trunk output channels); strides live in the registry
TRUNKS: dict[str, tuple[Callable[[bool], nn.Sequential], int]] = {
    "tiny": (lambda _: _tiny_features(), 32),
    "tiny_bn": (lambda _: _tiny_features("bn"), 32),
    "tiny_ln": (lambda _: _tiny_features("ln"), 32),
    "vgg16": (lambda imagenet: _vgg_features("vgg16", imagenet), 512),
    "vgg19": (lambda imagenet: _vgg_features("vgg19", imagenet), 512),
    "darknet19": (lambda _: darknet19_features(), 1024),
    "resnet18": (lambda imagenet: _resnet_features("resnet18", imagenet), 512),
    "resnet34": (lambda imagenet: _resnet_features("resnet34", imagenet), 512),
    "resnet50": (lambda imagenet: _resnet_features("resnet50", imagenet), 2048),
}


def input_normalization(spec: ModelSpec) -> Norm:
    """(mean, std) the model's pretrained weights expect: ImageNet's for built-ins, the library's own otherwise."""
    import wsitrain.models.pretrained as pretrained

    if spec.source == "torchvision":
        return pretrained.torchvision_mean_std(spec.arch)
    if spec.source == "timm":
        return pretrained.timm_mean_std(spec.arch)
    return IMAGENET_MEAN, IMAGENET_STD
