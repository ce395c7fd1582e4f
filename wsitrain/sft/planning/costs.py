"""What a plan costs: FLOPs per node, per-tile overhead, and the memory terms outside activations.

Every constant here carries the measurement behind it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wsitrain.errors import PlanError
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops.patch_grid import patch_cost, patches_in
from wsitrain.sft.ops.registry import WINDOW
from wsitrain.sft.target import TargetDevice

# The time model the planner minimizes and `Plan.slowdown` reports, in FLOP-equivalents: an operator call
# costs its FLOPs, plus BYTE_FLOPS per byte it reads and writes (depthwise convolutions, BatchNorm and
# element-wise layers are bound by memory traffic, not FLOPs), plus CALL_FLOPS per call (dispatch, autograd,
# kernel set-up), plus TILE_CALL_FLOPS per call the tile executor makes (cropping, its Python bookkeeping):
# light layers on many tiles pay these many times.
# CPU: fitted by `python scripts/calibrate_costs.py` on the 2-core CI machine (float32, one thread, two quiet
# runs): least squares over plain steps of FLOP-, traffic- and call-bound micro-models gave 9.0-9.2e10 FLOP/s,
# 1 byte = 7.5-8.1 FLOPs (11-12 GB/s) and a call of 9 us (8.1-8.4e5 FLOPs). Tiled steps of a 121-layer 1x1-conv
# chain on 32 px maps with 4 and 16 tiles then matched their predicted slowdown (7.2x, 26.6x) within 5% with
# 1e6 FLOPs (11 us) per executor call. With two threads (`--threads 2`) the FLOP rate doubles (1.8e11) but a
# call still takes 11 us, so a call is worth 1.9e6 FLOPs and a byte 11: these one-thread constants under-predict
# light models on several threads (the tiny whole-slide model at two threads: 1.34x predicted, 2.1x measured).
# CUDA: a 2080 Ti's nominal 13.4 TFLOP/s and 616 GB/s (22 FLOPs a byte) and a launch of ~15 us (2e8 FLOPs)
# that hides the executor's Python; not measured yet.
BYTE_FLOPS = {"cpu": 8.0, "cuda": 22.0}
CALL_FLOPS = {"cpu": 8.4e5, "cuda": 2e8}
TILE_CALL_FLOPS = {"cpu": 1.0e6, "cuda": 0.0}
# Bytes of optimizer state per parameter byte (SGD with momentum: one buffer; Adam(W): two moments).
OPTIMIZER_STATE = {"none": 0.0, "sgd": 1.0, "adam": 2.0, "adamw": 2.0}
# Temporaries of the optimizer step, in parameter sizes, with the foreach implementation CUDA uses by default:
# Adam's and AdamW's ``_foreach_sqrt(exp_avg_sq)`` builds every parameter's denominator at once (the simulated
# step showed one parameter-sized list live at the step, above weights, gradients and state: ResNet-18, +42.6 MB);
# SGD with momentum updates in place. Weight decay in Adam (not AdamW) adds one more list; wsitrain's default is
# AdamW.
OPTIMIZER_STEP_TEMPORARY = {"none": 0.0, "sgd": 0.0, "adam": 1.0, "adamw": 1.0}
# Allocators hand out more than tensors need: glibc's heap fragments under PyTorch's CPU allocation
# pattern (measured: DarkNet-19 plain training peaks 12% above the replayed tensors), and the CUDA
# caching allocator rounds and splits blocks. Activation memory is planned with this much slack.
ALLOCATOR_SLACK = 1.10
# Plans keep this share of the activation budget free for the memory model's own error: the estimate
# stays a best guess, the plan a safe one. CPU, measured with the tuned allocator (scripts/bench_whole_slide.py,
# uint8 image, 256 MiB): tiled steps of the tiny model at 4096, 8192 and 16384 px peaked 13%, 8% and 9% above
# their plans (252, 246, 255 MiB against 223, 228, 233 planned), so 8% left 1 MiB at 16384 px; VGG-16 at 2048
# and 4096 px under 2 GiB peaked 1% under. CUDA: not measured yet; the round-1 figure.
HEADROOM = {"cpu": 0.12, "cuda": 0.03}
# Memory a training step's kernels hold besides tensors: oneDNN scratchpads and reordered weight
# copies on CPU (measured: VGG-16 at 64 px, 30 MiB), cuBLAS/cuDNN workspaces on CUDA (per GPU generation:
# wsitrain.sft.target.GENERATIONS). A base (``TargetDevice.runtime_bytes``) plus twice the largest weight,
# since a conv's weight and its gradient are reordered at once.


def device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


DEFAULT_TIME_MODEL = "default constants"


@dataclass(frozen=True)
class TimeModel:
    """The time model's constants for one device (FLOP-equivalents), and where they came from."""

    byte_flops: float
    call_flops: float
    tile_call_flops: float
    source: str = DEFAULT_TIME_MODEL  # or "calibrated on <GPU> on <date>" (wsitrain doctor --calibrate)
    # FLOPs the tile executor runs cost this many times a whole map's (on average: wsitrain/gpu_speed.py
    # TILE_CONV_EFFICIENCY, the planner's own factor); 1.0 where not known
    tile_flop_factor: float = 1.0


