"""`wsitrain fit` end to end on small synthetic slides: it learns, tiling changes nothing, runs resume exactly,
run folders are never overwritten, and bad input fails before training."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from wsitrain.config import WsiTrainConfig
from wsitrain.errors import ConfigError, SlideError, WsiTrainError
from wsitrain.gpus import run_budget
from wsitrain.models import build
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.engine import seed_everything
from wsitrain.train.fit import run_fit
from wsitrain.train.state import FitState

# 16 slides of 256 px: half for validation. Stratified split, so 4 of each class in each half.
SYNTH = {"n": 16, "size": 256, "seed": 0, "positive_fraction": 0.5}
# A fixed tile size and checkpoint layer make the engine run 2 segments of 2x2 tiles (128 px at 256 px) whatever
# its memory model estimates; the budget is generous so the plan always fits.
TILED_ENGINE = {"memory_budget": "1GiB", "tile_size": 128, "checkpoints": ["features.pool2"]}


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic slides, written once; fits with data.synthetic = SYNTH reuse them (same parameters)."""
    out = tmp_path_factory.mktemp("synth")
    write_synthetic_dataset(out, **SYNTH)
    return out


@pytest.fixture(scope="module")
def small_labels(synth_dir: Path) -> Path:
    """6 training and 2 validation slides (fixed split column), for tests about mechanics rather than learning."""
    rows = list(csv.DictReader((synth_dir / "labels.csv").open()))
    by_label = {lab: [r["slide"] for r in rows if r["label"] == lab] for lab in ("negative", "positive")}
    path = synth_dir / "small.csv"
    with path.open("w") as f:
        f.write("slide,label,split\n")
        for lab, slides in by_label.items():
            for i, s in enumerate(slides[:4]):
                f.write(f"{s},{lab},{'val' if i == 3 else 'train'}\n")
    return path


def small_cfg(synth_dir: Path, small_labels: Path, log_dir: Path, **sections: Any) -> WsiTrainConfig:
    data = {"synthetic": None, "labels": str(small_labels), "slides_dir": str(synth_dir), **sections.pop("data", {})}
    return make_cfg(synth_dir, log_dir, data=data, **sections)


