"""A patch encoder on a non-overlapping grid (``wsitrain.patch.trunk.PatchTrunk``) as an operator of the engine.

To the planner and the executor it is a window whose kernel and stride are the patch and whose padding is zero: a
tile of whole patches reads exactly its own pixels, no halo. What its "kernel" keeps for backward and computes is
not read off layers but measured once per activation dtype (``wsitrain.patch.cost``: the encoder run on fake
tensors), and enters the memory model and the time model per patch (``patch_costs``).

Refused (run untiled, with the reason) where a tile's recompute would not reproduce its forward: dropout or
stochastic depth with a rate above zero in training mode draw other random numbers in the recompute, and a
BatchNorm in training mode normalises with the statistics of the chunk it sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from wsitrain.sft.ops.types import DROPOUT_WHY, OPAQUE, WINDOW, OpSpec, Window, not_tileable

if TYPE_CHECKING:
    from wsitrain.patch.cost import PatchCost
    from wsitrain.patch.prefix import PrefixCost

# OpSpec.extra key: fn(activation dtype) -> PatchCost, one patch's bytes and FLOPs (measured once per dtype)
PATCH_COST = "patch_cost"
# OpSpec.extra key: fn(activation dtype) -> PrefixCost | None, the frozen prefix a chunk's recompute may start after
PATCH_PREFIX = "patch_prefix"


def is_patch_module(m: nn.Module) -> bool:
    """A module the engine tiles as a patch grid: it declares ``sft_patch`` and has an int ``patch`` and an
    ``encoder`` (``wsitrain.patch.trunk.PatchTrunk``)."""
    return bool(getattr(m, "sft_patch", False)) and isinstance(getattr(m, "patch", None), int) and isinstance(
        getattr(m, "encoder", None), nn.Module
    )


def _random_in_training(encoder: nn.Module) -> str | None:
    """Why a training-mode encoder's recompute would differ from its forward, or None."""
    for name, m in encoder.named_modules():
        if not m.training:
            continue
        kind = type(m).__name__
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"{name} ({kind}, p={m.p}): {DROPOUT_WHY}"
        if kind in ("DropPath", "StochasticDepth") and float(getattr(m, "drop_prob", getattr(m, "p", 0.0))) > 0:
            return (f"{name} ({kind}): stochastic depth inside a patch encoder draws per patch, and a chunk's "
                    "recompute would draw again; set the encoder's drop_path_rate to 0")  # fmt: skip
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            return (f"{name} ({kind}) in training mode normalises with the statistics of the patches it sees; freeze "
                    "it (model.freeze_bn: true, the default)")  # fmt: skip
    return None


class _CostMemo:
    """The encoder's per-patch cost per (dtype, trainable parameters, modes): measured once, seconds on fake tensors."""

    def __init__(self, trunk: nn.Module) -> None:
        self.trunk = trunk
        self.memo: dict[tuple[Any, ...], PatchCost] = {}

    def __call__(self, act_dtype: torch.dtype) -> PatchCost:
        from wsitrain.patch.cost import measure_patch_cost  # the simulator's tracker: imported when first planned

        enc = self.trunk.encoder
        key = (act_dtype, tuple(p.requires_grad for p in enc.parameters()), tuple(m.training for m in enc.modules()))
        if key not in self.memo:
            self.memo[key] = measure_patch_cost(enc, self.trunk.patch, act_dtype)
        return self.memo[key]


class _PrefixMemo(_CostMemo):
    """The encoder's frozen prefix per (dtype, trainable parameters, modes) (``wsitrain.patch.prefix``)."""

    def __call__(self, act_dtype: torch.dtype) -> PrefixCost | None:  # type: ignore[override]
        from wsitrain.patch.prefix import measure_prefix

        enc = self.trunk.encoder
        key = (act_dtype, tuple(p.requires_grad for p in enc.parameters()), tuple(m.training for m in enc.modules()))
        if key not in self.memo:
            self.memo[key] = measure_prefix(enc, self.trunk.patch, act_dtype)  # type: ignore[assignment]
        return self.memo[key]  # type: ignore[return-value]


def prefix_memo(trunk: nn.Module) -> Callable[[torch.dtype], PrefixCost | None]:
    """The trunk's memo of its frozen prefix's per-patch cost, kept on the trunk as ``cost_memo``'s."""
    memo = trunk.__dict__.get("_sft_prefix")
    if memo is None:
        memo = trunk.__dict__["_sft_prefix"] = _PrefixMemo(trunk)
    return memo


def cost_memo(trunk: nn.Module) -> Callable[[torch.dtype], PatchCost]:
    """The trunk's memo of its per-patch costs, kept on the trunk (one measurement per dtype for every plan)."""
    memo = trunk.__dict__.get("_sft_cost")
    if memo is None:
        memo = trunk.__dict__["_sft_cost"] = _CostMemo(trunk)
    return memo


def patch_spec(m: nn.Module) -> OpSpec:
    """The spec of a patch trunk: a (patch, patch) window of stride patch, no padding, costed per patch."""
    name = type(m).__name__
    why = _random_in_training(m.encoder)
    if why is not None:
        return not_tileable(name, OPAQUE, why)
    p = int(m.patch)
    win = Window(p, p, 0, 1)
    return OpSpec(
        WINDOW, name, windows=(win, win), saves_input=False,  # the encoder's own saved copy of its patches is measured
        has_params=any(True for _ in m.parameters()),
        extra={PATCH_COST: cost_memo(m), PATCH_PREFIX: prefix_memo(m), "dim": int(m.dim)},
    )  # fmt: skip


def patch_cost(spec: OpSpec) -> Callable[[torch.dtype], PatchCost] | None:
    """The per-patch cost of a patch-trunk spec; None for any other operator."""
    return spec.extra.get(PATCH_COST)


def prefix_cost(spec: OpSpec) -> Callable[[torch.dtype], PrefixCost | None] | None:
    """The frozen-prefix cost of a patch-trunk spec; None for any other operator."""
    return spec.extra.get(PATCH_PREFIX)


def patches_in(spec: OpSpec, numel_out: float) -> float:
    """Patches (times the batch) behind ``numel_out`` elements of a patch trunk's (B, D, gh, gw) output."""
    return numel_out / max(1, int(spec.extra.get("dim", 1)))
