"""The public engine API: ``plan(model, input_shape, ...)`` and ``SFT(model, ...)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.fx.node import map_arg

from wsitrain.errors import PlanError
from wsitrain.memory import detect_budget
from wsitrain.sft.executor import NodeRunner, TiledSegment, run_segment
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planner import PlanContext, build_plan, fitting_plan
from wsitrain.sft.stats import StatsRecorder, StepStats
from wsitrain.units import format_bytes, parse_bytes


def _device_str(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


def _budget(memory_budget: int | float | str | None, device: str) -> int:
    if memory_budget is not None:
        return parse_bytes(memory_budget, what="memory_budget")
    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError(
            "cannot detect the memory of a CUDA device on a machine without one",
            hint="pass memory_budget (e.g. '11GiB') or a GPU preset",
        )
    return detect_budget(device)


def _param_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


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
) -> Plan:
    """Plan ``model`` on ``input_shape`` (B, C, H, W) within ``memory_budget``, on shapes only.

    ``dtype`` is the activation dtype (bf16/fp16 for autocast). For a CUDA device the image is
    assumed to stream from host memory as uint8 (``input_on_host``), as ``wsitrain fit`` does.
    Returns a plan with ``fits=False`` when nothing fits; raises PlanError for layers that cannot
    be tiled where tiling is needed.
    """
    dev = _device_str(device)
    dtype = dtype or _param_dtype(model)
    on_host = dev == "cuda" if input_on_host is None else input_on_host
    in_dtype = input_dtype or (torch.uint8 if on_host else dtype)
    budget = _budget(memory_budget, dev)
    p, _ = build_plan(
        model,
        ModelGraph(model),
        tuple(input_shape),
        budget,
        dtype,
        in_dtype,
        dev,
        on_host,
        tile_size=tile_size,
        checkpoints=checkpoints,
        optimizer=optimizer,
    )
    return p


def max_square_size(
    model: nn.Module,
    memory_budget: int | float | str,
    dtype: torch.dtype = torch.float32,
    batch: int = 1,
    channels: int = 3,
    optimizer: str | None = None,
    device: torch.device | str | None = None,
    limit: int = 1 << 20,
) -> int:
    """Largest square edge (a multiple of the model's stride) whose plan fits; 0 if none."""
    graph = ModelGraph(model)
    dev = _device_str(device)
    budget = _budget(memory_budget, dev)
    on_host = dev == "cuda"
    in_dtype = torch.uint8 if on_host else dtype
    stride = int(getattr(model, "stride", 32))

    def fits(edge: int) -> bool:
        try:
            ctx = PlanContext(graph, (batch, channels, edge, edge), dtype, in_dtype, dev, on_host, False, optimizer)
        except PlanError:
            return False
        return fitting_plan(ctx, budget) is not None

    lo, hi = 0, stride * 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if lo == 0 and not fits(stride * 2):
        return 0
    hi = min(hi, limit + stride)
    while hi - lo > stride:
        mid = (lo + hi) // 2 // stride * stride
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


class SFT(nn.Module):
    """Segmented fused-tiled execution of ``model``: same outputs and gradients, bounded memory.

    ``SFT(model, memory_budget="11GiB")`` plans per input shape (cached) and runs tiled where the
    activations would not fit. ``tile_size`` forces the tile edge (image pixels, halo excluded) and
    tiles every segment; ``checkpoints`` forces the checkpoint layers. The input may be uint8 or
    float and may live on the host while the model is on the GPU: tiles are cut on the host.
    """

    def __init__(
        self,
        model: nn.Module,
        memory_budget: int | float | str | None = None,
        tile_size: int | None = None,
        checkpoints: list[str] | None = None,
        optimizer: str | None = None,
        collect_stats: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.memory_budget = memory_budget
        self.tile_size = tile_size
        self.checkpoints = checkpoints
        self.optimizer = optimizer
        self.collect_stats = collect_stats
        self._graph = ModelGraph(model)
        self._runner = NodeRunner(self._graph)
        self._cache: dict[tuple[Any, ...], tuple[Plan, list[TiledSegment | None]]] = {}
        self.last_stats = StepStats()

    # ---- planning ------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        for b in self.model.buffers():
            return b.device
        return torch.device("cpu")

    def _act_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return _param_dtype(self.model)

    def plan_for(
        self,
        input_shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
        input_dtype: torch.dtype | None = None,
        input_on_host: bool = False,
    ) -> Plan:
        """The plan for an input shape (cached per shape, dtype and the modules' train/eval modes)."""
        device = self._device()
        act = dtype or self._act_dtype(device)
        return self._plan(tuple(input_shape), act, input_dtype or act, input_on_host, False)[0]

    def _plan(
        self, shape: tuple[int, ...], act: torch.dtype, in_dtype: torch.dtype, on_host: bool, x_grad: bool
    ) -> tuple[Plan, list[TiledSegment | None]]:
        device = self._device()
        key = (shape, act, in_dtype, on_host, x_grad, device, self._graph.mode_key())
        if key not in self._cache:
            budget = _budget(self.memory_budget, device.type)
            p, ctx = build_plan(
                self.model,
                self._graph,
                shape,
                budget,
                act,
                in_dtype,
                device.type,
                on_host,
                x_grad,
                tile_size=self.tile_size,
                checkpoints=self.checkpoints,
                optimizer=self.optimizer,
            )
            if not p.fits:
                raise PlanError(
                    f"{p.model_name} on input {shape} does not fit {format_bytes(budget)}: "
                    f"the best plan needs {format_bytes(p.estimated_peak_bytes)}",
                    hint="raise the memory budget, read slides at a coarser resolution (data.mpp / data.level), "
                    "or train in bf16",
                )
            segs = [TiledSegment(ctx, s, self._runner, device) if s.mode == "tiled" else None for s in p.segments]
            self._cache[key] = (p, segs)
        return self._cache[key]

    # ---- execution -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> Any:
        device = self._device()
        on_host = x.device != device
        act = self._act_dtype(device)
        p, segs = self._plan(tuple(x.shape), act, x.dtype, on_host, x.requires_grad)
        self._runner.masks.new_step()  # stochastic depth: one draw per sample and step, replayed by every tile
        stats = StepStats()
        self.last_stats = stats
        recorder = StatsRecorder(device, stats) if self.collect_stats else None
        if recorder is not None:
            stats.peak_bytes = recorder.peak_now()
        env: dict[int, Any] = {0: x}
        for sp, seg in zip(p.segments, segs, strict=True):
            if seg is None:
                if sp.start == 0 and on_host:
                    env[0] = x.to(device, non_blocking=True)
                self._runner.run_plain(sp.start, sp.end, env)
            else:
                seg.stats = recorder
                env[sp.end] = run_segment(seg, env[sp.start])
            for k in [k for k in env if k < sp.end]:
                del env[k]  # autograd keeps what backward needs; this frame keeps nothing more
        trunk_end = p.segments[-1].end
        self._runner.run_plain(trunk_end, len(self._graph.nodes) - 1, env)
        idx = self._runner.index
        return map_arg(self._graph.output_fx.args[0], lambda n: env[idx[n]])

    def extra_repr(self) -> str:
        return f"memory_budget={self.memory_budget!r}, tile_size={self.tile_size!r}, checkpoints={self.checkpoints!r}"
