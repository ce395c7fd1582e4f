"""Trace a model into a DAG of operators: the structure every later pass annotates.

``ModelGraph`` holds the fx trace, the nodes in execution order with their inputs and users, and
the names users know (module paths). It does not depend on an input shape; the facts that do
(shapes, bytes, cut points) are computed by ``wsitrain.sft.facts.annotate``.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from wsitrain.errors import PlanError
from wsitrain.sft.ops.fold_bn import fold_pairs, folded_bn_spec
from wsitrain.sft.ops.registry import INPUT, OpSpec, function_spec, is_leaf_module, module_spec, node_parameters
from wsitrain.sft.ops.space import prune_unused_shape_reads
from wsitrain.sft.trail import WHERE


class _Tracer(fx.Tracer):
    def __init__(self) -> None:
        super().__init__()
        self.failed_in: str | None = None  # the innermost module whose forward raised while tracing

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf_module(m) or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                with contextlib.suppress(NameError):
                    self.failed_in = f"{self.path_of_module(m)} ({type(m).__name__})"
            raise


@dataclass(frozen=True)
class GNode:
    """One operator of the traced model, in execution order."""

    index: int
    name: str  # the layer name users know: module path for modules, "path (op)" for functions
    fx_node: fx.Node
    inputs: tuple[int, ...]  # indices of the nodes whose tensors it reads
    users: tuple[int, ...]


def trace(model: nn.Module) -> fx.GraphModule:
    """Trace ``model`` with torch.fx, keeping known layers whole; explain failures."""
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises many types; the user needs the model name, the layer and the reason
        where = f" in layer {tracer.failed_in}" if tracer.failed_in else ""
        raise PlanError(
            f"cannot trace {type(model).__name__} with torch.fx{where}: {exc}",
            hint="the model's forward must not branch on tensor values; wrap such code in a leaf module",
        ) from exc
    prune_unused_shape_reads(graph)  # `n, c, h, w = x.shape` with c unused: no tile region reaches it
    prune_dead_nodes(graph, model)  # DLA's unused `project` shortcut: no tile region would reach it either
    return fx.GraphModule(model, graph)


def _removable(n: fx.Node, root: nn.Module) -> bool:
    """Can a node nobody reads be skipped without changing anything plain PyTorch does?

    Only when running it has no effect: not in place, not random, and not a module with buffers (a
    train-mode BatchNorm updates its running statistics even when its output is unused).
    """
    if n.op == "call_module":
        mod = root.get_submodule(str(n.target))
        return not any(True for _ in mod.buffers()) and not isinstance(mod, nn.modules.dropout._DropoutNd)
    if n.op == "call_method":
        return not str(n.target).endswith("_")
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        random = any(k in name for k in ("dropout", "rand", "bernoulli", "normal_"))
        return not name.endswith("_") and not random and not n.is_impure()
    return n.op == "get_attr"


def prune_dead_nodes(graph: fx.Graph, root: nn.Module) -> None:
    """Drop nodes whose value nothing reads and the model does not return (last first, so chains go too)."""
    for node in reversed(list(graph.nodes)):
        if not node.users and node.op not in ("placeholder", "output") and _removable(node, root):
            graph.erase_node(node)


def user_name(n: fx.Node) -> str:
    """The name a user knows: ``features.3`` for a module, ``layer1.0 (add)`` for a function inside one."""
    if n.op == "call_module":
        return str(n.target)
    if n.op == "placeholder":
        return "input"
    stack = n.meta.get("nn_module_stack") or {}
    owner = next(reversed(stack.values()))[0] if stack else ""
    what = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", n.name)
    return f"{owner} ({what})" if owner else n.name


def _meta_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers are meta tensors of the same shapes.

    Shape propagation runs on it, so planning never touches (or swaps out) the user's weights and
    costs no memory for them. Done with deepcopy's memo rather than ``torch.func.functional_call``,
    which imports ~900 modules (seconds) on first use in every process that plans.
    """
    memo: dict[int, Any] = {}
    for p in gm.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in gm.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    # eval: shapes do not depend on the mode, and train-mode BatchNorm would update (meta) running
    # statistics, which with momentum=None reads num_batches_tracked (.item() fails on meta tensors)
    return copy.deepcopy(gm, memo).eval()


