"""timm's norm-act layers: a BatchNorm2d whose forward also applies ``self.drop`` then ``self.act``.

``timm.layers.norm_act.BatchNormAct2d`` subclasses ``nn.BatchNorm2d`` (so its weights load as a plain BatchNorm's)
and its forward is a copy of ``_BatchNorm.forward`` (the same momentum / cumulative-average / running-statistics
handling, then ``F.batch_norm``) followed by ``x = self.act(self.drop(x))``. After the normalization everything is
pointwise in space when the drop does nothing and the activation is elementwise, so the layer tiles as a
BatchNorm does: in eval mode as a pointwise layer, in training mode as a batch-statistics barrier whose sweeps
apply the drop and activation after ``(x - m) * inv * w + b``.

Recognized by class name and module (no timm import: timm is optional) and only when the class keeps timm's own
forward: a subclass that overrides it means something else. Refused, by name:
- a drop that is active (training with a positive rate): its mask would differ between a tile and the map;
- an activation that is not a known elementwise one (it could mix positions);
- ``SyncBatchNorm`` / timm's ``SyncBatchNormAct`` in training: statistics reduced across processes (in eval they
  normalize with running statistics, pointwise);
- any other BatchNorm2d subclass with its own forward, with batch statistics.
timm's ``FrozenBatchNormAct2d`` is a plain ``nn.Module`` (not a BatchNorm): it is traced through as the pointwise
arithmetic it is and needs nothing here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from wsitrain.sft.ops.activations import is_pointwise_module, known_activation

# elementwise activations timm creates (timm.layers.create_act: get_act_layer) besides torch.nn's own
_TIMM_ACT_MODULES = ("timm.layers.activations", "timm.layers.activations_me")
# timm's drops that are the identity in eval or at rate 0 (attribute holding the rate)
_TIMM_DROPS = {"DropBlock2d": "drop_prob", "DropPath": "drop_prob"}


def _timm_batchnorm_act(m: nn.Module) -> type | None:
    """timm's BatchNormAct2d class among ``type(m)``'s bases, when ``m`` runs its forward (else None)."""
    for cls in type(m).__mro__:
        if cls.__name__ == "BatchNormAct2d" and cls.__module__.startswith("timm."):
            return cls if type(m).forward is cls.forward else None
    return None


def is_batchnorm_act(m: nn.Module) -> bool:
    """A timm BatchNormAct2d (or a subclass keeping its forward, such as wsitrain's frozen one)."""
    return isinstance(m, nn.BatchNorm2d) and _timm_batchnorm_act(m) is not None


def is_sync_batchnorm(m: nn.Module) -> bool:
    """torch's SyncBatchNorm, or timm's SyncBatchNormAct built on it."""
    return isinstance(m, nn.SyncBatchNorm)


def _is_elementwise_act(a: nn.Module) -> bool:
    return (
        isinstance(a, nn.Identity)
        or known_activation(a)
        or type(a).__module__ in _TIMM_ACT_MODULES
        or is_pointwise_module(a)
    )


def _drop_active(d: nn.Module) -> bool | None:
    """Whether drop ``d`` changes its input now; None for a drop this module does not know."""
    if isinstance(d, nn.Identity):
        return False
    if isinstance(d, _DropoutNd):
        return d.training and d.p > 0
    rate = _TIMM_DROPS.get(type(d).__name__)
    if rate is not None and type(d).__module__.startswith("timm."):
        return d.training and float(getattr(d, rate, 0.0)) > 0
    return None


def norm_act_refusal(m: nn.Module) -> str | None:
    """Why norm-act layer ``m`` cannot be tiled as a BatchNorm followed by pointwise layers; None when it can
    (and for anything that is no norm-act layer)."""
    name = type(m).__name__
    drop, act = getattr(m, "drop", None), getattr(m, "act", None)
    if not (is_batchnorm_act(m) or (is_sync_batchnorm(m) and (drop is not None or act is not None))):
        return None
    if drop is not None:
        active = _drop_active(drop)
        if active is None:
            return (
                f"{name}'s drop layer {type(drop).__name__} is not a drop the SFT engine knows (nn.Dropout, timm's "
                "DropBlock2d or DropPath); use one of those, or none"
            )
        if active:
            return (
                f"{name}'s drop layer {type(drop).__name__} is active in training: its random mask would be drawn "
                "per tile, not once for the map; set its rate to 0 or put it in eval mode"
            )
    if act is not None and not _is_elementwise_act(act):
        return (
            f"{name}'s activation {type(act).__name__} is not an elementwise activation the SFT engine knows "
            "(torch.nn's or timm.layers.activations'); it could mix positions across tiles"
        )
    return None


def uses_batch_stats(m: nn.Module) -> bool:
    """A BatchNorm that normalizes with batch statistics: training mode, or no running statistics."""
    return isinstance(m, _BatchNorm) and (m.training or m.running_mean is None)


def sync_batchnorm_refusal(m: nn.Module) -> str | None:
    """Why a SyncBatchNorm(Act) cannot be tiled now: with batch statistics it reduces them across processes."""
    if not (is_sync_batchnorm(m) and uses_batch_stats(m)):
        return None
    return (
        f"{type(m).__name__} with batch statistics (training mode) reduces them across processes, which tiles of "
        "one process cannot reproduce; convert it back to BatchNorm2d / timm's BatchNormAct2d (their batch "
        "statistics tile exactly), or freeze it (eval mode)"
    )


def custom_batchnorm_refusal(m: nn.Module) -> str | None:
    """Why a BatchNorm2d subclass with its own forward cannot be tiled with batch statistics (in eval mode with
    running statistics it stays a pointwise layer, as before)."""
    if not (isinstance(m, nn.BatchNorm2d) and uses_batch_stats(m)):
        return None
    if type(m).forward is _BatchNorm.forward or is_batchnorm_act(m):
        return None
    return (
        f"{type(m).__name__} overrides BatchNorm2d's forward; with batch statistics (training mode) the SFT engine "
        "tiles exactly only torch's BatchNorm2d and timm's BatchNormAct2d; freeze it "
        "(wsitrain.models.freeze_batchnorm(model), or eval mode)"
    )


def act_after_norm(m: nn.BatchNorm2d) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a BatchNormAct2d applies after its normalization (its drop, inactive here, then its activation),
    out of place; None for a plain BatchNorm or an identity activation. Call only when ``norm_act_refusal`` is None.
    """
    if not is_batchnorm_act(m):
        return None
    act = getattr(m, "act", None)
    if act is None or isinstance(act, nn.Identity):
        return None
    if getattr(act, "inplace", False):
        # in place it would write into the normalized tile autograd may still read; shallow copy: shares parameters
        act = copy.copy(act)
        act.inplace = False
    return act
