"""Attention pooling over the whole map (attention-MIL, ABMIL / CLAM), plain and fused into the last tiled segment.

The trunk ends in a map ``hs`` (B, C + K, H, W): C feature channels ``h`` and K attention scores ``s`` (one per
branch), computed per position by ordinary layers (a 1x1 projection, ``tanh(V h)`` and, gated, ``sigmoid(U h)``,
then ``w``: wsitrain.models.attention). ``AttentionPool`` turns it into K pooled vectors (B, K, C)::

    a_k = softmax over (H, W) of s_k (positions outside ``mask`` excluded)        # (B, K, H, W)
    z_k = sum_p a_kp h_p                                                          # (B, K, C)

Fused (``AttentionAccumulator``), each tile folds into a running maximum ``m``, denominator ``d`` and weighted sum
``S`` (the online softmax: when ``m`` grows the old terms are rescaled by ``exp(m_old - m_new)``), so the map never
exists whole. Backward gives each recomputed tile the gradient softmax-then-sum gives it, from the global ``m``,
``d``, pooled ``z`` and pooled gradient ``G`` (B, K, C)::

    dL/dh_p = sum_k a_kp G_k                 dL/ds_kp = a_kp (G_k . h_p - G_k . z_k)

Instance scores (``instance_k`` > 0, for ``model.attention.instance_loss``): each branch's ``instance_k`` highest
scores over the attended positions are appended to its pooled vector, (B, K, C + instance_k), largest first, ties by
the lower row-major index (``topk_pool.ordered``), -inf past the positions the mask keeps. Fused, each tile's scores
are merged into a running list in that same order, so the tiled forward keeps exactly the plain one's positions; in
backward a tile adds each kept score's gradient at the position it holds::

    dL/ds_kp += dL/dtop_kj    where top_kj is position p's score

Border (``border`` > 0, ``model.attention.border_cells``): the map's outer ``border`` rings of cells are left out of the
mask, as background is. Their features are computed against the trunk's zero padding, so they differ from the tissue's
in the same way on every slide; an attention head can rank them first on every slide, and the instance loss held its
peak there (docs/research/plateau.md section 11, measured). A sample whose kept positions all lie on the border keeps
them: a slide is never left with nothing to attend to.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from wsitrain.sft.ops.pool_mask import MaskedPool, MaskSource
from wsitrain.sft.ops.topk_pool import merge_tile, ordered, scatter_kept


class AttentionPool(MaskedPool, nn.Module):
    """(B, C + K, H, W) -> (B, K, C): each branch's attention-weighted mean of the C features; with ``instance_k``,
    (B, K, C + instance_k): each branch's highest scores follow its vector (``instance_scores``).

    ``mask`` (B or 1, 1, H, W) bool, set for one forward with ``masked()`` (pool_mask.MaskedPool): positions outside
    it get no attention (CLAM attends to tissue patches only). A sample whose mask is empty everywhere is an error,
    not a silent NaN.
    """

    allows_empty_mask = False

    def __init__(self, branches: int = 1, instance_k: int = 0, border: int = 0) -> None:
        super().__init__()
        if branches < 1:
            raise ValueError(f"AttentionPool needs at least one branch, got {branches}")
        for name, value in (("instance_k", instance_k), ("border", border)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"AttentionPool's {name} must be an integer >= 0, got {value!r}")
        self.branches = branches
        self.instance_k = instance_k
        self.border = border
        self.mask: MaskSource | None = None

    def mask_at(self, height: int, width: int) -> torch.Tensor | None:
        """The set mask (``MaskedPool.mask_at``) without the map's outer ``border`` rings: (B or 1, 1, H, W) bool, or
        None (everywhere) without either. Plain and fused read it here alike."""
        mask = super().mask_at(height, width)
        b = self.border
        if not b or height <= 2 * b or width <= 2 * b:  # a map with no inside keeps its border
            return mask
        inside = torch.zeros(1, 1, height, width, dtype=torch.bool)
        inside[..., b : height - b, b : width - b] = True
        if mask is None:
            return inside
        kept = mask & inside.to(mask.device)  # (B, 1, H, W)
        if is_fake(kept):
            return kept
        on_border_only = ~kept.flatten(1).any(1)  # (B,)
        return torch.where(on_border_only[:, None, None, None], mask, kept) if bool(on_border_only.any()) else kept

    def weights(self, hs: torch.Tensor) -> torch.Tensor:
        """The attention weights (B, K, H, W) this pool gives ``hs``: softmax over the map, 0 outside the mask."""
        s = hs[:, -self.branches :]  # (B, K, H, W)
        mask = self.mask_at(s.shape[-2], s.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask.to(s.device), float("-inf"))
        return torch.softmax(s.flatten(2), dim=-1).view_as(s)

    def forward(self, hs: torch.Tensor) -> torch.Tensor:
        # in the map's dtype even under autocast (bf16 tiles accumulate in float32): as the fused pool computes it
        with without_autocast(hs):
            h = hs[:, : -self.branches]  # (B, C, H, W)
            a = self.weights(hs).to(hs.dtype)  # (B, K, H, W)
            z = torch.einsum("bkn,bcn->bkc", a.flatten(2), h.flatten(2))  # (B, K, C)
            if not self.instance_k:
                return z
            s = hs[:, -self.branches :].to(_acc_dtype(hs.dtype))  # (B, K, H, W), as the fused pool reads them
            mask = self.mask_at(s.shape[-2], s.shape[-1])
            if mask is not None:
                s = s.masked_fill(~mask.to(s.device), float("-inf"))
            flat = s.flatten(2)  # (B, K, N)
            top, _ = ordered(flat, torch.arange(flat.shape[-1], device=s.device), self.instance_k)
            return torch.cat([z, padded(top, self.instance_k).to(z.dtype)], -1)  # (B, K, C + instance_k)

    def extra_repr(self) -> str:
        return (f"branches={self.branches}" + (f", instance_k={self.instance_k}" if self.instance_k else "")
                + (f", border={self.border}" if self.border else ""))  # fmt: skip


class InstanceSplit(nn.Module):
    """After an ``AttentionPool`` with ``instance_k``: (B, K, C + instance_k) -> the pooled vectors (B, K, C), or
    (B, K * C) with ``flatten`` (one branch: what ``nn.Flatten(1)`` gives the classifier). The scores end here; a
    training loss reads them on this module's input (``wsitrain.train.instance_loss``, a forward pre-hook)."""

    def __init__(self, instance_k: int, flatten: bool) -> None:
        super().__init__()
        self.instance_k, self.flatten = instance_k, flatten

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        v = z[..., : z.shape[-1] - self.instance_k]  # (B, K, C)
        return v.flatten(1) if self.flatten else v

    def extra_repr(self) -> str:
        return f"instance_k={self.instance_k}, flatten={self.flatten}"


