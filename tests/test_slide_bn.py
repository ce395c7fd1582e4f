"""``model.bn_stats: slide``: trainable BatchNorm normalises with each slide's own statistics in prediction too.

Reference (plain autograd) vs the tiled engine in float64, in training and in prediction (eval mode, where such a
BatchNorm still reads its batch), on ``tiny_bn`` and a torchvision ResNet; then what it changes for a user: no running
statistics in checkpoints, older checkpoints still load, config checks, fit and predict."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml
from test_map_norm import compare
from test_sft_attention import assert_same, step
from tiny_runs import config_file, finished_run, invoke, synthetic_slides
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models import build
from wsitrain.models.heads import AttentionSpec
from wsitrain.sft import SFT

CLAM_MB = AttentionSpec(per_class=True, instance_k=4, border=1)


def _slide_bn(name: str, pool: str = "max", spec: AttentionSpec | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = build(name, 2, pool=pool, attention=spec, freeze_bn=False, bn_stats="slide").double()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(m.running_mean is None and not m.track_running_stats for m in norms)
    return model


@pytest.mark.parametrize("training", [False, True], ids=["predict", "train"])
@pytest.mark.parametrize(("pool", "spec"), [("max", None), ("attention", CLAM_MB)], ids=["max", "clam_mb"])
def test_slide_statistics_are_exact_on_tiny_bn(pool: str, spec: AttentionSpec | None, training: bool) -> None:
    compare(_slide_bn("tiny_bn", pool, spec).train(training))


@pytest.mark.parametrize(("name", "kw"), [("tiny_ln", {}), ("tiny_bn", {"freeze_bn": False})], ids=["ln", "bn_running"])
def test_the_normalised_tiny_trunks_are_exact(name: str, kw: dict) -> None:
    """The benchmark's small trunks with a norm, tiled as plain in float64, a training step: tiny_ln's per-cell
    LayerNorm (no statistics across the slide) and tiny_bn's BatchNorm updating its running statistics (buffers
    compared)."""
    torch.manual_seed(0)
    model = build(name, 2, pool="max", **kw).double().train()
    sft = SFT(copy.deepcopy(model), tile_size=64, memory_budget="2GiB")  # before the step moves running statistics
    x = torch.rand(2, 3, 160, 192, dtype=torch.float64) * 255
    ref = step(model, x, None)
    got = step(sft, x, None)
    assert_same(got, ref, [n for n, _ in model.named_parameters()])
    assert sft.plan_for(x.shape, input_dtype=torch.float64).segments[0].tile_grid != (1, 1)


def test_slide_statistics_are_exact_on_a_resnet_in_prediction() -> None:
    compare(_slide_bn("torchvision/resnet18").eval())


def test_prediction_reads_the_slide_not_running_averages(tmp_path: Path) -> None:
    torch.manual_seed(3)
    running = build("tiny_bn", 2, pool="max", freeze_bn=False).double()
    x = torch.rand(1, 3, 64, 96, dtype=torch.float64) * 255
    with torch.no_grad():
        running.train()(x)  # one step's statistics into the running averages, as training leaves them
    path = tmp_path / "running.pt"
    torch.save(running.state_dict(), path)
    # a checkpoint with running statistics loads; they are dropped, the weights kept
    slide = build("tiny_bn", 2, pool="max", freeze_bn=False, bn_stats="slide", weights=path).double()
    assert not any("running" in k or "num_batches" in k for k in slide.state_dict())
    assert slide.state_dict().keys() < running.state_dict().keys()
    with torch.no_grad():
        y = torch.randn(1, 3, 64, 96, dtype=torch.float64) * 60 + 128  # another slide's colours
        torch.testing.assert_close(slide.eval()(y), running.train()(y), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(slide.eval()(y), running.eval()(y))
    with pytest.raises(WsiTrainError, match="freeze_bn"):
        build("tiny_bn", 2, bn_stats="slide")  # freeze_bn defaults to true
    with pytest.raises(WsiTrainError, match="unknown bn_stats 'batch'"):
        build("tiny_bn", 2, freeze_bn=False, bn_stats="batch")


def test_fit_predict_and_validate(tmp_path: Path) -> None:
    cfg = config_file(tmp_path, synthetic_slides(tmp_path / "synth"))
    cfg.write_text(cfg.read_text().replace(
        "model: {name: tiny}", "model: {name: tiny_bn, pool: max, freeze_bn: false, bn_stats: slide}"))  # fmt: skip
    run = finished_run(cfg)
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["bn_stats"] == "slide"
    assert not any("running" in k for k in torch.load(run / "last.pt", weights_only=True)["model"])
    out = tmp_path / "p.csv"
    res = invoke("--quiet", "predict", str(cfg), "--checkpoint", str(run / "last.pt"), "--slides",
                 str(tmp_path / "synth"), "--out", str(out), "--heatmaps", str(tmp_path / "maps"))  # fmt: skip
    assert res.exit_code == 0, res.output  # predict rebuilds the slide statistics from the checkpoint's config
    assert len(out.read_text().splitlines()) == 5 and (tmp_path / "maps" / "heatmaps.json").exists()
    frozen = invoke("validate", str(cfg), "--set", "model.freeze_bn=true")
    assert frozen.exit_code == 2 and "model.bn_stats" in frozen.output and "model.freeze_bn: false" in frozen.output
    bad = invoke("validate", str(cfg), "--set", "model.bn_stats=batch")
    assert bad.exit_code == 2 and "model.bn_stats" in bad.output and "running, slide" in bad.output
