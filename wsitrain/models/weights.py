"""Load a local state-dict file into a model, with errors that name the file and the offending keys."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from wsitrain.errors import WsiTrainError

_SHOW = 5  # keys listed in an error; a mismatch usually means a different architecture, a few names say which


def _state_dict_from(obj: object, path: Path) -> dict[str, torch.Tensor]:
    # Training checkpoints often wrap the weights; accept the two common wrappers.
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


def load_weights(model: nn.Module, weights: str | Path) -> None:
    """Load ``weights`` (a local file) into ``model`` strictly; raise WsiTrainError on any mismatch."""
    path = Path(weights).expanduser()
    if not path.is_file():
        raise WsiTrainError(f"weights file {path} does not exist", hint="give the path of a local state-dict file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip or unsafe-type errors all mean: not a plain state-dict file
        raise WsiTrainError(
            f"cannot read weights file {path}: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            hint="save it with torch.save(model.state_dict(), path); only tensors are loaded (weights_only)",
        ) from e
    state = _state_dict_from(obj, path)
    name = getattr(model, "name", type(model).__name__)
    expected = model.state_dict()
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
        raise WsiTrainError(
            f"weights file {path} does not match model {name!r}: " + "; ".join(problems),
            hint="use weights saved from the same model name and num_classes (wsitrain.models.build)",
        )
    model.load_state_dict(state, strict=True)
