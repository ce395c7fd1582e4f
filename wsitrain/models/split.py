"""Split a library classifier (torchvision, timm) into a spatial trunk and a small head at its last global pooling.

The engine tiles the trunk (everything before the pooling) and runs the head untiled, so a library model is
rebuilt as ``features -> pool -> flatten -> classifier``:

* ``features``: the library's own modules up to the pooling, in a plain ``nn.Sequential`` when the model's
  forward is a straight chain (module paths stay the library's, e.g. ``features.1.0.block.3``), else an fx
  ``GraphModule`` over the same modules. The modules are the library's objects, not traced copies, so their
  train/eval branches (StochasticDepth, DropPath, BatchNorm) still follow the module's mode.
* ``classifier``: what the library applies between pooling and its last Linear (dropout, a pre-logits MLP, a
  LayerNorm), its own modules, then a new ``Linear(C, num_classes)``. Layers the library applies to the pooled
  ``(B, C, 1, 1)`` map before flattening get that map back through an ``nn.Unflatten``.

Where the model is analysed: torch.fx traces only the model's own ``forward`` with its children kept whole
(and opens a child only when the last global pooling hides inside it, like SqueezeNet's classifier or timm's
``head``), so a child's internals never matter here.
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import functional_call

from wsitrain.errors import WsiTrainError

# Side of the square meta image used to read the trunk's output channels and stride: shape arithmetic only
# (meta tensors), large enough that unpadded stems and ceil-mode pools do not blur the stride.
_PROBE_SIDE = 1024

# Pointwise functions a model's forward may apply between its children, as the modules that do the same:
# function -> (module class, whether it takes ``inplace``).
_FUNCTIONAL_MODULES: dict[object, tuple[type[nn.Module], bool]] = {
    F.relu: (nn.ReLU, True),
    torch.relu: (nn.ReLU, False),
    F.relu6: (nn.ReLU6, True),
    F.silu: (nn.SiLU, True),
    F.gelu: (nn.GELU, False),
    F.hardswish: (nn.Hardswish, True),
    torch.sigmoid: (nn.Sigmoid, False),
}
_FLATTEN_FUNCS = {torch.flatten, torch.squeeze}
_FLATTEN_METHODS = {"flatten", "view", "reshape", "squeeze"}
_MEAN_FUNCS = {torch.mean, torch.amax}
_MEAN_METHODS = {"mean", "amax"}


@dataclass(frozen=True)
class TrunkAndHead:
    """A library classifier split for the engine."""

    features: nn.Module  # (B, 3, H, W) -> (B, channels, H / stride, W / stride)
    classifier: nn.Module  # (B, channels) -> (B, num_classes), after global pooling and flatten
    channels: int
    stride: int
    dropped: tuple[str, ...]  # library children not kept whole: the replaced last Linear, aux heads, VGG's classifier


class _Tracer(fx.Tracer):
    """Keeps every child of an opened module whole; opens only the root and the modules in ``opened``."""

    def __init__(self, opened: set[str]) -> None:
        super().__init__()
        self.opened = opened

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        parent = module_qualified_name.rpartition(".")[0]
        if module_qualified_name not in self.opened and parent in self.opened:
            return True
        return super().is_leaf_module(m, module_qualified_name)


def _is_pool_module(m: nn.Module) -> bool:
    # timm's SelectAdaptivePool2d is matched by name so this module does not import timm.
    return isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)) or type(m).__name__ == "SelectAdaptivePool2d"


def _is_global_size(size: object) -> bool:
    if isinstance(size, (tuple, list)):
        return all(s == 1 for s in size)
    return size == 1


def _spatial_dims(dims: object) -> bool:
    return isinstance(dims, (tuple, list)) and sorted(int(d) for d in dims) in ([2, 3], [-2, -1])


def _pooling(node: fx.Node, gm: fx.GraphModule) -> bool | None:
    """None if ``node`` is no pooling over H and W; else whether it pools to 1 x 1 (global)."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)):
            return _is_global_size(m.output_size)
        return True if type(m).__name__ == "SelectAdaptivePool2d" else None
    if node.op == "call_function" and node.target in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        return _is_global_size(size)
    dims: object = None
    if node.op == "call_function" and node.target in _MEAN_FUNCS:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    elif node.op == "call_method" and node.target in _MEAN_METHODS:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return True if _spatial_dims(dims) else None


