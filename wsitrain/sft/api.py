"""The public engine: ``SFT(model, ...)``, planning per input shape and executing the plan (``plan_api``: on shapes)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.memory import PeakMeter, tune_library_allocator
from wsitrain.sft.budget import MemoryProbe, _model_name, _param_dtype, resolve_budget_bytes
from wsitrain.sft.execution.hooks import ExecHooks, TileObserver
from wsitrain.sft.execution.host_register import upload_whole
from wsitrain.sft.execution.runner import NodeRunner
from wsitrain.sft.execution.runtime import DeviceRuntime, runtime_for
from wsitrain.sft.execution.segments import run_tiled, tiled_segment
from wsitrain.sft.execution.spill import SpillFiles
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.execution.stats import StatsRecorder, StepStats
from wsitrain.sft.execution.tiled import TiledSegment
from wsitrain.sft.facts import GraphFacts, load_meta_kernels
from wsitrain.sft.plan_api import model_graph, node_namer
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.costs import TimeModel
from wsitrain.sft.planning.placement import place_host
from wsitrain.sft.planning.planner import build_plan
from wsitrain.sft.source import is_source
from wsitrain.sft.target import TargetDevice, detection_device, target_for
from wsitrain.sft.trail import guarded
from wsitrain.units import format_bytes, parse_bytes

# Plans kept per SFT, least recently used evicted. A run with data.region: tissue sees one shape per
# slide; shape buckets keep that to a few, and a plan is rebuilt in well under a second when evicted.
PLAN_CACHE_SIZE = 4


def _on_host(x: torch.Tensor, device: torch.device) -> bool:
    """Is ``x`` host memory outside the budget? On CUDA an image in host memory is. On CPU host and device are the same
    RAM: an image in it (uint8 or float) is inside the budget, as segment 0's checkpoint, and only a slide read tile by
    tile (a region source, sft/source.py) is planned outside it, as wsitrain fit's preflight plans it."""
    return x.device != device or (device.type == "cpu" and is_source(x))


@dataclass(frozen=True)
class _Compiled:
    """A cached plan with what executing it needs."""

    plan: Plan
    facts: GraphFacts
    segments: tuple[TiledSegment | None, ...]


