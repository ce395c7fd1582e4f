"""Fine-tuning controls through config and fit: model.freeze, train.backbone_lr_scale, train.class_balance."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from test_fit_train import StopAfterSteps, fit, model_weights, small_cfg, small_labels, synth_dir  # noqa: F401

from wsitrain.config import WsiTrainConfig
from wsitrain.errors import ConfigError, WsiTrainError
from wsitrain.models import build
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.class_balance import class_weights, loss_weight, sampled_slides
from wsitrain.train.optim import build_optimizer, parameter_groups


def _cfg(**model: object) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({"model": model})


def test_freeze_config_forms() -> None:
    assert _cfg(freeze="layer2").model.freeze.spec().until == "layer2"
    assert _cfg(freeze={"until": "layer2"}).model.freeze.until == "layer2"
    assert _cfg(freeze=["features.conv1", "layer1"]).model.freeze.spec().modules == ("features.conv1", "layer1")
    assert _cfg().model.freeze_spec() is None
    for bad in ({}, [], {"until": " "}, {"untill": "layer2"}):
        with pytest.raises(Exception) as e:
            WsiTrainConfig.model_validate({"model": {"freeze": bad}})
        assert "freeze" in str(e.value)


def test_train_keys_validated(tmp_path: Path) -> None:
    from wsitrain.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("train:\n  backbone_lr_scale: 0\n  class_balance: oversample\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    text = str(e.value)
    assert "train.backbone_lr_scale: must be > 0" in text and "train.class_balance: 'oversample'" in text


def test_parameter_groups_split_head_and_trunk() -> None:
    from wsitrain.models.freeze import FreezeSpec

    model = build("tiny", 2, freeze=FreezeSpec("conv1"))
    groups = parameter_groups(model, 1e-3, 0.1)
    assert [g["name"] for g in groups] == ["head", "backbone"]
    assert groups[0]["lr"] == 1e-3 and groups[1]["lr"] == pytest.approx(1e-4)
    named = {id(p): n for n, p in model.named_parameters()}
    assert {named[id(p)] for p in groups[0]["params"]} == {"classifier.weight", "classifier.bias"}
    assert all(named[id(p)].startswith("features.conv") for p in groups[1]["params"])
    assert not any("conv1" in named[id(p)] for g in groups for p in g["params"]), "frozen parameters in no group"
    opt = build_optimizer(groups, "adamw", 1e-3)
    assert [g["lr"] for g in opt.param_groups] == [1e-3, pytest.approx(1e-4)]
    assert len(parameter_groups(model, 1e-3, 1.0)) == 1


def test_class_weights_and_sampling() -> None:
    labels = [0] * 12 + [1] * 4
    w = class_weights(labels)
    assert w == {0: pytest.approx(16 / 24), 1: pytest.approx(2.0)}
    assert sum(w[y] for y in labels) == pytest.approx(len(labels)), "weights keep the mean loss's scale"
    assert loss_weight("weights", w, 1) == 2.0 and loss_weight("none", w, 1) == 1.0
    draws = [y for e in range(200) for y in (labels[i] for i in sampled_slides(labels, 0, e))]
    assert abs(sum(draws) / len(draws) - 0.5) < 0.03, "sampling draws the classes about equally"
    assert sampled_slides(labels, 0, 3) == sampled_slides(labels, 0, 3) != sampled_slides(labels, 0, 4)


def test_fit_with_freeze_records_and_resumes(
    synth_dir: Path, small_labels: Path, tmp_path: Path  # noqa: F811
) -> None:
    model = {"freeze": {"until": "conv2"}}
    train = {"epochs": 2, "checkpoint_every": 3, "backbone_lr_scale": 0.5, "class_balance": "weights"}
    full, out = fit(small_cfg(synth_dir, small_labels, tmp_path, name="full", model=model, train=train), quiet=False)
    assert "frozen normalize, features.conv1" in out and "class balance: weights" in out
    ft = json.loads((full / "fine_tuning.json").read_text())
    assert ft["frozen"]["modules"][-1] == "features.conv2"
    assert [g["name"] for g in ft["lr_groups"]] == ["head", "backbone"]
    assert ft["lr_groups"][1]["lr"] == pytest.approx(ft["lr_groups"][0]["lr"] * 0.5)
    assert ft["class_balance"]["mode"] == "weights"
    ck = load_checkpoint(full / "last.pt")
    assert ck["frozen"] == ["features.conv1.weight", "features.conv1.bias", "features.conv2.weight",
                            "features.conv2.bias"]  # fmt: skip

    # frozen weights never move: the best and last checkpoints hold the same conv1/conv2
    best = load_checkpoint(full / "best.pt")["model"]
    for k in ck["frozen"]:
        torch.testing.assert_close(ck["model"][k], best[k], rtol=0, atol=0)

    # killed and resumed: the same weights as the uninterrupted run; a changed freeze is refused
    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="killed", model=model, train=train)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, callbacks=[StopAfterSteps(4)])
    other = small_cfg(synth_dir, small_labels, tmp_path, name="killed", model={"freeze": {"until": "conv1"}},
                      train=train)  # fmt: skip
    with pytest.raises(WsiTrainError, match="froze"):
        fit(other, resume=tmp_path / "killed", force=True)
    fit(cfg, resume=tmp_path / "killed")
    a, b = model_weights(full / "last.pt"), model_weights(tmp_path / "killed" / "last.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_fit_class_balance_sampling(synth_dir: Path, small_labels: Path, tmp_path: Path) -> None:  # noqa: F811
    run, _ = fit(small_cfg(synth_dir, small_labels, tmp_path, train={"epochs": 1, "class_balance": "sampling"}))
    slides = [json.loads(line)["slide"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "train"]  # fmt: skip
    assert len(slides) == 6
    ft = json.loads((run / "fine_tuning.json").read_text())
    assert ft["class_balance"]["mode"] == "sampling" and ft["frozen"] is None
    # the epoch's slides are the seeded class-balanced draw (with replacement), dealt in the epoch's order
    train = json.loads((run / "data.json").read_text())["train"]
    label = {Path(r["slide"]).stem: r["label"] for r in csv.DictReader(small_labels.open())}
    drawn = sampled_slides([int(label[s] == "positive") for s in train], 3, 0)
    assert sorted(slides) == sorted(train[i] for i in drawn)
