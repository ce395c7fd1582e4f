"""A frozen BatchNorm folded into the convolution before it: which pairs fold, and the folded weights.

A BatchNorm normalising with its running statistics is a per-channel scale and shift of its input. After a
convolution it is one convolution: ``s = gamma / sqrt(var + eps)``, ``w' = w * s`` (per output channel) and
``b' = beta + (b - mean) * s`` (``b`` = 0 without a bias). The engine computes ``w'`` and ``b'`` once per step from
the original parameters, with autograd (``execution/folds.py``), so the convolution's weight and bias and the
BatchNorm's weight and bias get their gradients through the fold, checkpoints keep the original parameters, and no
BatchNorm kernel runs, forward or backward. Measured on an H200 (docs/benchmarks/gpu_time_breakdown.md): frozen
BatchNorm took 261 of the capped ResNet-50 step's 683 ms, in kernels at 0.13-0.17 of the card's bandwidth.

A pair folds when:
- the convolution is a plain ``nn.Conv2d`` (its own forward, zero padding, no hooks) whose only reader is the
  BatchNorm: its output exists nowhere else, so nothing can tell it changed;
- the BatchNorm normalises with running statistics (eval mode, or frozen by ``freeze_batchnorm``), runs torch's,
  wsitrain's frozen or timm's BatchNormAct2d forward (its activation stays, applied after the folded convolution;
  its drop is inactive in eval mode), has no hooks, and matches the convolution's output channels.
A BatchNorm *before* a convolution (DenseNet's norm-relu-conv) does not fold: its shift would have to pass through
the convolution's zero padding, which is not shifted, so the border pixels would differ.
The engine folds only when no BatchNorm of the model normalises with batch statistics: a multi-pass segment
(``execution/barrier_stats.py``) differentiates its statistics against the layers' own parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from wsitrain.models.frozen_bn import FrozenBatchNorm2d
from wsitrain.sft.ops.activations import ACTIVATIONS
from wsitrain.sft.ops.norm_act import act_after_norm, is_batchnorm_act, norm_act_refusal, uses_batch_stats
from wsitrain.sft.ops.types import ELEMENTWISE, POINTWISE, OpSpec


def _no_hooks(m: nn.Module) -> bool:
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def foldable_conv(m: nn.Module | None) -> bool:
    """A plain ``nn.Conv2d`` whose forward is torch's, with zero padding and no hooks."""
    return (
        isinstance(m, nn.Conv2d)
        and type(m).forward is nn.Conv2d.forward
        and m.padding_mode == "zeros"
        and _no_hooks(m)
    )


def foldable_bn(m: nn.Module | None) -> bool:
    """A BatchNorm2d normalising with its running statistics now, whose forward is torch's, wsitrain's frozen one or
    timm's BatchNormAct2d (drop inactive, activation elementwise), without hooks."""
    if not isinstance(m, nn.BatchNorm2d) or isinstance(m, nn.SyncBatchNorm) or uses_batch_stats(m):
        return False
    known = type(m).forward in (_BatchNorm.forward, FrozenBatchNorm2d.forward) or (
        is_batchnorm_act(m) and norm_act_refusal(m) is None
    )
    return known and _no_hooks(m)


def fold_pairs(gm: fx.GraphModule, nodes: list[fx.Node]) -> dict[int, int]:
    """Convolution node index -> BatchNorm node index for every pair that folds now (module docstring); ``nodes``:
    the graph's nodes in execution order (``ModelGraph.nodes``' fx nodes). Empty when any BatchNorm of the model
    normalises with batch statistics."""
    if any(isinstance(m, _BatchNorm) and uses_batch_stats(m) for m in gm.modules()):
        return {}
    index = {n: i for i, n in enumerate(nodes)}
    pairs: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if n.op != "call_module" or len(n.users) != 1:
            continue
        conv = gm.get_submodule(str(n.target))
        (user,) = n.users
        if not foldable_conv(conv) or user.op != "call_module" or user not in index:
            continue
        bn = gm.get_submodule(str(user.target))
        if not foldable_bn(bn) or user.all_input_nodes != [n] or len(user.args) != 1 or user.kwargs:
            continue
        assert isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d)
        if bn.num_features == conv.out_channels:
            pairs[i] = index[user]
    return pairs


def folded_weights(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w', b')`` of the convolution with the BatchNorm folded in, through autograd from the original parameters.
    (Cout, Cin/groups, kh, kw) and (Cout,)."""
    assert bn.running_mean is not None and bn.running_var is not None
    scale = torch.rsqrt(bn.running_var + bn.eps)  # (Cout,)
    if bn.weight is not None:
        scale = bn.weight * scale
    w = conv.weight * scale.reshape(-1, 1, 1, 1)
    shift = -bn.running_mean if conv.bias is None else conv.bias - bn.running_mean
    b = shift * scale
    if bn.bias is not None:
        b = bn.bias + b
    return w, b


def folded_conv(conv: nn.Conv2d, weight: torch.Tensor, bias: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The convolution run with the folded weights (its stride, padding, dilation and groups)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        return conv._conv_forward(x, weight, bias)

    return run


def after_fold(bn: nn.BatchNorm2d) -> Callable[[torch.Tensor], torch.Tensor]:
    """What runs in a folded BatchNorm's place: nothing (its input itself), or a BatchNormAct2d's activation, out of
    place."""
    act = act_after_norm(bn)
    if act is None:
        return _identity
    return act


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def folded_bn_spec(bn: nn.BatchNorm2d, name: str) -> OpSpec:
    """The planner's view of a folded BatchNorm: an alias of its input, or its activation (out of place)."""
    act = act_after_norm(bn)
    if act is None:
        return OpSpec(POINTWISE, name, alias=True, layout_rule=ELEMENTWISE)
    si, so = ACTIVATIONS.get(type(act), (True, True))  # timm's own activations: as if it kept both
    return OpSpec(
        POINTWISE,
        name,
        saves_input=si,
        saves_output=so,
        flops_per_output=1.0,
        has_params=any(True for _ in act.parameters()),
        layout_rule=ELEMENTWISE,
    )


__all__ = [
    "after_fold",
    "fold_pairs",
    "foldable_bn",
    "foldable_conv",
    "folded_bn_spec",
    "folded_conv",
    "folded_weights",
]

