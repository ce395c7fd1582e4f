"""The precisions a run, a plan or a benchmark can use: their names, and what each means to torch.

The one place that maps ``fp32`` / ``bf16`` / ``fp16`` to dtypes. Names and checks are torch-free so the
config can use them without importing torch; the dtype functions import torch when first called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, get_args

from wsitrain.errors import WsiTrainError

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_precision(name: str, what: str = "--precision") -> Precision:
    """``name`` if it is a known precision, else a WsiTrainError naming ``what`` (the option or config key)."""
    if name not in PRECISIONS:
        raise WsiTrainError(f"{what}: unknown precision {name!r}", hint=f"choose one of: {', '.join(PRECISIONS)}")
    return name  # type: ignore[return-value]


def activation_dtype(name: str) -> torch.dtype:
    """The dtype activations are computed in (what the planner sizes): float32, bfloat16 or float16."""
    import torch  # here, not at the top: config.py imports this module and must stay torch-free

    return getattr(torch, _DTYPE_NAMES[check_precision(name)])


def is_half(dtype: torch.dtype) -> bool:
    """Is ``dtype`` one of the half precisions (bf16, fp16: tensor-core arithmetic on a GPU)?"""
    return dtype in (activation_dtype("bf16"), activation_dtype("fp16"))


def autocast_dtype(name: str) -> torch.dtype | None:
    """The dtype for ``torch.autocast``; None for fp32, which runs without autocast."""
    return None if check_precision(name) == "fp32" else activation_dtype(name)


def _cuda_has_bf16(device: torch.device) -> bool:
    import torch

    with torch.cuda.device(device):
        try:  # torch >= 2.4 reports emulated bf16 (slow, pre-Ampere) as supported unless told not to
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:
            return bool(torch.cuda.is_bf16_supported())


def check_device_precision(
    name: str,
    device: torch.device,
    what: str = "train.precision",
    has_bf16: Callable[[torch.device], bool] | None = None,
) -> None:
    """WsiTrainError when ``device`` cannot run precision ``name``: bf16 needs an Ampere or newer GPU
    (compute capability >= 8.0); before it, bf16 kernels are emulated or missing. ``has_bf16`` is injectable."""
    if name != "bf16" or device.type != "cuda":
        return
    if not (has_bf16 or _cuda_has_bf16)(device):
        raise WsiTrainError(
            f"{what}: bf16 needs an Ampere or newer GPU (compute capability 8.0 or more); {device} is older",
            hint="set the precision to fp16 (with gradient scaling) or fp32",
        )
