"""Operator registry: what each traced module means for tiling, and facts about nodes users can read.

Specs of modules live here; functions and tensor methods in ops_functions.py; the spec type and the
kinds in ops_types.py (all re-exported here, the engine's single import point for operator facts).
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from wsitrain.sft.ops.activations import ACTIVATIONS, is_pointwise_module, known_activation
from wsitrain.sft.ops.attention_pool import AttentionPool, InstanceSplit
from wsitrain.sft.ops.functions import exact_in_place_function, function_spec, in_place_callable, out_of_place_callable
from wsitrain.sft.ops.grn import grn_spec, is_grn_module
from wsitrain.sft.ops.masked_pool import MaskedAmax
from wsitrain.sft.ops.norm_act import (
    act_after_norm,
    custom_batchnorm_refusal,
    is_sync_batchnorm,
    norm_act_refusal,
    sync_batchnorm_refusal,
)
from wsitrain.sft.ops.pad import is_pad_module, pad_module_spec
from wsitrain.sft.ops.patch_grid import is_patch_module, patch_spec
from wsitrain.sft.ops.resample import is_resample_module, resample_module_spec
from wsitrain.sft.ops.topk_pool import MaskedTopKMean
from wsitrain.sft.ops.types import (
    CAT,
    CONCAT,
    CONST,
    DROPOUT_WHY,
    ELEMENTWISE,
    GETITEM,
    HEAD,
    INPUT,
    MERGE,
    NCHW,
    OPAQUE,
    PERMUTE,
    POINTWISE,
    REDUCE,
    RESHAPE,
    SHAPE,
    SIZE,
    SPATIAL_KINDS,
    SPLIT,
    TRAILING,
    TRANSPOSE,
    WINDOW,
    OpSpec,
    Window,
    activation_spec,
    not_tileable,
)

__all__ = [
    "CAT",
    "CONCAT",
    "CONST",
    "ELEMENTWISE",
    "GETITEM",
    "HEAD",
    "INPUT",
    "MERGE",
    "NCHW",
    "OPAQUE",
    "PERMUTE",
    "POINTWISE",
    "REDUCE",
    "RESHAPE",
    "SHAPE",
    "SIZE",
    "SPATIAL_KINDS",
    "SPLIT",
    "TRAILING",
    "TRANSPOSE",
    "WINDOW",
    "OpSpec",
    "Window",
    "attribute",
    "batchnorm_spec",
    "drop_rate",
    "function_spec",
    "is_leaf_module",
    "is_pointwise_module",
    "is_sample_drop",
    "known_activation",
    "module_spec",
    "node_parameters",
    "out_of_place_callable",
    "in_place_callable",
    "exact_in_place_function",
    "user_name",
]


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _conv_windows(m: nn.Conv2d) -> tuple[Window, Window]:
    k, s, d = _pair(m.kernel_size), _pair(m.stride), _pair(m.dilation)
    if isinstance(m.padding, str):  # "same" pads d*(k-1) in total, the smaller half first; "valid" pads nothing
        p = tuple((d[i] * (k[i] - 1)) // 2 if m.padding == "same" else 0 for i in range(2))
    else:
        p = _pair(m.padding)
    return Window(k[0], s[0], p[0], d[0]), Window(k[1], s[1], p[1], d[1])


def _pool_windows(m: nn.MaxPool2d | nn.AvgPool2d) -> tuple[Window, Window]:
    k = _pair(m.kernel_size)
    s = _pair(m.stride if m.stride is not None else m.kernel_size)
    p = _pair(m.padding)
    d = _pair(getattr(m, "dilation", 1))
    return Window(k[0], s[0], p[0], d[0]), Window(k[1], s[1], p[1], d[1])


_HEAD_MODULES = (
    nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Linear, nn.Softmax, nn.LogSoftmax, AttentionPool,
    MaskedAmax, MaskedTopKMean, InstanceSplit,
)
# Per-sample drop modules (stochastic depth): their mask is drawn once per step and replayed (ops_drop.py).
SAMPLE_DROP_NAMES = ("StochasticDepth", "DropPath")


def is_sample_drop(m: nn.Module) -> bool:
    """torchvision's StochasticDepth, timm's DropPath, or a module that declares ``sft_sample_drop``."""
    return type(m).__name__ in SAMPLE_DROP_NAMES or bool(getattr(m, "sft_sample_drop", False))


def drop_rate(m: nn.Module) -> float:
    """Drop probability of a per-sample drop module (``p`` in torchvision, ``drop_prob`` in timm)."""
    return float(getattr(m, "p", getattr(m, "drop_prob", 0.0)))


def is_leaf_module(m: nn.Module) -> bool:
    """Modules the tracer keeps whole: everything this registry knows, plus torch.nn's own.

    Per-sample drop modules stay whole so their train/eval mode is read when planning, not frozen
    into the trace. Only nn.LayerNorm itself is a leaf: subclasses (LayerNorm2d) override forward
    and are traced through (permute, layer_norm, permute).
    """
    # SyncBatchNorm too: its forward branches on the process group (untraceable), timm's SyncBatchNormAct with it
    known = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.BatchNorm2d, nn.SyncBatchNorm, nn.Identity)
    known += (nn.Dropout, nn.Dropout2d)
    return (
        isinstance(m, known + tuple(ACTIVATIONS) + _HEAD_MODULES)
        or type(m) is nn.LayerNorm
        or is_pointwise_module(m)
        or is_sample_drop(m)
        or is_resample_module(m)
        or is_pad_module(m)
        or is_grn_module(m)
        or is_patch_module(m)
    )


def batchnorm_spec(m: nn.Module, name: str, flops: float) -> OpSpec:
    """A BatchNorm applied pointwise; a norm-act layer's activation adds its FLOP, parameters and saved tensor."""
    act = act_after_norm(m) if isinstance(m, nn.BatchNorm2d) else getattr(m, "act", None)
    if act is None or isinstance(act, nn.Identity):
        return OpSpec(POINTWISE, name, saves_input=True, flops_per_output=flops, has_params=m.affine)
    return OpSpec(
        POINTWISE,
        name,
        saves_input=True,
        saves_output=True,  # the activation keeps its input or output: one more map of the output's size
        flops_per_output=flops + 1.0,
        has_params=m.affine or any(True for _ in act.parameters()),
    )


