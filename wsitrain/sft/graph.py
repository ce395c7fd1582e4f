"""Trace a model into a DAG of operators, annotate shapes on meta tensors, and find the cut points.

This is the annotating pass: it records frozen facts per node (spec, inputs, shape) and never
runs the model on real data. A *cut point* is a node through which every path from the image to
the head passes; only there can a checkpoint sit (never inside a residual block).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from wsitrain.errors import PlanError
from wsitrain.sft.ops import (
    INPUT,
    POINTWISE,
    OpSpec,
    function_spec,
    is_leaf_module,
    module_spec,
)
from wsitrain.sft.ops_space import can_checkpoint, ends_trunk, prune_unused_shape_reads


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf_module(m) or super().is_leaf_module(m, module_qualified_name)


@dataclass(frozen=True)
class GNode:
    """One operator of the traced model, in execution order."""

    index: int
    name: str  # the layer name users know: module path for modules, fx name otherwise
    fx_node: fx.Node
    inputs: tuple[int, ...]  # indices of the nodes whose tensors it reads
    users: tuple[int, ...]


def trace(model: nn.Module) -> fx.GraphModule:
    """Trace ``model`` with torch.fx, keeping known layers whole; explain failures."""
    try:
        graph = _Tracer().trace(model)
    except Exception as exc:  # fx raises many types; the user needs the model name and the reason
        raise PlanError(
            f"cannot trace {type(model).__name__} with torch.fx: {exc}",
            hint="the model's forward must not branch on tensor values; wrap such code in a leaf module",
        ) from exc
    prune_unused_shape_reads(graph)
    return fx.GraphModule(model, graph)


class ModelGraph:
    """The operator DAG of a model with its cut points. Shapes are computed per input shape."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.gm = trace(model)
        fx_nodes = [n for n in self.gm.graph.nodes if n.op not in ("output", "get_attr")]
        placeholders = [n for n in fx_nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise PlanError(
                f"{type(model).__name__}.forward takes {len(placeholders)} inputs; SFT needs exactly one image"
            )
        pos = {n: i for i, n in enumerate(fx_nodes)}
        users: list[list[int]] = [[] for _ in fx_nodes]
        nodes: list[GNode] = []
        for i, n in enumerate(fx_nodes):
            ins = tuple(dict.fromkeys(pos[a] for a in n.all_input_nodes if a in pos))
            for j in ins:
                users[j].append(i)
            nodes.append(GNode(i, str(n.target) if n.op == "call_module" else n.name, n, ins, ()))
        self.nodes = [GNode(g.index, g.name, g.fx_node, g.inputs, tuple(users[g.index])) for g in nodes]
        outputs = [n for n in self.gm.graph.nodes if n.op == "output"]
        self.output_fx = outputs[0]

    # ---- facts that depend on the modules' current modes -------------------------------------
    def specs(self) -> list[OpSpec]:
        """Spec of every node under the modules' current train/eval modes."""
        out: list[OpSpec] = []
        for g in self.nodes:
            n = g.fx_node
            if n.op == "placeholder":
                out.append(OpSpec(INPUT, "input"))
            elif n.op == "call_module":
                out.append(module_spec(self.gm.get_submodule(str(n.target))))
            else:
                out.append(function_spec(n))
        return out

    def mode_key(self) -> tuple[bool, ...]:
        """Train/eval flags of every module: plans are cached per mode (BatchNorm and Dropout change tileability)."""
        return tuple(m.training for m in self.gm.modules())

    # ---- shapes ------------------------------------------------------------------------------
    def shapes(
        self, input_shape: tuple[int, ...], input_dtype: torch.dtype
    ) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every node's output for an input shape, on meta tensors (nothing allocated)."""
        recorder = _ShapeRecorder(self.gm)
        x = torch.empty(input_shape, dtype=input_dtype, device="meta")
        try:
            with _on_meta(self.gm):
                recorder(x)
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(
                f"shape propagation failed at layer {recorder.current!r} for input shape {tuple(input_shape)}: {exc}",
                hint="check that the image is large enough for the model's strides and has the channels it expects",
            ) from exc
        return [recorder.result[g.fx_node] for g in self.nodes]

    # ---- structure -----------------------------------------------------------------------------
    def cut_points(
        self, specs: list[OpSpec], shapes: list[tuple[tuple[int, ...], torch.dtype]]
    ) -> tuple[list[int], int]:
        """Valid checkpoint positions in the trunk, and the index of the trunk's last node.

        A cut after node i is valid when no later node reads a node before i: the whole future
        depends on node i alone. This is the dominator/post-dominator condition for a DAG laid out
        in execution order. The trunk ends at the last cut before the first head operator.
        """
        n = len(self.nodes)
        min_input_after = [n] * (n + 1)  # min over nodes j > i of their smallest input index
        for i in range(n - 1, -1, -1):
            ins = self.nodes[i].inputs
            m = min(ins) if ins else i
            min_input_after[i] = min(min_input_after[i + 1], m)
        final_users = {a for a in self.output_fx.all_input_nodes}
        valid = []
        for i in range(n):
            later_ok = min_input_after[i + 1] >= i
            # a value the model returns besides the last node cannot sit inside a segment
            later_ok = later_ok and all(self.nodes[k].fx_node not in final_users for k in range(i))
            # tiles are cut from and joined into (B, C, H, W) checkpoints; never an int, a tuple or channels-last
            later_ok = later_ok and can_checkpoint(specs[i], shapes[i][0])
            if later_ok:
                valid.append(i)
        first_head = next(
            (
                i
                for i, (s, (shape, _)) in enumerate(zip(specs, shapes, strict=True))
                if ends_trunk(s)
            ),
            n,
        )
        trunk = [i for i in valid if i < first_head]
        if not trunk:
            raise PlanError("the model has no spatial trunk to tile")
        return trunk, trunk[-1]

    def candidate_cuts(self, specs: list[OpSpec], cuts: list[int], trunk_end: int) -> list[int]:
        """Cuts worth a checkpoint: after an activation chain, not between a conv and its activation."""
        out = []
        for i in cuts:
            if i in (0, trunk_end):
                out.append(i)
                continue
            us = self.nodes[i].users
            nxt = specs[us[0]] if len(us) == 1 else None
            if nxt is not None and nxt.kind == POINTWISE and not nxt.alias:
                continue  # storing the pre-activation costs the same and forces an extra recompute step
            out.append(i)
        return out


@contextlib.contextmanager
def _on_meta(root: nn.Module) -> Iterator[None]:
    """Temporarily give every module meta parameters and buffers of the same shapes.

    Done by hand: torch.func.functional_call would do the same but imports ~900 modules (seconds)
    on first use, in every process that plans.
    """
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for m in root.modules():
            for store in (m._parameters, m._buffers):
                for k, v in store.items():
                    if v is None or v.device.type == "meta":
                        continue
                    saved.append((store, k, v))
                    meta = torch.empty_like(v, device="meta")
                    store[k] = nn.Parameter(meta, v.requires_grad) if isinstance(v, nn.Parameter) else meta
        yield
    finally:
        for store, k, v in reversed(saved):
            store[k] = v


class _ShapeRecorder(nn.Module):
    """Runs the traced graph node by node on meta tensors and records each output's shape."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm
        self.result: dict[fx.Node, tuple[tuple[int, ...], torch.dtype]] = {}
        self.current = ""

    def forward(self, x: torch.Tensor) -> Any:
        recorder = self

        class _Interp(fx.Interpreter):
            def run_node(self, n: fx.Node) -> Any:
                recorder.current = str(n.target) if n.op == "call_module" else n.name
                out = super().run_node(n)
                if isinstance(out, torch.Tensor):
                    recorder.result[n] = (tuple(out.shape), out.dtype)
                else:
                    recorder.result[n] = ((), torch.float32)
                return out

        return _Interp(self.gm).run(x)
