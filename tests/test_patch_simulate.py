"""Patch encoders on the simulated CUDA device: attention runs as the fused kernel a GPU runs (also in the recompute,
which autograd runs on its own thread), and a step stays within its plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wsitrain.sft.simulate.fused_attention import fused_attention

timm = pytest.importorskip("timm", reason="the encoder is a timm ViT")


class _Recompute(torch.autograd.Function):
    """Calls attention inside backward, as the engine's recompute does."""

    seen: list[str] = []

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        q = torch.empty(2, 3, 17, 8, device="meta", requires_grad=True)
        with torch.enable_grad():
            _Recompute.seen.append(type(F.scaled_dot_product_attention(q, q, q).grad_fn).__name__)
        return g


def test_attention_in_backward_runs_as_the_fused_kernel() -> None:
    _Recompute.seen.clear()
    with fused_attention():
        x = torch.empty(3, device="meta", requires_grad=True)
        _Recompute.apply(x).sum().backward()
    assert _Recompute.seen == ["ScaledDotProductEfficientAttentionBackward0"]
    q = torch.empty(2, 3, 17, 8, device="meta", requires_grad=True)
    assert "Efficient" not in type(F.scaled_dot_product_attention(q, q, q).grad_fn).__name__  # restored after


def test_a_simulated_patch_step_stays_within_its_plan() -> None:
    from tiny_encoders import tiny_vit

    from wsitrain.gpus import resolve_budget
    from wsitrain.models.zoo import patch_model
    from wsitrain.sft.simulate import simulate_step, simulation_text

    budget = resolve_budget("2080ti", None)
    with torch.device("meta"):
        net = patch_model("tiny", tiny_vit(), 32, 24, 2, pool="gated_attention")
    s = simulate_step(net, (1, 3, 512, 512), budget.bytes, optimizer="adamw", target=budget.target, tile_size=64)
    assert any(seg.mode == "tiled" and seg.n_tiles > 1 for seg in s.plan.segments)
    assert s.within_budget and s.host_within_plan, simulation_text(s)
    assert s.device_peak.bytes <= s.plan.estimated_peak_bytes, simulation_text(s)
