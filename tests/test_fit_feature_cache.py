"""``train.feature_cache``: `wsitrain fit` with a patch encoder frozen whole trains the head on cached embeddings.

A tiny timm ViT on 32 px patches (tests/tiny_encoders.py) frozen by ``model.freeze: {until: features}``, six synthetic
slides read whole (128 px: a 4 x 4 patch grid; one has background patches its tissue mask leaves out), flips and
quarter turns on. Checked: the encoder embeds each slide once per augmentation drawn across two epochs (counted at
``PatchTrunk``'s input, less the preflight's probes) and another run reads every bag back; a run killed in its second
epoch resumes to the uninterrupted run's rows and weights; one optimizer step on the cache equals the same step end to
end (``off``), with the same augmentations and masks: losses, outputs, every weight, the validation loss; ``predict``
on the cached run's folder, through the engine, gives the probabilities its validation gave; a bad value is a config
error (exit 2). float32: the fit has no float64 mode."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from wsitrain.config import WsiTrainConfig, load_config
from wsitrain.errors import ConfigError
from wsitrain.patch.trunk import PatchTrunk
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.fit import run_fit
from wsitrain.train.predict import run_predict
from wsitrain.train.state import FitState

pytest.importorskip("timm", reason="the encoder is a timm ViT")

@pytest.fixture(scope="module")
def labels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_synthetic_dataset(tmp_path_factory.mktemp("fc_slides"), n=6, size=128, seed=3))


def _cfg(labels: Path, log_dir: Path, cache: str, *, epochs: int = 1, augment: bool = True,
         accumulate: int = 1) -> WsiTrainConfig:  # fmt: skip
    return WsiTrainConfig.model_validate({
        "name": f"fc-{cache}", "seed": 0,
        "data": {"labels": str(labels), "prefetch": False, "val_fraction": 0.34, "region": "whole",
                 "augment": {"flips": augment, "rot90": augment}},
        "model": {"name": "python:tiny_encoders:tiny_vit", "patch": 32, "pool": "attention",
                  "freeze": {"until": "features"}},
        "engine": {"device": "cpu", "memory_budget": "1GiB", "tile_size": 64},
        "train": {"epochs": epochs, "optimizer": "sgd", "momentum": 0.0, "lr": 0.5, "accumulate": accumulate,
                  "feature_cache": cache, "checkpoint_every": 1},
        "log": {"dir": str(log_dir), "tiles": "off"},
    })  # fmt: skip


def _fit(cfg: WsiTrainConfig, **kwargs: Any) -> Path:
    return run_fit(cfg, console=Console(file=io.StringIO(), width=200), **kwargs)


class _StopAfter:
    """Interrupts the fit once ``n`` optimizer steps are done (their checkpoint written), as a kill would."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, state: FitState) -> None:
        if state.global_step >= self.n:
            raise KeyboardInterrupt(f"stopped after step {self.n}")


