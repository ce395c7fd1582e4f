"""Load a local weights file into a model, with errors that name the file and the offending keys.

Accepted: a plain state dict (``torch.save(model.state_dict(), path)``), the common ``{"state_dict": ...}`` /
``{"model": ...}`` wrappers, and a wsitrain run checkpoint (``best.pt`` / ``last.pt``), whose model state is used.
A state dict of the trunk alone (every key of the model's ``features``, with or without the ``features.`` prefix,
and nothing else: ``torch.save(model.features.state_dict(), path)``) loads the trunk and leaves the head as built,
the usual start of fine-tuning from weights pretrained elsewhere (self-supervised on pathology, or another task).
Files are read by ``wsitrain.safe_load`` (``weights_only=True``): tensors and plain containers only, nothing
executed from the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models.freeze import TRUNK
from wsitrain.safe_load import safe_torch_load

_SHOW = 5  # keys listed in an error; a mismatch usually means a different architecture, a few names say which


def _read(path: Path) -> object:
    """The file's contents as data (tensors and plain values): wsitrain.safe_load refuses anything that runs code."""
    return safe_torch_load(path, "weights file")


def _checkpoint_model_name(obj: dict[str, Any]) -> str | None:
    """The model a wsitrain run checkpoint was trained with (its saved config), if it says."""
    config = obj.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    name = model.get("name") if isinstance(model, dict) else None
    return name if isinstance(name, str) else None


def _state_dict_from(obj: object, path: Path, model_name: str) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict) and "format" in obj and isinstance(obj.get("model"), dict):
        trained = _checkpoint_model_name(obj)
        if trained is not None and trained != model_name:
            raise WsiTrainError(
                f"weights file {path} is a wsitrain checkpoint of model {trained!r}, not {model_name!r}",
                hint=f"set model.name: {trained} to start from it, or give weights saved from {model_name!r}",
            )
    # Training checkpoints often wrap the weights; accept the two common wrappers (wsitrain's is "model").
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WsiTrainError(
            f"weights file {path} does not hold a state dict (a mapping of names to tensors)",
            hint="save it with torch.save(model.state_dict(), path)",
        )
    return obj


def _listing(keys: list[str]) -> str:
    more = f" (+{len(keys) - _SHOW} more)" if len(keys) > _SHOW else ""
    return ", ".join(keys[:_SHOW]) + more


MODEL, TRUNK_ONLY = "model", "trunk"  # what ``load_weights`` loaded


def _trunk_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor] | None:
    """``state`` as the trunk's own state dict when it holds exactly the trunk's keys (``features.`` prefixed or
    not); else None."""
    trunk = getattr(model, TRUNK, None)
    if not isinstance(trunk, nn.Module):
        return None
    keys = set(trunk.state_dict())
    prefix = f"{TRUNK}."
    if set(state) == {prefix + k for k in keys}:
        return {k[len(prefix) :]: v for k, v in state.items()}
    return dict(state) if keys and set(state) == keys else None


def load_weights(model: nn.Module, weights: str | Path) -> str:
    """Load ``weights`` (a local file) into ``model`` strictly, the whole model or (a file of the trunk's keys alone)
    its trunk; raise WsiTrainError on any mismatch. Returns what was loaded: ``MODEL`` or ``TRUNK_ONLY``."""
    path = Path(weights).expanduser()
    if not path.is_file():
        raise WsiTrainError(
            f"weights file {path} does not exist",
            hint="give the path of a local state-dict file or a run's best.pt / last.pt, or `imagenet`",
        )
    name = str(getattr(model, "name", type(model).__name__))
    state = _state_dict_from(_read(path), path, name)
    trunk_state = _trunk_state(state, model)
    target = model if trunk_state is None else model.get_submodule(TRUNK)
    state = state if trunk_state is None else trunk_state
    expected = target.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_listing(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches (file vs model): {_listing(shapes)}")
    if problems:
        what = "model" if trunk_state is None else "trunk of model"
        raise WsiTrainError(
            f"weights file {path} does not match the {what} {name!r}: " + "; ".join(problems),
            hint="use weights saved from the same model name and num_classes (wsitrain.models.build), or the trunk "
            f"alone (torch.save(model.{TRUNK}.state_dict(), path))",
        )
    target.load_state_dict(state, strict=True)
    return MODEL if trunk_state is None else TRUNK_ONLY