class ModelGraph:
    """The operator DAG of a model. Shape-dependent facts live in ``GraphFacts``.

    ``fold_bn``: frozen BatchNorm layers after a convolution fold into it (``ops/fold_bn.py``; their nodes stay, as
    aliases of the convolution's output or their activation).
    """

    def __init__(self, model: nn.Module, fold_bn: bool = True) -> None:
        self.model = model
        self.fold_bn = fold_bn
        self._folds: dict[tuple[bool, ...], dict[int, int]] = {}
        self.gm = trace(model)
        fx_nodes = [n for n in self.gm.graph.nodes if n.op not in ("output", "get_attr")]
        placeholders = [n for n in fx_nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise PlanError(
                f"{type(model).__name__}.forward takes {len(placeholders)} inputs; SFT needs exactly one image"
            )
        pos = {n: i for i, n in enumerate(fx_nodes)}
        users: list[list[int]] = [[] for _ in fx_nodes]
        ins_of: list[tuple[int, ...]] = []
        for i, n in enumerate(fx_nodes):
            ins = tuple(dict.fromkeys(pos[a] for a in n.all_input_nodes if a in pos))
            for j in ins:
                users[j].append(i)
            ins_of.append(ins)
        names = [user_name(n) for n in fx_nodes]
        seen: dict[str, int] = {}
        for nm in names:
            seen[nm] = seen.get(nm, 0) + 1
        # two functions in one module (two adds in a block) would share a name: tell them apart by fx name
        names = [
            nm if seen[nm] == 1 or n.op == "call_module" else f"{nm.split(' (')[0]} ({n.name})"
            for nm, n in zip(names, fx_nodes, strict=True)
        ]
        self.nodes = tuple(GNode(i, names[i], n, ins_of[i], tuple(users[i])) for i, n in enumerate(fx_nodes))
        self.index = {g.fx_node: g.index for g in self.nodes}
        self.output_fx = next(n for n in self.gm.graph.nodes if n.op == "output")
        self._meta: fx.GraphModule | None = None

    @property
    def meta_gm(self) -> fx.GraphModule:
        """The graph on meta parameters, for shape propagation (made on first use)."""
        if self._meta is None:
            self._meta = _meta_copy(self.gm)
        return self._meta

    def module(self, i: int) -> nn.Module | None:
        n = self.nodes[i].fx_node
        return self.gm.get_submodule(str(n.target)) if n.op == "call_module" else None

    def specs(self) -> list[OpSpec]:
        """Spec of every node under the modules' current train/eval modes."""
        out: list[OpSpec] = []
        folded = set(self.fold_pairs().values())
        for g in self.nodes:
            WHERE.node = g.index
            n = g.fx_node
            if n.op == "placeholder":
                out.append(OpSpec(INPUT, "input"))
            elif g.index in folded:
                bn = self.gm.get_submodule(str(n.target))
                assert isinstance(bn, nn.BatchNorm2d)
                out.append(folded_bn_spec(bn, type(bn).__name__))
            elif n.op == "call_module":
                out.append(module_spec(self.gm.get_submodule(str(n.target))))
            else:
                out.append(function_spec(n))
        WHERE.node = None
        return out

    def fold_pairs(self) -> dict[int, int]:
        """Convolution node -> BatchNorm node of the pairs that fold under the modules' current modes."""
        if not self.fold_bn:
            return {}
        key = self.mode_key()
        if key not in self._folds:
            self._folds[key] = fold_pairs(self.gm, [g.fx_node for g in self.nodes])
        return self._folds[key]

    def unfolded(self) -> ModelGraph:
        """This graph with nothing folded: plain PyTorch as users run it (every BatchNorm its own kernel), what a
        plan's baselines compare against. Shares the trace and its meta copy."""
        if not self.fold_bn:
            return self
        g = copy.copy(self)
        g.fold_bn = False
        g._folds = {}
        return g

    def mode_key(self) -> tuple[bool, ...]:
        """Train/eval flags of every module: plans are cached per mode (BatchNorm and Dropout change tileability)."""
        return tuple(m.training for m in self.gm.modules())

    def trainable_params(self, i: int) -> list[nn.Parameter]:
        """Parameters node i reads that receive gradients (a module's, or get_attr ones such as layer scale)."""
        return [p for p in node_parameters(self.nodes[i].fx_node, self.gm) if p.requires_grad]
