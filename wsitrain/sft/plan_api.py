"""The engine's answers on shapes only: ``plan(model, input_shape, ...)`` and ``max_square_size``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.sft.budget import _device_str, _model_name, _param_dtype, resolve_budget_bytes
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.costs import TimeModel
from wsitrain.sft.planning.planner import build_plan, new_session
from wsitrain.sft.planning.search import fitting_plan, worth_running
from wsitrain.sft.target import TargetDevice
from wsitrain.sft.trail import guarded
from wsitrain.units import format_bytes

# max_square_size searches up to this edge: 1M px is ten whole slides at 20x side by side.
MAX_SQUARE_LIMIT = 1 << 20


def plan(
    model: nn.Module,
    input_shape: tuple[int, ...],
    memory_budget: int | float | str | None = None,
    dtype: torch.dtype | None = None,
    *,
    tile_size: int | None = None,
    checkpoints: list[str] | None = None,
    optimizer: str | None = None,
    input_on_host: bool | None = None,
    input_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    host_checkpoints: str = "auto",
    target: TargetDevice | None = None,
    time_model: TimeModel | None = None,
    input_requires_grad: bool = False,
    one_pass: bool = True,
    fold_bn: bool = True,
    keep_prefix: str = "auto",
) -> Plan:
    """Plan ``model`` on ``input_shape`` (B, C, H, W) within ``memory_budget``, on shapes only.

    ``dtype`` is the activation dtype (bf16/fp16 for autocast). For a CUDA device the image is assumed to stream
    from host memory as uint8 (``input_on_host``), as ``wsitrain fit`` does. ``time_model``: default constants.
    Returns a plan with ``fits=False`` when nothing fits; raises PlanError for layers that cannot
    be tiled where tiling is needed. ``target``: the device's planning facts (default: detected, ``target_for``).
    ``input_requires_grad``: plan for an image that wants its gradient (saliency; SFT plans so for such an x).
    ``one_pass``: as ``SFT``'s (planning/one_pass.py). ``fold_bn``: as ``SFT``'s (ops/fold_bn.py).
    """
    dev = _device_str(device)
    dtype = dtype or _param_dtype(model)
    on_host = dev == "cuda" if input_on_host is None else input_on_host
    in_dtype = input_dtype or (torch.uint8 if on_host else dtype)
    budget = resolve_budget_bytes(memory_budget, dev)
    graph = model_graph(model, fold_bn)
    with guarded(f"planning {_model_name(model)} on input {tuple(input_shape)}", node_namer(graph)):
        p, _ = build_plan(
            graph,
            _model_name(model),
            tuple(input_shape),
            budget,
            dtype,
            in_dtype,
            dev,
            on_host,
            input_requires_grad,
            tile_size=tile_size,
            checkpoints=checkpoints,
            optimizer=optimizer,
            host_checkpoints=host_checkpoints,
            target=target,
            time_model=time_model,
            one_pass=one_pass,
            keep_prefix=keep_prefix,
        )
    return p


def model_graph(model: nn.Module, fold_bn: bool = True) -> ModelGraph:
    """The model's graph; an internal error while building it names the model (``trail.guarded``). ``fold_bn``:
    frozen BatchNorm after a convolution folds into it (``ops/fold_bn.py``)."""
    with guarded(f"tracing {_model_name(model)}", lambda i: f"node {i}"):
        return ModelGraph(model, fold_bn)


def node_namer(graph: ModelGraph) -> Any:
    return lambda i: graph.nodes[i].name  # the layer name of a node index, for internal errors


def max_square_size(
    model: nn.Module,
    memory_budget: int | float | str,
    dtype: torch.dtype = torch.float32,
    batch: int = 1,
    channels: int = 3,
    optimizer: str | None = None,
    device: torch.device | str | None = None,
    limit: int = MAX_SQUARE_LIMIT,
    target: TargetDevice | None = None,
    time_model: TimeModel | None = None,
    input_dtype: torch.dtype | None = None,
) -> int:
    """Largest square edge (a multiple of the model's stride) whose plan fits; 0 if none. The image as ``plan``
    takes it: on a CUDA device in host memory (uint8 unless ``input_dtype``), elsewhere inside the budget."""
    graph = model_graph(model)
    dev = _device_str(device)
    budget = resolve_budget_bytes(memory_budget, dev)
    on_host = dev == "cuda"
    in_dtype = input_dtype or (torch.uint8 if on_host else dtype)
    stride = int(getattr(model, "stride", 32))

    def fits(edge: int) -> bool:
        try:
            shape = (batch, channels, edge, edge)
            sess = new_session(
                graph, shape, dtype, in_dtype, dev, on_host, False, optimizer, "auto", target, time_model
            )
        except PlanError:
            return False
        state = fitting_plan(sess, budget)
        return state is not None and worth_running(sess, state, None)

    # Bisect from the top: with the pool fused, memory stops growing with the image, and plans of large
    # images are quick (few segmentations fit), while small images make the search try everything.
    top = limit // stride * stride
    with guarded(f"sizing {_model_name(model)} for {format_bytes(budget)}", node_namer(graph)):
        if fits(top):
            return top
        lo, hi = 0, top  # fits(lo) (0: trivially), not fits(hi)
        while hi - lo > stride:
            mid = (lo + hi) // 2 // stride * stride
            if mid <= lo:
                break
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo if lo > 0 or fits(stride) else 0