def make_cfg(synth_dir: Path, log_dir: Path, **sections: Any) -> WsiTrainConfig:
    data = {"synthetic": {**SYNTH, "cache_dir": str(synth_dir)}, "region": "whole", "val_fraction": 0.5}
    base: dict[str, Any] = {
        "name": "exp",
        "seed": 3,
        "data": data,
        "model": {"name": "tiny", "pool": "max"},
        "engine": {**TILED_ENGINE, "device": "cpu"},  # CPU: exact comparisons below need deterministic kernels
        "train": {"epochs": 2, "optimizer": "adam", "lr": 1e-2, "schedule": "constant"},
        "log": {"dir": str(log_dir), "tiles": "summary"},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            base[key] = {**base.get(key, {}), **value}
        else:
            base[key] = value
    return WsiTrainConfig.model_validate(base)


def fit(cfg: WsiTrainConfig, quiet: bool = True, **kwargs: Any) -> tuple[Path, str]:
    buf = io.StringIO()
    # force_terminal: without --quiet the live display renders as it would in a terminal.
    run = run_fit(cfg, console=Console(file=buf, width=200, force_terminal=not quiet), quiet=quiet, **kwargs)
    return run, buf.getvalue()


class StopAfterSteps:
    """A fit callback that interrupts the run once ``n`` optimizer steps are done, as a kill at a known point."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, state: FitState) -> None:
        if state.global_step >= self.n:
            raise KeyboardInterrupt(f"stopped after step {self.n}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(path)["model"]


def test_fit_learns_and_writes_a_complete_run_folder(synth_dir: Path, tmp_path: Path) -> None:
    # Seeds 0-3 all reach validation accuracy 1.0 by epoch 5 with these settings; 6 epochs leaves a margin.
    # Tissue crops are about 110-210 px: 96 px tiles give every plan 2x2 to 3x2 tiles in each segment.
    cfg = make_cfg(synth_dir, tmp_path, seed=0, data={"region": "tissue"}, engine={"tile_size": 96},
                   train={"epochs": 6, "val_every": 3}, log={"tiles": "all"})
    run, out = fit(cfg)
    assert run == tmp_path / "exp"
    for name in ("config.yaml", "versions.json", "metrics.jsonl", "tiles.jsonl", "plans.jsonl", "plan.txt",
                 "last.pt", "best.pt", "summary.json"):
        assert (run / name).is_file(), name
    assert "BatchNorm" in out and "engine plan for" in out

    rows = read_jsonl(run / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    assert len(train) == 6 * 8 and [r["epoch"] for r in val] == [3, 6]
    for key in ("epoch", "step", "slide", "loss", "lr", "step_s", "read_s", "peak_bytes", "forward_s", "backward_s"):
        assert train[0][key] is not None, key
    first = sum(r["loss"] for r in train[:8]) / 8
    last = sum(r["loss"] for r in train[-8:]) / 8
    assert last < first
    assert val[-1]["accuracy"] > 0.6 and val[-1]["n"] == 8

    # region "tissue" gives each slide its own shape: each shape got its own plan, and the plans really tile.
    plans = read_jsonl(run / "plans.jsonl")
    assert len({tuple(p["shape"]) for p in plans}) == len(plans) >= 2
    segments = plans[0]["plan"]["segments"]
    assert len(segments) >= 2 and any(s["mode"] == "tiled" and s["n_tiles"] > 1 for s in segments)
    tiles = read_jsonl(run / "tiles.jsonl")
    assert {"segment", "row", "col", "phase", "ms", "bytes"} <= set(tiles[0])
    assert {t["phase"] for t in tiles} == {"forward", "backward"}


def test_tiled_and_untiled_training_give_the_same_losses_and_weights(synth_dir: Path, tmp_path: Path) -> None:
    common = {"train": {"epochs": 1, "accumulate": 2, "clip_grad_norm": 1.0, "optimizer": "sgd", "lr": 0.05}}
    tiled_cfg = make_cfg(synth_dir, tmp_path, name="tiled", engine={"tile_size": 128}, **common)
    plain_cfg = make_cfg(synth_dir, tmp_path, name="plain", engine={"tile_size": None, "checkpoints": None},
                         **common)  # the budget fits the whole model: one plain segment
    tiled, _ = fit(tiled_cfg)
    plain, _ = fit(plain_cfg)

    tiled_plan = read_jsonl(tiled / "plans.jsonl")[0]["plan"]["segments"]
    plain_plan = read_jsonl(plain / "plans.jsonl")[0]["plan"]["segments"]
    assert len(tiled_plan) == 2 and all(s["mode"] == "tiled" and s["n_tiles"] == 4 for s in tiled_plan)
    assert all(s["mode"] == "plain" for s in plain_plan)

    def losses(run: Path) -> list[float]:
        return [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]

    torch.testing.assert_close(losses(tiled), losses(plain), rtol=1e-5, atol=1e-5)
    a, b = model_weights(tiled / "last.pt"), model_weights(plain / "last.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    # Training moved every trained parameter away from its initial value (same seed, same build as the fit).
    seed_everything(tiled_cfg.seed, False)
    initial = build("tiny", 2, pool="max").state_dict()
    assert set(initial) == set(a)
    trained = {name for name, p in build("tiny", 2).named_parameters() if p.requires_grad}
    assert trained, "the model has parameters to train"
    for key in trained:
        assert not torch.allclose(a[key], initial[key]), f"{key} did not change"
    # ...and by no more than SGD can move it: 4 steps (8 slides, accumulate 2), gradients clipped to norm 1,
    # momentum 0.9: the velocity's norm is at most 1, 1.9, 2.71, 3.439, so the distance is at most lr * 9.049.
    # (A different initial model, e.g. another seed, would be far further away.)
    distance = torch.sqrt(sum(((a[k] - initial[k]) ** 2).sum() for k in trained))
    assert 0 < distance <= 0.05 * 9.049 + 1e-6
    for key in set(a) - trained:  # buffers (the input normalization) are not trained
        torch.testing.assert_close(a[key], initial[key], rtol=0, atol=0, msg=key)


def test_one_pass_training_gives_plain_losses_and_weights(synth_dir: Path, tmp_path: Path) -> None:
    """Average pooling, two classes, cross-entropy, one slide a step: the last tiled segment runs in one pass
    (wsitrain/sft/execution/one_pass.py) and trains as plain PyTorch does; engine.one_pass: false recomputes."""
    common = {"model": {"pool": "avg"}, "train": {"epochs": 1, "optimizer": "sgd", "lr": 0.05}}
    one_cfg = make_cfg(synth_dir, tmp_path, name="one", engine={"tile_size": 128}, **common)
    off_cfg = make_cfg(synth_dir, tmp_path, name="off", engine={"tile_size": 128, "one_pass": False}, **common)
    plain_cfg = make_cfg(synth_dir, tmp_path, name="plain", engine={"tile_size": None, "checkpoints": None}, **common)
    runs = {name: fit(cfg)[0] for name, cfg in (("one", one_cfg), ("off", off_cfg), ("plain", plain_cfg))}
    segments = {name: read_jsonl(run / "plans.jsonl")[0]["plan"]["segments"] for name, run in runs.items()}
    assert segments["one"][-1]["mode"] == "tiled" and segments["one"][-1]["one_pass"]
    assert segments["off"][-1]["mode"] == "tiled" and not any(s["one_pass"] for s in segments["off"])

    def losses(run: Path) -> list[float]:
        return [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]

    for name in ("one", "off"):
        torch.testing.assert_close(losses(runs[name]), losses(runs["plain"]), rtol=1e-5, atol=1e-5)
        a, b = model_weights(runs[name] / "last.pt"), model_weights(runs["plain"] / "last.pt")
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


def test_killed_run_resumes_to_the_same_weights(synth_dir: Path, small_labels: Path, tmp_path: Path) -> None:
    # 6 training slides a epoch, 2 epochs: 12 steps; augmentation (flips, rot90) on, so its seeding is tested too.
    train = {"epochs": 2, "checkpoint_every": 3, "schedule": "cosine", "warmup_steps": 2}
    full, _ = fit(small_cfg(synth_dir, small_labels, tmp_path, name="full", train=train))

    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="killed", train=train)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, callbacks=[StopAfterSteps(5)])  # killed during step 6: the last checkpoint is from step 3
    killed = tmp_path / "killed"
    ck = load_checkpoint(killed / "last.pt")
    assert (ck["epoch"], ck["next_index"], ck["global_step"]) == (0, 3, 3)

    resumed, out = fit(cfg, resume=killed)
    assert resumed == killed and "resuming" in out
    a, b = model_weights(full / "last.pt"), model_weights(killed / "last.pt")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
    # Same learning rates and data order after the resume: the resumed steps' rows equal the full run's.
    full_rows = [r for r in read_jsonl(full / "metrics.jsonl") if r["kind"] == "train" and r["step"] > 3]
    rows = read_jsonl(killed / "metrics.jsonl")
    marker = [i for i, r in enumerate(rows) if r["kind"] == "resume"]
    assert len(marker) == 1 and rows[marker[0]]["step"] == 3
    # the killed run logged steps 4-5 too; the resume dropped them (it redoes them), so no step appears twice
    assert [r["step"] for r in rows[: marker[0]]] == [1, 2, 3]
    resumed_rows = [r for r in rows[marker[0]:] if r["kind"] == "train"]
    assert [(r["slide"], r["lr"]) for r in resumed_rows] == [(r["slide"], r["lr"]) for r in full_rows]
    torch.testing.assert_close([r["loss"] for r in resumed_rows], [r["loss"] for r in full_rows])


def test_resume_with_a_changed_config_is_refused_unless_forced(
    synth_dir: Path, small_labels: Path, tmp_path: Path
) -> None:
    cfg = small_cfg(synth_dir, small_labels, tmp_path, train={"epochs": 1})
    run, _ = fit(cfg)
    changed = small_cfg(synth_dir, small_labels, tmp_path, train={"epochs": 2, "lr": 5e-3})
    with pytest.raises(WsiTrainError, match=r"train\.epochs.*train\.lr|train\.lr.*train\.epochs") as err:
        fit(changed, resume=run)
    assert "--force" in err.value.hint
    before = (run / "config.yaml").read_text()
    again, _ = fit(changed, resume=run, force=True)
    assert again == run
    assert (run / "config.yaml").read_text() == before  # never overwritten with a different config
    assert (run / "config.resume-1.yaml").is_file()
    assert load_checkpoint(run / "last.pt")["epoch"] == 2


def test_existing_run_folder_is_never_overwritten(synth_dir: Path, small_labels: Path, tmp_path: Path) -> None:
    old = tmp_path / "exp"
    old.mkdir()
    (old / "metrics.jsonl").write_text("old run\n")
    run, out = fit(small_cfg(synth_dir, small_labels, tmp_path, train={"epochs": 1}), quiet=False)
    assert run == tmp_path / "exp-2" and "exp-2" in out
    assert "slide 6/6" in out and "tiles" in out and "summary" in out  # live display and end table
    assert (old / "metrics.jsonl").read_text() == "old run\n"
    assert sorted(p.name for p in old.iterdir()) == ["metrics.jsonl"]


def test_missing_slides_fail_before_training(synth_dir: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label\nslide_000.svs,a\nmissing_1.svs,b\nmissing_2.svs,a\n")
    cfg = make_cfg(synth_dir, tmp_path / "runs", data={"synthetic": None, "labels": str(labels),
                                                         "slides_dir": str(synth_dir)})
    with pytest.raises(SlideError) as err:
        fit(cfg)
    assert "missing_1.svs" in err.value.message and "missing_2.svs" in err.value.message
    assert not (tmp_path / "runs").exists()


def test_config_errors_fail_before_training(synth_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.num_classes"):
        fit(make_cfg(synth_dir, tmp_path, model={"num_classes": 3}))
    with pytest.raises(WsiTrainError, match="no such run folder"):
        fit(make_cfg(synth_dir, tmp_path), resume=tmp_path / "nope")
    assert not (tmp_path / "exp").exists()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(synth_dir: Path, small_labels: Path, tmp_path: Path, precision: str) -> None:
    cfg = small_cfg(synth_dir, small_labels, tmp_path, engine={"tile_size": None, "checkpoints": None},
                    train={"epochs": 1, "precision": precision, "lr": 1e-3, "clip_grad_norm": 5.0, "loss": "mse"})
    run, _ = fit(cfg)
    rows = read_jsonl(run / "metrics.jsonl")
    assert len(rows) == 7 and all(math.isfinite(r["loss"]) for r in rows)
    ck = load_checkpoint(run / "last.pt")
    # fp16 keeps a loss scale (gradient scaler) in the checkpoint; bf16 needs none.
    assert bool(ck["scaler"]) == (precision == "fp16")
    assert all(torch.isfinite(v).all() for v in ck["model"].values())


def test_the_budget_is_resolved_once_per_run(
    synth_dir: Path, small_labels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wsitrain.train.recipe as recipe

    calls = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return run_budget(*args, **kwargs)

    monkeypatch.setattr(recipe, "run_budget", counting)
    # engine.memory_budget unset: detected once at the start; tissue regions give each slide its own shape.
    cfg = small_cfg(synth_dir, small_labels, tmp_path, data={"region": "tissue"}, engine={"memory_budget": None},
                    train={"epochs": 1})
    run, out = fit(cfg, quiet=False)
    assert len(calls) == 1
    plans = read_jsonl(run / "plans.jsonl")
    assert len({tuple(p["shape"]) for p in plans}) >= 2
    assert len({p["plan"]["budget_bytes"] for p in plans}) == 1  # every shape planned against the same budget
    assert out.count("memory budget:") == 1 and "detected on cpu at the start of the run" in out
