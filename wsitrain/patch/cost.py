"""What one patch costs the engine: bytes autograd keeps, working sets, FLOPs, measured on fake tensors.

A patch encoder is one operator to the planner (``trunk.PatchTrunk``), so its memory cannot be read off its layers.
It is measured instead: the encoder runs on ``SMALL`` and ``LARGE`` patches under ``FakeTensorMode`` (shapes only,
nothing allocated, the user's weights untouched), once without autograd and once forward and backward, with the
live storages counted (``simulate.tracker.LiveMemory``), the saved tensors counted by
``torch.autograd.graph.saved_tensors_hooks`` and the FLOPs by ``torch.utils.flop_counter``. Each figure per patch is
the difference between the two runs over the patches between them, so what does not grow with the patches (the
weights, their autocast copies, their gradients) drops out. Low precision runs under CPU autocast on fake CPU
tensors, so the saved mix of float32 (LayerNorm, the residual stream) and half tensors is autocast's own, and the
attention is the ``scaled_dot_product_attention`` kernel the encoder calls (a fused kernel keeps an O(tokens) log-sum
-exp; the math path would keep each head's tokens x tokens matrix, and is measured as such when it is the one
called).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from wsitrain.sft.simulate.tracker import LiveMemory

# Patches per measuring run: two sizes, their difference is the per-patch slope. Two and four rather than one and
# two: at one patch a ViT-B's backward peak sits where its weight gradients are cast (a fixed cost), at two and more
# on its saved activations (measured on fake tensors: the 1 -> 2 difference was 4.8 MB, the 2 -> 4 one 117 MB).
SMALL, LARGE = 2, 4


@dataclass(frozen=True)
class PatchCost:
    """One patch's bytes and FLOPs in the engine's chunks, at one activation dtype (each figure per patch)."""

    saved: int  # bytes autograd keeps for backward (the patch's copy cut from the image included)
    forward_grad: int  # peak live bytes of a forward under autograd (saved included)
    forward_nograd: int  # peak live bytes of a forward without autograd (the forward sweep)
    backward: int  # peak live bytes of backward beyond ``saved`` (the gradients in flight)
    flops_forward: float
    flops_backward: float  # what autograd differentiates: frozen leading blocks are not (zero when nothing trains)
    largest_tensor: int  # elements of the largest tensor per patch (the 2^31-element limit of some kernels)
    # operators one call of the encoder runs that make a new tensor, forward and backward (whatever the patches): each
    # a kernel launch on a GPU, which the time model prices per call (costs.CALL_FLOPS); views launch none
    ops_forward: int = 1
    ops_backward: int = 1


def _fake_copy(module: nn.Module) -> nn.Module:
    """``module`` with fake CPU parameters and buffers of its shapes, dtypes and requires_grad (call in the mode)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="cpu"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
    return copy.deepcopy(module, memo)


class _Meter(LiveMemory):
    """Live host bytes without the parameters' gradients (they are the weights' cost, not the patches')."""

    def __init__(self) -> None:
        super().__init__(devices=("cpu",))
        self.grads = 0
        self.kernels = 0
        self.top = 0
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        before = len(self._info)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # an operator that makes a new storage launches a kernel; views, reshapes and transposes launch none
        self.kernels += len(self._info) > before
        self.top = max(self.top, self.live["cpu"] - self.grads)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out

    def reset(self) -> None:
        self.top = self.live["cpu"] - self.grads


@dataclass(frozen=True)
class _Run:
    saved: int
    forward_grad: int
    forward_nograd: int
    backward: int
    flops_forward: float
    flops_backward: float
    largest: int
    ops_forward: int
    ops_backward: int


def _run(encoder: nn.Module, n: int, patch: int, act_dtype: torch.dtype) -> _Run:
    low = act_dtype in (torch.float16, torch.bfloat16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        enc = _fake_copy(encoder)
        pdtype = next((p.dtype for p in enc.parameters()), torch.float32)
        x_dtype = torch.float32 if low else pdtype
        meter = _Meter()
        for p in enc.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: setattr(meter, "grads", meter.grads + q.nbytes))
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, nn.Parameter):
                saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        def cast() -> Any:
            return torch.autocast("cpu", dtype=act_dtype, enabled=low)

        with meter:
            x = torch.empty((n, 3, patch, patch), dtype=x_dtype)
            base = meter.live["cpu"]
            meter.reset()
            with torch.no_grad(), cast():
                enc(x)
            nograd = meter.top - base
            meter.reset()
            flops = FlopCounterMode(display=False)
            ops0 = meter.kernels
            with flops:
                with cast(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = enc(x)
                fwd_flops = flops.get_total_flops()
                ops1 = meter.kernels
                grad_fwd = meter.top - base
                kept = sum(saved.values())
                meter.reset()
                if y.requires_grad:
                    y.float().sum().backward()
                bwd_flops = flops.get_total_flops() - fwd_flops
            ops2 = meter.kernels
            bwd = max(0, meter.top - base - kept)
            del y
    return _Run(kept, grad_fwd, nograd, bwd, float(fwd_flops), float(bwd_flops), meter.largest, ops1 - ops0,
                ops2 - ops1)


def measure_patch_cost(encoder: nn.Module, patch: int, act_dtype: torch.dtype) -> PatchCost:
    """``encoder``'s per-patch cost at ``act_dtype`` (autocast's when bf16/fp16), in its current train/eval modes and
    with its current trainable parameters (see the module doc)."""
    a, b = _run(encoder, SMALL, patch, act_dtype), _run(encoder, LARGE, patch, act_dtype)
    k = LARGE - SMALL

    def per(f: str) -> int:
        return max(0, -(-(getattr(b, f) - getattr(a, f)) // k))  # rounded up: never below the slope

    return PatchCost(
        saved=per("saved"), forward_grad=per("forward_grad"), forward_nograd=per("forward_nograd"),
        backward=per("backward"), flops_forward=(b.flops_forward - a.flops_forward) / k,
        flops_backward=(b.flops_backward - a.flops_backward) / k, largest_tensor=max(1, b.largest // LARGE),
        ops_forward=max(1, b.ops_forward), ops_backward=b.ops_backward,
    )  # fmt: skip
