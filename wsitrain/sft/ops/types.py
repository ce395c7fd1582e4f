"""Operator specs: the vocabulary the planner and the executor share about one traced operator.

Every fx node of a model is described by an ``OpSpec``: how an output interval along H or W maps to
the input interval it reads (the paper's sigma/delta, done with exact integer intervals), whether it
can run on a tile (FT-compatible), where H and W sit in its output, what autograd saves for it (for
the memory model), and its FLOPs. ops.py describes modules, ops_functions.py functions and tensor
methods, ops_space.py fits each spec to the layout of its input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from torch import fx

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
TRAILING = (
    "trailing"  # acts on the last ``extra["trailing"]`` dims (Linear, LayerNorm): fine when H, W are not among them
)
PERMUTE = "permute"
TRANSPOSE = "transpose"
RESHAPE = "reshape"  # view / reshape / flatten / unflatten: fine when it only regroups the non-image dims
SPLIT = "split"  # chunk / split along a non-image dim: a tuple of tensors with the input's layout
GETITEM = "getitem"  # one tensor of a split, or a slice that keeps the image axes whole
CAT = "cat"  # concatenation along a non-image dim
SIZE = "size"  # x.size() / x.shape: ints of the tensor it reads
REDUCE = "reduce"  # mean / sum / amax over non-image dims


# OpSpec.extra key: the callable a tile runs in place of the node's own (with the node's arguments), where the
# original call would measure the tile rather than the image (``resample.FixedFactor``), or a ``PlacedCall``
TILE_CALL = "tile_call"


@runtime_checkable
class PlacedCall(Protocol):
    """A TILE_CALL that must know where the tile sits in the whole map (``stretch.StretchCall``: a resize whose
    source grid the whole map's extents stretch computes global indices, shifted by the crop's start)."""

    def at(self, rows: tuple[int, int], cols: tuple[int, int]) -> Callable[..., Any]:
        """The callable for a tile whose crop of the node's first input spans global ``rows`` x ``cols``."""
        ...


def tile_call(spec: OpSpec, crop: Callable[[], tuple[tuple[int, int], tuple[int, int]]]) -> Callable[..., Any] | None:
    """What a tile runs in place of the node (None: the node itself). ``crop()``: the global rows and cols of the
    tile's crop of the node's first input, asked only by a ``PlacedCall``."""
    call = spec.extra.get(TILE_CALL)
    return call.at(*crop()) if isinstance(call, PlacedCall) else call


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

    def output_count(self, lo: int, hi: int) -> int:
        """Outputs the layer produces on the crop [lo, hi) (its own padding applied at both ends)."""
        return (hi - lo + 2 * self.padding - self.dilation * (self.kernel - 1) - 1) // self.stride + 1


class AxisMap(Protocol):
    """What regions and executors ask of one axis of a WINDOW operator (``Window``, ``resample.Upscale``)."""

    def input_interval(self, a: int, b: int, size_in: int) -> tuple[int, int]: ...

    def first_output(self, lo: int) -> int: ...

    def output_count(self, lo: int, hi: int) -> int: ...


@dataclass(frozen=True)
class OpSpec:
    """Facts about one traced operator, as the planner and executor need them."""

    kind: str
    type_name: str  # e.g. "Conv2d", "ReLU", "add"
    windows: tuple[AxisMap, AxisMap] | None = None  # (H, W) for WINDOW ops
    tileable: bool = True
    why_not: str = ""  # when not tileable: the reason and the fix
    inplace: bool = False  # output aliases its input
    # (saves input, saves output) of the out-of-place form, where it differs from the in-place one: tiles run every
    # layer out of place (a tile cut from a checkpoint is a view of it), and out-of-place LeakyReLU, ReLU6, SiLU,
    # GELU, Hardswish, Hardtanh keep their *input* for backward where the in-place form keeps the output
    out_of_place_saves: tuple[bool, bool] | None = None
    alias: bool = False  # returns its input unchanged (Identity, eval Dropout)
    saves_input: bool = False  # autograd keeps the input for backward
    saves_output: bool = False  # autograd keeps the output for backward
    index_bytes: int = 0  # extra bytes per output element kept for backward (max-pool indices)
    # autograd keeps a copy of the input, as large as the output: in-place ops whose derivative reads the original
    # input (SiLU, Hardswish, Hardsigmoid, Mish), which autograd clones before overwriting it
    saves_input_clone: bool = False
    flops_per_output: float = 0.0  # forward FLOPs per output element
    has_params: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    # Where H and W sit in the output (in each tensor of a tuple output): (2, 3) for (B, C, H, W),
    # (1, 2) for channels-last (B, H, W, C); None for values that do not vary over the image plane
    # (ints from size(), constants, the head). Set by ops_space.resolve_layouts from the input's layout.
    spatial_dims: tuple[int, int] | None = (2, 3)
    layout_rule: str = NCHW  # how the output layout follows from the input's (see the rules above)


def out_of_place(spec: OpSpec) -> OpSpec:
    """The operator as a tile runs it: never in place, saving what the out-of-place form saves."""
    if not spec.inplace:
        return spec
    si, so = spec.out_of_place_saves or (spec.saves_input, spec.saves_output)
    return replace(spec, inplace=False, saves_input=si, saves_output=so, saves_input_clone=False)


def in_place(spec: OpSpec) -> OpSpec:
    """The activation as a tile runs it in place (``NodeFacts.in_place_in_tile``): its output is its input's
    storage and autograd keeps that storage, the result, for backward (``activations.exact_in_place``)."""
    return replace(spec, inplace=True, saves_input=False, saves_output=True, saves_input_clone=False)


# In-place activations whose derivative reads the original input: autograd clones the input before the op writes
# it (``original_self`` in PyTorch's derivatives), so the in-place form keeps a copy of the input and not its
# output. Seen on the simulated device: EfficientNet-B0's plain segments held conv, BatchNorm and SiLU-clone maps,
# 25% above a replay that took in-place SiLU to keep only its output. ReLU, ReLU6/Hardtanh, LeakyReLU and ELU
# differentiate from their result and keep the output.
INPLACE_CLONES_INPUT = frozenset({"silu", "hardswish", "hardsigmoid", "mish"})


def activation_spec(
    name: str, saves_input: bool, saves_output: bool, inplace: bool, has_params: bool = False
) -> OpSpec:
    """A pointwise activation: in place it keeps its output (its input's storage), or a clone of its input."""
    clones = inplace and name.lower().rstrip("_") in INPLACE_CLONES_INPUT
    return OpSpec(
        POINTWISE,
        name,
        inplace=inplace,
        saves_input=saves_input and not inplace,
        saves_output=(saves_output or inplace) and not clones,
        saves_input_clone=clones,
        out_of_place_saves=(saves_input, saves_output) if inplace else None,
        flops_per_output=1.0,
        has_params=has_params,
        layout_rule=ELEMENTWISE,
    )


def not_tileable(type_name: str, kind: str, why: str) -> OpSpec:
    return OpSpec(kind=kind, type_name=type_name, tileable=False, why_not=why, saves_input=True)


DROPOUT_WHY = (
    "element-wise Dropout in training mode draws position-dependent masks that differ between a tile's forward "
    "and its recomputation; use p=0 or eval mode for Dropout inside the tiled trunk (stochastic depth, one "
    "decision per sample, is supported)"
)


def call_arg(node: fx.Node, pos: int, key: str, default: Any = None) -> Any:
    """Argument ``key`` of a call node, given by keyword or at position ``pos``."""
    if key in node.kwargs:
        return node.kwargs[key]
    return node.args[pos] if len(node.args) > pos else default
