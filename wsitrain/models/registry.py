"""Model names: the one place that says which names exist and what each one means.

Five forms: a built-in name (``vgg16``), ``torchvision/<name>`` for any torchvision classification model,
``timm/<name>`` for a timm model (optional extra ``wsitrain[timm]``), ``timm/hf-hub:<org>/<name>`` for a timm
model whose config and weights are in the user's Hugging Face cache (UNI, Virchow2, H-optimus-0, Prov-GigaPath),
and ``python:<module>:<function>`` for the user's own patch encoder (the function returns an ``nn.Module`` taking
``(B, 3, p, p)`` to ``(B, D)``). ``resolve_model_name`` is the only validation of a name; config, CLI options,
bench and plan all call it.

A model is used either as a whole-slide trunk (a CNN: its convolutional trunk tiled over the slide) or as a patch
encoder applied to every ``model.patch`` px patch of a grid (wsitrain.patch). ``ModelSpec.patch_only`` says a name
can only be the latter (vision transformers, hub encoders, user modules); any CNN becomes a patch encoder when
``model.patch`` is set.

Torch-free at import (config validation imports this module); torchvision or timm is imported only to check
a name in their form; a ``python:`` module is located (``importlib.util.find_spec``) but neither imported nor run.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from typing import Literal

from wsitrain.errors import ConfigError

Source = Literal["builtin", "torchvision", "timm", "hf-hub", "python"]

TORCHVISION_PREFIX = "torchvision/"
TIMM_PREFIX = "timm/"
HF_HUB_PREFIX = "hf-hub:"  # after TIMM_PREFIX: timm's own spelling of a Hugging Face hub model
PYTHON_PREFIX = "python:"

# ``model.weights: imagenet`` asks for the library's own pretrained weights (never a file called "imagenet").
IMAGENET = "imagenet"

# torchvision's classification namespace also holds transformers; they need a fixed input size and have no spatial
# feature map to tile, so they are patch encoders only (applied to each model.patch px patch of the slide).
_TORCHVISION_NOT_CNN = ("vit_", "swin_", "maxvit_")
# timm's modules (timm.models._registry's file of each model) whose models are transformers or token mixers without a
# convolutional trunk the engine could tile: patch encoders only. Another timm model that has no global pooling over
# height and width is refused by wsitrain.models.split with a hint to set model.patch.
_TIMM_PATCH_MODULES = frozenset({
    "beit", "cait", "coat", "convit", "crossvit", "davit", "deepseek_vit", "deit", "eva", "gcvit", "gemma4_vit",
    "hiera", "hieradet_sam2", "levit", "maxxvit", "mlp_mixer", "mvitv2", "naflexvit", "nest", "pit", "qwen3_vit",
    "sequencer", "swin_transformer", "swin_transformer_v2", "swin_transformer_v2_cr", "tiny_vit", "tnt", "twins",
    "vision_transformer", "vision_transformer_hybrid", "vision_transformer_relpos", "vision_transformer_sam",
    "vitamin", "volo", "xcit",
})  # fmt: skip


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
    # a patch encoder only (no spatial trunk to tile: a transformer, a hub encoder, a user's module); a CNN becomes a
    # patch encoder too when model.patch is set
    patch_only: bool = False

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
        f"choose one of {', '.join(BUILTIN_NAMES)}, or torchvision/<name> for any torchvision classification model "
        "(e.g. torchvision/efficientnet_b0, torchvision/vit_b_16), or timm/<name> for a timm model "
        "(e.g. timm/resnet18, timm/vit_small_patch16_224; needs `pip install 'wsitrain[timm]'`), or "
        "timm/hf-hub:<org>/<name> for a timm model in your Hugging Face cache (e.g. timm/hf-hub:MahmoodLab/UNI), or "
        "python:<module>:<function> for your own patch encoder"
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


def torchvision_patch_names() -> list[str]:
    """torchvision's classification transformers: patch encoders only (imports torchvision)."""
    import torchvision.models

    names = torchvision.models.list_models(module=torchvision.models)
    return [n for n in names if n.startswith(_TORCHVISION_NOT_CNN)]


def _resolve_torchvision(name: str, arch: str, key: str) -> ModelSpec:
    names = torchvision_cnn_names()
    if arch in names:
        return ModelSpec(name, "torchvision", arch, f"torchvision {arch}, trunk and head split at its global pooling")
    if arch in torchvision_patch_names():
        return ModelSpec(name, "torchvision", arch, f"torchvision {arch}, a patch encoder", patch_only=True)
    reason = f"{name!r} is not a torchvision classification model{_closest(arch, names + torchvision_patch_names())}"
    raise ModelNameError(key, reason, "`wsitrain models` lists torchvision's CNNs, e.g. torchvision/convnext_tiny")


