"""Model names: the one place that says which names exist and what each one means.

Three forms: a built-in name (``vgg16``), ``torchvision/<name>`` for any torchvision classification CNN, and
``timm/<name>`` for a timm model (optional extra ``wsitrain[timm]``). ``resolve_model_name`` is the only
validation of a name; config, CLI options, bench and plan all call it.

Torch-free at import (config validation imports this module); torchvision or timm is imported only to check
a name in their form.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from typing import Literal

from wsitrain.errors import ConfigError

Source = Literal["builtin", "torchvision", "timm"]

TORCHVISION_PREFIX = "torchvision/"
TIMM_PREFIX = "timm/"

# ``model.weights: imagenet`` asks for the library's own pretrained weights (never a file called "imagenet").
IMAGENET = "imagenet"

# torchvision's classification namespace also holds transformers; their trunks need a fixed input size and
# have no spatial feature map to tile, so they are not models wsitrain can train on slides.
_TORCHVISION_NOT_CNN = ("vit_", "swin_", "maxvit_")


def is_imagenet(weights: object) -> bool:
    """Whether a ``model.weights`` value asks for the library's ImageNet weights rather than a file.

    Accepts the text or a ``Path`` of it (config paths arrive as ``Path("imagenet")``); a file that is really
    called ``imagenet`` is reached by an absolute path or another name.
    """
    return weights is not None and str(weights) == IMAGENET


@dataclass(frozen=True)
class ModelSpec:
    """What a model name resolves to."""

    name: str  # as the user writes it: "vgg16", "torchvision/efficientnet_b0", "timm/resnet18.a1_in1k"
    source: Source
    arch: str  # the name inside its library (for built-ins: the built-in name)
    summary: str  # one line saying what it is
    stride: int | None = None  # the trunk's downsampling, known up front for built-ins
    imagenet_from: str | None = None  # built-ins: the torchvision model whose ImageNet trunk weights fit

    @property
    def is_builtin(self) -> bool:
        return self.source == "builtin"


BUILTIN_MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("tiny", "builtin", "tiny", "4 conv layers, 8-32 channels: tests and demos", 16),
        ModelSpec("tiny_bn", "builtin", "tiny_bn", "tiny with a BatchNorm after each conv: tests and benchmarks", 16),
        ModelSpec("tiny_ln", "builtin", "tiny_ln", "tiny with a LayerNorm of each cell's channels after each conv", 16),
        ModelSpec(
            "vgg16", "builtin", "vgg16", "VGG-16 trunk (13 convs, no BatchNorm), as in the SFT paper", 32, "vgg16"
        ),
        ModelSpec("vgg19", "builtin", "vgg19", "VGG-19 trunk (16 convs, no BatchNorm)", 32, "vgg19"),
        ModelSpec("darknet19", "builtin", "darknet19", "DarkNet-19 trunk (YOLO9000's classifier, BatchNorm)", 32),
        ModelSpec("resnet18", "builtin", "resnet18", "ResNet-18 trunk (torchvision layout)", 32, "resnet18"),
        ModelSpec("resnet34", "builtin", "resnet34", "ResNet-34 trunk (torchvision layout)", 32, "resnet34"),
        ModelSpec("resnet50", "builtin", "resnet50", "ResNet-50 trunk (torchvision layout)", 32, "resnet50"),
    )
}
BUILTIN_NAMES: tuple[str, ...] = tuple(BUILTIN_MODELS)


class ModelNameError(ConfigError):
    """An unknown or unusable model name. ``reason`` is the problem without the key, for pydantic validators."""

    def __init__(self, key: str, reason: str, hint: str) -> None:
        super().__init__([f"{key}: {reason}"])
        # One problem, said in one line: also right where the name came from a CLI option, not a config file.
        self.message = f"{key}: {reason}"
        self.args = (self.message,)
        self.reason = reason
        self.hint = hint


def naming_help() -> str:
    """How to name a model, in one sentence (used by errors and `wsitrain models`)."""
    return (
        f"choose one of {', '.join(BUILTIN_NAMES)}, or torchvision/<name> for any torchvision classification CNN "
        "(e.g. torchvision/efficientnet_b0), or timm/<name> for a timm model (e.g. timm/resnet18; "
        "needs `pip install 'wsitrain[timm]'`)"
    )


def timm_installed() -> bool:
    """Whether the optional timm package can be imported (checked without importing it)."""
    return importlib.util.find_spec("timm") is not None


def _closest(name: str, choices: list[str]) -> str:
    near = difflib.get_close_matches(name, choices, n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def torchvision_cnn_names() -> list[str]:
    """torchvision's classification models that are CNNs (imports torchvision)."""
    import torchvision.models

    names = torchvision.models.list_models(module=torchvision.models)
    return [n for n in names if not n.startswith(_TORCHVISION_NOT_CNN)]


def _resolve_torchvision(name: str, arch: str, key: str) -> ModelSpec:
    names = torchvision_cnn_names()
    if arch not in names:
        if arch.startswith(_TORCHVISION_NOT_CNN):
            reason = f"{name!r} is a vision transformer, not a CNN; wsitrain tiles convolutional trunks"
        else:
            reason = f"{name!r} is not a torchvision classification CNN{_closest(arch, names)}"
        raise ModelNameError(key, reason, "`wsitrain models` lists torchvision's CNNs, e.g. torchvision/convnext_tiny")
    return ModelSpec(name, "torchvision", arch, f"torchvision {arch}, trunk and head split at its global pooling")


def _resolve_timm(name: str, arch: str, key: str) -> ModelSpec:
    if not timm_installed():
        raise ModelNameError(
            key, f"{name!r} needs the optional package timm, which is not installed", "pip install 'wsitrain[timm]'"
        )
    import timm

    if not timm.is_model(arch):
        near = _closest(arch.split(".")[0], timm.list_models())
        raise ModelNameError(
            key,
            f"{name!r} is not a timm model{near}",
            "timm.list_models('pattern*') lists timm's names; a pretrained tag may follow a dot (resnet18.a1_in1k)",
        )
    return ModelSpec(name, "timm", arch, f"timm {arch}, trunk and head split at its global pooling")


def resolve_model_name(name: object, key: str = "model.name") -> ModelSpec:
    """The ModelSpec for ``name``; ModelNameError (a ConfigError, exit 2) naming ``key`` and the choices if unknown."""
    if not isinstance(name, str) or not name.strip():
        raise ModelNameError(key, f"{name!r} is not a model name; {naming_help()}", "`wsitrain models` lists them")
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    for prefix, resolve in ((TORCHVISION_PREFIX, _resolve_torchvision), (TIMM_PREFIX, _resolve_timm)):
        if name.startswith(prefix):
            arch = name[len(prefix) :]
            if not arch:
                raise ModelNameError(key, f"{name!r} names no model after {prefix!r}", f"e.g. {prefix}resnet18")
            return resolve(name, arch, key)
    near = _closest(name, list(BUILTIN_NAMES))
    raise ModelNameError(
        key,
        f"{name!r} is not a valid choice; {naming_help()}",
        f"`wsitrain models` lists the built-ins and how to name the rest{near}",
    )
