"""Specs of call_function and call_method nodes: arithmetic, activations, reshapes, channels-last ops.

``ops_space.resolve_layouts`` then fits each spec to its input's layout: a ``view`` that only
regroups channels stays tileable, one that merges H and W ends the tiled part.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from wsitrain.sft.ops.pad import PAD_FUNCS, pad_function_spec
from wsitrain.sft.ops.resample import RESAMPLE_FUNCS, resample_function_spec
from wsitrain.sft.ops.types import (
    CAT,
    CONCAT,
    DROPOUT_WHY,
    ELEMENTWISE,
    GETITEM,
    HEAD,
    MERGE,
    OPAQUE,
    PERMUTE,
    POINTWISE,
    REDUCE,
    RESHAPE,
    SHAPE,
    SIZE,
    SPLIT,
    TRAILING,
    TRANSPOSE,
    WINDOW,
    OpSpec,
    Window,
    activation_spec,
    call_arg,
    not_tileable,
)

_FUNCTIONAL_POINTWISE = {
    F.relu: (False, True),
    torch.relu: (False, True),
    F.relu6: (True, False),
    F.leaky_relu: (True, False),
    F.gelu: (True, False),
    F.silu: (True, False),
    F.mish: (True, False),
    torch.sigmoid: (False, True),
    F.sigmoid: (False, True),
    torch.tanh: (False, True),
    F.tanh: (False, True),
    F.hardswish: (True, False),
    F.elu: (False, True),
    F.hardsigmoid: (True, False),
    torch.exp: (False, True),
    torch.sqrt: (False, True),
    torch.rsqrt: (False, True),
    torch.abs: (True, False),
    torch.square: (True, False),
    torch.log: (True, False),
    torch.clamp: (True, False),
    torch.neg: (False, False),
    operator.neg: (False, False),
}
_FUNCTIONAL_INPLACE = {torch.relu_: torch.relu, F.relu_: F.relu}
# Element-wise arithmetic: type name and whether autograd keeps the operands. With two feature maps
# it is a MERGE; with scalars, constants or per-channel tensors it is pointwise (ops_space decides).
_MERGE_FUNCS = {
    operator.add: ("add", False),
    operator.iadd: ("add", False),
    torch.add: ("add", False),
    operator.mul: ("mul", True),
    operator.imul: ("mul", True),
    torch.mul: ("mul", True),
    operator.sub: ("sub", False),
    operator.isub: ("sub", False),
    torch.sub: ("sub", False),
    torch.rsub: ("sub", False),
    operator.truediv: ("div", True),
    operator.itruediv: ("div", True),
    torch.div: ("div", True),
    torch.true_divide: ("div", True),
    operator.pow: ("pow", True),
    torch.pow: ("pow", True),
    torch.maximum: ("maximum", True),
    torch.minimum: ("minimum", True),
}
_INPLACE_TO_OUT = {
    operator.iadd: operator.add,
    operator.imul: operator.mul,
    operator.isub: operator.sub,
    operator.itruediv: operator.truediv,
}
_MERGE_METHODS = {
    "add": ("add", False),
    "sub": ("sub", False),
    "rsub": ("sub", False),
    "mul": ("mul", True),
    "div": ("div", True),
    "true_divide": ("div", True),
    "pow": ("pow", True),
    "maximum": ("maximum", True),
    "minimum": ("minimum", True),
}
_POINTWISE_METHODS = {
    "relu": (False, True),
    "sigmoid": (False, True),
    "tanh": (False, True),
    "exp": (False, True),
    "sqrt": (False, True),
    "rsqrt": (False, True),
    "neg": (False, False),
    "abs": (True, False),
    "square": (True, False),
    "clamp": (True, False),
    "clamp_min": (True, False),
    "clamp_max": (True, False),
}
# Methods that copy or retype a tensor, element by element.
_COPY_METHODS = ("contiguous", "clone", "float", "double", "half", "bfloat16", "to", "type_as")
_HEAD_FUNCS = {F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
_RESHAPE_METHODS = ("flatten", "view", "reshape", "unflatten", "squeeze", "unsqueeze")
_RESHAPE_FUNCS = {torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze, torch.unflatten}
_REDUCE_METHODS = ("mean", "sum", "amax", "amin")
_REDUCE_FUNCS = {torch.mean: "mean", torch.sum: "sum", torch.amax: "amax", torch.amin: "amin"}
_DROPOUT_FUNCS = {F.dropout, F.dropout2d, torch.dropout}


def _method_spec(node: fx.Node) -> OpSpec:
    name = str(node.target)
    base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
    inplace = base != name
    if base in _MERGE_METHODS:
        tname, saves = _MERGE_METHODS[base]
        return OpSpec(MERGE, tname, inplace=inplace, saves_input=saves, flops_per_output=1.0, layout_rule=ELEMENTWISE)
    if base in _POINTWISE_METHODS:
        si, so = _POINTWISE_METHODS[base]
        return OpSpec(
            POINTWISE,
            name,
            inplace=inplace,
            saves_input=si and not inplace,
            saves_output=so or inplace,
            out_of_place_saves=(si, so) if inplace else None,
            flops_per_output=1.0,
            layout_rule=ELEMENTWISE,
        )
    if name in _COPY_METHODS:
        return OpSpec(POINTWISE, name, layout_rule=ELEMENTWISE)
    if name == "permute":
        return OpSpec(POINTWISE, name, alias=True, layout_rule=PERMUTE)
    if name in ("transpose", "swapaxes"):
        return OpSpec(POINTWISE, name, alias=True, layout_rule=TRANSPOSE)
    if name in ("chunk", "split", "tensor_split"):
        return OpSpec(POINTWISE, name, alias=True, layout_rule=SPLIT)
    if name in ("size", "dim"):
        return OpSpec(SHAPE, name, layout_rule=SIZE)
    if name in _RESHAPE_METHODS:
        if name == "squeeze" and call_arg(node, 1, "dim") is None:
            # squeeze() drops every size-1 dim, and a tile may have size 1 where the image has not
            return OpSpec(HEAD, name, tileable=False, why_not="squeeze() without a dim ends the tiled part")
        return OpSpec(
            HEAD,
            name,
            tileable=False,
            why_not="reshapes that merge the image axes end the tiled part",
            alias=True,
            layout_rule=RESHAPE,
        )
    if name in _REDUCE_METHODS:
        return OpSpec(HEAD, name, tileable=False, why_not="global operations end the tiled part", layout_rule=REDUCE)
    if name == "max":
        return OpSpec(HEAD, name, tileable=False, why_not="reshapes end the tiled part")
    return not_tileable(name, OPAQUE, f"tensor method .{name}() is not supported inside a tiled region")


def _pool_spec(node: fx.Node, tname: str) -> OpSpec:
    """F.max_pool2d / F.avg_pool2d with constant arguments (Inception calls them in forward)."""
    is_max = node.target is F.max_pool2d
    k = call_arg(node, 1, "kernel_size")
    s = call_arg(node, 2, "stride") or k
    p = call_arg(node, 3, "padding", 0)
    d = call_arg(node, 4, "dilation", 1) if is_max else 1
    if is_max and call_arg(node, 6, "return_indices", False):
        return not_tileable(tname, OPAQUE, "return_indices=True is not supported inside a tiled region")
    if not is_max and call_arg(node, 6, "divisor_override") is not None:
        return not_tileable(tname, OPAQUE, "avg_pool2d with divisor_override is not supported inside a tiled region")
    try:
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = (_pair(v) for v in (k, s, p, d))
    except (TypeError, ValueError):
        return not_tileable(tname, OPAQUE, f"{tname} with sizes computed at run time is not supported when tiled")
    wins = (Window(kh, sh, ph, dh), Window(kw, sw, pw, dw))
    return OpSpec(
        WINDOW,
        tname,
        windows=wins,
        saves_input=True,
        index_bytes=8 if is_max else 0,
        flops_per_output=float(kh * kw),
    )


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        a, b = (v[0], v[1]) if len(v) == 2 else (v[0], v[0])
    else:
        a = b = v
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        raise TypeError("computed size")
    return int(a), int(b)


def function_spec(node: fx.Node) -> OpSpec:
    """Describe a call_function / call_method node (ops_space.resolve_layouts then fits it to its input's layout)."""
    if node.op == "call_method":
        return _method_spec(node)
    target = node.target
    tname = getattr(target, "__name__", str(target))
    if target in _MERGE_FUNCS:
        kind, saves = _MERGE_FUNCS[target]
        return OpSpec(
            MERGE,
            kind,
            inplace=target in _INPLACE_TO_OUT,
            saves_input=saves,
            flops_per_output=1.0,
            layout_rule=ELEMENTWISE,
        )
    if target in (F.max_pool2d, F.avg_pool2d):
        return _pool_spec(node, tname)
    if target in PAD_FUNCS:
        return pad_function_spec(node)
    if target in RESAMPLE_FUNCS:
        return resample_function_spec(node)
    if target is torch.cat or target is torch.concat:
        return OpSpec(CONCAT, "cat", layout_rule=CAT)
    if target in _FUNCTIONAL_POINTWISE or target in _FUNCTIONAL_INPLACE:
        si, so = _FUNCTIONAL_POINTWISE.get(target, (False, True))
        inplace = target in _FUNCTIONAL_INPLACE or bool(node.kwargs.get("inplace", False))
        return activation_spec(tname, si, so, inplace)
    if target in _DROPOUT_FUNCS:
        p, training = call_arg(node, 1, "p", 0.5), call_arg(node, 2, "training", target is torch.dropout)
        if training and p > 0:
            return not_tileable(tname, OPAQUE, DROPOUT_WHY)
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=ELEMENTWISE)
    if target is torch.permute:
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=PERMUTE)
    if target in (torch.transpose, torch.swapaxes):
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=TRANSPOSE)
    if target in (torch.chunk, torch.split, torch.tensor_split):
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=SPLIT)
    if target is operator.getitem:
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=GETITEM)
    if target is getattr and call_arg(node, 1, "name") in ("shape", "ndim", "dtype", "device"):
        return OpSpec(SHAPE, "getattr", layout_rule=SIZE)
    if target is F.layer_norm:
        shape = call_arg(node, 1, "normalized_shape", ())
        n = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
        return OpSpec(
            POINTWISE,
            tname,
            saves_input=True,
            flops_per_output=8.0,
            layout_rule=TRAILING,
            extra={"trailing": n},
        )
    if target is F.linear:
        return OpSpec(
            HEAD,
            tname,
            tileable=False,
            why_not="global operations end the tiled part",
            saves_input=True,
            layout_rule=TRAILING,
            extra={"trailing": 1},
        )
    if target in _RESHAPE_FUNCS:
        if target is torch.squeeze and call_arg(node, 1, "dim") is None:
            return OpSpec(HEAD, tname, tileable=False, why_not="squeeze() without a dim ends the tiled part")
        return OpSpec(
            HEAD,
            tname,
            tileable=False,
            why_not="reshapes that merge the image axes end the tiled part",
            alias=True,
            layout_rule=RESHAPE,
        )
    if target in _REDUCE_FUNCS:
        return OpSpec(HEAD, tname, tileable=False, why_not="global operations end the tiled part", layout_rule=REDUCE)
    if target in _HEAD_FUNCS:
        return OpSpec(HEAD, tname, tileable=False, why_not="global operations end the tiled part")
    return not_tileable(tname, OPAQUE, f"function {tname} is not supported inside a tiled region")


