"""What a plan costs: FLOPs per node, per-tile overhead, and the memory terms outside activations.

Every constant here carries the measurement behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

from wsitrain.errors import PlanError
from wsitrain.sft.facts import GraphFacts
from wsitrain.sft.ops import WINDOW

# Per tile, operator and pass, the fixed cost of running it, in FLOP-equivalents: launches on CUDA;
# on CPU, measured: VGG-16 at 1024 px with 16 tiles ran 1.72x plain against 1.18x with 4 tiles of
# the same layers, about 7 ms per tile, operator and pass beyond the FLOPs (oneDNN set-up per shape).
TILE_OVERHEAD_FLOPS = {"cpu": 1.5e9, "cuda": 2e8}
# Bytes of optimizer state per parameter byte (SGD with momentum: one buffer; Adam(W): two moments).
OPTIMIZER_STATE = {"none": 0.0, "sgd": 1.0, "adam": 2.0, "adamw": 2.0}
# Allocators hand out more than tensors need: glibc's heap fragments under PyTorch's CPU allocation
# pattern (measured: DarkNet-19 plain training peaks 12% above the replayed tensors), and the CUDA
# caching allocator rounds and splits blocks. Activation memory is planned with this much slack.
ALLOCATOR_SLACK = 1.10
# Plans keep this share of the activation budget free for the memory model's own error: the estimate
# stays a best guess, the plan a safe one. CPU, measured with the tuned allocator: tiled steps of the tiny
# model at 4096-8192 px peaked 4-6% above their plans (scripts/bench_whole_slide.py), VGG-16 at 1024 px
# 1% under (scripts/bench_sft.py). CUDA: not measured yet; the round-1 figure.
HEADROOM = {"cpu": 0.08, "cuda": 0.03}
# Memory a training step's kernels hold besides tensors: oneDNN scratchpads and reordered weight
# copies on CPU (measured: VGG-16 at 64 px, 30 MiB), cuDNN workspaces on CUDA. A base plus twice
# the largest weight, since a conv's weight and its gradient are reordered at once.
RUNTIME_BASE = {"cpu": 12 * 2**20, "cuda": 64 * 2**20}


def device_kind(device: str) -> str:
    return "cuda" if device.startswith("cuda") else "cpu"


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes that exist for the whole step whatever the plan: weights, optimizer state, kernel workspaces."""

    model: int
    optimizer: int
    runtime: int
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


def memory_terms(facts: GraphFacts, device: str, optimizer: str | None) -> MemoryTerms:
    key = "none" if optimizer is None else optimizer.lower()
    if key not in OPTIMIZER_STATE:
        raise PlanError(
            f"optimizer {optimizer!r} has no known state size",
            hint=f"use one of: {', '.join(OPTIMIZER_STATE)} (or None when planning without an optimizer)",
        )
    runtime = RUNTIME_BASE[device_kind(device)] + 2 * facts.largest_param_bytes
    kind = device_kind(device)
    return MemoryTerms(
        facts.model_bytes, int(OPTIMIZER_STATE[key] * facts.trainable_bytes), runtime, headroom=HEADROOM[kind]
    )


def node_flops(facts: GraphFacts, i: int, numel_out: float) -> tuple[float, float]:
    """Forward and backward FLOPs of node i producing ``numel_out`` output elements."""
    node = facts.nodes[i]
    f = node.spec.flops_per_output * numel_out
    if not node.requires_grad:
        return f, 0.0
    grads_in = any(facts.nodes[v].requires_grad for v in node.inputs)
    if node.spec.kind == WINDOW and node.spec.has_params:
        return f, f * (1.0 + (1.0 if grads_in else 0.0))
    return f, f
