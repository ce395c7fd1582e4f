"""Attention on the simulated device as a GPU runs it: ``scaled_dot_product_attention``'s fused kernel.

On meta tensors PyTorch has no fused attention to choose, so ``F.scaled_dot_product_attention`` decomposes into its
math form, which materialises every head's tokens x tokens scores and their softmax (for a ViT-B chunk of 900
patches, 2 x 1.56 GiB that no CUDA step holds: simulated at 11200 px on the 2080 Ti preset). A CUDA device runs the
memory-efficient (or flash) kernel instead, which keeps an O(tokens) log-sum-exp for backward: within
``fused_attention()`` unmasked calls on meta tensors go to ``aten._scaled_dot_product_efficient_attention`` (its meta
kernel and backward exist); masked calls and other devices keep PyTorch's own choice.

The function is swapped on ``torch.nn.functional`` for the duration of the block rather than intercepted by a
``TorchFunctionMode``: a mode is thread-local, and the engine recomputes tiles inside backward, which autograd runs
on its own thread for the meta device (the mode was not active there: the recompute held the math form's scores).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def _fused(original: Any) -> Any:
    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        if attn_mask is None and not enable_gqa and q.device.type == "meta":
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, k, v, None, grad, float(dropout_p), bool(is_causal), scale=scale
            )
            return out[0]
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)  # fmt: skip

    return sdpa


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Within the block, unmasked ``F.scaled_dot_product_attention`` on meta tensors runs as CUDA's fused kernel."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