def default_time_model(device: str) -> TimeModel:
    kind = device_kind(device)
    return TimeModel(BYTE_FLOPS[kind], CALL_FLOPS[kind], TILE_CALL_FLOPS[kind])


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes that exist for the whole step whatever the plan: weights, optimizer state, kernel workspaces."""

    model: int
    optimizer: int
    runtime: int
    step: int = 0  # the optimizer step's peak above ``fixed``: every gradient plus the step's temporaries
    slack: float = ALLOCATOR_SLACK
    headroom: float = HEADROOM["cuda"]

    @property
    def fixed(self) -> int:
        return self.model + self.optimizer + self.runtime

    def scale_peak(self, replayed: float) -> int:
        """What the process will really hold: replayed tensor bytes plus allocator slack on activations."""
        return int(self.fixed + self.slack * max(0.0, replayed - self.fixed))

    def effective_budget(self, budget: float) -> float:
        """The replayed-bytes limit that keeps ``scale_peak`` within ``budget``, with headroom."""
        return self.fixed + (1.0 - self.headroom) * (budget - self.fixed) / self.slack

    def budget_for(self, replayed: float) -> int:
        """The least whole budget whose ``effective_budget`` admits ``replayed`` bytes: its inverse, rounded up.

        Not ``scale_peak``: that is what the process holds; a plan also keeps its headroom free above it.
        """
        budget = math.ceil(self.fixed + self.slack * max(0.0, replayed - self.fixed) / (1.0 - self.headroom))
        while self.effective_budget(budget) < replayed:  # float rounding in the division: at most a byte or two
            budget += 1
        return budget


def memory_terms(facts: GraphFacts, target: TargetDevice, optimizer: str | None) -> MemoryTerms:
    key = "none" if optimizer is None else optimizer.lower()
    if key not in OPTIMIZER_STATE:
        raise PlanError(
            f"optimizer {optimizer!r} has no known state size",
            hint=f"use one of: {', '.join(OPTIMIZER_STATE)} (or None when planning without an optimizer)",
        )
    runtime = target.runtime_bytes + 2 * facts.largest_param_bytes
    kind = target.kind
    step = int((1.0 + OPTIMIZER_STEP_TEMPORARY[key]) * facts.trainable_bytes) if key != "none" else 0
    return MemoryTerms(
        facts.model_bytes, int(OPTIMIZER_STATE[key] * facts.trainable_bytes), runtime, step, headroom=HEADROOM[kind]
    )


def node_flops(facts: GraphFacts, i: int, numel_out: float) -> tuple[float, float]:
    """Forward and backward FLOPs of node i producing ``numel_out`` output elements."""
    node = facts.nodes[i]
    cost = patch_cost(node.spec)
    if cost is not None:  # a patch encoder: its measured FLOPs per patch, backward only where autograd goes
        pc, n = cost(facts.act_dtype), patches_in(node.spec, numel_out)
        return pc.flops_forward * n, pc.flops_backward * n if node.requires_grad else 0.0
    f = node.spec.flops_per_output * numel_out
    if not node.requires_grad:
        return f, 0.0
    grads_in = any(facts.nodes[v].requires_grad for v in node.inputs)
    if node.spec.kind == WINDOW and node.spec.has_params:
        return f, f * (1.0 + (1.0 if grads_in else 0.0))
    return f, f


@dataclass(frozen=True)
class Work:
    """What running some nodes costs: FLOPs (the paper's count) and the time model's FLOP-equivalents."""

    flops: float = 0.0
    time: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.time + other.time)


@dataclass(frozen=True)
class WorkTerms:
    """The time model's three inputs for some calls of a node: FLOPs, bytes read and written, calls."""

    flops: float
    traffic: float
    calls: float
    tiled: bool = False  # calls made by the tile executor (each pays TILE_CALL_FLOPS more)
    batch: bool = False  # a tile is a batch of whole inputs (a chunk of patches): its FLOPs at a whole map's rate
    inner_calls: float = 0.0  # operators a call runs beyond itself (a patch encoder's layers), priced as plain calls

    def time(self, tm: TimeModel) -> float:
        per_call = tm.call_flops + (tm.tile_call_flops if self.tiled else 0.0)
        flops = self.flops * (tm.tile_flop_factor if self.tiled and not self.batch else 1.0)
        return flops + tm.byte_flops * self.traffic + per_call * self.calls + tm.call_flops * self.inner_calls


def node_terms(
    facts: GraphFacts, i: int, numel_out: float, numel_in: float, calls: int, backward: bool = True, tiled: bool = False
) -> WorkTerms:
    """Forward (and, with ``backward`` when the node needs gradients, backward) of node i over ``calls`` calls
    producing ``numel_out`` elements from ``numel_in`` input elements in all. Backward reads the output's
    gradient and the saved input and writes the input's gradient: twice the forward's traffic."""
    fw, bw = node_flops(facts, i, numel_out)
    traffic = _elem_bytes(facts, i) * (numel_out + numel_in)
    # a chunk of patches is a batch of whole encoder inputs, not a crop of a map: its FLOPs run at the batch's rate,
    # and one call of the encoder launches every operator it runs (measured)
    cost = patch_cost(facts.nodes[i].spec)
    batch = cost is not None
    pc = cost(facts.act_dtype) if cost is not None else None
    inner_fwd = calls * (pc.ops_forward - 1) if pc is not None else 0
    if backward and facts.nodes[i].requires_grad:
        inner = inner_fwd + (calls * (pc.ops_backward - 1) if pc is not None else 0)
        return WorkTerms(fw + bw, 3 * traffic, 2 * calls, tiled, batch, inner)
    return WorkTerms(fw, traffic, calls, tiled, batch, inner_fwd)


def node_work(
    facts: GraphFacts, i: int, numel_out: float, numel_in: float, calls: int, tm: TimeModel, tiled: bool = False
) -> Work:
    """Forward and backward of node i (see ``node_terms``) as FLOPs and modelled time."""
    t = node_terms(facts, i, numel_out, numel_in, calls, tiled=tiled)
    return Work(t.flops, t.time(tm))


def forward_work(
    facts: GraphFacts, i: int, numel_out: float, numel_in: float, calls: int, tm: TimeModel, tiled: bool = True
) -> Work:
    """A forward alone by the tile executor (the recompute of a tiled segment; a forward sweep, ``tiled`` False
    when its one tile is the whole map)."""
    t = node_terms(facts, i, numel_out, numel_in, calls, backward=False, tiled=tiled)
    return Work(t.flops, t.time(tm))


def _elem_bytes(facts: GraphFacts, i: int) -> float:
    node = facts.nodes[i]
    n = math.prod(node.shape)
    return node.nbytes / n if n else 0.0