def _trace(net: nn.Module, label: str) -> tuple[fx.GraphModule, int]:
    """Trace the model's forward, opening children until no pooling hides after the last one found."""
    opened = {""}
    for _ in range(8):  # a global pool nested deeper than this is not a classifier head
        try:
            graph = _Tracer(opened).trace(net)
        except Exception as exc:  # fx raises many types; say which model and why
            raise WsiTrainError(
                f"cannot analyse {label}: torch.fx cannot trace its forward ({exc.__class__.__name__}: {exc})",
                hint="use a built-in model or a torchvision/timm CNN whose forward torch.fx can trace",
            ) from exc
        gm = fx.GraphModule(net, graph)
        nodes = list(graph.nodes)
        pools = [i for i, n in enumerate(nodes) if _pooling(n, gm) is not None]
        after = nodes[pools[-1] + 1 :] if pools else nodes
        hidden = [
            str(n.target)
            for n in after
            if n.op == "call_module" and any(_is_pool_module(s) for s in gm.get_submodule(str(n.target)).modules())
        ]
        if not hidden:
            if not pools:
                raise WsiTrainError(
                    f"{label} has no pooling over height and width, so it has no spatial trunk to tile",
                    hint="wsitrain trains CNN classifiers (a convolutional trunk, then global pooling and a head)",
                )
            return gm, pools[-1]
        opened |= set(hidden)
    raise WsiTrainError(f"cannot find the global pooling of {label}", hint="use a built-in model")


def _chain(nodes: list[fx.Node], start: fx.Node) -> bool:
    """Whether ``nodes`` form a straight line from ``start``: each reads only the one before it."""
    prev = start
    for n in nodes:
        if n.all_input_nodes != [prev]:
            return False
        prev = n
    return True


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _as_module(node: fx.Node, gm: fx.GraphModule) -> nn.Module | None:
    """The module that does what ``node`` does, for a chain; None if there is none."""
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_function" and node.target in _FUNCTIONAL_MODULES:
        cls, takes_inplace = _FUNCTIONAL_MODULES[node.target]
        return cls(inplace=bool(node.kwargs.get("inplace", False))) if takes_inplace else cls()
    return None


def _key(node: fx.Node) -> str:
    # A Sequential key cannot hold dots; the last path component keeps the library's name ("layer4", "features").
    return str(node.target).rpartition(".")[2] if node.op == "call_module" else node.name


def _unique(items: Iterable[tuple[str, nn.Module]]) -> OrderedDict[str, nn.Module]:
    out: OrderedDict[str, nn.Module] = OrderedDict()
    for key, m in items:
        k, i = key, 1
        while k in out:
            i += 1
            k = f"{key}_{i}"
        out[k] = m
    return out


def _trunk(gm: fx.GraphModule, pool: fx.Node) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """The trunk up to the pooling's input: a Sequential of the library's modules, or a GraphModule over them."""
    feat = pool.all_input_nodes[0]
    keep = _ancestors(feat)
    ordered = [n for n in gm.graph.nodes if n in keep]
    placeholder, body = ordered[0], ordered[1:]
    modules = [_as_module(n, gm) for n in body]
    if _chain(body, placeholder) and all(m is not None for m in modules):
        items = [(_key(n), m) for n, m in zip(body, modules, strict=True) if m is not None]
        return _sequential(items), items
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in ordered:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[feat])
    return fx.GraphModule(gm, graph, class_name="Trunk"), []


def _sequential(items: list[tuple[str, nn.Module]]) -> nn.Sequential:
    """Items as one Sequential; a lone Sequential child (plus pointwise functions) is opened so paths stay short."""
    with_params = [(k, m) for k, m in items if any(True for _ in m.parameters())]
    if len(with_params) == 1 and type(with_params[0][1]) is nn.Sequential:
        only = with_params[0][1]
        if len(items) == 1:
            return only
        opened: list[tuple[str, nn.Module]] = []
        for k, m in items:
            opened.extend(only.named_children() if m is only else [(k, m)])
        if len({k for k, _ in opened}) == len(opened):
            return nn.Sequential(OrderedDict(opened))
    return nn.Sequential(_unique(items))


