"""Models the SFT engine can run: each is a plain chain ``normalize -> features -> pool -> flatten -> classifier``.

Names (built-ins, ``torchvision/<name>``, ``timm/<name>``) are defined once in ``wsitrain.models.registry``,
which is torch-free so config validation does not import torch. The names below are imported on first use
for the same reason (PEP 562 module ``__getattr__``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from wsitrain.models.registry import (
    BUILTIN_MODELS,
    BUILTIN_NAMES,
    IMAGENET,
    ModelNameError,
    ModelSpec,
    is_imagenet,
    resolve_model_name,
)

if TYPE_CHECKING:
    from wsitrain.models.frozen_bn import FrozenBatchNorm2d, freeze_batchnorm, is_frozen_bn
    from wsitrain.models.heads import POOLS
    from wsitrain.models.normalize import IMAGENET_MEAN, IMAGENET_STD, InputNormalization
    from wsitrain.models.weights import load_weights
    from wsitrain.models.zoo import MODEL_NAMES, build, count_parameters, parameter_bytes

_LAZY = {
    "FrozenBatchNorm2d": "frozen_bn",
    "freeze_batchnorm": "frozen_bn",
    "is_frozen_bn": "frozen_bn",
    "IMAGENET_MEAN": "normalize",
    "IMAGENET_STD": "normalize",
    "InputNormalization": "normalize",
    "load_weights": "weights",
    "MODEL_NAMES": "zoo",
    "POOLS": "heads",
    "build": "zoo",
    "count_parameters": "zoo",
    "parameter_bytes": "zoo",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"wsitrain.models.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'wsitrain.models' has no attribute {name!r}")


__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_NAMES",
    "IMAGENET",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MODEL_NAMES",
    "POOLS",
    "FrozenBatchNorm2d",
    "InputNormalization",
    "ModelNameError",
    "ModelSpec",
    "build",
    "count_parameters",
    "freeze_batchnorm",
    "is_frozen_bn",
    "is_imagenet",
    "load_weights",
    "parameter_bytes",
    "resolve_model_name",
]
