"""model.attention.instance_loss: the MIL instance loss on the positive class's attention scores, its checks, and
what fit trains with it (wsitrain.train.instance_loss; the pool's carried scores are exact: test_sft_attention.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from tiny_runs import config_file, finished_run, invoke, synthetic_slides

from wsitrain.config import AttentionConfig, ModelConfig, WsiTrainConfig, config_to_dict
from wsitrain.errors import WsiTrainError
from wsitrain.models import build
from wsitrain.models.heads import AttentionSpec
from wsitrain.sft import SFT
from wsitrain.sft.ops.attention_pool import InstanceSplit
from wsitrain.train.instance_loss import InstanceLoss, InstanceLossSpec, instance_loss_spec
from wsitrain.train.loop import Trainer


def _model(per_class: bool = True, k: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return build("tiny", 2, pool="attention", attention=AttentionSpec(per_class=per_class, instance_k=k)).double()


def _scores(model: torch.nn.Module, x: torch.Tensor, branch: int) -> torch.Tensor:
    """The branch's scores over the whole map, largest first (what the loss should read)."""
    return model[:3](x)[0, -model.pool.branches + branch].flatten().sort(descending=True).values


@pytest.mark.parametrize(("per_class", "branch"), [(True, 1), (False, 0)])
def test_the_loss_is_bce_of_a_positive_s_top_score_and_of_a_negative_s_k_top_scores(per_class: bool,
                                                                                     branch: int) -> None:  # fmt: skip
    model = _model(per_class)
    x = torch.rand(1, 3, 160, 192, dtype=torch.float64)
    loss = InstanceLoss(model, InstanceLossSpec(0.5, positive=1, branch=branch, negative_cells=5,
                                                   positive_cells=1))  # fmt: skip
    with loss.captured() as cap:
        model(x)
    s = _scores(model, x, branch)
    torch.testing.assert_close(loss(cap, 1), F.binary_cross_entropy_with_logits(s[:1], torch.ones(1, dtype=s.dtype)))
    torch.testing.assert_close(loss(cap, 0), F.binary_cross_entropy_with_logits(s[:5], torch.zeros(5, dtype=s.dtype)))


def test_a_positive_slide_may_push_several_of_its_highest_cells_up() -> None:
    model = _model(per_class=True)
    x = torch.rand(1, 3, 160, 192, dtype=torch.float64)
    loss = InstanceLoss(model, InstanceLossSpec(0.5, positive=1, branch=1, negative_cells=5, positive_cells=3))
    with loss.captured() as cap:
        model(x)
    s = _scores(model, x, 1)
    torch.testing.assert_close(loss(cap, 1), F.binary_cross_entropy_with_logits(s[:3], torch.ones(3, dtype=s.dtype)))
    with pytest.raises(ValueError, match="carries 8 scores, the loss reads 9"):
        InstanceLoss(model, InstanceLossSpec(0.5, 1, 1, negative_cells=5, positive_cells=9))


def test_the_capture_lives_only_inside_its_block_and_a_missing_forward_is_an_error() -> None:
    model = _model()
    loss = InstanceLoss(model, InstanceLossSpec(1.0, 1, 1, 4, 1))
    with loss.captured() as cap:
        pass
    with pytest.raises(RuntimeError, match="no forward ran"):
        loss(cap, 0)
    split = next(m for m in model.modules() if isinstance(m, InstanceSplit))
    assert not split._forward_pre_hooks  # removed on leaving the block
    with pytest.raises(WsiTrainError, match="carry its scores"):
        InstanceLoss(build("tiny", 2, pool="attention"), InstanceLossSpec(1.0, 1, 0, 4, 1))


def test_cells_off_a_small_mask_are_not_cells() -> None:
    """A mask keeping 2 positions, 8 scores carried: the loss averages over the 2, without NaN."""
    model = _model(per_class=False)
    x = torch.rand(1, 3, 128, 128, dtype=torch.float64)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    mask[0, 0, 3, 4:6] = True
    loss = InstanceLoss(model, InstanceLossSpec(1.0, 1, 0, 8, 1))
    with loss.captured() as cap, model.pool.masked(mask):
        model(x)
    value = loss(cap, 0)
    s = model[:3](x)[0, -1, 3, 4:6]
    torch.testing.assert_close(value, F.binary_cross_entropy_with_logits(s, torch.zeros_like(s)))
    value.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_spec_is_checked_against_the_run_s_classes() -> None:
    assert instance_loss_spec(0.5, 64, None, True, ["negative", "positive"]) == InstanceLossSpec(0.5, 1, 1, 64, 16)
    assert instance_loss_spec(0.5, 64, None, True, ["negative", "positive"], 3).positive_cells == 3
    assert instance_loss_spec(0.5, 64, "benign", True, ["benign", "tumour"]) == InstanceLossSpec(0.5, 0, 0, 64, 16)
    assert instance_loss_spec(0.5, 64, "benign", False, ["benign", "tumour"]).branch == 0  # one branch: that one
    with pytest.raises(WsiTrainError, match="positive_class is 'tumor', not one of") as err:
        instance_loss_spec(0.5, 64, "tumor", True, ["benign", "tumour"])
    assert "benign, tumour" in (err.value.hint or "")
    with pytest.raises(WsiTrainError, match="needs two classes .* the labels have 3: a, b, c"):
        instance_loss_spec(0.5, 64, None, True, ["a", "b", "c"])
    with pytest.raises(WsiTrainError, match="assumes a classification"):
        instance_loss_spec(0.5, 64, None, True, None)


