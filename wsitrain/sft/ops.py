"""Operator registry: what each traced operator means for tiling.

Every fx node of a model is described by an ``OpSpec``: how an output interval along H or W maps to
the input interval it reads (the paper's sigma/delta, done with exact integer intervals), whether it
can run on a tile (FT-compatible), what autograd saves for it (for the memory model), and its FLOPs.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

# Kinds of operator, by how they touch the spatial axes.
WINDOW = "window"  # conv / pool: output pixel reads a strided, dilated window of input pixels
POINTWISE = "pointwise"  # one input, output pixel reads the same input pixel (activations, frozen BN)
MERGE = "merge"  # several aligned inputs combined pixel by pixel (residual add, mul)
CONCAT = "concat"  # channel concatenation of aligned inputs (dense blocks)
INPUT = "input"  # the image
OPAQUE = "opaque"  # keeps (B, C, H, W) but cannot be tiled (GroupNorm, train-mode BN, unknown modules)
HEAD = "head"  # global pooling, flatten, linear: ends the tiled part, runs untiled
SHAPE = "shape"  # ints measured on a tensor (x.size(), x.shape, arithmetic on them): computed from the tile
CONST = "const"  # values that do not depend on the image (a parameter reshaped): computed whole, never cropped

# Kinds a tiled segment can run. SHAPE and CONST values do not vary over the image plane; they run
# inside the tile like any other node (a size() reads the tile, so a reshape built from it fits the tile).
SPATIAL_KINDS = (WINDOW, POINTWISE, MERGE, CONCAT, SHAPE, CONST)

# How an operator treats the layout of its spatial input (``OpSpec.layout_rule``); ops_space.py
# resolves each rule into the dims where H and W sit in the operator's output.
NCHW = "nchw"  # needs (B, C, H, W): convs, pools, BatchNorm, modules that declare themselves pointwise
ELEMENTWISE = "elementwise"  # any layout; other operands broadcast with size 1 on the image axes
TRAILING = "trailing"  # acts on the last ``extra["trailing"]`` dims (Linear, LayerNorm): fine when H, W are not among them
PERMUTE = "permute"
TRANSPOSE = "transpose"
RESHAPE = "reshape"  # view / reshape / flatten / unflatten: fine when it only regroups the non-image dims
SPLIT = "split"  # chunk / split along a non-image dim: a tuple of tensors with the input's layout
GETITEM = "getitem"  # one tensor of a split, or a slice that keeps the image axes whole
CAT = "cat"  # concatenation along a non-image dim
SIZE = "size"  # x.size() / x.shape: ints of the tensor it reads
REDUCE = "reduce"  # mean / sum / amax over non-image dims


@dataclass(frozen=True)
class Window:
    """One axis of a sliding window: kernel, stride, left padding, dilation."""

    kernel: int
    stride: int
    padding: int
    dilation: int

    def input_interval(self, a: int, b: int, size_in: int) -> tuple[int, int]:
        """Input crop [lo, hi) that yields exact outputs [a, b) when the original layer runs on it.

        The crop start is aligned to the stride so the layer samples the global grid, and it starts
        at 0 only at the true image border, where the layer's own padding is the real padding.
        """
        start = a * self.stride - self.padding
        lo = 0 if start <= 0 else (start // self.stride) * self.stride
        end = (b - 1) * self.stride - self.padding + self.dilation * (self.kernel - 1) + 1
        return lo, min(size_in, end)

    def first_output(self, lo: int) -> int:
        """Global index of the first output the layer produces on a crop starting at ``lo``."""
        return lo // self.stride


@dataclass(frozen=True)
class OpSpec:
    """Facts about one traced operator, as the planner and executor need them."""

    kind: str
    type_name: str  # e.g. "Conv2d", "ReLU", "add"
    windows: tuple[Window, Window] | None = None  # (H, W) for WINDOW ops
    tileable: bool = True
    why_not: str = ""  # when not tileable: the reason and the fix
    inplace: bool = False  # output aliases its input
    alias: bool = False  # returns its input unchanged (Identity, eval Dropout)
    saves_input: bool = False  # autograd keeps the input for backward
    saves_output: bool = False  # autograd keeps the output for backward
    index_bytes: int = 0  # extra bytes per output element kept for backward (max-pool indices)
    flops_per_output: float = 0.0  # forward FLOPs per output element
    has_params: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # Where H and W sit in the output (in each tensor of a tuple output): (2, 3) for (B, C, H, W),
    # (1, 2) for channels-last (B, H, W, C); None for values that do not vary over the image plane
    # (ints from size(), constants, the head). Set by ops_space.resolve_layouts from the input's layout.
    spatial_dims: tuple[int, int] | None = (2, 3)
    layout_rule: str = NCHW  # how the output layout follows from the input's (see the rules above)


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


# Pointwise activations: (saves input, saves output) of the out-of-place form. In-place forms save
# their output (which is their input's storage).
_ACTIVATIONS: dict[type, tuple[bool, bool]] = {
    nn.ReLU: (False, True),
    nn.ReLU6: (True, False),
    nn.LeakyReLU: (True, False),
    nn.ELU: (False, True),
    nn.CELU: (False, True),
    nn.SELU: (False, True),
    nn.GELU: (True, False),
    nn.SiLU: (True, False),
    nn.Mish: (True, False),
    nn.Sigmoid: (False, True),
    nn.Tanh: (False, True),
    nn.Hardswish: (True, False),
    nn.Hardsigmoid: (True, False),
    nn.Hardtanh: (True, False),
    nn.Softplus: (True, False),
    nn.PReLU: (True, False),
}

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
_HEAD_MODULES = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Linear, nn.Softmax, nn.LogSoftmax)
_HEAD_FUNCS = {F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
_RESHAPE_METHODS = ("flatten", "view", "reshape", "unflatten", "squeeze", "unsqueeze")
_RESHAPE_FUNCS = {torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze, torch.unflatten}
_REDUCE_METHODS = ("mean", "sum", "amax", "amin")
_REDUCE_FUNCS = {torch.mean: "mean", torch.sum: "sum", torch.amax: "amax", torch.amin: "amin"}
_DROPOUT_FUNCS = {F.dropout, F.dropout2d, torch.dropout}
# Per-sample drop modules (stochastic depth): their mask is drawn once per step and replayed (ops_drop.py).
SAMPLE_DROP_NAMES = ("StochasticDepth", "DropPath")


def is_pointwise_module(m: nn.Module) -> bool:
    """Modules that declare themselves pointwise (wsitrain's InputNormalization does)."""
    return bool(getattr(m, "sft_pointwise", False)) or type(m).__name__ == "InputNormalization"


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
    known = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.BatchNorm2d, nn.Identity, nn.Dropout, nn.Dropout2d)
    return (
        isinstance(m, known + tuple(_ACTIVATIONS) + _HEAD_MODULES)
        or type(m) is nn.LayerNorm
        or is_pointwise_module(m)
        or is_sample_drop(m)
    )


