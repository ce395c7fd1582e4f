"""Patch encoders: a model name -> an ``nn.Module`` mapping ``(B, 3, p, p)`` to ``(B, D)``, and what it expects.

``build_encoder`` is the one place a patch encoder is made, whatever the name's form (wsitrain.models.registry):

* ``timm/<name>``: ``timm.create_model(name, num_classes=0)`` (its pooled pre-logits features), at ``img_size=p``
  when ``model.patch`` differs from the model's own size (timm resamples the position embedding of pretrained
  weights). ``pretrained`` reads timm's weights from its cache (wsitrain.models.pretrained).
* ``timm/hf-hub:<org>/<name>``: the repository's ``config.json`` (``architecture``, ``model_args``,
  ``pretrained_cfg``) and ``model.safetensors`` (or ``pytorch_model.bin``) read from the Hugging Face cache folder
  only (``HF_HUB_CACHE``, or ``HF_HOME/hub``, read when called): the network is never touched, so offline machines
  and ``HF_HUB_OFFLINE=1`` behave the same. The weights are always the hub's unless ``model.weights`` names a file.
* ``torchvision/vit_*`` (``swin_*``, ``maxvit_*``): the model without its classification layer, built for
  ``image_size=p``; ImageNet weights have their position embedding interpolated to that size.
* a CNN (built-in, ``torchvision/<cnn>``): its trunk, then a global average pool: the classic patch + MIL
  pipeline's encoder. ``model.patch`` must say the patch size (a CNN has none of its own).
* ``python:<module>:<function>``: ``function()`` returns the module. Optional ``pretrained_cfg`` attribute on it
  (timm's convention: a dict with ``mean``, ``std``, ``input_size``) gives its normalisation and patch size;
  otherwise ImageNet's and ``model.patch`` (required).

Every encoder's ``EncoderInfo`` carries its input normalisation (the model's ``InputNormalization`` is built from
it, so uint8 patches are normalised as the encoder was pretrained) and its blocks in forward order (for
``model.freeze.last_blocks`` and ``train.layer_decay``).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models.normalize import IMAGENET_MEAN, IMAGENET_STD
from wsitrain.models.registry import ModelSpec, resolve_model_name, split_entry_point
from wsitrain.patch.blocks import block_paths
from wsitrain.patch.lora import LoraSpec
from wsitrain.safe_load import first_line, library_loads_weights_only

RGB = tuple[float, float, float]

# Hub repositories whose model card asks for create_model arguments that config.json cannot hold (classes): the
# published loading recipe, applied for the user. Virchow and Virchow2 (paige-ai model cards): a SwiGLU MLP and SiLU.
_HUB_CLASS_ARGS: dict[str, dict[str, str]] = {
    "paige-ai/Virchow": {"mlp_layer": "timm.layers.SwiGLUPacked", "act_layer": "torch.nn.SiLU"},
    "paige-ai/Virchow2": {"mlp_layer": "timm.layers.SwiGLUPacked", "act_layer": "torch.nn.SiLU"},
}
_HUB_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # timm's order (timm.models._hub)


@dataclass(frozen=True)
class EncoderInfo:
    """What a patch encoder expects and gives."""

    patch: int  # patch edge in px the encoder is applied to
    dim: int  # embedding width D
    mean: RGB  # input normalisation the weights were trained with, per channel of [0, 1] RGB
    std: RGB
    blocks: tuple[str, ...]  # module paths (inside the encoder) of its repeated blocks, in forward order


def _rgb(values: Sequence[float], what: str) -> RGB:
    vals = tuple(float(v) for v in values)
    if len(vals) != 3:
        raise WsiTrainError(f"the encoder's {what} has {len(vals)} values, not 3 (RGB)",
                            hint="patch encoders take RGB patches")  # fmt: skip
    return vals[0], vals[1], vals[2]


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, read from the environment now (not at import, as huggingface_hub does)."""
    import os

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface")
    return Path(home).expanduser() / "hub"