def test_config_builds_the_pool_that_carries_the_scores_and_round_trips() -> None:
    m = ModelConfig(pool="attention", attention={"branches": "per_class", "instance_loss": 0.5, "instance_cells": 16})
    assert m.attention.spec() == AttentionSpec(per_class=True, instance_k=16, border=1)  # the loss leaves the ring out
    assert AttentionConfig().spec().instance_k == 0  # off by default: the pool carries nothing
    assert AttentionConfig().spec().border == 0  # and attends to the border as to any tissue
    assert AttentionConfig(instance_loss=0.5, border_cells=0).spec().border == 0
    assert AttentionConfig(border_cells=2).spec() == AttentionSpec(border=2)  # for any attention head
    assert AttentionSpec.from_dict({"border_cells": 2}).border == 2
    assert AttentionSpec.from_dict({"instance_loss": 0.5}).border == 1  # a checkpoint from before the key: its loss's
    assert build("tiny", 2, pool="attention", attention=AttentionSpec(border=2)).pool.border == 2
    wide = ModelConfig(pool="attention", attention={"instance_loss": 0.5, "instance_cells": 4,
                                                    "instance_positive_cells": 20})  # fmt: skip
    assert wide.attention.spec().instance_k == 20  # enough for both sides
    saved_wide = config_to_dict(WsiTrainConfig.model_validate({"model": wide.model_dump()}))["model"]["attention"]
    assert AttentionSpec.from_dict(saved_wide) == wide.attention.spec()
    saved = config_to_dict(WsiTrainConfig.model_validate({"model": m.model_dump()}))["model"]["attention"]
    assert AttentionSpec.from_dict(saved) == m.attention.spec()  # what predict builds from a checkpoint
    with pytest.raises(ValueError, match="model.attention applies to pool"):
        ModelConfig(pool="max", attention={"instance_loss": 0.5})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        AttentionConfig(instance_loss=-1)
    with pytest.raises(ValueError, match="apply to instance_loss, which is 0"):
        AttentionConfig(positive_class="tumour")
    with pytest.raises(ValueError, match="apply to instance_loss, which is 0"):
        AttentionConfig(instance_positive_cells=4)
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        AttentionConfig(border_cells=-1)


def test_the_trainer_back_propagates_the_slide_loss_plus_the_weighted_instance_loss() -> None:
    """One tiled train_slide against plain autograd of CE + 0.5 x the instance loss, the same weights (float64)."""
    torch.manual_seed(1)
    model = _model(per_class=True, k=6)
    reference = copy.deepcopy(model)
    x = torch.rand(3, 96, 128, dtype=torch.float64)
    spec = InstanceLossSpec(0.5, positive=1, branch=1, negative_cells=6, positive_cells=2)
    for label in (0, 1):
        engine = SFT(model, tile_size=32, memory_budget="1GiB")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        trainer = Trainer(engine, opt, sched, device=torch.device("cpu"), instance=InstanceLoss(engine, spec))
        model.zero_grad(set_to_none=True)
        step = trainer.train_slide(x, label, scale=1.0)
        assert engine.plan_for((1, 3, 96, 128), input_dtype=torch.float64).segments[-1].n_tiles > 1  # really tiled
        reference.zero_grad(set_to_none=True)
        logits = reference(x[None])
        ce = F.cross_entropy(logits, torch.tensor([label]))
        s = _scores(reference, x[None], 1)
        top = s[:2] if label else s[:6]
        aux = F.binary_cross_entropy_with_logits(top, torch.full_like(top, float(label)))
        (ce + 0.5 * aux).backward()
        # the trainer computes the slide's loss in float32 (train.optim.compute_loss), so float32's tolerance; the
        # instance scores' own exactness, float64 through the tiles, is test_sft_attention.py's
        assert step.loss == pytest.approx(float(ce.detach()), rel=1e-6)  # the step reports the slide's own loss
        for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_fit_trains_with_the_instance_loss_and_refuses_a_class_that_is_not_there(tmp_path: Path) -> None:
    cfg = config_file(tmp_path, synthetic_slides(tmp_path / "synth"))
    text = cfg.read_text().replace("model: {name: tiny}", "model: {name: tiny, pool: attention, attention: "
                                   "{branches: per_class, instance_loss: 0.5, instance_cells: 8}}")  # fmt: skip
    cfg.write_text(text)
    run = finished_run(cfg)
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]["attention"]
    assert saved["instance_loss"] == 0.5 and saved["instance_cells"] == 8  # the run folder records the choice
    state = torch.load(run / "last.pt", weights_only=True)["model"]
    assert not any("instance" in k for k in state)  # no parameters of its own: a checkpoint loads either way
    out = tmp_path / "p.csv"
    res = invoke("--quiet", "predict", str(cfg), "--checkpoint", str(run / "last.pt"), "--slides",
                 str(tmp_path / "synth"), "--out", str(out), "--heatmaps", str(tmp_path / "maps"))  # fmt: skip
    assert res.exit_code == 0, res.output  # predict rebuilds the pool from the checkpoint's config, maps included
    assert len(out.read_text().splitlines()) == 5 and (tmp_path / "maps" / "heatmaps.json").exists()
    cfg.write_text(text.replace("instance_cells: 8", "instance_cells: 8, positive_class: tumour"))
    res = invoke("fit", str(cfg))
    assert res.exit_code == 2, res.output
    assert "model.attention.positive_class is 'tumour'" in res.output
