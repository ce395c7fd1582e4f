"""The model a check runs: resolved by name or imported from ``module:function``, in float64 with random weights."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models.registry import TIMM_PREFIX, TORCHVISION_PREFIX, resolve_model_name

NUM_CLASSES = 3
KEY = "check-model NAME"
NAME_HINT = (
    "name a built-in (tiny, resnet18, ...), torchvision/<name>, timm/<name>, or a Python function returning an "
    "nn.Module as module:function (my_models:build_net, or path/to/file.py:build_net)"
)


def is_python_ref(name: str) -> bool:
    """``package.module:function`` or ``path/file.py:function`` (not a library name)."""
    return ":" in name and not name.startswith((TORCHVISION_PREFIX, TIMM_PREFIX))


def _import_module(ref: str) -> object:
    path = Path(ref)
    if ref.endswith(".py"):
        if not path.is_file():
            raise WsiTrainError(f"{KEY}: file {ref} does not exist", hint=NAME_HINT)
        spec = importlib.util.spec_from_file_location(f"wsitrain_check_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise WsiTrainError(f"{KEY}: cannot import {ref}", hint=NAME_HINT)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod
    try:
        return importlib.import_module(ref)
    except ModuleNotFoundError as e:
        raise WsiTrainError(
            f"{KEY}: cannot import module {ref!r}: {e}",
            hint="run from the folder that holds it, or add that folder to PYTHONPATH; " + NAME_HINT,
        ) from e


def _from_python(ref: str) -> nn.Module:
    module_ref, _, fn_name = ref.rpartition(":")
    if not module_ref or not fn_name.isidentifier():
        raise WsiTrainError(f"{KEY}: {ref!r} is not module:function", hint=NAME_HINT)
    fn = getattr(_import_module(module_ref), fn_name, None)
    if not callable(fn):
        raise WsiTrainError(f"{KEY}: {module_ref} has no function {fn_name!r}", hint=NAME_HINT)
    model = fn()
    if not isinstance(model, nn.Module):
        raise WsiTrainError(
            f"{KEY}: {ref}() returned {type(model).__name__}, not a torch.nn.Module",
            hint="the function must take no arguments and return the model",
        )
    return model


def load_model(name: str, train_bn: bool = False, seed: int = 0) -> nn.Module:
    """The model ``name`` in float64, seeded random weights (``randomize``), BatchNorm in train or eval mode.

    Everything else stays in eval mode: Dropout and stochastic depth would draw different masks in the two runs.
    """
    torch.manual_seed(seed)
    if is_python_ref(name):
        model = _from_python(name)
    else:
        from wsitrain.models import build

        resolve_model_name(name, key=KEY)  # ModelNameError (exit 2) naming the command's argument
        model = build(name, NUM_CLASSES, freeze_bn=not train_bn)
    model = model.double().eval()
    randomize(model)
    if train_bn:
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()  # a frozen BatchNorm (freeze_batchnorm) stays in eval mode
    return model


@torch.no_grad()
def randomize(model: nn.Module) -> None:
    """Keep every path of the model alive: libraries zero-init some gammas (the last BatchNorm of a residual
    block, GRN, skip-init gains) and BatchNorm starts with trivial statistics.

    BatchNorm affine parameters and running statistics become random; any other parameter whose elements are all
    equal (zeros, ones, a layer scale of 1e-6) becomes random with the same sign.
    """
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if m.affine:
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
            if m.running_mean is not None and m.running_var is not None:
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        for p in m.parameters(recurse=False):
            if p.numel() == 0 or not p.is_floating_point() or not bool((p == p.reshape(-1)[0]).all()):
                continue
            v = float(p.reshape(-1)[0])
            if v > 0:
                p.uniform_(0.5, 1.5)
            elif v < 0:
                p.uniform_(-1.5, -0.5)
            else:
                p.uniform_(-0.5, 0.5)


def parse_size(size: str) -> tuple[int, int]:
    """``128`` (square) or ``128x160`` (H x W) to (H, W)."""
    parts = size.lower().replace(" ", "").split("x")
    try:
        hw = [int(p) for p in parts]
    except ValueError:
        hw = []
    if len(hw) == 1:
        hw = hw * 2
    if len(hw) != 2 or min(hw) < 1:
        raise WsiTrainError(f"--size {size!r} is not an edge (128) or HxW (128x160)", hint="e.g. --size 128x160")
    return hw[0], hw[1]