@dataclass(frozen=True)
class HubFiles:
    """A hub repository's files in the local cache."""

    repo: str
    config: dict[str, Any]
    weights: Path


def _not_cached(repo: str, cache: Path, what: str) -> WsiTrainError:
    folder = cache / f"models--{repo.replace('/', '--')}"
    return WsiTrainError(
        f"timm/hf-hub:{repo}: {what} is not in the Hugging Face cache (searched {folder}); wsitrain reads the hub "
        "cache only and never downloads",
        hint=f"on a machine with internet run `huggingface-cli download {repo}` (or `hf download {repo}`; gated models "
        "such as UNI and Virchow2 need the access granted on their hub page and `hf auth login` first) and copy its "
        f"models--{repo.replace('/', '--')} folder into {cache}, or point HF_HOME (or HF_HUB_CACHE) at a cache that "
        "holds it",
    )


def hub_files(repo_rev: str) -> HubFiles:
    """``config.json`` and the weights file of hub repository ``org/name[@revision]`` from the local cache only."""
    from huggingface_hub import try_to_load_from_cache

    repo, _, revision = repo_rev.partition("@")
    cache = hub_cache()

    def cached(filename: str) -> Path | None:
        found = try_to_load_from_cache(repo, filename, cache_dir=cache, revision=revision or None)
        return Path(found) if isinstance(found, str) else None

    config_file = cached("config.json")
    if config_file is None:
        raise _not_cached(repo, cache, "its config.json")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise WsiTrainError(f"timm/hf-hub:{repo}: cannot read {config_file}: {first_line(exc)}",
                            hint="delete that snapshot and download the repository again") from exc  # fmt: skip
    if not isinstance(config, dict) or not isinstance(config.get("architecture"), str):
        raise WsiTrainError(
            f"timm/hf-hub:{repo}: {config_file} has no \"architecture\": not a timm model repository",
            hint="name a repository whose config.json is timm's (architecture, model_args, pretrained_cfg); models "
            "published for the transformers library only (e.g. owkin/phikon) are not timm models",
        )
    weights = next((f for f in map(cached, _HUB_WEIGHT_FILES) if f is not None), None)
    if weights is None:
        raise _not_cached(repo, cache, f"its weights ({' or '.join(_HUB_WEIGHT_FILES)})")
    return HubFiles(repo, config, weights)


def _dotted(path: str) -> Any:
    module, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _timm_size(net: nn.Module) -> int | None:
    size = (getattr(net, "pretrained_cfg", None) or {}).get("input_size")
    return int(size[-1]) if size else None


def _timm_encoder(net: nn.Module, name: str) -> nn.Module:
    """A timm model whose forward returns tokens (``global_pool=""``, as Virchow's config sets) pools its class token
    instead: one vector per patch."""
    if getattr(net, "global_pool", None) == "" and hasattr(net, "reset_classifier"):
        try:
            net.reset_classifier(0, "token")
        except (AssertionError, ValueError, TypeError) as exc:
            raise WsiTrainError(f"{name}: its forward returns tokens and it has no class-token pooling",
                                hint="wrap it in python:<module>:<function> with (B, D) output") from exc  # fmt: skip
    return net


def _timm(spec: ModelSpec, pretrained: bool, patch: int | None) -> tuple[nn.Module, int, RGB, RGB]:
    from wsitrain.models.pretrained import timm_net

    # a transformer is rebuilt for the patch size (timm resamples pretrained position embeddings); a CNN takes any
    size = {"img_size": patch} if patch is not None and spec.patch_only else {}
    net = timm_net(spec.arch, pretrained, num_classes=0, **size)
    cfg = net.pretrained_cfg
    own = patch or _timm_size(net)
    if own is None:
        raise WsiTrainError(f"{spec.name} has no input size of its own", hint="set model.patch (px)")
    return _timm_encoder(net, spec.name), own, _rgb(cfg["mean"], "mean"), _rgb(cfg["std"], "std")


