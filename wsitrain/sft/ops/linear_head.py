"""A head whose gradient is known before the loss: a linear layer with one or two outputs after a global mean.

With ``pool -> flatten -> Linear(C, K)`` after the trunk, the pooled value's gradient is ``g @ W`` for the
loss's gradient ``g`` (1, K) on the logits. For one output (a risk score, a regression target) it is a multiple
of ``W[0]``; for two classes under a softmax loss (cross-entropy, with weights or label smoothing) ``g``'s two
entries sum to zero, since such a loss does not change when both logits move together, so it is a multiple of
``W[1] - W[0]``. Either way one *direction* ``u`` is known in forward, and only its coefficient waits for the
loss. The engine's one-pass segment (``execution/one_pass.py``) back-propagates each tile along ``u`` while it
computes the tile's forward, and scales the sums by the coefficient once the loss has given it: the last tiled
segment then needs no forward sweep of its own and no recompute.

A gradient off that direction (another loss on two logits, a head dropout's mask) is found in backward
(``coefficient``) and the segment runs its usual recompute instead: never a wrong gradient.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from wsitrain.sft.graph import ModelGraph

# The head's outputs a single direction covers: one (any loss) or two (a softmax loss).
MAX_OUTPUTS = 2

# A pooled gradient is taken as a multiple of the direction when what is left off it is at most this share of its
# norm. Cross-entropy's two logit gradients, p - y, sum to zero only up to the rounding of p0 + p1 = 1: in float64
# that leaves about 1e-16 of the gradient, in float32 about 1e-7, more on a slide the model calls with
# p = 1 - 1e-5, where float32's p - y itself carries that much rounding. Past this share (2^-12) the segment
# recomputes and back-propagates as without one-pass.
RESIDUAL_SHARE = 2.0**-12
# A head that multiplies in half precision (autocast, or half weights) rounds its weight and the pooled gradient to that
# precision: the gradient is off the float32 direction by that rounding alone (a share of 2.1e-3 in bf16 on the one-pass
# tests' ResNet block, against 7e-8 in float32, measured). Within RESIDUAL_SHARE every bf16 step recomputed after its
# one pass, as the H200 did (docs/benchmarks/gpu_time_breakdown.md): the segment's work twice. Up to four units of the
# dtype's rounding the gradient is taken as on the direction; the direction's multiple is then closer to the exact
# gradient than the rounded one is, and the one-pass gradients are as close to float64's as plain autocast's
# (tests/test_sft_one_pass.py).
HALF_RESIDUAL_SHARE = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}


def residual_share(head_dtype: torch.dtype) -> float:
    """The share of a pooled gradient's norm that may lie off the direction, for a head multiplying in this dtype."""
    return HALF_RESIDUAL_SHARE.get(head_dtype, RESIDUAL_SHARE)

_FLATTENS = (torch.flatten, torch.squeeze)
_FLATTEN_METHODS = ("flatten", "view", "reshape", "squeeze")


def _is_flatten(node: fx.Node, module: nn.Module | None) -> bool:
    if node.op == "call_module":
        return isinstance(module, nn.Flatten)
    if node.op == "call_function":
        return node.target in _FLATTENS
    return node.op == "call_method" and node.target in _FLATTEN_METHODS


def linear_head(graph: ModelGraph, pool: int, batch: int) -> int | None:
    """The index of the ``Linear`` that ends the model after the global pool ``pool``, when only flattening lies
    between them, it gives at most ``MAX_OUTPUTS`` values per sample and the batch is one slide; else None.

    One slide: the coefficient is per sample, and a tile's backward sums over the batch.
    """
    if batch != 1:
        return None
    i = pool
    while True:
        users = graph.nodes[i].users
        if len(users) != 1:
            return None
        j = users[0]
        if graph.nodes[j].inputs != (i,):
            return None
        module = graph.module(j)
        if isinstance(module, nn.Linear):
            plain = type(module).forward is nn.Linear.forward  # a subclass may do more than W x + b
            return j if not graph.nodes[j].users and plain and module.out_features <= MAX_OUTPUTS else None
        if not _is_flatten(graph.nodes[j].fx_node, module):
            return None
        i = j


def head_direction(weight: torch.Tensor) -> torch.Tensor:
    """The direction (C,) the pooled gradient takes for a ``Linear`` with this weight (K, C): ``W[0]`` for one
    output, ``W[1] - W[0]`` for two (a softmax loss)."""
    w = weight.detach()
    return w[0] if w.shape[0] == 1 else w[1] - w[0]


def coefficient(pooled_grad: torch.Tensor, direction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, residual)``: the multiple ``a`` (a 0-d float64 tensor) of ``direction`` (C,) nearest to the pooled
    gradient (1, C), and the share of the gradient's norm left off it (0-d float64; 1 for a zero direction)."""
    g = pooled_grad.reshape(-1).double()
    u = direction.reshape(-1).double().to(g.device)
    tiny = torch.finfo(torch.float64).tiny  # a zero denominator gives 0 / tiny = 0, not NaN, with no host read
    uu = (u * u).sum()
    a = (g * u).sum() / uu.clamp_min(tiny)
    share = (g - a * u).norm() / g.norm().clamp_min(tiny)
    return a, torch.where(uu > 0, share, torch.ones_like(share))