def module_spec(m: nn.Module) -> OpSpec:
    """Describe a leaf module (its current train/eval mode matters for BatchNorm, Dropout, stochastic depth)."""
    name = type(m).__name__
    if is_patch_module(m):  # a patch encoder on its grid: a window of whole patches (ops/patch_grid.py)
        return patch_spec(m)
    if isinstance(m, nn.Conv2d):
        if m.padding_mode == "circular":
            return not_tileable(name, OPAQUE, "circular padding wraps around the image; use zeros/reflect padding")
        wins = _conv_windows(m)
        cin_per_group = m.in_channels // m.groups
        flops = 2.0 * cin_per_group * wins[0].kernel * wins[1].kernel + (1.0 if m.bias is not None else 0.0)
        return OpSpec(WINDOW, name, windows=wins, saves_input=True, flops_per_output=flops, has_params=True)
    if isinstance(m, nn.MaxPool2d):
        if m.return_indices:
            return not_tileable(name, OPAQUE, "return_indices=True is not supported inside a tiled region")
        wins = _pool_windows(m)
        return OpSpec(
            WINDOW,
            name,
            windows=wins,
            saves_input=True,
            index_bytes=8,
            flops_per_output=float(wins[0].kernel * wins[1].kernel),
        )
    if isinstance(m, nn.AvgPool2d):
        wins = _pool_windows(m)
        return OpSpec(
            WINDOW, name, windows=wins, saves_input=True, flops_per_output=float(wins[0].kernel * wins[1].kernel)
        )
    if isinstance(m, nn.BatchNorm2d) or is_sync_batchnorm(m):
        why = norm_act_refusal(m) or sync_batchnorm_refusal(m) or custom_batchnorm_refusal(m)
        if why is not None:
            return not_tileable(name, OPAQUE, why)
        if m.training and m.track_running_stats is not False:
            return not_tileable(
                name,
                OPAQUE,
                "BatchNorm2d in training mode normalizes with statistics of the whole batch, which a tile does not "
                "see; freeze it (wsitrain.models.freeze_batchnorm(model), or put BatchNorm layers in eval mode; "
                "`wsitrain fit` freezes BatchNorm by default)",
            )
        if m.training:
            return not_tileable(name, OPAQUE, "BatchNorm2d without running statistics cannot be tiled; use eval mode")
        return batchnorm_spec(m, name, 2.0)
    if isinstance(m, (nn.Dropout, nn.Dropout2d)):
        if m.training and m.p > 0:
            return not_tileable(name, OPAQUE, DROPOUT_WHY)
        return OpSpec(POINTWISE, name, alias=True, layout_rule=ELEMENTWISE)
    if is_sample_drop(m):
        if not m.training or drop_rate(m) == 0.0:
            return OpSpec(POINTWISE, name, alias=True, layout_rule=ELEMENTWISE)
        # x * mask with a (B, 1, ...) mask drawn once per step (ops_drop.py): autograd keeps only the mask
        return OpSpec(POINTWISE, name, flops_per_output=1.0, layout_rule=ELEMENTWISE)
    if isinstance(m, nn.Identity):
        return OpSpec(POINTWISE, name, alias=True, layout_rule=ELEMENTWISE)
    resample = resample_module_spec(m)
    if resample is not None:
        return resample
    if is_pad_module(m):
        return pad_module_spec(m)
    if is_grn_module(m):
        return grn_spec(m)
    for cls, (si, so) in ACTIVATIONS.items():
        if isinstance(m, cls):
            return activation_spec(name, si, so, bool(getattr(m, "inplace", False)), any(True for _ in m.parameters()))
    if type(m) is nn.LayerNorm:
        return OpSpec(
            POINTWISE,
            name,
            saves_input=True,
            flops_per_output=8.0,
            has_params=m.elementwise_affine,
            layout_rule=TRAILING,
            extra={"trailing": len(m.normalized_shape)},
        )
    if is_pointwise_module(m):
        return OpSpec(POINTWISE, name, flops_per_output=2.0)
    if isinstance(m, nn.Linear):
        # on (B, C) features a head layer; on channels-last (B, H, W, C) pointwise in space (ops_space)
        return OpSpec(
            HEAD,
            name,
            tileable=False,
            why_not="global layers end the tiled part",
            saves_input=True,
            flops_per_output=2.0 * m.in_features + (1.0 if m.bias is not None else 0.0),
            has_params=True,
            layout_rule=TRAILING,
            extra={"trailing": 1},
        )
    if isinstance(m, _HEAD_MODULES):
        return OpSpec(
            HEAD,
            name,
            tileable=False,
            why_not="global layers end the tiled part",
            saves_input=True,
            has_params=any(True for _ in m.parameters()),
            layout_rule=RESHAPE if isinstance(m, nn.Flatten) or (isinstance(m, InstanceSplit) and m.flatten) else NCHW,
        )
    return not_tileable(
        name,
        OPAQUE,
        f"{name} is not an operator the SFT engine knows how to tile; keep it where activations are small "
        "(the planner then runs it untiled), or replace it with a supported layer",
    )