def _hub(spec: ModelSpec, pretrained: bool, patch: int | None) -> tuple[nn.Module, int, RGB, RGB]:
    import timm

    files = hub_files(spec.arch.removeprefix("hf-hub:"))
    cfg = files.config
    args = dict(cfg.get("model_args") or {})
    args.update({k: _dotted(v) for k, v in _HUB_CLASS_ARGS.get(files.repo, {}).items()})
    args["num_classes"] = 0
    if patch is not None:
        args["img_size"] = patch
    pcfg = dict(cfg.get("pretrained_cfg") or {})
    overlay = {**pcfg, "file": str(files.weights), "hf_hub_id": None, "source": "file"}
    try:
        with library_loads_weights_only():  # a pytorch_model.bin is unpickled by timm: held to weights_only
            net = timm.create_model(cfg["architecture"], pretrained=pretrained, pretrained_cfg_overlay=overlay, **args)
    except Exception as exc:  # key, shape or file errors: the cached repository does not build
        raise WsiTrainError(f"{spec.name}: cannot build {cfg['architecture']} from {files.weights.parent}: "
                            f"{first_line(exc)}",
                            hint="delete that snapshot and download the repository again") from exc  # fmt: skip
    own = patch or _timm_size(net)
    if own is None:
        raise WsiTrainError(f"{spec.name}: its config.json gives no input_size", hint="set model.patch (px)")
    mean = pcfg.get("mean", IMAGENET_MEAN)
    std = pcfg.get("std", IMAGENET_STD)
    return _timm_encoder(net, spec.name), own, _rgb(mean, "mean"), _rgb(std, "std")


def _torchvision_transformer(spec: ModelSpec, pretrained: bool, patch: int | None) -> tuple[nn.Module, int]:
    import torchvision.models
    from torchvision.models import vision_transformer as tv_vit

    from wsitrain.models.pretrained import torchvision_net

    arch = spec.arch
    if arch.startswith("vit_"):
        native = int(torchvision.models.get_model_weights(arch).DEFAULT.meta["min_size"][0])
        size = patch or native
        if pretrained:
            net = torchvision_net(arch, True)
            if size != native:  # the weights' position embedding, interpolated to the patch's token grid
                state = tv_vit.interpolate_embeddings(size, net.patch_size, net.state_dict())
                fresh = torchvision.models.get_model(arch, weights=None, image_size=size)
                fresh.load_state_dict(state)
                net = fresh
        else:
            net = torchvision.models.get_model(arch, weights=None, image_size=size)
        net.heads = nn.Identity()  # (B, hidden_dim): the class token after the last LayerNorm
        return net, size
    net = torchvision_net(arch, pretrained)
    size = patch or 224  # swin / maxvit: ImageNet's 224 px
    if arch.startswith("swin_"):
        net.head = nn.Identity()
    else:  # maxvit: pool, flatten, LayerNorm, then an MLP head: keep the first three
        net.classifier = net.classifier[:3]
    return net, size


def _cnn(spec: ModelSpec, pretrained: bool) -> nn.Module:
    """The CNN's trunk followed by a global average pool: (B, 3, p, p) -> (B, C). A built-in's trunk as
    ``zoo.build`` makes it (wsitrain.models.trunks), a torchvision CNN's split at its global pooling."""
    if spec.is_builtin:
        from wsitrain.models.trunks import TRUNKS

        if pretrained and spec.imagenet_from is None:
            raise WsiTrainError(f"built-in model {spec.name!r} has no ImageNet weights",
                                hint="give a local weights file, or use resnet18/34/50 or vgg16/19")  # fmt: skip
        trunk = TRUNKS[spec.name][0](pretrained)
    else:
        from wsitrain.models.pretrained import torchvision_net
        from wsitrain.models.split import split_classifier

        trunk = split_classifier(torchvision_net(spec.arch, pretrained), spec.name, 1).features
    return nn.Sequential(trunk, nn.AdaptiveAvgPool2d(1), nn.Flatten(1))