@pytest.fixture
def patches_encoded() -> Iterator[list[int]]:
    """Patches through a PatchTrunk's forward (real tensors: the planner's fake ones are not counted)."""
    seen = [0]

    def hook(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if isinstance(module, PatchTrunk) and type(args[0]) is torch.Tensor:
            x = args[0]
            seen[0] += x.shape[0] * (x.shape[2] // module.patch) * (x.shape[3] // module.patch)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    yield seen
    handle.remove()


def _rows(run: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == kind]


def test_each_slide_and_view_is_embedded_once(labels: Path, tmp_path: Path, patches_encoded: list[int]) -> None:
    run = _fit(_cfg(labels, tmp_path, "auto", epochs=2))
    train = _rows(run, "train")
    views = {(r["slide"], r["feature_cache"]["view"]) for r in train}
    n_val = _rows(run, "val")[0]["n"]
    assert len(train) == 2 * (6 - n_val) and len(_rows(run, "val")) == 2
    assert len(views) > len(train) // 2  # the augmentations drawn differ between epochs
    assert sum(r["feature_cache"]["embedded"] for r in train) == len(views)  # each (slide, view) embedded once
    # the files: a bag and its grid per (slide, view) and per validation slide (un-augmented, for both validations)
    bags = [f for f in (tmp_path / "feature_cache").glob("*/*.pt") if not f.name.endswith(".grid.pt")]
    assert len(bags) == len(views) + n_val == len(list((tmp_path / "feature_cache").glob("*/*.grid.pt")))
    assert (run / "best.pt").is_file() and (run / "last.pt").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["optimizer_steps"] == len(train) and summary["mean_forward_s"] > 0 and summary["mean_slide_s"] > 0
    first = patches_encoded[0]

    # the same run again, killed in its second epoch, then resumed: every bag read back (the same encoder, weights
    # and reads), and the same steps, rows and weights as the run never stopped
    with pytest.raises(KeyboardInterrupt):
        _fit(_cfg(labels, tmp_path, "auto", epochs=2), name="killed", callbacks=[_StopAfter(len(train) // 2 + 1)])
    assert not any(r["feature_cache"]["embedded"] for r in _rows(tmp_path / "killed", "train"))
    # the encoder's patches in the first run, less the preflight's (the second run's only ones): the bags' patches
    assert first - (patches_encoded[0] - first) == sum(len(torch.load(f)) for f in bags)
    resumed = _fit(_cfg(labels, tmp_path, "auto", epochs=2), resume=tmp_path / "killed")
    assert [(r["step"], r["loss"]) for r in _rows(resumed, "train")] == [(r["step"], r["loss"]) for r in train]
    w, w0 = load_checkpoint(resumed / "last.pt")["model"], load_checkpoint(run / "last.pt")["model"]
    for k in w0:
        torch.testing.assert_close(w[k], w0[k], rtol=0, atol=0)


def test_one_step_on_the_cache_equals_the_step_end_to_end(labels: Path, tmp_path: Path,
                                                          patches_encoded: list[int]) -> None:  # fmt: skip
    # four training slides, one optimizer step of their mean gradient, each in the flips and turns drawn for it; a
    # patient column (a patient per slide) validates through the task path, the one the test split takes too
    rows = list(csv.DictReader(labels.open()))
    per_patient = labels.with_name("patients.csv")
    per_patient.write_text("slide,label,patient\n" + "".join(f"{r['slide']},{r['label']},p{i}\n"
                                                              for i, r in enumerate(rows)))  # fmt: skip
    cached = _fit(_cfg(per_patient, tmp_path, "auto", accumulate=4))
    embedded = patches_encoded[0]
    e2e = _fit(_cfg(per_patient, tmp_path, "off", accumulate=4))
    assert patches_encoded[0] > embedded  # off: the engine ran the encoder
    assert not any("feature_cache" in r for r in _rows(e2e, "train"))
    a, b = _rows(cached, "train"), _rows(e2e, "train")
    assert [r["slide"] for r in a] == [r["slide"] for r in b] and {r["step"] for r in a} == {1}
    torch.testing.assert_close(torch.tensor([r["loss"] for r in a]), torch.tensor([r["loss"] for r in b]))
    torch.testing.assert_close(torch.tensor([r["probs"] for r in a]), torch.tensor([r["probs"] for r in b]))
    wa, wb = load_checkpoint(cached / "last.pt")["model"], load_checkpoint(e2e / "last.pt")["model"]
    grids = [torch.load(f) for f in (tmp_path / "feature_cache").glob("*/*.grid.pt")]
    assert any(len(g) > 2 and not g[2:].all() for g in grids)  # a bag pooled under a tissue mask
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], msg=lambda m, k=k: f"{k}: {m}")
    first = load_checkpoint(cached / "last.pt")  # the head moved: the comparison is not of two untouched heads
    assert first["global_step"] == 1
    va, vb = _rows(cached, "val")[0], _rows(e2e, "val")[0]
    assert va["n_patients"] == vb["n_patients"] == va["n"] > 0
    for key in ("loss", "patient_roc_auc", "patient_accuracy"):
        torch.testing.assert_close(va[key], vb[key])

    # predict on the cached run's folder runs the whole model through the engine: the validation's probabilities
    out = run_predict(load_config(cached / "config.yaml"), checkpoint=cached / "best.pt", slides=labels.parent,
                      out=tmp_path / "pred.csv", console=Console(file=io.StringIO()))  # fmt: skip
    with open(out, newline="") as f:
        pred = {Path(r["path"]).resolve(): r for r in csv.DictReader(f)}
    val = json.loads((cached / "validation.json").read_text())
    assert len(val["slides"]) == _rows(cached, "val")[0]["n"] > 0
    for s in val["slides"]:
        for c, p in s["probs"].items():  # predict writes 6 decimals
            assert abs(float(pred[Path(s["path"]).resolve()][f"prob_{c}"]) - p) < 2e-6


def test_bad_value_is_a_config_error(write_yaml) -> None:
    with pytest.raises(ConfigError, match="train.feature_cache") as err:
        load_config(write_yaml("train: {feature_cache: always}\n"))
    assert err.value.exit_code == 2
