"""Call the traced nodes of a graph on real tensors: as plain autograd, or out of place inside tiles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx
from torch.fx.node import map_arg

from wsitrain.sft.execution.folds import FoldReplay
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.ops.drop import MaskReplay, replay_callable
from wsitrain.sft.ops.registry import in_place_callable, out_of_place_callable
from wsitrain.sft.trail import WHERE


def _call(node: fx.Node, fn: Any, kwargs: dict[str, Any], args: tuple[Any, ...]) -> Any:
    if node.op == "call_method":
        return getattr(args[0], fn)(*args[1:], **kwargs)
    return fn(*args, **kwargs)


class NodeRunner:
    """Runs nodes by index; values live in an ``env`` dict the caller owns."""

    def __init__(self, graph: ModelGraph) -> None:
        self.graph = graph
        self.index = graph.index
        self.original: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.safe: dict[int, tuple[Any, dict[str, Any]]] = {}
        # activations a tile runs writing into their input (planned: SegmentPlan.in_place, wsitrain/sft/in_place.py),
        # made on first use
        self.overwriting: dict[int, tuple[Any, dict[str, Any]]] = {}
        self.masks = MaskReplay()  # per-sample drop masks of the current step, replayed by tiles and recomputes
        self.folds = FoldReplay(graph)  # the current step's folded convolution weights (ops/fold_bn.py)
        for g in graph.nodes[1:]:
            WHERE.node = g.index
            n = g.fx_node
            module = graph.module(g.index)
            drop = replay_callable(module, g.index, self.masks)
            fn = module if module is not None else n.target
            self.original[g.index] = (drop or fn, dict(n.kwargs))
            self.safe[g.index] = (drop, dict(n.kwargs)) if drop else out_of_place_callable(n, module)
        WHERE.node = None
        # users in execution order, to free values after their last reader
        self.last_user = {g.index: max(g.users, default=g.index) for g in graph.nodes}

    def get_attr(self, n: fx.Node) -> Any:
        obj: Any = self.graph.gm
        for part in str(n.target).split("."):
            obj = getattr(obj, part)
        return obj

    def run(
        self,
        i: int,
        env: dict[int, Any],
        out_of_place: bool,
        fetch: Callable[[int], Any] | None = None,
        call: Callable[..., Any] | None = None,
        in_place: bool = False,
    ) -> Any:
        """Node i's value. ``call``: what a tile runs in its place, with its arguments (``OpSpec.extra[TILE_CALL]``).
        ``in_place``: overwrite the input (only where a plan says so: ``SegmentPlan.in_place``). A folded convolution
        or BatchNorm (``execution/folds.py``) runs its step's stand-in when ``call`` gives none."""
        n = self.graph.nodes[i].fx_node
        if call is None and not in_place and self.folds.current is not None:
            call = self.folds.plain_call(i)
        if in_place:
            if i not in self.overwriting:
                self.overwriting[i] = in_place_callable(n, self.graph.module(i))
            fn, kwargs = self.overwriting[i]
        else:
            fn, kwargs = (self.safe if out_of_place else self.original)[i]

        def arg(a: fx.Node) -> Any:
            if a.op == "get_attr":
                return self.get_attr(a)
            j = self.index[a]
            return fetch(j) if fetch is not None else env[j]

        if call is not None:  # stands in for a function or module: called with the node's own arguments
            return call(*map_arg(n.args, arg), **map_arg(kwargs, arg))
        return _call(n, fn, map_arg(kwargs, arg), map_arg(n.args, arg))

    def run_plain(self, start: int, end: int, env: dict[int, Any]) -> None:
        """Nodes start+1..end with ordinary autograd; values are dropped after their last reader."""
        for i in range(start + 1, end + 1):
            # never write into the segment input: it may be a checkpoint or the caller's tensor
            reads_start = start in self.graph.nodes[i].inputs
            env[i] = self.run(i, env, out_of_place=reads_start)
            for j in self.graph.nodes[i].inputs:
                if self.last_user[j] <= i and j != end:
                    env.pop(j, None)

    def output(self, env: dict[int, Any]) -> Any:
        """The model's return value, from the values in ``env``."""
        return map_arg(self.graph.output_fx.args[0], lambda n: env[self.index[n]])