def _python(spec: ModelSpec) -> nn.Module:
    module, func = split_entry_point(spec.arch)
    try:
        make = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise WsiTrainError(f"model.name {spec.name}: {first_line(exc)}",
                            hint=f"define {func}() in {module}, returning an nn.Module") from exc  # fmt: skip
    net = make()
    if not isinstance(net, nn.Module):
        raise WsiTrainError(f"model.name {spec.name}: {module}.{func}() returned {type(net).__name__}, not a module",
                            hint="return a module taking (B, 3, p, p) to (B, D)")  # fmt: skip
    return net


def _probe_dim(net: nn.Module, patch: int, name: str) -> int:
    """D from one forward of a (1, 3, p, p) patch (on the module's device: meta under planning)."""
    param = next(net.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    was = net.training
    net.eval()
    try:
        with torch.no_grad():
            out = net(torch.zeros(1, 3, patch, patch, device=device, dtype=dtype))
    except Exception as exc:  # the module's own errors: say which module and size
        raise WsiTrainError(f"{name}: a (1, 3, {patch}, {patch}) patch fails in its forward: {first_line(exc)}",
                            hint="set model.patch to a size the encoder accepts") from exc  # fmt: skip
    finally:
        net.train(was)
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 1:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise WsiTrainError(f"{name}: a (1, 3, {patch}, {patch}) patch gives {shape}, not (1, D)",
                            hint="a patch encoder returns one embedding per patch: (B, D)")  # fmt: skip
    return int(out.shape[1])


def _embedding_dim(net: nn.Module, patch: int, name: str) -> int:
    dim = getattr(net, "num_features", None)  # timm's pooled width
    if isinstance(dim, int) and getattr(net, "global_pool", "token") not in ("", None):
        return dim
    dim = getattr(net, "hidden_dim", None)  # torchvision ViT
    if isinstance(dim, int):
        return dim
    return _probe_dim(net, patch, name)


def _state_for(encoder: nn.Module, obj: object, path: Path) -> dict[str, torch.Tensor]:
    """The encoder's state from a weights file: its own keys, or under ``encoder.`` / ``features.encoder.`` (a
    wsitrain patch model's state dict or checkpoint)."""
    from wsitrain.models.weights import _state_dict_from

    state = _state_dict_from(obj, path, str(getattr(encoder, "name", "encoder")))
    keys = set(encoder.state_dict())
    for prefix in ("", "encoder.", "features.encoder."):
        picked = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if set(picked) == keys:
            return picked
    missing = sorted(keys - set(state))[:5]
    raise WsiTrainError(
        f"weights file {path} does not hold this encoder's weights: missing keys {', '.join(missing)}"
        + (f" (+{len(keys - set(state)) - 5} more)" if len(keys - set(state)) > 5 else ""),
        hint="save them with torch.save(encoder.state_dict(), path), or give a wsitrain run's best.pt",
    )


def load_encoder_weights(encoder: nn.Module, weights: Path) -> None:
    """Load a local file into ``encoder`` strictly, through the safe loader (wsitrain.safe_load)."""
    from wsitrain.safe_load import safe_torch_load

    path = Path(weights).expanduser()
    if not path.is_file():
        raise WsiTrainError(f"model.weights: {path} does not exist", hint="give a local weights file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        obj: object = load_file(str(path))
    else:
        obj = safe_torch_load(path, "weights file")
    state = _state_for(encoder, obj, path)
    shapes = [k for k, v in encoder.state_dict().items() if state[k].shape != v.shape]
    if shapes:
        raise WsiTrainError(f"weights file {path}: shapes differ from the encoder at {', '.join(shapes[:5])}",
                            hint="use weights of the same architecture and model.patch")  # fmt: skip
    encoder.load_state_dict(state, strict=True)


def build_encoder(name: str, *, weights: Path | None, pretrained: bool, patch: int | None = None,
                  lora: LoraSpec | None = None) -> tuple[nn.Module, EncoderInfo]:  # fmt: skip
    """The patch encoder ``name`` (B, 3, p, p) -> (B, D) and its ``EncoderInfo``.

    ``pretrained``: the library's own weights (timm's or torchvision's, from their caches); hub names always load
    their hub weights unless ``weights`` (a local file: the encoder's state dict, or a wsitrain patch model's) is
    given. ``patch``: ``model.patch`` in px, or None for the encoder's own input size. ``lora``: adapters on the
    encoder (wsitrain.patch.lora; its other weights frozen). Errors are WsiTrainError
    (exit 2) naming the model and how to fix it.
    """
    spec = resolve_model_name(name)
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    if spec.source == "hf-hub":
        net, size, mean, std = _hub(spec, weights is None or pretrained, patch)
    elif spec.source == "timm" and spec.patch_only:
        net, size, mean, std = _timm(spec, pretrained, patch)
    elif spec.source == "torchvision" and spec.patch_only:
        from wsitrain.models.pretrained import torchvision_mean_std

        net, size = _torchvision_transformer(spec, pretrained, patch)
        if pretrained:
            mean, std = (_rgb(v, "mean/std") for v in torchvision_mean_std(spec.arch))
    elif spec.source == "python":
        net = _python(spec)
        cfg = getattr(net, "pretrained_cfg", None) or {}
        mean, std = _rgb(cfg.get("mean", mean), "mean"), _rgb(cfg.get("std", std), "std")
        own = cfg.get("input_size")
        if patch is None and not own:
            raise WsiTrainError(f"model.patch is required with {name}: the module gives no input size of its own",
                                hint="set model.patch to the px edge it takes")  # fmt: skip
        size = patch or int(own[-1])
    else:  # a CNN (built-in, torchvision or timm) as a patch encoder
        if patch is None:
            raise WsiTrainError(f"{name} is a CNN: as a patch encoder it needs model.patch (px)",
                                hint="set model.patch, e.g. 224, or remove it to tile the CNN over the whole slide")
        if spec.source == "timm":
            net, size, mean, std = _timm(spec, pretrained, patch)
        else:
            from wsitrain.models.trunks import input_normalization

            net, size = _cnn(spec, pretrained), patch
            m, s = input_normalization(spec)
            mean, std = _rgb(m, "mean"), _rgb(s, "std")
    dim = _embedding_dim(net, size, name)
    blocks = block_paths(net)  # before LoRA: its layers wrap the targets, the block paths stay the same
    if lora is None:
        if weights is not None:
            load_encoder_weights(net, weights)
        return net, EncoderInfo(size, dim, mean, std, blocks)
    from wsitrain.patch.lora import apply_lora

    # a file of a LoRA run holds the adapters (and base_layer keys): the adapters go in first; any other file holds
    # the base weights the adapters start from
    adapted = weights is not None and file_has_lora(weights)
    if weights is not None and not adapted:
        load_encoder_weights(net, weights)
    apply_lora(net, lora, name)
    if adapted:
        assert weights is not None
        load_encoder_weights(net, weights)
    return net, EncoderInfo(size, dim, mean, std, blocks)


def file_has_lora(weights: Path) -> bool:
    from wsitrain.patch.lora import has_lora_keys
    from wsitrain.safe_load import safe_torch_load

    path = Path(weights).expanduser()
    if not path.is_file() or path.suffix == ".safetensors":
        return False
    obj = safe_torch_load(path, "weights file")
    state = obj.get("model", obj.get("state_dict", obj)) if isinstance(obj, dict) else {}
    return isinstance(state, dict) and has_lora_keys(state)
