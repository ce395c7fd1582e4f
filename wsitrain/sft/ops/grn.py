"""ConvNeXt V2's global response normalization (timm's ``GlobalResponseNorm``): a statistic of the whole map.

    g = ||x||_2 over H and W, per (sample, channel)        n = g / (mean of g over channels + eps)
    y = x + bias + weight * x * n

Pointwise in space once ``n`` is known, like squeeze-excitation. The module is kept whole by the tracer; on its
own it is not tileable (no tile sees ``g``). The annotating pass makes it a multi-pass barrier
(``wsitrain.sft.ops.barriers``, kind GRN): a sweep sums each tile's owned squares into ``s = sum x^2``, ``n`` is
computed once from ``s``, and tiles apply the formula above with ``n`` fixed; in backward, the gradient of ``n``
summed over all tiles gives ``G_s``, and each position's share of the statistic's gradient is ``2 x G_s``
(``wsitrain.sft.execution.barrier_stats``). The layout is the module's: ``channels_last`` (B, H, W, C) or not.
"""

from __future__ import annotations

import torch
from torch import nn

from wsitrain.sft.ops.types import ELEMENTWISE, OPAQUE, OpSpec

GRN_NAMES = ("GlobalResponseNorm",)
# per element: its square for the statistic (2), then x * n, * weight, + bias, + x (4); autograd keeps x
GRN_FLOPS = 6.0


def is_grn_module(m: nn.Module) -> bool:
    """timm's GlobalResponseNorm (known by name: timm is optional), with the attributes its forward reads."""
    return type(m).__name__ in GRN_NAMES and all(
        hasattr(m, a) for a in ("spatial_dim", "channel_dim", "wb_shape", "eps", "weight", "bias")
    )


def grn_spec(m: nn.Module) -> OpSpec:
    """Untileable on its own; the annotating pass turns it into a barrier when its layout is the map's."""
    return OpSpec(
        OPAQUE,
        type(m).__name__,
        tileable=False,
        why_not="global response normalization divides by a norm over the whole map",
        saves_input=True,
        flops_per_output=GRN_FLOPS,
        has_params=True,
        layout_rule=ELEMENTWISE,  # keeps its input's layout, channels-last or not
    )


def grn_spatial_dims(m: nn.Module, ndim: int) -> tuple[int, int]:
    """The dims the module's norm runs over, normalized to ``ndim``."""
    a, b = m.spatial_dim
    return int(a) % ndim, int(b) % ndim


def grn_normalizer(m: nn.Module, sq: torch.Tensor) -> torch.Tensor:
    """``n`` from the sum of squares ``sq`` (keepdim over the image axes), as the module computes it from x."""
    x_g = sq.sqrt()
    return x_g / (x_g.mean(dim=m.channel_dim, keepdim=True) + m.eps)


def grn_apply(m: nn.Module, x: torch.Tensor, x_n: torch.Tensor) -> torch.Tensor:
    """The module's output on a tile ``x`` with the whole map's ``n``."""
    return x + torch.addcmul(m.bias.view(m.wb_shape), m.weight.view(m.wb_shape), x * x_n.to(x.dtype))