def _flatten_sequentials(key: str, m: nn.Module) -> list[tuple[str, nn.Module]]:
    if isinstance(m, nn.Sequential):
        return [item for k, c in m.named_children() for item in _flatten_sequentials(k, c)]
    return [(key, m)]


def _pool_flattens(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether the pooling itself returns (B, C) rather than (B, C, 1, 1)."""
    if node.op == "call_module":
        return isinstance(getattr(gm.get_submodule(str(node.target)), "flatten", None), nn.Flatten)
    if node.op == "call_function" and node.target in (F.adaptive_avg_pool2d, F.adaptive_max_pool2d):
        return False
    return not (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))  # mean / amax


def _is_flatten(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _FLATTEN_FUNCS) or (
        node.op == "call_method" and node.target in _FLATTEN_METHODS
    )


def _head_items(gm: fx.GraphModule, pool: fx.Node, label: str) -> tuple[list[tuple[str, nn.Module]], int | None]:
    """The library's layers after the pooling, as modules, and the index of the first one that sees (B, C).

    Flatten steps, identities and zero dropouts are left out; None as index: nothing flattens before the end.
    """
    nodes = list(gm.graph.nodes)
    items: list[tuple[str, nn.Module]] = []
    flat_from: int | None = 0 if _pool_flattens(pool, gm) else None
    for n in nodes[nodes.index(pool) + 1 :]:
        if n.op == "output" or (n.op == "call_function" and n.target is operator.getitem):
            continue  # getitem: a tuple output's first element (the logits of a model with auxiliary outputs)
        if _is_flatten(n):
            flat_from = len(items) if flat_from is None else flat_from
        elif n.op == "call_module":
            for key, m in _flatten_sequentials(_key(n), gm.get_submodule(str(n.target))):
                if isinstance(m, nn.Flatten):
                    flat_from = len(items) if flat_from is None else flat_from
                elif not isinstance(m, nn.Identity) and not (isinstance(m, nn.Dropout) and m.p == 0):
                    items.append((key, m))
        elif n.op == "call_function" and n.target is F.dropout:
            p = float(n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5))
            if p > 0:
                items.append((n.name, nn.Dropout(p)))
        else:
            raise WsiTrainError(
                f"cannot rebuild the head of {label}: {n.op} {n.target} after its global pooling is not a layer "
                "wsitrain knows how to keep",
                hint="use a built-in model or another torchvision/timm CNN",
            )
    return items, flat_from


def _meta_output(module: nn.Module, shape: tuple[int, ...]) -> torch.Size:
    """Output shape of ``module`` (in eval mode) for an input of ``shape``, on meta tensors: nothing computed."""
    state = {k: torch.empty_like(v, device="meta") for k, v in module.state_dict(keep_vars=True).items()}
    modes = [(m, m.training) for m in module.modules()]
    module.eval()  # the branch the tracer saw; train-mode BatchNorm would refuse a batch of one 1 x 1 map
    try:
        x = torch.empty(shape, device="meta")
        return functional_call(module, state, (x,), strict=False, tie_weights=True).shape
    finally:
        for m, mode in modes:
            m.training = mode


def _probe(features: nn.Module, label: str) -> tuple[int, int]:
    """(channels, stride) of the trunk, from shapes on meta tensors (nothing computed or allocated)."""
    try:
        shape = _meta_output(features, (1, 3, _PROBE_SIDE, _PROBE_SIDE))
    except Exception as exc:
        raise WsiTrainError(
            f"cannot run the trunk of {label} on a {_PROBE_SIDE} px image to read its output shape: {exc}",
            hint="wsitrain tiles CNNs of any input size; this model seems to need a fixed input size (a vision "
            "transformer or hybrid)",
        ) from exc
    if len(shape) != 4 or shape[-1] < 1:
        raise WsiTrainError(
            f"the trunk of {label} gives shape {tuple(shape)}, not a (B, C, H, W) feature map",
            hint="wsitrain trains CNN classifiers; use a convolutional model",
        )
    stride = 2 ** round(math.log2(_PROBE_SIDE / shape[-1]))  # CNN strides are powers of two
    return int(shape[1]), int(stride)


def split_classifier(net: nn.Module, label: str, num_classes: int) -> TrunkAndHead:
    """Split library classifier ``net`` (named ``label`` in errors) at its last pooling over H and W.

    After a global (1 x 1) pooling the library's head is kept up to its last Linear, which becomes a new
    ``num_classes``-way Linear. After a fixed-size adaptive pooling (VGG, AlexNet: 7 x 7 into a 25088-wide
    classifier) nothing of the library's head fits a global pooling, so it is dropped.
    """
    modes = [(m, m.training) for m in net.modules()]
    net.eval()  # trace the inference branch: no auxiliary heads (GoogLeNet, Inception)
    try:
        gm, p = _trace(net, label)
    finally:
        for m, mode in modes:
            m.training = mode
    pool = list(gm.graph.nodes)[p]
    features, trunk_items = _trunk(gm, pool)
    pre: list[tuple[str, nn.Module]] = []
    flat_from: int | None = 0
    logits_key = "fc"  # the new Linear takes the name of the library layer it replaces
    if _pooling(pool, gm):
        head, flat_from = _head_items(gm, pool, label)
        last = max((i for i, (_, m) in enumerate(head) if isinstance(m, (nn.Linear, nn.Conv2d))), default=None)
        if last is not None:
            pre, logits_key = head[:last], head[last][0]
        elif trunk_items:
            features, pre = _cut_logits_conv(trunk_items, label)
            flat_from = 0
    channels, stride = _probe(features, label)
    n4 = len(pre) if flat_from is None else min(flat_from, len(pre))
    layers = pre
    if n4:
        # Layers the library runs on the pooled (B, C, 1, 1) map (a 1x1 conv, LayerNorm2d, BatchNorm) run on it here
        # too, as the library's own modules: the vector is unflattened for them and flattened again after.
        layers = [("unflatten", nn.Unflatten(1, (channels, 1, 1))), *pre[:n4], ("flatten", nn.Flatten(1)), *pre[n4:]]
    try:
        width = _meta_output(nn.Sequential(_unique(layers)), (1, channels))[-1] if layers else channels
    except Exception as exc:
        raise WsiTrainError(
            f"cannot rebuild the head of {label}: its layers after pooling do not take the trunk's {channels} "
            f"channels ({exc})",
            hint="this model's pooling is not a plain average (e.g. timm's catavgmax); use another model",
        ) from exc
    ref = next(iter(net.parameters()))
    new = nn.Linear(int(width), num_classes, device=ref.device, dtype=ref.dtype)
    classifier: nn.Module = new if not layers else nn.Sequential(_unique([*layers, (logits_key, new)]))
    kept = {id(t) for t in [*features.parameters(), *classifier.parameters()]}
    dropped = tuple(k for k, m in net.named_children() if any(id(t) not in kept for t in m.parameters()))
    return TrunkAndHead(features, classifier, channels, stride, dropped)


def _cut_logits_conv(items: list[tuple[str, nn.Module]], label: str) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """SqueezeNet-style heads: dropout -> 1x1 conv to the classes -> ReLU -> pooling. Cut before the dropout."""
    rest = list(items)
    while rest and not any(True for _ in rest[-1][1].parameters()):
        rest.pop()  # activations after the class conv
    if not rest or not isinstance(rest[-1][1], nn.Conv2d):
        raise WsiTrainError(f"cannot find the classification layer of {label}", hint="use a built-in model")
    rest.pop()  # the library's class conv, replaced by the new Linear
    pre: list[tuple[str, nn.Module]] = []
    while rest and isinstance(rest[-1][1], (nn.Dropout, nn.Dropout2d)):
        pre.insert(0, rest.pop())
    return _sequential(rest), pre
