"""Load a local weights file into a model, with errors that name the file and the offending keys.

Accepted: a plain state dict (``torch.save(model.state_dict(), path)``), the common ``{"state_dict": ...}`` /
``{"model": ...}`` wrappers, and a wsitrain run checkpoint (``best.pt`` / ``last.pt``), whose model state is used.
Files are read with ``weights_only=True``: tensors and plain containers only, nothing executed from the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from wsitrain.errors import WsiTrainError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SHOW = 5  # keys listed in an error; a mismatch usually means a different architecture, a few names say which


def first_line(exc: BaseException) -> str:
    """An exception as one plain line: its type and the first line of its message, without terminal escapes
    (torch's weights-only error carries ANSI bold codes)."""
    text = _ANSI.sub("", str(exc)).strip()
    return f"{exc.__class__.__name__}: {text.splitlines()[0]}" if text else exc.__class__.__name__


def _numpy_rng_globals() -> list[Any]:
    """What a run checkpoint's numpy RNG state pickles (an ndarray of uint32), allowed for weights_only loading."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    dtype_classes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64)]
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, *dtype_classes]


def _read(path: Path) -> object:
    try:
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip or unsafe-type errors all mean: not a weights file we can read safely
        raise WsiTrainError(
            f"cannot read weights file {path}: {first_line(e)}",
            hint="give a state dict saved with torch.save(model.state_dict(), path), or best.pt / last.pt of a "
            "wsitrain run; only tensors and plain containers are loaded (weights_only)",
        ) from e


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


def load_weights(model: nn.Module, weights: str | Path) -> None:
    """Load ``weights`` (a local file) into ``model`` strictly; raise WsiTrainError on any mismatch."""
    path = Path(weights).expanduser()
    if not path.is_file():
        raise WsiTrainError(
            f"weights file {path} does not exist",
            hint="give the path of a local state-dict file or a run's best.pt / last.pt, or `imagenet`",
        )
    name = str(getattr(model, "name", type(model).__name__))
    state = _state_dict_from(_read(path), path, name)
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