def _relu_in_place(x: torch.Tensor, inplace: bool = True) -> torch.Tensor:
    return torch.relu_(x)


# Functions whose in-place form is exact in a tile (see ``activations.exact_in_place``): ReLU only.
_EXACT_IN_PLACE_FUNCS = {F.relu, torch.relu, F.relu_, torch.relu_}


def exact_in_place_function(node: fx.Node) -> bool:
    """A call_function node whose in-place form computes the same bits as its out-of-place form (ReLU)."""
    return node.op == "call_function" and node.target in _EXACT_IN_PLACE_FUNCS


def in_place_callable(node: fx.Node, module: nn.Module | None) -> tuple[Any, dict[str, Any]]:
    """The callable and kwargs to run ``node`` writing into its input: only for nodes the planner marked
    (``NodeFacts.in_place_in_tile``), whose input nobody else reads and no one saved for backward."""
    kwargs = dict(node.kwargs)
    if node.op == "call_module":
        assert module is not None
        if not getattr(module, "inplace", False):
            module = copy.copy(module)  # shallow: shares parameters, only the flag differs
            module.inplace = True
        return module, kwargs
    assert exact_in_place_function(node), node
    return _relu_in_place, kwargs


def out_of_place_callable(node: fx.Node, module: nn.Module | None) -> tuple[Any, dict[str, Any]]:
    """The callable and kwargs to run ``node`` without writing into its input.

    A tile cut from a checkpoint is a view of it: an in-place first operator would write into the
    checkpoint (a trap the best public peer fell into), so tiled execution never runs in place.
    """
    kwargs = dict(node.kwargs)
    if node.op == "call_module":
        assert module is not None
        if getattr(module, "inplace", False):
            module = copy.copy(module)  # shallow: shares parameters, only the flag differs
            module.inplace = False
        return module, kwargs
    if node.op == "call_function":
        target = _INPLACE_TO_OUT.get(node.target, _FUNCTIONAL_INPLACE.get(node.target, node.target))
        if kwargs.get("inplace"):
            kwargs["inplace"] = False
        return target, kwargs
    name = str(node.target)
    if name.endswith("_") and not name.startswith("_") and hasattr(torch.Tensor, name[:-1]):
        name = name[:-1]  # add_ -> add, clamp_ -> clamp, ...
    return name, kwargs
