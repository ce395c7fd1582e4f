"""A tile's 1x1 convolution as a matrix product, where cuDNN runs it on slow kernels.

A tile's halo leaves maps whose pixel count is not a multiple of 8 (387 x 387, 321 x 193). On such NCHW maps in half
precision cuDNN falls back to old generic kernels for 1x1 layers, and forward with backward runs up to 12x slower than
the same layer as a matrix product over the map's pixels, measured on an H200 (bf16, nine tile shapes of ResNet-50's
capped 8192 px step: 8-61 TFLOP/s as convolutions, 96-145 as matrix products, 3.0-12.1x on 128-1024 channels and
about even on 64-256; aligned maps: the same time either way; ``benchmarks/bench_pointwise.py``,
docs/benchmarks/pointwise_matmul.md). cuBLAS takes any leading dimension.

The product is the convolution's arithmetic: for each image, ``W (Cout, Cin) @ x (Cin, H*W)``. In float64 it equals
the layer to rounding; in bf16 the forward came out bitwise equal on every measured shape. Its autograd saves the same
two tensors a convolution saves (the input, a view of the tile's map, and the weight), so the memory a plan counts
holds. The plan says which layers may switch (``SegmentPlan.pointwise_matmul``: tiled segments planned for CUDA in
half precision); a tile decides by its own map's shape, so tiles of one geometry (background reuse) decide alike.
"""

from __future__ import annotations

import torch
from torch import nn

from wsitrain.precision import is_half

# a map's pixels per channel must be a multiple of this for cuDNN's fast 1x1 kernels in half precision: 16 bytes of
# bf16 / fp16 (the H200's kernels by shape: docs/benchmarks/gpu_time_breakdown.md). The simulated clock reads it too.
ALIGN = 8


def is_pointwise_conv(m: nn.Module | None) -> bool:
    """A plain ``nn.Conv2d`` with a 1x1 kernel, stride 1, no padding and one group (subclasses with their own forward,
    such as timm's weight-standardized or same-padding convolutions, are left to run as themselves)."""
    return (
        isinstance(m, nn.Conv2d)
        and type(m).forward is nn.Conv2d.forward
        and tuple(m.kernel_size) == (1, 1)
        and tuple(m.stride) == (1, 1)
        and m.groups == 1
        and (m.padding == "valid" or tuple(m.padding) == (0, 0))
    )


def switches_to_matmul(device_kind: str, act_dtype: torch.dtype) -> bool:
    """Whether a plan for this device kind and activation dtype lets tiles run 1x1 layers as matrix products."""
    return device_kind == "cuda" and is_half(act_dtype)


def unaligned(x: torch.Tensor) -> bool:
    """One image's map (a batch of several runs the layer: ``bmm`` over a stride-0 weight was no faster, 3.71 against
    3.64 ms for 2 x 323 x 389 on an H200), contiguous (NCHW, not a crop: a product then needs no copy), whose pixel
    count is not a multiple of ``ALIGN``."""
    return x.dim() == 4 and x.shape[0] == 1 and x.is_contiguous() and (x.shape[2] * x.shape[3]) % ALIGN != 0


class PointwiseMatmul:
    """What a tile runs in a 1x1 layer's place: the layer itself on aligned maps, its matrix product on others."""

    def __init__(self, conv: nn.Module | None) -> None:
        if not isinstance(conv, nn.Conv2d) or not is_pointwise_conv(conv):
            raise ValueError(f"not a plain 1x1 convolution: {conv}")
        self.conv = conv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # a layer with hooks (a user's forward hook, an old-style spectral norm) runs as itself: they see its call
        if not unaligned(x) or self.conv._forward_hooks or self.conv._forward_pre_hooks:
            return self.conv(x)
        return pointwise_matmul(x, self.conv.weight, self.conv.bias)


def pointwise_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``conv2d(x, weight, bias)`` for a 1x1 kernel, as a matrix product over pixels. (B, Cin, H, W) -> (B, Cout, H, W).

    Under autocast the product casts both operands (the weight per call: a view is not a leaf autocast caches).
    """
    b, cin, h, w = x.shape
    cout = weight.shape[0]
    w2 = weight.reshape(cout, cin)  # (Cout, Cin), a view
    if b == 1:
        y = torch.mm(w2, x.reshape(cin, h * w))  # (Cout, H*W)
    else:
        # one weight for every image: bmm reads it through a stride-0 view (matmul would fold the batch into the
        # pixels, copying the map transposed)
        y = torch.bmm(w2.expand(b, cout, cin), x.reshape(b, cin, h * w))  # (B, Cout, H*W)
    y = y.reshape(b, cout, h, w)
    if bias is not None:
        y = y + bias.to(y.dtype).reshape(1, cout, 1, 1)
    return y


__all__ = ["ALIGN", "PointwiseMatmul", "is_pointwise_conv", "pointwise_matmul", "switches_to_matmul", "unaligned"]
