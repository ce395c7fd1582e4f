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

SPATIAL_KINDS = (WINDOW, POINTWISE, MERGE, CONCAT)


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
}
_FUNCTIONAL_INPLACE = {torch.relu_: torch.relu, F.relu_: F.relu}
_MERGE_FUNCS = {
    operator.add: "add",
    operator.iadd: "add",
    torch.add: "add",
    operator.mul: "mul",
    operator.imul: "mul",
    torch.mul: "mul",
    operator.sub: "sub",
    operator.isub: "sub",
    torch.sub: "sub",
}
_INPLACE_TO_OUT = {operator.iadd: operator.add, operator.imul: operator.mul, operator.isub: operator.sub}
_MERGE_METHODS = {"add": "add", "add_": "add", "mul": "mul", "mul_": "mul", "sub": "sub", "sub_": "sub"}
_POINTWISE_METHODS = {"relu": (False, True), "relu_": (False, True), "sigmoid": (False, True), "tanh": (False, True)}
_HEAD_MODULES = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Flatten, nn.Linear, nn.Softmax, nn.LogSoftmax)
_HEAD_FUNCS = {torch.flatten, F.adaptive_avg_pool2d, F.adaptive_max_pool2d, F.linear, torch.mean, torch.amax}
_HEAD_METHODS = {"flatten", "view", "reshape", "mean", "amax", "max", "sum", "squeeze", "unsqueeze", "size"}


def is_pointwise_module(m: nn.Module) -> bool:
    """Modules that declare themselves pointwise (wsitrain's InputNormalization does)."""
    return bool(getattr(m, "sft_pointwise", False)) or type(m).__name__ == "InputNormalization"


def is_leaf_module(m: nn.Module) -> bool:
    """Modules the tracer keeps whole: everything this registry knows, plus torch.nn's own."""
    known = (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.BatchNorm2d, nn.Identity, nn.Dropout, nn.Dropout2d)
    return isinstance(m, known + tuple(_ACTIVATIONS) + _HEAD_MODULES) or is_pointwise_module(m)


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
    )


def _not_tileable(type_name: str, kind: str, why: str) -> OpSpec:
    return OpSpec(kind=kind, type_name=type_name, tileable=False, why_not=why, saves_input=True)


def module_spec(m: nn.Module) -> OpSpec:
    """Describe a leaf module (its current train/eval mode matters for BatchNorm and Dropout)."""
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
            return _not_tileable(
                name,
                OPAQUE,
                "Dropout in training mode draws position-dependent masks that differ between a tile's forward "
                "and its recomputation; use p=0 or eval mode for layers inside the tiled trunk",
            )
        return OpSpec(POINTWISE, name, alias=True)
    if isinstance(m, nn.Identity):
        return OpSpec(POINTWISE, name, alias=True)
    for cls, (si, so) in _ACTIVATIONS.items():
        if isinstance(m, cls):
            return _activation(name, si, so, bool(getattr(m, "inplace", False)), any(True for _ in m.parameters()))
    if is_pointwise_module(m):
        return OpSpec(POINTWISE, name, flops_per_output=2.0)
    if isinstance(m, _HEAD_MODULES):
        return OpSpec(
            HEAD,
            name,
            tileable=False,
            why_not="global layers end the tiled part",
            saves_input=True,
            has_params=any(True for _ in m.parameters()),
        )
    return _not_tileable(
        name,
        OPAQUE,
        f"{name} is not an operator the SFT engine knows how to tile; keep it where activations are small "
        "(the planner then runs it untiled), or replace it with a supported layer",
    )


def function_spec(node: fx.Node) -> OpSpec:
    """Describe a call_function / call_method node."""
    target = node.target
    if node.op == "call_method":
        name = str(target)
        if name in _MERGE_METHODS:
            return OpSpec(
                MERGE,
                _MERGE_METHODS[name],
                inplace=name.endswith("_"),
                saves_input=_MERGE_METHODS[name] == "mul",
                flops_per_output=1.0,
            )
        if name in _POINTWISE_METHODS:
            si, so = _POINTWISE_METHODS[name]
            return OpSpec(
                POINTWISE, name, inplace=name.endswith("_"), saves_input=si, saves_output=so, flops_per_output=1.0
            )
        if name in ("contiguous", "clone"):
            return OpSpec(POINTWISE, name, alias=name == "contiguous")
        if name in _HEAD_METHODS:
            return OpSpec(HEAD, name, tileable=False, why_not="reshapes end the tiled part")
        return _not_tileable(name, OPAQUE, f"tensor method .{name}() is not supported inside a tiled region")
    tname = getattr(target, "__name__", str(target))
    if target in _MERGE_FUNCS:
        kind = _MERGE_FUNCS[target]
        return OpSpec(MERGE, kind, inplace=target in _INPLACE_TO_OUT, saves_input=kind == "mul", flops_per_output=1.0)
    if target is torch.cat or target is torch.concat:
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        if dim not in (1, -3):
            return _not_tileable("cat", OPAQUE, f"torch.cat along dim {dim}: only channel concatenation (dim=1) tiles")
        return OpSpec(CONCAT, "cat")
    if target in _FUNCTIONAL_POINTWISE or target in _FUNCTIONAL_INPLACE:
        si, so = _FUNCTIONAL_POINTWISE.get(target, (False, True))
        inplace = target in _FUNCTIONAL_INPLACE or bool(node.kwargs.get("inplace", False))
        return _activation(tname, si, so, inplace)
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
    if name.endswith("_") and name.rstrip("_") in ("add", "mul", "sub", "relu"):
        name = name.rstrip("_")
    return name, kwargs