def _activation(name: str, saves_input: bool, saves_output: bool, inplace: bool, has_params: bool = False) -> OpSpec:
    """A pointwise activation: in place it keeps only its output, which is its input's storage."""
    return OpSpec(
        POINTWISE,
        name,
        inplace=inplace,
        saves_input=saves_input and not inplace,
        saves_output=saves_output or inplace,
        flops_per_output=1.0,
        has_params=has_params,
        layout_rule=ELEMENTWISE,
    )


def _not_tileable(type_name: str, kind: str, why: str) -> OpSpec:
    return OpSpec(kind=kind, type_name=type_name, tileable=False, why_not=why, saves_input=True)


_DROPOUT_WHY = (
    "element-wise Dropout in training mode draws a mask per pixel that a tile's recomputation would draw "
    "again differently; use p=0 or eval mode for Dropout inside the tiled trunk (stochastic depth, "
    "one decision per sample, is supported)"
)


def module_spec(m: nn.Module) -> OpSpec:
    """Describe a leaf module (its current train/eval mode matters for BatchNorm, Dropout, stochastic depth)."""
    name = type(m).__name__
    if isinstance(m, nn.Conv2d):
        if m.padding_mode == "circular":
            return _not_tileable(name, OPAQUE, "circular padding wraps around the image; use zeros/reflect padding")
        wins = _conv_windows(m)
        cin_per_group = m.in_channels // m.groups
        flops = 2.0 * cin_per_group * wins[0].kernel * wins[1].kernel + (1.0 if m.bias is not None else 0.0)
        return OpSpec(WINDOW, name, windows=wins, saves_input=True, flops_per_output=flops, has_params=True)
    if isinstance(m, nn.MaxPool2d):
        if m.return_indices:
            return _not_tileable(name, OPAQUE, "return_indices=True is not supported inside a tiled region")
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
    if isinstance(m, nn.BatchNorm2d):
        if m.training and m.track_running_stats is not False:
            return _not_tileable(
                name,
                OPAQUE,
                "BatchNorm2d in training mode normalizes with statistics of the whole batch, which a tile does not "
                "see; freeze it (wsitrain.models.freeze_batchnorm(model), or put BatchNorm layers in eval mode; "
                "`wsitrain fit` freezes BatchNorm by default)",
            )
        if m.training:
            return _not_tileable(name, OPAQUE, "BatchNorm2d without running statistics cannot be tiled; use eval mode")
        return OpSpec(POINTWISE, name, saves_input=True, flops_per_output=2.0, has_params=m.affine)
    if isinstance(m, (nn.Dropout, nn.Dropout2d)):
        if m.training and m.p > 0:
            return _not_tileable(name, OPAQUE, _DROPOUT_WHY)
        return OpSpec(POINTWISE, name, alias=True, layout_rule=ELEMENTWISE)
    if is_sample_drop(m):
        if not m.training or drop_rate(m) == 0.0:
            return OpSpec(POINTWISE, name, alias=True, layout_rule=ELEMENTWISE)
        # x * mask with a (B, 1, ...) mask drawn once per step (ops_drop.py): autograd keeps only the mask
        return OpSpec(POINTWISE, name, flops_per_output=1.0, layout_rule=ELEMENTWISE)
    if isinstance(m, nn.Identity):
        return OpSpec(POINTWISE, name, alias=True, layout_rule=ELEMENTWISE)
    for cls, (si, so) in _ACTIVATIONS.items():
        if isinstance(m, cls):
            return _activation(name, si, so, bool(getattr(m, "inplace", False)), any(True for _ in m.parameters()))
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
            layout_rule=RESHAPE if isinstance(m, nn.Flatten) else NCHW,
        )
    return _not_tileable(
        name,
        OPAQUE,
        f"{name} is not an operator the SFT engine knows how to tile; keep it where activations are small "
        "(the planner then runs it untiled), or replace it with a supported layer",
    )


