"""Library models (torchvision, timm) with or without their own ImageNet weights, read through their own caches.

torchvision keeps weights in ``$TORCH_HOME/hub/checkpoints`` (``torch.hub.get_dir()``); timm in the Hugging Face
hub cache (``$HF_HUB_CACHE``, by default ``$HF_HOME/hub``). A cached file is read without touching the network.
When it is missing the library may download it; if that fails (no network, ``HF_HUB_OFFLINE=1``), the error
names the folder and the file expected and how to fill it, instead of a library traceback.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.safe_load import first_line, library_loads_weights_only, refusal

if TYPE_CHECKING:  # timm is optional: its types only for annotations
    from timm.models import PretrainedCfg


def _build(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()``; builders that compute with tensors (torchvision's RegNet widths) fail under a meta default device,
    so those are built on the CPU and then moved to meta, as the caller's ``with torch.device("meta")`` asked."""
    try:
        return make()
    except NotImplementedError:
        if torch.get_default_device().type != "meta":
            raise
        with torch.device("cpu"):
            return make().to("meta")


# ---- torchvision ---------------------------------------------------------------------------------------------
def torchvision_cache_file(arch: str) -> tuple[Path, str]:
    """(cached file, download URL) of torchvision's default ImageNet weights for ``arch``."""
    import torchvision.models

    url = torchvision.models.get_model_weights(arch).DEFAULT.url
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path), url


def torchvision_mean_std(arch: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The normalization torchvision's weights for ``arch`` were trained with."""
    import torchvision.models

    t = torchvision.models.get_model_weights(arch).DEFAULT.transforms()
    return tuple(float(v) for v in t.mean), tuple(float(v) for v in t.std)


def torchvision_net(arch: str, imagenet: bool) -> nn.Module:
    """torchvision classifier ``arch``, randomly initialised or with its default ImageNet weights."""
    import torchvision.models

    if not imagenet:
        return _build(lambda: torchvision.models.get_model(arch, weights=None))
    path, url = torchvision_cache_file(arch)
    cached = path.is_file()
    try:
        # torchvision's own loader: it reads the cached file (downloading only if it is missing) and applies the
        # key fix-ups some of its old checkpoints need (DenseNet).
        with library_loads_weights_only():  # torch.hub's default is weights_only=False: a planted file would run
            return _build(lambda: torchvision.models.get_model(arch, weights="DEFAULT"))
    except Exception as exc:  # network, file or unpickling errors: all mean the weights are not usable
        if cached and isinstance(exc, pickle.UnpicklingError):  # a planted or foreign file: refused, nothing run
            raise WsiTrainError(
                f"the cached ImageNet weights of torchvision/{arch}: {path} {refusal(exc)}",
                hint=f"delete {path} and download it again from {url}",
            ) from exc
        if cached:
            raise WsiTrainError(
                f"cannot read the cached ImageNet weights of torchvision/{arch} at {path}: {first_line(exc)}",
                hint=f"delete {path} and download it again from {url}",
            ) from exc
        raise WsiTrainError(
            f"the ImageNet weights of torchvision/{arch} are not in torchvision's cache and cannot be downloaded "
            f"({first_line(exc)}): expected file {path}",
            hint=f"on a machine with internet download {url} into {path.parent} (e.g. `curl -L -o {path} {url}`), "
            "or set TORCH_HOME to a folder whose hub/checkpoints holds that file",
        ) from exc


# ---- timm ----------------------------------------------------------------------------------------------------
def _timm_cfg(arch: str) -> PretrainedCfg:
    import timm.models

    cfg = timm.models.get_pretrained_cfg(arch)
    if cfg is None:
        raise WsiTrainError(
            f"timm/{arch} has no pretrained weights in timm",
            hint="name a tag timm has weights for, e.g. timm/resnet18.a1_in1k (timm.list_pretrained('resnet18*'))",
        )
    return cfg


def timm_mean_std(arch: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The normalization timm's default pretrained weights for ``arch`` were trained with."""
    try:
        cfg = _timm_cfg(arch)
    except WsiTrainError:
        from wsitrain.models.normalize import IMAGENET_MEAN, IMAGENET_STD

        return IMAGENET_MEAN, IMAGENET_STD
    return tuple(float(v) for v in cfg.mean), tuple(float(v) for v in cfg.std)


def timm_cache_files(arch: str) -> tuple[list[Path], str]:
    """(files timm would read, one of them is enough; how to fill the cache) for ``arch``'s pretrained weights."""
    cfg = _timm_cfg(arch)
    if cfg.hf_hub_id:
        from huggingface_hub import constants

        repo = cfg.hf_hub_id.split("@")[0]
        # timm tries the safetensors file first, then the pickle (timm.models._hub.load_state_dict_from_hf).
        names = [cfg.hf_hub_filename] if cfg.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]
        folder = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}" / "snapshots" / "<revision>"
        how = (
            f"on a machine with internet run `hf download {repo} {names[0]}` with the same HF_HOME / HF_HUB_CACHE "
            f"and copy that cache here, or set HF_HUB_CACHE to a folder that holds models--{repo.replace('/', '--')}; "
            "without internet set HF_HUB_OFFLINE=1 so the hub does not retry the network first"
        )
        return [folder / n for n in names], how
    url = cfg.url or ""
    path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
    return [path], f"on a machine with internet download {url} into {path.parent}"


def timm_cached(arch: str) -> bool:
    """Whether one of the files timm would read for ``arch`` is in its cache (no network)."""
    cfg = _timm_cfg(arch)
    files, _ = timm_cache_files(arch)
    if not cfg.hf_hub_id:
        return files[0].is_file()
    from huggingface_hub import try_to_load_from_cache

    repo, _, revision = cfg.hf_hub_id.partition("@")
    return any(isinstance(try_to_load_from_cache(repo, f.name, revision=revision or None), str) for f in files)


def timm_net(arch: str, imagenet: bool, **kwargs: Any) -> nn.Module:
    """timm model ``arch``, randomly initialised or with timm's pretrained weights (tag after a dot, or default);
    ``kwargs`` go to ``timm.create_model`` (a patch encoder's ``num_classes=0``, ``img_size``)."""
    import timm

    if not imagenet:
        return _build(lambda: timm.create_model(arch, pretrained=False, **kwargs))
    cached = timm_cached(arch)
    files, how = timm_cache_files(arch)
    try:
        with library_loads_weights_only():  # timm asks for weights_only itself; held to the same rule regardless
            return _build(lambda: timm.create_model(arch, pretrained=True, **kwargs))
    except Exception as exc:  # hub, network, file or key errors: all mean the weights are not usable
        if cached:
            raise WsiTrainError(
                f"cannot load the cached pretrained weights of timm/{arch} ({' or '.join(map(str, files))}): "
                f"{first_line(exc)}",
                hint="delete the cached files so timm downloads them again",
            ) from exc
        raise WsiTrainError(
            f"the pretrained weights of timm/{arch} are not in the cache and cannot be downloaded "
            f"({first_line(exc)}): expected {' or '.join(map(str, files))}",
            hint=how,
        ) from exc
