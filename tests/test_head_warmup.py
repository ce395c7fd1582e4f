"""``train.head_warmup`` (wsitrain/train/head_warmup.py): head-only steps on the initial trunk's patch features.

The warm-up must change the head only (the trunk bitwise as built), learn (its loss falls on a separable toy set), and
run in ``fit`` on a new run: the run folder's metrics record it and the saved head differs from a run without it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_runs import config_file, finished_run, invoke, synthetic_slides

import wsitrain.train.head_warmup as hw
from wsitrain.config import TrainConfig, WsiTrainConfig
from wsitrain.errors import WsiTrainError
from wsitrain.models import build
from wsitrain.train.frozen_mil import patch_features
from wsitrain.train.head_warmup import (
    BATCH,
    _mean_loss,
    bag_bytes,
    head_modules,
    host_patch_features,
    prior_loss,
    split_held_out,
    warm_up_head,
)
from wsitrain.train.recipe import _check_head_warmup, _check_warmup_bags, _check_warmup_hold_out


def toy_slides(n: int = 4) -> tuple[list[torch.Tensor], list[int]]:
    """64 px uint8 images: positives hold one bright 16 px square (at a different place each), negatives none."""
    g = torch.Generator().manual_seed(0)
    images, labels = [], []
    for i in range(n):
        x = (torch.rand(1, 3, 64, 64, generator=g) * 60 + 60).to(torch.uint8)
        if i % 2:
            r, c = 16 * (i % 3), 16 * ((i + 1) % 4)
            x[:, :, r : r + 16, c : c + 16] = 250
        images.append(x)
        labels.append(i % 2)
    return images, labels


@pytest.mark.parametrize("pool", ["attention", "max", "topk"])
def test_warmup_trains_the_head_only_and_learns(pool: str) -> None:
    torch.manual_seed(0)
    model = build("tiny", 2, pool=pool, topk=2)
    trunk = {k: v.clone() for k, v in model.features.state_dict().items()}
    head = {k: v.clone() for m in head_modules(model) for k, v in m.state_dict().items()}
    images, labels = toy_slides()
    res = warm_up_head(model, images, labels, steps=120, patch=16, lr=3e-2, seed=0)
    assert res.steps == 120 and res.slides == 4 and len(res.losses) == 30
    for k, v in model.features.state_dict().items():
        assert torch.equal(v, trunk[k]), f"the trunk's {k} changed"
    after = {k: v for m in head_modules(model) for k, v in m.state_dict().items()}
    if res.kept:
        assert any(not torch.equal(after[k], head[k]) for k in head), "the head did not change"
    else:  # it did not learn (max and top-k heads see no square in these patches): the head is back as it was
        assert all(torch.equal(after[k], head[k]) for k in head)
    if pool == "attention":  # measured here: 0.75 -> 0.62
        assert res.last_loss < res.first_loss - 0.08, res.losses
        assert res.kept and abs(res.prior_loss - math.log(2)) < 1e-12


def test_a_warmup_that_learns_nothing_is_not_kept() -> None:
    """Two copies of each image, one per label: nothing to learn, so the head is put back bitwise."""
    torch.manual_seed(0)
    model = build("tiny", 2, pool="attention")
    head = {k: v.clone() for m in head_modules(model) for k, v in m.state_dict().items()}
    images, _ = toy_slides(2)
    res = warm_up_head(model, images * 2, [0, 1, 1, 0], steps=40, patch=16, lr=3e-2, seed=0)
    assert not res.kept and "not kept" in res.summary()
    after = {k: v for m in head_modules(model) for k, v in m.state_dict().items()}
    assert all(torch.equal(after[k], head[k]) for k in head)
    assert all(p.grad is None for p in model.parameters()), "the warm-up left gradients behind"
    assert model.training, "the model's mode is restored"


def test_config_short_form_and_checks() -> None:
    t = TrainConfig(head_warmup=500)
    assert t.head_warmup is not None and (t.head_warmup.steps, t.head_warmup.patch, t.head_warmup.lr) == (500, 64, None)
    assert TrainConfig(head_warmup={"steps": 10, "patch": 32, "lr": 0.01}).head_warmup.patch == 32  # type: ignore
    assert TrainConfig().head_warmup is None
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        TrainConfig(head_warmup=0)
    with pytest.raises(ValueError, match="loss: mse"):
        TrainConfig(head_warmup=10, loss="mse")
    w = TrainConfig(head_warmup={"steps": 10, "hold_out": 0.25}).head_warmup
    assert w is not None and (w.hold_out, w.patience) == (0.25, 200)
    assert TrainConfig(head_warmup=10).head_warmup.hold_out == 0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="less than 1"):
        TrainConfig(head_warmup={"steps": 10, "hold_out": 1})
    assert TrainConfig(head_warmup={"steps": 10, "layout": "map"}).head_warmup.layout == "map"  # type: ignore
    with pytest.raises(ValueError, match="unknown train.head_warmup.layout 'cells': choose one of patches, map"):
        TrainConfig(head_warmup={"steps": 10, "layout": "cells"})


def test_held_out_split_is_per_class_seeded_and_refuses_an_empty_side() -> None:
    labels = [0] * 8 + [1] * 4
    fit, held = split_held_out(labels, 0.25, seed=3)
    assert sorted(fit + held) == list(range(12)) and not set(fit) & set(held)
    assert [labels[i] for i in held].count(0) == 2 and [labels[i] for i in held].count(1) == 1
    assert split_held_out(labels, 0.25, seed=3) == (fit, held)
    assert split_held_out([0, 0, 1, 1], 0.1, seed=0)[1].__len__() == 2, "at least one slide of each class"
    with pytest.raises(ValueError, match="class 1 has 1 training slide: holding out 0.25 of them leaves none"):
        split_held_out([0, 0, 0, 1], 0.25, seed=0)


def test_prior_loss_on_other_labels_is_the_constant_outputs_cross_entropy() -> None:
    assert prior_loss([0, 0, 0, 1]) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert prior_loss([0, 0, 0, 1], [1, 1]) == pytest.approx(-math.log(0.25))
    assert prior_loss([0, 0, 0, 1], [0, 1]) == pytest.approx(-(math.log(0.75) + math.log(0.25)) / 2)


def test_a_held_out_warmup_keeps_its_lowest_held_out_head_and_stops_after_patience(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reference vs variant: with held-out losses scripted to be lowest after pass 2, the variant (cap 3000 steps,
    patience 3) stops 3 passes later and keeps bitwise the head of a reference that stopped after pass 2 (its cap:
    12 steps); the held-out bags never train it, the trunk is untouched."""
    def run(steps: int, script: list[float]) -> tuple[hw.WarmupResult, dict[str, torch.Tensor]]:
        scripted = iter(script)
        monkeypatch.setattr(hw, "_mean_loss", lambda *a: next(scripted))
        torch.manual_seed(0)
        model = build("tiny", 2, pool="attention")
        trunk = {k: v.clone() for k, v in model.features.state_dict().items()}
        images, labels = toy_slides(8)
        res = warm_up_head(model, images, labels, steps=steps, patch=16, lr=3e-2, seed=0, hold_out=0.25, patience=3)
        after = {k: v.clone() for m in head_modules(model) for k, v in m.state_dict().items()}
        for k, v in model.features.state_dict().items():
            assert torch.equal(v, trunk[k]), f"the trunk's {k} changed"
        return res, after

    res, kept = run(3000, [0.60, 0.50, 0.55, 0.70, 0.80, 0.10])
    assert res.held_out == 2 and res.slides == 8 and res.held_out_losses == [0.60, 0.50, 0.55, 0.70, 0.80]
    assert res.steps == 6 * 5 and res.best_step == 12, "6 fitted bags a pass; stopped 3 passes after the lowest"
    assert res.held_out_loss == 0.50 and res.kept and res.prior_loss == pytest.approx(math.log(2))
    assert "lowest held-out loss 0.500 (2 slides) at step 12" in res.summary()
    ref, ref_head = run(12, [0.60, 0.50])
    assert ref.steps == 12 and ref.best_step == 12
    for k, v in ref_head.items():
        assert torch.equal(kept[k], v), f"the head kept is not the lowest pass's: {k}"


