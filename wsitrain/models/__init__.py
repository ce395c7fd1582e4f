"""Models the SFT engine can run: each is a plain chain ``normalize -> features -> pool -> flatten -> classifier``."""

from wsitrain.models.frozen_bn import FrozenBatchNorm2d, freeze_batchnorm
from wsitrain.models.normalize import IMAGENET_MEAN, IMAGENET_STD, InputNormalization
from wsitrain.models.weights import load_weights
from wsitrain.models.zoo import MODEL_NAMES, POOLS, build, count_parameters, parameter_bytes

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MODEL_NAMES",
    "POOLS",
    "FrozenBatchNorm2d",
    "InputNormalization",
    "build",
    "count_parameters",
    "freeze_batchnorm",
    "load_weights",
    "parameter_bytes",
]