def padded(top: torch.Tensor, k: int) -> torch.Tensor:
    """(B, K, n) ordered scores -> (B, K, k): -inf after the n a map smaller than k has."""
    if top.shape[-1] >= k:
        return top
    return torch.cat([top, top.new_full((*top.shape[:-1], k - top.shape[-1]), float("-inf"))], -1)


def instance_scores(pooled: torch.Tensor, instance_k: int) -> torch.Tensor:
    """An ``AttentionPool``'s output (B, K, C + instance_k) -> each branch's highest scores (B, K, instance_k),
    largest first, -inf past the positions its mask kept."""
    return pooled[..., pooled.shape[-1] - instance_k :]


def without_autocast(x: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Autocast off for ``x``'s device type while the block runs (meta tensors, shapes only, have no autocast)."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # half-precision tiles accumulate in float32, as autocast runs softmax (and the average pool's sum) in float32
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class AttentionAccumulator:
    """Online softmax over the tiles of (B, C + K, H, W): forward folding and each tile's backward share."""

    kind = "attention"
    share_reads_output = True  # a tile's gradient share depends on its own output (reuse.py keeps it)

    def __init__(self, branches: int, height: int, width: int, mask: torch.Tensor | None, instance_k: int = 0
                 ) -> None:  # fmt: skip
        self.k, self.h, self.w = branches, height, width
        self.instance_k = instance_k
        self.top: torch.Tensor | None = None  # (B, K, <= instance_k) the running highest scores, ordered
        self.top_index: torch.Tensor | None = None  # (B, K, <= instance_k) int64: their global flat positions
        if mask is not None and tuple(mask.shape[-2:]) != (height, width):
            raise ValueError(f"attention mask is {tuple(mask.shape[-2:])} but the map is {(height, width)}")
        self.mask = mask  # (B or 1, 1, H, W) bool, where the caller made it (read by holds_gradient: no device sync)
        self._device_mask: torch.Tensor | None = None  # the same on the tiles' device, copied once, not per tile
        self._z: torch.Tensor | None = None  # the pooled value, once forward is complete (backward reads it per tile)
        self.m: torch.Tensor | None = None  # (B, K) running maximum score
        self.d: torch.Tensor | None = None  # (B, K) running denominator, relative to m
        self.s: torch.Tensor | None = None  # (B, K, C) running weighted feature sum, relative to m
        self.dtype: torch.dtype | None = None  # the tiles' dtype: the pooled value's, as plain PyTorch gives it

    @property
    def value(self) -> torch.Tensor | None:
        return self.s

    def _scores(self, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The tile's scores (B, K, th, tw) in the accumulation dtype, -inf outside the mask."""
        s = y[:, -self.k :].to(_acc_dtype(y.dtype))
        if self.mask is not None:
            if self._device_mask is None or self._device_mask.device != s.device:
                self._device_mask = self.mask.to(s.device)
            m = self._device_mask[:, :, rows[0] : rows[1], cols[0] : cols[1]]
            s = s.masked_fill(~m, float("-inf"))
        return s

    def add(self, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        """One tile ``y`` (B, C + K, th, tw) covering ``rows`` x ``cols`` of the map."""
        # The forward sweep runs under the step's autocast: a bf16 einsum here rounded the pooled value, and the
        # score gradients' sum over the map (0: G . sum_p a_p h_p - G . z) no longer cancelled (measured: the
        # attention layers' bf16 gradients 12-40x further from float64 than plain bf16's).
        with without_autocast(y):
            self._add(y, rows, cols)

    def _add(self, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        self.dtype, self._z = y.dtype, None
        s = self._scores(y, rows, cols)  # (B, K, th, tw)
        h = y[:, : -self.k].to(s.dtype)  # (B, C, th, tw)
        tile_max = s.amax((2, 3))  # (B, K); -inf where the tile is wholly masked
        m_new = tile_max if self.m is None else torch.maximum(self.m, tile_max)
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # no (-inf) - (-inf)
        e = torch.exp(s - safe[:, :, None, None])  # (B, K, th, tw); 0 outside the mask
        d = e.sum((2, 3))
        part = torch.einsum("bkhw,bchw->bkc", e, h)
        if self.m is not None:
            assert self.d is not None and self.s is not None
            old = torch.exp(self.m - safe)  # rescales the old terms; 0 while nothing was seen (m = -inf)
            d = self.d * old + d
            part = self.s * old[:, :, None] + part
        self.m, self.d, self.s = m_new, d, part
        if self.instance_k:  # the tile's scores merged into the running ordered list
            self.top, self.top_index = merge_tile(self.top, self.top_index, s, rows, cols, self.w, self.instance_k)

    def pooled(self) -> torch.Tensor:
        """z (B, K, C) in the accumulation dtype."""
        assert self.s is not None and self.d is not None, "no tile was added"
        if self._z is None:
            self._z = self.s / self.d[:, :, None]
        return self._z

    def result(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The pooled (B, K, C), as plain PyTorch computes it (in ``dtype``, by default the tiles')."""
        assert self.dtype is not None, "no tile was added"
        z = self.pooled().to(dtype or self.dtype)
        if not self.instance_k:
            return z
        assert self.top is not None
        return torch.cat([z, padded(self.top, self.instance_k).to(z.dtype)], -1)  # (B, K, C + instance_k)

    def grad_view(self, grad_out: torch.Tensor) -> torch.Tensor:
        """The pooled value's gradient as (B, K, C), or (B, K, C + instance_k)."""
        return grad_out.reshape(grad_out.shape[0], self.k, -1)

    def holds_gradient(self, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
        """Only tiles with a position inside the mask receive a nonzero share."""
        if self.mask is None or is_fake(self.mask):
            return True
        return bool(self.mask[:, :, rows[0] : rows[1], cols[0] : cols[1]].any())

    def tile_grad(self, g: torch.Tensor, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The gradient (B, C + K, th, tw) of tile ``y`` given the pooled gradient ``g`` (B, K, C [+ instance_k])."""
        with without_autocast(y):
            return self._tile_grad(g, y, rows, cols)

    def _tile_grad(self, g: torch.Tensor, y: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]
                   ) -> torch.Tensor:  # fmt: skip
        assert self.m is not None and self.d is not None
        s = self._scores(y, rows, cols)
        h = y[:, : -self.k].to(s.dtype)
        safe = torch.where(torch.isinf(self.m), torch.zeros_like(self.m), self.m)
        a = torch.exp(s - safe[:, :, None, None]) / self.d[:, :, None, None]  # (B, K, th, tw): the tile's weights
        g = g.to(s.dtype)
        g, g_top = (g[..., : -self.instance_k], g[..., -self.instance_k :]) if self.instance_k else (g, None)
        gh = torch.einsum("bkhw,bkc->bchw", a, g)  # (B, C, th, tw)
        gz = (g * self.pooled()).sum(-1)  # (B, K): G_k . z_k
        gs = a * (torch.einsum("bkc,bchw->bkhw", g, h) - gz[:, :, None, None])  # (B, K, th, tw)
        if g_top is not None:  # each kept score's gradient at its position, where this tile holds it
            assert self.top is not None and self.top_index is not None
            n = self.top_index.shape[-1]  # fewer than instance_k on a smaller map: the rest are padding
            # off-mask positions (-inf, kept only where the mask keeps fewer than instance_k) take no gradient, as
            # plain autograd's masked_fill gives them none
            gs = gs + scatter_kept(g_top[..., :n], self.top_index, torch.isfinite(self.top), rows, cols,
                                   tuple(gs.shape), self.w)  # fmt: skip
        return torch.cat([gh, gs], 1).to(y.dtype)