def _arg(node: fx.Node, pos: int, key: str, default: Any = None) -> Any:
    """Argument ``key`` of a call node, given by keyword or at position ``pos``."""
    if key in node.kwargs:
        return node.kwargs[key]
    return node.args[pos] if len(node.args) > pos else default


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
        if name == "squeeze" and _arg(node, 1, "dim") is None:
            # squeeze() drops every size-1 dim, and a tile may have size 1 where the image has not
            return OpSpec(HEAD, name, tileable=False, why_not="squeeze() without a dim ends the tiled part")
        return OpSpec(
            HEAD, name, tileable=False, why_not="reshapes that merge the image axes end the tiled part",
            alias=True, layout_rule=RESHAPE,
        )
    if name in _REDUCE_METHODS:
        return OpSpec(HEAD, name, tileable=False, why_not="global operations end the tiled part", layout_rule=REDUCE)
    if name in ("max", "unsqueeze"):
        return OpSpec(HEAD, name, tileable=False, why_not="reshapes end the tiled part")
    return _not_tileable(name, OPAQUE, f"tensor method .{name}() is not supported inside a tiled region")


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
    if target is torch.cat or target is torch.concat:
        return OpSpec(CONCAT, "cat", layout_rule=CAT)
    if target in _FUNCTIONAL_POINTWISE or target in _FUNCTIONAL_INPLACE:
        si, so = _FUNCTIONAL_POINTWISE.get(target, (False, True))
        inplace = target in _FUNCTIONAL_INPLACE or bool(node.kwargs.get("inplace", False))
        return _activation(tname, si, so, inplace)
    if target in _DROPOUT_FUNCS:
        p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", target is torch.dropout)
        if training and p > 0:
            return _not_tileable(tname, OPAQUE, _DROPOUT_WHY)
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=ELEMENTWISE)
    if target is torch.permute:
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=PERMUTE)
    if target in (torch.transpose, torch.swapaxes):
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=TRANSPOSE)
    if target in (torch.chunk, torch.split, torch.tensor_split):
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=SPLIT)
    if target is operator.getitem:
        return OpSpec(POINTWISE, tname, alias=True, layout_rule=GETITEM)
    if target is getattr and _arg(node, 1, "name") in ("shape", "ndim", "dtype", "device"):
        return OpSpec(SHAPE, "getattr", layout_rule=SIZE)
    if target is F.layer_norm:
        shape = _arg(node, 1, "normalized_shape", ())
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
            HEAD, tname, tileable=False, why_not="global operations end the tiled part", saves_input=True,
            layout_rule=TRAILING, extra={"trailing": 1},
        )
    if target in _RESHAPE_FUNCS:
        if target is torch.squeeze and _arg(node, 1, "dim") is None:
            return OpSpec(HEAD, tname, tileable=False, why_not="squeeze() without a dim ends the tiled part")
        return OpSpec(
            HEAD, tname, tileable=False, why_not="reshapes that merge the image axes end the tiled part",
            alias=True, layout_rule=RESHAPE,
        )
    if target in _REDUCE_FUNCS:
        return OpSpec(HEAD, tname, tileable=False, why_not="global operations end the tiled part", layout_rule=REDUCE)
    if target in _HEAD_FUNCS:
        return OpSpec(HEAD, tname, tileable=False, why_not="global operations end the tiled part")
    return _not_tileable(tname, OPAQUE, f"function {tname} is not supported inside a tiled region")


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
