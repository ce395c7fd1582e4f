"""Planning patch-encoder models: ``wsitrain plan`` says the patches, the chunk, the per-patch cost and memory by
part; the chunk follows the budget; frozen leading layers shrink backward; encoders whose recompute would differ are
refused with the module named."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_runs import invoke
from torch import nn

from wsitrain.models.zoo import patch_model
from wsitrain.sft import plan
from wsitrain.sft.ops.registry import module_spec

pytest.importorskip("timm", reason="the encoder is a timm ViT")

MODEL = "python:tiny_encoders:tiny_vit"


def test_plan_prints_the_patch_view() -> None:
    res = invoke("plan", "--model", MODEL, "--size", "2048", "--memory", "96MiB", "--pool", "gated_attention",
                 "--no-max-size", "--tissue", "0.5")  # fmt: skip
    assert res.exit_code == 0, res.output
    out = res.output
    assert "patch encoder: 32 px patches, 24-wide embeddings; 64 x 64 = 4,096 patches per slide" in out
    assert "patches recomputed and back-propagated at once" in out and "memory by part (planned)" in out
    assert "embedding map" in out and "forward + backward of all patches" in out
    assert "2,048 of 4,096 patches hold tissue" in out and "with tissue in 50% of the patches" in out


def test_plan_json_has_the_patch_view_and_the_chunk_follows_the_budget() -> None:
    chunks = []
    for memory in ("80MiB", "320MiB"):
        res = invoke("plan", "--model", MODEL, "--size", "2048", "--memory", memory, "--pool", "gated_attention",
                     "--no-max-size", "--json")  # fmt: skip
        assert res.exit_code == 0, res.output
        d = json.loads(res.output.strip().splitlines()[-1])
        assert d["plan"]["fits"]
        p = d["patch"]
        assert p["patches"] == 4096 and p["per_patch"]["saved"] > 0 and p["per_patch"]["flops_forward"] > 0
        chunks.append(p["chunk"])
    assert chunks[0] < chunks[1], chunks


def test_freezing_the_patch_embedding_shrinks_backward() -> None:
    res = invoke("plan", "--model", MODEL, "--size", "1024", "--memory", "24MiB", "--pool", "attention",
                 "--no-max-size", "--freeze", "features.encoder.patch_embed")  # fmt: skip
    assert res.exit_code == 0, res.output
    # the position embedding and class token still train: no frozen stem to keep (wsitrain/patch/prefix.py)
    assert "frozen:" in res.output and "first trainable block's input: recomputed: the frozen layers" in res.output


def _encoder_with(layer: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 8, stride=8), layer, nn.AdaptiveAvgPool2d(1), nn.Flatten(1))


@pytest.mark.parametrize(
    ("layer", "why"),
    [(nn.Dropout(0.1), "Dropout, p=0.1"), (nn.BatchNorm2d(4), "BatchNorm2d) in training mode")],
)
def test_a_recompute_that_would_differ_is_refused_naming_the_module(layer: nn.Module, why: str) -> None:
    model = patch_model("x", _encoder_with(layer), 32, 4, 2).train()
    spec = module_spec(model.features)
    assert not spec.tileable and "1 (" in spec.why_not and why in spec.why_not
    model.eval()
    assert module_spec(model.features).tileable  # in eval mode the same encoder tiles


def test_the_chunk_keeps_every_tensor_within_the_element_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA target whose kernels take at most N elements per tensor (2^31, here made small): the chunk's largest
    tensor (the patches times the largest tensor one patch makes, measured) stays within it, though memory alone
    would take the whole grid at once."""
    from tiny_encoders import tiny_vit

    import wsitrain.sft.target as target_mod
    from wsitrain.gpus import resolve_budget
    from wsitrain.patch.plan_summary import patch_trunk
    from wsitrain.sft.ops.patch_grid import cost_memo

    net = patch_model("tiny", tiny_vit(), 32, 24, 2, pool="gated_attention")
    largest = cost_memo(patch_trunk(net))(torch.float32).largest_tensor
    target = resolve_budget("h200", None).target
    shape = (1, 3, 512, 512)  # 16 x 16 patches

    def chunk() -> int:
        p = plan(net, input_shape=shape, memory_budget="1GiB", optimizer="adamw", device="cuda", target=target)
        tiled = [s for s in p.segments if s.mode == "tiled"]
        return tiled[0].tile_edge ** 2 if tiled else 256

    assert chunk() == 256  # the whole grid fits at once
    monkeypatch.setattr(target_mod, "CONV_ELEMENTS_LIMIT", 20 * largest)
    assert 1 <= chunk() <= 20


def test_lora_plans_the_adapters_as_trained_and_the_base_weights_as_frozen(tmp_path) -> None:
    """``model.lora``: the plan's gradients and optimizer state are the adapters' and the head's (what requires a
    gradient in the peft-wrapped model fit builds), its weights every parameter; without LoRA every parameter trains."""
    pytest.importorskip("peft", reason="model.lora is peft's")
    import io

    import yaml
    from rich.console import Console

    from wsitrain.config import load_config
    from wsitrain.plan.command import PLAN_NUM_CLASSES, run_plan
    from wsitrain.train.engine import build_model

    figures, counts = {}, {}
    for name, lora in (("plain", None), ("lora", {"rank": 4, "alpha": 8, "targets": ["qkv", "fc2"]})):
        model = {"name": MODEL, "patch": 32, "pool": "attention", **({"lora": lora} if lora else {})}
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({"data": {"synthetic": {"n": 8, "size": 512}}, "model": model,
                                       "train": {"optimizer": "adamw"}}))  # fmt: skip
        buf = io.StringIO()
        code = run_plan(config=cfg, model=None, size=None, gpu=None, memory="256MiB", batch=1, precision=None,
                        tile=None, with_max_size=False, as_json=True,
                        console=Console(file=buf, width=250, color_system=None))  # fmt: skip
        assert code == 0, buf.getvalue()
        figures[name] = json.loads(buf.getvalue())
        net = build_model(load_config(cfg).model, PLAN_NUM_CLASSES, with_weights=False)
        counts[name] = (sum(p.numel() for p in net.parameters()), sum(p.numel() for p in net.parameters()
                                                                      if p.requires_grad))  # fmt: skip
    adapters = counts["lora"][0] - counts["plain"][0]
    assert adapters == (4 * 24 + 72 * 4) + (4 * 96 + 24 * 4)  # qkv (24 -> 72) and fc2 (96 -> 24), rank 4
    for name, (every, trained) in counts.items():
        out = figures[name]
        bd, patch = out["plan"]["breakdown"], out["patch"]
        assert patch["weights_bytes"] == 4 * every
        assert bd["gradients"] == patch["gradient_bytes"] == 4 * trained
        assert bd["optimizer"] == patch["optimizer_bytes"] == 2 * 4 * trained  # adamw: two states per parameter
    assert counts["plain"][1] == counts["plain"][0]  # without LoRA every parameter trains
    assert counts["lora"][1] == adapters + counts["plain"][0] - figures["lora"]["patch"]["frozen"]