class SFT(nn.Module):
    """Segmented fused-tiled execution of ``model``: same outputs and gradients, bounded memory.

    ``SFT(model, memory_budget="11GiB")`` plans per input shape (a few plans cached) and runs tiled
    where the activations would not fit. Without ``memory_budget`` the budget is detected once, at
    the first plan, and kept for every later shape (``memory_probe`` replaces the device probe).
    ``tile_size`` forces the tile edge (image pixels, halo excluded) and tiles every segment;
    ``checkpoints`` forces the checkpoint layers. The input may be uint8 or float and may live on the
    host while the model is on the GPU: tiles are cut on the host. ``tile_peaks`` records each tile's
    peak memory in ``last_stats`` (it restarts the device's peak counter per tile, so leave it off
    while measuring whole steps). ``reuse_tiles``: compute background tiles (flat input, halo included) once per
    sweep and skip tiles whose output gradient is zero; the step is bitwise the same either way. ``runtime``
    replaces the device's streams, events and page-locked buffers
    (``wsitrain.sft.simulate`` passes its simulated CUDA runtime; by default the model's device decides).
    ``host_memory``: host RAM per rank for the host checkpoints (bytes or "16GiB"); the ones it does not hold spill
    to memory-mapped files in ``spill_dir`` (default the system temp folder), bitwise the same step
    (``planning/placement.py``, ``execution/spill.py``). None: every host checkpoint stays in RAM. ``one_pass``: where
    the last tiled segment ends in a global mean and a linear head of one or two outputs, back-propagate its tiles in
    forward along the head's gradient direction (``execution/one_pass.py``; no forward sweep, no recompute, the same
    gradients up to rounding); False: always recompute. ``fold_bn``: a frozen (eval-mode) BatchNorm after a convolution
    folds into the convolution's weight and bias, recomputed from the original parameters every step
    (``ops/fold_bn.py``: no BatchNorm kernel runs, the same outputs and gradients up to rounding); False: every
    BatchNorm runs as itself. ``keep_prefix``: a patch encoder's frozen stem and leading blocks
    (``model.freeze.last_blocks`` on a timm ViT) run forward once per step, their output kept from the forward sweep
    for the chunks' recompute, where the plan says so: "auto" (its peak and step time decide,
    ``planning/kept_prefix.py``), "always" (wherever it can), "never" (recomputed in each chunk); exact either way.
    """

    def __init__(
        self,
        model: nn.Module,
        memory_budget: int | float | str | None = None,
        tile_size: int | None = None,
        checkpoints: list[str] | None = None,
        optimizer: str | None = None,
        collect_stats: bool = True,
        tile_peaks: bool = False,
        memory_probe: MemoryProbe | None = None,
        host_checkpoints: str = "auto",
        runtime: DeviceRuntime | None = None,
        time_model: TimeModel | None = None,
        target: TargetDevice | None = None,
        reuse_tiles: bool = True,
        host_memory: int | str | None = None,
        spill_dir: str | None = None,
        one_pass: bool = True,
        fold_bn: bool = True,
        keep_prefix: str = "auto",
    ) -> None:
        super().__init__()
        self.model = model
        self.memory_budget = memory_budget
        self.tile_size = tile_size
        self.checkpoints = checkpoints
        self.optimizer = optimizer
        self.collect_stats = collect_stats
        self.tile_peaks = tile_peaks
        self.host_checkpoints = host_checkpoints  # "auto" (CUDA may use host memory), "always", "never"
        self._probe = memory_probe  # how the budget is detected when none is given (injectable for tests)
        self.time_model = time_model  # None: the device's default constants; wsitrain fit passes a calibration
        # background tiles computed once per sweep and skipped zero-gradient tiles (execution/reuse.py); off: every
        # tile computed, the reference the reuse tests compare against bitwise
        self.reuse_tiles = reuse_tiles
        self.one_pass = one_pass
        # a patch encoder's frozen prefix output kept for the recompute: "auto" (by the budget), "always", "never"
        self.keep_prefix = keep_prefix
        self.target = target  # the device's planning facts; None: detected (the simulated device: a preset's)
        self._budget_bytes: int | None = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        self.fold_bn = fold_bn
        self._graph = model_graph(model, fold_bn)
        load_meta_kernels()  # the first plan's lazy imports happen here, not inside the first step (facts.py)
        with guarded(f"compiling {_model_name(model)}", node_namer(self._graph)):
            self._runner = NodeRunner(self._graph)
        self._cache: OrderedDict[tuple[Any, ...], _Compiled] = OrderedDict()
        self._runtime = runtime
        self.host_memory = None if host_memory is None else parse_bytes(host_memory, "host_memory")
        self._stager = HostStager(runtime=runtime, spill=SpillFiles(spill_dir))
        self._hooks = ExecHooks()
        self.last_stats = StepStats()

    # ---- planning ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (CPU for a model without any)."""
        return self._device()

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        for b in self.model.buffers():
            return b.device
        return torch.device("cpu")

    def _plan_device(self, device: torch.device) -> str:
        """The device type plans are priced for: the runtime's (the simulated device plans as CUDA)."""
        return (self._runtime or runtime_for(device)).plan_device

    def _act_dtype(self, device: torch.device) -> torch.dtype:
        try:
            autocast = torch.is_autocast_enabled(device.type)
        except RuntimeError:  # a device type without autocast: a model built on the meta device, to plan
            autocast = False
        if autocast:
            return torch.get_autocast_dtype(device.type)
        return _param_dtype(self.model)

    @property
    def budget_bytes(self) -> int:
        """The run's budget: given, or detected once on first use and then fixed."""
        if self._budget_bytes is None:
            d = self._device()
            self._budget_bytes = resolve_budget_bytes(None, detection_device(d, self._plan_device(d)), self._probe)
        return self._budget_bytes

    @property
    def cached_plans(self) -> int:
        return len(self._cache)

    def replan(self, budget_bytes: int) -> None:
        """Plan every shape again within ``budget_bytes`` (cached plans dropped): fit's answer to an out of memory."""
        self._budget_bytes = parse_bytes(budget_bytes, "budget_bytes")
        self.memory_budget = self._budget_bytes
        self._cache.clear()

    def plan_of(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> Plan:
        """The plan ``forward(x)`` runs (x's shape, dtype, placement), with activations in ``dtype`` (autocast's)."""
        dev = self._device()
        act = dtype or self._act_dtype(dev)
        return self._compiled(tuple(x.shape), act, x.dtype, _on_host(x, dev), x.requires_grad).plan

    @property
    def staging_buffers(self) -> int:
        return self._stager.buffers

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
        return self._compiled(tuple(input_shape), act, input_dtype or act, input_on_host, False).plan

    def _compiled(
        self, shape: tuple[int, ...], act: torch.dtype, in_dtype: torch.dtype, on_host: bool, x_grad: bool
    ) -> _Compiled:
        device = self._device()
        key = (shape, act, in_dtype, on_host, x_grad, device, self._graph.mode_key())
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        budget = self.budget_bytes
        tune_library_allocator(device)  # CPU: the budget holds only with glibc's threshold fixed (said once)
        with guarded(f"planning {_model_name(self.model)} on input {shape}", node_namer(self._graph)):
            p, facts = build_plan(
                self._graph, _model_name(self.model), shape, budget, act, in_dtype, self._plan_device(device),
                on_host, x_grad, tile_size=self.tile_size, checkpoints=self.checkpoints, optimizer=self.optimizer,
                host_checkpoints=self.host_checkpoints, time_model=self.time_model, reuse_tiles=self.reuse_tiles,
                one_pass=self.one_pass, keep_prefix=self.keep_prefix,
                target=self.target or target_for(detection_device(device, self._plan_device(device))),
            )  # fmt: skip
            p = place_host(p, self.host_memory)  # which host checkpoints stay in RAM, which spill to disk
            if not p.fits:
                why = "; ".join(p.notes) or f"the best plan needs {format_bytes(p.estimated_peak_bytes)}"
                least = f" to at least {format_bytes(p.min_budget_bytes)}" if p.min_budget_bytes else ""
                raise PlanError(
                    f"{p.model_name} on input {shape} does not fit {format_bytes(budget)}: {why}",
                    hint=f"raise the memory budget{least}, read slides at a coarser resolution (data.mpp / "
                    "data.level), or train in bf16",
                )
            segs = tuple(
                tiled_segment(facts, s, self._runner, device, self._stager, self._hooks, p.reuse_tiles)
                if s.mode == "tiled"
                else None
                for s in p.segments
            )
        compiled = _Compiled(p, facts, segs)
        self._cache[key] = compiled
        while len(self._cache) > PLAN_CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    # ---- hooks ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def observe_trunk(self, fn: TileObserver) -> Iterator[None]:
        """Within the block, forward calls ``fn(tile, rows, cols)`` for each tile of the trunk's last feature map.

        ``tile`` is (B, C, th, tw), detached; ``rows``/``cols`` are its intervals in trunk-output pixels.
        A plain (untiled) last segment calls ``fn`` once with the whole map.
        """
        old = self._hooks.trunk_observer
        self._hooks.trunk_observer = fn
        try:
            yield
        finally:
            self._hooks.trunk_observer = old

    @contextlib.contextmanager
    def input_gradient_sink(self, fn: TileObserver) -> Iterator[None]:
        """Within the block, backward hands each tile's share of the image gradient to ``fn(grad, rows, cols)``.

        Shares of overlapping tiles add up to the exact input gradient, in image pixels; a tiled first
        segment then builds no full-size input gradient (the image's ``.grad`` stays None). With a plain
        first segment ``fn`` is called once with the whole gradient.
        """
        old = self._hooks.input_grad_sink
        self._hooks.input_grad_sink = fn
        try:
            yield
        finally:
            self._hooks.input_grad_sink = old

    # ---- execution -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> Any:
        device = self._device()
        on_host = _on_host(x, device)
        c = self._compiled(tuple(x.shape), self._act_dtype(device), x.dtype, on_host, x.requires_grad)
        self._runner.masks.new_step()  # per-sample drop masks: drawn once this step, replayed by every tile
        self._runner.folds.new_step(self._graph.fold_pairs())  # folded weights from this step's parameters
        stats = StepStats()
        self.last_stats = stats
        meter = PeakMeter(device) if self.tile_peaks else None
        self._hooks.stats = StatsRecorder(device, stats, meter) if self.collect_stats else None
        env: dict[int, Any] = {0: x}
        for sp, seg in zip(c.plan.segments, c.segments, strict=True):
            if seg is None:
                if self._hooks.on_tile is not None:  # where a peak happens: a plain segment has one "tile"
                    self._hooks.on_tile(sp.index, 0, 0, "plain forward")
                if sp.start == 0:
                    if is_source(env[0]):  # a slide read tile by tile, but the plan starts untiled: read it whole
                        env[0] = env[0].materialize()
                    self._plain_input_sink(env)
                    if on_host:  # the whole image at once: its pages registered for the copy (host_register.py)
                        env[0] = upload_whole(env[0], device)
                self._runner.run_plain(sp.start, sp.end, env)
            else:
                env[sp.end] = run_tiled(seg, env[sp.start])
            for k in [k for k in env if k < sp.end]:
                del env[k]  # autograd keeps what backward needs; this frame keeps nothing more
        trunk_end = c.facts.trunk_end
        if c.segments[-1] is None and self._hooks.trunk_observer is not None:
            fmap = env[trunk_end]  # (B, C, h, w)
            self._hooks.trunk_observer(fmap.detach(), (0, fmap.shape[2]), (0, fmap.shape[3]))
        head_start = trunk_end
        fusion = c.facts.fusion
        if c.plan.segments[-1].fused_pool and fusion is not None:
            head_start = fusion.node  # the last segment returned the pooled value itself
            env[head_start] = env.pop(trunk_end).view(fusion.out_shape)
        self._runner.run_plain(head_start, c.facts.n - 1, env)
        return self._runner.output(env)

    def _plain_input_sink(self, env: dict[int, Any]) -> None:
        """With a plain first segment, the sink gets the whole image gradient at once (read at backward time)."""
        x = env[0]
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            return
        hooks = self._hooks

        def hook(g: torch.Tensor) -> torch.Tensor:
            if hooks.input_grad_sink is not None:
                hooks.input_grad_sink(g, (0, g.shape[2]), (0, g.shape[3]))
            return g

        env[0] = x.view_as(x)  # a hook on a view leaves the caller's tensor without a hook after the step
        env[0].register_hook(hook)

    def extra_repr(self) -> str:
        return f"memory_budget={self.memory_budget!r}, tile_size={self.tile_size!r}, checkpoints={self.checkpoints!r}"
