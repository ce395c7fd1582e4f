"""A patch encoder's frozen prefix (``model.freeze.last_blocks``) runs forward once per step where the plan keeps
the first trainable block's input (``SegmentPlan.kept_prefix``), and in each chunk's recompute where it does not.

Float64, against plain autograd on the whole bag: the output, every trainable parameter's gradient and the input
gradient (when it wants one: the prefix is then recomputed, its gradient flowing through the frozen blocks), for a
timm ViT of depth 3 with its last 1 and 2 blocks trained, batch 2, a ragged slide, kept and recomputed (forced with
``SFT(keep_prefix=...)``). Plus: how often the frozen blocks run, and the plan's decision against the budget.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from wsitrain.models.freeze import FreezeSpec, apply_freeze
from wsitrain.models.zoo import patch_model
from wsitrain.sft import SFT
from wsitrain.sft import plan as plan_model

timm = pytest.importorskip("timm", reason="the ViT encoders are timm's")

P, DIM = 32, 24
SHAPE = (2, 3, 5 * P + 7, 3 * P + 11)  # a 5 x 3 grid of patches per sample, ragged past the last whole patch


def _model(last_blocks: int) -> nn.Module:
    torch.manual_seed(0)
    enc = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0, img_size=P, patch_size=8,
                            depth=3, embed_dim=DIM, num_heads=2)  # fmt: skip
    model = patch_model("test-encoder", enc, P, DIM, 3, pool="attention")
    apply_freeze(model, FreezeSpec(last_blocks=last_blocks))
    return model.double()


def _step(model: nn.Module, x: torch.Tensor, x_grad: bool) -> tuple:
    inner = model.model if isinstance(model, SFT) else model
    inner.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(x_grad)
    y = model(xr)
    y = y[0] if isinstance(y, tuple) else y
    (y * torch.arange(1.0, 1.0 + y.shape[-1], dtype=y.dtype)).square().sum().backward()
    return y.detach(), [p.grad for p in inner.parameters()], xr.grad


@pytest.mark.parametrize("last_blocks", [1, 2])
@pytest.mark.parametrize("keep", ["always", "never"])
@pytest.mark.parametrize("x_grad", [False, True], ids=["no-input-grad", "input-grad"])
def test_kept_and_recomputed_prefix_are_exact(last_blocks: int, keep: str, x_grad: bool) -> None:
    model = _model(last_blocks)
    torch.manual_seed(1)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    sft = SFT(copy.deepcopy(model), tile_size=2 * P, memory_budget="1GiB", keep_prefix=keep)
    ref, got = _step(model, x, x_grad), _step(sft, x, x_grad)
    torch.testing.assert_close(got[0], ref[0])
    for (n, p), a, b in zip(model.named_parameters(), got[1], ref[1], strict=True):
        assert (a is None) == (b is None) == (not p.requires_grad), n
        if a is not None:
            torch.testing.assert_close(a, b, msg=lambda m, n=n: f"{n}: {m}")
    if x_grad:
        torch.testing.assert_close(got[2], ref[2])
    seg = sft.plan_for(SHAPE, input_dtype=torch.float64).segments[-1]
    assert seg.mode == "tiled" and seg.n_tiles > 1 and seg.prefix_blocks == 3 - last_blocks
    # with the input's gradient wanted the plan recomputes the prefix (it must run under autograd)
    planned = sft._compiled(SHAPE, torch.float64, torch.float64, False, x_grad).plan.segments[-1]
    assert planned.kept_prefix == (keep == "always" and not x_grad)


@pytest.mark.parametrize("keep", ["always", "never"])
def test_the_frozen_prefix_runs_once_per_step_when_kept(keep: str) -> None:
    """Patches through the frozen first block in one training step: each once when kept, twice when recomputed
    (the forward sweep and the chunk's recompute; random pixels: no background chunk to reuse)."""
    model = _model(1)
    sft = SFT(model, tile_size=2 * P, memory_budget="1GiB", keep_prefix=keep)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    sft.plan_for(SHAPE, input_dtype=torch.float64)  # planned first: its measurements run the encoder on fake tensors
    seen: list[int] = []
    model.features.encoder.blocks[0].register_forward_hook(lambda m, a, out: seen.append(a[0].shape[0]))
    trained: list[int] = []
    model.features.encoder.blocks[2].register_forward_hook(lambda m, a, out: trained.append(a[0].shape[0]))
    _step(sft, x, False)
    patches = SHAPE[0] * 5 * 3
    assert sum(trained) == 2 * patches  # the trained block: the sweep and the recompute, either way
    assert sum(seen) == (patches if keep == "always" else 2 * patches)


def test_the_plan_keeps_the_prefix_where_the_budget_holds_it() -> None:
    """``keep_prefix="auto"`` keeps it where the plan's peak plus the kept bytes fit, recomputes it where they do
    not; kept, the plan counts the bytes in its peak and takes the prefix's FLOPs off the step."""
    model = _model(1)
    shape = (1, 3, 24 * P, 24 * P)  # 576 patches of 17 tokens x 24 x 8 bytes: 1.8 MiB kept
    kw = {"tile_size": 4 * P, "dtype": torch.float64, "device": "cpu"}
    never = plan_model(model, shape, memory_budget="4GiB", keep_prefix="never", **kw)
    kept = plan_model(model, shape, memory_budget="4GiB", **kw)
    seg_n, seg_k = never.segments[-1], kept.segments[-1]
    assert seg_k.kept_prefix and not seg_n.kept_prefix and seg_n.prefix_bytes == seg_k.prefix_bytes
    assert seg_k.prefix_bytes == 576 * 17 * DIM * 8
    assert kept.breakdown["kept_prefix"] == seg_k.prefix_bytes and "kept_prefix" not in never.breakdown
    assert kept.estimated_peak_bytes > never.estimated_peak_bytes
    assert kept.time_sft < never.time_sft and kept.flops_sft < never.flops_sft
    # a budget between the two plans' needs: the plan without the kept prefix fits, with it it would not
    lo = never.estimated_peak_bytes
    budgets = [lo + k * seg_k.prefix_bytes // 8 for k in range(0, 24, 2)]
    decided = [plan_model(model, shape, memory_budget=b, **kw) for b in budgets]
    fitting = [p for p in decided if p.fits]
    assert any(not p.segments[-1].kept_prefix for p in fitting), "no fitting budget recomputes the prefix"
    assert any(p.segments[-1].kept_prefix for p in fitting), "no fitting budget keeps the prefix"
    for p in fitting:
        assert p.estimated_peak_bytes <= p.budget_bytes


def test_wsitrain_plan_says_kept_or_recomputed(tmp_path) -> None:
    """``wsitrain plan`` on a config with ``model.freeze.last_blocks``: kept with its bytes where the budget holds
    them, recomputed with the bytes it would need where not; a sweep planned on its own tiles runs on the recompute's
    when the prefix is kept (each kept chunk is one the recompute reads back)."""
    import yaml
    from tiny_runs import invoke

    cfg = tmp_path / "run.yaml"
    model = {"name": "python:tiny_encoders:tiny_vit_deep", "patch": 32, "pool": "attention",
             "freeze": {"last_blocks": 1}}  # fmt: skip
    cfg.write_text(yaml.safe_dump({"data": {"synthetic": {"n": 8, "size": 1024}}, "model": model,
                                   "train": {"optimizer": "adamw"}}))  # fmt: skip
    # 1024 patches x 17 tokens (16 and the class token) x 24 wide x float32 = 1.59 MiB
    res = invoke("plan", "--config", str(cfg), "--memory", "28MiB", "--no-max-size")
    assert res.exit_code == 0, res.output
    assert "the first trainable block's input: kept (1.59 MiB, planned)" in res.output
    res = invoke("plan", "--config", str(cfg), "--memory", "20MiB", "--no-max-size")
    assert res.exit_code == 0, res.output
    assert ("the first trainable block's input: recomputed (would need 1.59 MiB, planned; does not fit the budget "
            "beside the plan)") in res.output


def test_keeping_moves_a_sweep_on_its_own_tiles_onto_the_recompute_tiles() -> None:
    from tiny_encoders import tiny_vit_deep

    model = patch_model("deep", tiny_vit_deep(), 32, 24, 2, pool="attention")
    apply_freeze(model, FreezeSpec(last_blocks=1))
    kw = {"dtype": torch.float32, "input_dtype": torch.uint8, "device": "cpu", "optimizer": "adamw"}
    never = plan_model(model, (1, 3, 2048, 2048), memory_budget="40MiB", keep_prefix="never", **kw).segments[0]
    kept = plan_model(model, (1, 3, 2048, 2048), memory_budget="40MiB", keep_prefix="always", **kw).segments[0]
    assert never.forward_grid and not never.kept_prefix, "the test needs a sweep on its own tiles"
    assert kept.kept_prefix and kept.forward_grid == () and kept.forward_regions is None
    assert kept.regions is not None and kept.tile_grid == never.tile_grid