def test_a_held_out_warmup_that_does_not_generalise_is_not_kept() -> None:
    """toy_slides(8)'s squares sit elsewhere on every positive: the two held-out bags' loss stays at ln 2 (measured:
    0.693 after 60 steps), so the warm-up stops after ``patience`` passes and the head is put back bitwise."""
    torch.manual_seed(0)
    model = build("tiny", 2, pool="attention")
    head = {k: v.clone() for m in head_modules(model) for k, v in m.state_dict().items()}
    images, labels = toy_slides(8)
    res = warm_up_head(model, images, labels, steps=3000, patch=16, lr=3e-2, seed=0, hold_out=0.25, patience=5)
    best = res.held_out_losses.index(res.held_out_loss)
    assert res.steps < 3000 and len(res.held_out_losses) - 1 - best == 5
    assert not res.kept and "not 0.01 below the prior's held-out loss 0.693" in res.summary()
    after = {k: v for m in head_modules(model) for k, v in m.state_dict().items()}
    assert all(torch.equal(after[k], head[k]) for k in head)
    _, held = split_held_out(labels, 0.25, seed=0)
    bags = [host_patch_features(model, images[i], 16, torch.device("cpu")) for i in held]
    again = _mean_loss(head_modules(model), [hw.Bag(b) for b in bags], [labels[i] for i in held], torch.device("cpu"))
    assert again > res.prior_loss - 0.01, "the head put back scores no better than the prior"