def _need_timm(name: str, key: str) -> None:
    if not timm_installed():
        raise ModelNameError(
            key, f"{name!r} needs the optional package timm, which is not installed", "pip install 'wsitrain[timm]'"
        )


def timm_patch_only(arch: str) -> bool:
    """Whether timm model ``arch`` (a registered name, a pretrained tag allowed) is a transformer-like patch encoder."""
    from timm.models import get_arch_name, is_model_in_modules

    return is_model_in_modules(get_arch_name(arch), _TIMM_PATCH_MODULES)


def _resolve_hub(name: str, repo: str, key: str) -> ModelSpec:
    """``timm/hf-hub:<org>/<name>[@revision]``: only the form is checked here (the cache is read when the model is
    built, wsitrain.patch.encoders), so a config validates on a machine without the weights."""
    _need_timm(name, key)
    org, _, rest = repo.partition("/")
    model = rest.split("@")[0]
    if not org or not model or "/" in model:
        raise ModelNameError(key, f"{name!r} does not name a hub repository as <org>/<name>",
                             "e.g. timm/hf-hub:MahmoodLab/UNI or timm/hf-hub:bioptimus/H-optimus-0")  # fmt: skip
    return ModelSpec(name, "hf-hub", f"{HF_HUB_PREFIX}{repo}", f"timm model {repo} from the Hugging Face cache, "
                     "a patch encoder", patch_only=True)  # fmt: skip


def _resolve_timm(name: str, arch: str, key: str) -> ModelSpec:
    if arch.startswith(HF_HUB_PREFIX):
        return _resolve_hub(name, arch[len(HF_HUB_PREFIX) :], key)
    _need_timm(name, key)
    import timm

    if not timm.is_model(arch):
        near = _closest(arch.split(".")[0], timm.list_models())
        raise ModelNameError(
            key,
            f"{name!r} is not a timm model{near}",
            "timm.list_models('pattern*') lists timm's names; a pretrained tag may follow a dot (resnet18.a1_in1k)",
        )
    if timm_patch_only(arch):
        return ModelSpec(name, "timm", arch, f"timm {arch}, a patch encoder", patch_only=True)
    return ModelSpec(name, "timm", arch, f"timm {arch}, trunk and head split at its global pooling")


def split_entry_point(text: str) -> tuple[str, str]:
    """``my_pkg.my_mod:build_encoder`` -> (module, function); ValueError saying what is wrong with the form."""
    module, sep, func = text.partition(":")
    if not sep or not module or not func:
        raise ValueError("write it as python:<module>:<function>, e.g. python:my_package.encoders:build_encoder")
    if not all(part.isidentifier() for part in module.split(".")) or not func.isidentifier():
        raise ValueError(f"{module}:{func} is not <dotted.module>:<function> (Python identifiers)")
    return module, func


def _resolve_python(name: str, target: str, key: str) -> ModelSpec:
    """``python:<module>:<function>``: the module must be importable (located, not imported: importing runs code)."""
    try:
        module, func = split_entry_point(target)
    except ValueError as exc:
        raise ModelNameError(key, f"{name!r}: {exc}", "the function returns an nn.Module taking (B, 3, p, p) to "
                             "(B, D); set model.patch to p") from exc  # fmt: skip
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or not a package
        found = False
    if not found:
        raise ModelNameError(key, f"{name!r}: module {module!r} cannot be found on the Python path",
                             "install the package that holds it, or add its folder to PYTHONPATH")  # fmt: skip
    return ModelSpec(name, "python", f"{module}:{func}", f"the patch encoder {module}.{func}()", patch_only=True)


def resolve_model_name(name: object, key: str = "model.name") -> ModelSpec:
    """The ModelSpec for ``name``; ModelNameError (a ConfigError, exit 2) naming ``key`` and the choices if unknown."""
    if not isinstance(name, str) or not name.strip():
        raise ModelNameError(key, f"{name!r} is not a model name; {naming_help()}", "`wsitrain models` lists them")
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    if name.startswith(PYTHON_PREFIX):
        return _resolve_python(name, name[len(PYTHON_PREFIX) :], key)
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