# ---- facts about nodes, for the annotating pass and for error messages --------------------------------
def user_name(node: fx.Node, gm: nn.Module) -> str:
    """The name a user knows for ``node``: its module path and class, e.g. ``features.1.0.block.3 (Linear)``.

    Functions and tensor methods are named by the module whose forward calls them (recorded by the
    fx tracer in ``node.meta["nn_module_stack"]``) and the operation: ``features.1.0 (CNBlock): mul``.
    """
    if node.op == "call_module":
        return f"{node.target} ({type(gm.get_submodule(str(node.target))).__name__})"
    if node.op == "placeholder":
        return f"input '{node.target}'"
    op = str(node.target) if node.op in ("call_method", "get_attr") else getattr(node.target, "__name__", node.name)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return f"{op} (in the model's own forward)"
    path, cls = list(stack.values())[-1]
    cls_name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return f"{path} ({cls_name}): {op}"


def node_parameters(node: fx.Node, gm: nn.Module) -> list[nn.Parameter]:
    """Parameters ``node`` reads: its module's, and those it takes as get_attr arguments (layer scale, LayerNorm2d)."""
    found: dict[int, nn.Parameter] = {}
    if node.op == "call_module":
        for p in gm.get_submodule(str(node.target)).parameters():
            found.setdefault(id(p), p)
    for a in node.all_input_nodes:
        if a.op == "get_attr":
            obj = attribute(gm, str(a.target))
            if isinstance(obj, nn.Parameter):
                found.setdefault(id(obj), obj)
    return list(found.values())


def attribute(gm: nn.Module, target: str) -> Any:
    """The object a get_attr node names."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