def test_fit_warms_the_head_up_on_a_new_run(tmp_path: Path) -> None:
    """One tiny fit with the warm-up: it ran once, before the first epoch, on the two training slides."""
    cfg = config_file(tmp_path, synthetic_slides(tmp_path / "synth"))
    cfg.write_text(cfg.read_text().replace("lr: 0.003", "lr: 0.003, head_warmup: {steps: 12, patch: 32}"))
    run = finished_run(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r.get("kind") for r in rows]
    assert kinds.count("head_warmup") == 1, kinds
    warm = rows[kinds.index("head_warmup")]
    assert warm["steps"] == 12 and warm["slides"] == 2, warm
    assert all(r.get("kind") != "train" for r in rows[: kinds.index("head_warmup")]), "it runs before the training"


def test_fit_with_a_held_out_map_warmup_records_it_and_refuses_a_split_leaving_a_class_empty(tmp_path: Path) -> None:
    """Eight slides, four train (two a class): ``hold_out: 0.5`` scores on one slide of each class, and fit's metrics
    say so; on the four-slide cohort (one training slide a class) fit exits 2 naming the key, before any run folder."""
    cfg = config_file(tmp_path, tmp_path / "synth8")
    warm = "lr: 0.003, head_warmup: {steps: 40, patch: 32, hold_out: 0.5, patience: 5, layout: map}"
    cfg.write_text(cfg.read_text().replace("n: 4,", "n: 8,").replace("lr: 0.003", warm))
    run = finished_run(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    warm_row = next(r for r in rows if r.get("kind") == "head_warmup")
    assert warm_row["slides"] == 4 and warm_row["held_out"] == 2, warm_row
    assert math.isfinite(warm_row["held_out_loss"]) and 0 < warm_row["best_step"] <= warm_row["steps"] <= 40

    small = tmp_path / "small"
    small.mkdir()
    cfg = config_file(small, synthetic_slides(small / "synth"))
    cfg.write_text(cfg.read_text().replace("lr: 0.003", warm))
    result = invoke("fit", str(cfg))
    assert result.exit_code == 2, result.output
    assert "train.head_warmup.hold_out: class 0 has 1 training slide" in result.output
    assert not (small / "runs").exists(), "nothing is written before the check"


def test_the_checks_fit_makes_before_the_run_folder_exists() -> None:
    """A patch under the model's stride, streamed reads, a regression task: each a clear input error."""
    def cfg(**kw: object) -> WsiTrainConfig:
        data = {"synthetic": {"n": 4}, "stream_tiles": kw.pop("stream", False)}
        return WsiTrainConfig.model_validate({"data": data, "train": {"head_warmup": kw}})

    _check_head_warmup(cfg(steps=5, patch=16), None, 16)  # one map cell per patch: fine
    with pytest.raises(WsiTrainError, match=r"patch is 8 px, smaller than the model's stride \(16 px\)"):
        _check_head_warmup(cfg(steps=5, patch=8), None, 16)
    _check_head_warmup(cfg(steps=5, patch=32, layout="map"), None, 16)
    with pytest.raises(WsiTrainError, match=r"patch 40 px is not a multiple of the model's stride \(16 px\)"):
        _check_head_warmup(cfg(steps=5, patch=40, layout="map"), None, 16)
    with pytest.raises(WsiTrainError, match="data.stream_tiles is on"):
        _check_head_warmup(cfg(steps=5, stream=True), None, 16)
    with pytest.raises(WsiTrainError, match="but the task is survival"):
        _check_head_warmup(cfg(steps=5), SimpleNamespace(kind="survival"), 16)  # type: ignore[arg-type]
    _check_warmup_hold_out(cfg(steps=5, hold_out=0.5), [0, 0, 1, 1])
    with pytest.raises(WsiTrainError, match=r"hold_out: class 0 has 1 training slide.*\n?.*lower train.head_warmup"):
        _check_warmup_hold_out(cfg(steps=5, hold_out=0.5), [0, 1])


def test_patch_features_go_to_the_device_a_batch_at_a_time_in_row_major_order() -> None:
    """The warm-up's features: frozen_mil's (each patch through the trunk once, row-major), computed one row of
    patches and at most ``BATCH`` patches at a time, so the device never holds the slide; the bag stays on the host."""
    torch.manual_seed(0)
    model = build("tiny", 2).double()
    image = (torch.rand(1, 3, 8 * 16 + 5, 10 * 16 + 7) * 255).to(torch.uint8)  # ragged edges left out
    seen: list[int] = []
    hook = model.features.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    try:
        got = host_patch_features(model, image, 16, torch.device("cpu"))
    finally:
        hook.remove()
    want = patch_features(model, image.double() / 255, 16)  # the whole slide at once
    assert got.shape == want.shape == (80, want.shape[1]) and got.device.type == "cpu"
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
    assert max(seen) <= min(BATCH, 10) and sum(seen) == 80, seen  # one row of 10 patches per forward


def test_fit_refuses_bags_over_the_host_budget_and_names_a_patch_that_fits() -> None:
    """ResNet-50's 2,048 channels at 64 px patches: 20 GB per 100,000 px slide. Over engine.host_memory it is an
    input error naming the smallest patch (a multiple of the stride) whose bags fit."""
    def cfg(patch: int) -> WsiTrainConfig:
        return WsiTrainConfig.model_validate({"data": {"synthetic": {"n": 4}}, "engine": {"host_memory": "16GiB"},
                                              "train": {"head_warmup": {"steps": 5, "patch": patch}}})  # fmt: skip

    shapes = [(100_000, 100_000)]
    assert bag_bytes(shapes[0], 64, 2048) == 1562 * 1562 * 2048 * 4  # 19.99 GB
    with pytest.raises(WsiTrainError, match=r"patch bags of 1 training slide need 18\.61 GiB") as e:
        _check_warmup_bags(cfg(64), shapes, 2048, 32)
    assert "set train.head_warmup.patch to 96 or more" in str(e.value.hint)
    _check_warmup_bags(cfg(96), shapes, 2048, 32)  # 8.27 GiB: fits


def test_the_map_layout_puts_each_patchs_cells_where_they_lie() -> None:
    """Reference vs variant: each whole patch's block of the map is the trunk's map of that patch alone, its mean the
    patch's vector of ``layout: patches``; the ragged edge stays 0 and out of the mask, which also drops what the
    tissue mask drops."""
    torch.manual_seed(0)
    model = build("tiny", 2, pool="attention")
    image = torch.rand(1, 3, 80, 112)  # 2 x 3 whole 32 px patches, a ragged 16 px edge on each
    tissue = torch.ones(1, 1, 5, 7, dtype=torch.bool)
    tissue[..., 0, 0] = False
    cells, mask = hw.host_cell_map(model, image, 32, torch.device("cpu"), lambda h, w: tissue)
    assert cells.shape == (1, 32, 5, 7) and mask.shape == (1, 1, 5, 7)
    trunk = torch.nn.Sequential(model.normalize, model.features).eval()
    vectors = host_patch_features(model, image, 32, torch.device("cpu"))  # (6, C), row-major
    for r in range(2):
        for c in range(3):
            with torch.no_grad():
                alone = trunk(image[:, :, 32 * r : 32 * r + 32, 32 * c : 32 * c + 32])[0]
            block = cells[0, :, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2]
            torch.testing.assert_close(block, alone)
            torch.testing.assert_close(block.mean(dim=(1, 2)), vectors[3 * r + c])
    assert cells[..., 4, :].abs().sum() == 0 and cells[..., :, 6].abs().sum() == 0
    expect = torch.zeros(1, 1, 5, 7, dtype=torch.bool)
    expect[..., :4, :6] = True
    expect[..., 0, 0] = False
    assert torch.equal(mask, expect)
    with pytest.raises(ValueError, match="not a multiple of the model's stride"):
        hw.host_cell_map(model, image, 24, torch.device("cpu"))


@pytest.mark.parametrize("pool", ["attention", "max"])
def test_a_map_bag_as_large_as_the_slide_is_what_end_to_end_sees(pool: str) -> None:
    """With one patch covering the whole slide, the warm-up's head gives exactly the model's own forward on the slide
    under the same tissue mask (float64): the head warms up on end to end's input, not on averages of it."""
    torch.manual_seed(0)
    model = build("tiny", 2, pool=pool).double().eval()
    image = torch.rand(1, 3, 64, 64, dtype=torch.float64)
    tissue = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    tissue[..., 1:3, :] = True
    cells, mask = hw.host_cell_map(model, image, 64, torch.device("cpu"), lambda h, w: tissue)
    got = hw.bag_logits(head_modules(model), hw.Bag(cells, mask))
    pool_module = hw.masked_pool(model)
    assert pool_module is not None
    with torch.no_grad(), pool_module.masked(tissue):
        want = model(image)
    torch.testing.assert_close(got.detach(), want)
    unmasked = hw.bag_logits(head_modules(model), hw.Bag(cells, torch.ones_like(mask)))
    assert not torch.allclose(unmasked.detach(), want), "the mask changed nothing: the test could not fail"


def test_a_map_warmup_learns_and_leaves_the_trunk_as_it_was() -> None:
    torch.manual_seed(0)
    model = build("tiny", 2, pool="attention")
    trunk = {k: v.clone() for k, v in model.features.state_dict().items()}
    images, labels = toy_slides()
    res = warm_up_head(model, images, labels, steps=120, patch=16, lr=3e-2, seed=0, layout="map")
    for k, v in model.features.state_dict().items():
        assert torch.equal(v, trunk[k]), f"the trunk's {k} changed"
    assert res.steps == 120 and res.kept and res.last_loss < res.first_loss - 0.08, res.losses
    assert all(p.grad is None for p in model.parameters())
