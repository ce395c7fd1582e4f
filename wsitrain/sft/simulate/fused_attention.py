"""Attention on the simulated device as a GPU runs it: ``scaled_dot_product_attention``'s fused kernel.

On meta tensors PyTorch has no fused attention to choose, so ``F.scaled_dot_product_attention`` decomposes into its
math form, which materialises every head's tokens x tokens scores and their softmax (for a ViT-B chunk of 900
patches, 2 x 1.56 GiB that no CUDA step holds: simulated at 22400 px on the 2080 Ti preset). A CUDA device runs the
memory-efficient (or flash) kernel instead, which keeps an O(tokens) log-sum-exp for backward: the call is routed to
``aten._scaled_dot_product_efficient_attention`` (its meta kernel and backward exist) while the mode is active.
Calls with an attention mask keep PyTorch's own choice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class FusedAttention(TorchFunctionMode):
    """Within the mode, unmasked ``scaled_dot_product_attention`` on meta tensors runs as CUDA's fused kernel."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is None and q.device.type == "meta" and not kwargs.get("enable_gqa", False):
                dropout = float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
                causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
                out = torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k, v, None, grad, dropout, causal, scale=kwargs.get("scale")
                )
                return out[0]
        return func(*args, **kwargs)
