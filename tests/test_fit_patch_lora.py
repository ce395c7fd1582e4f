"""A patch-encoder run through ``fit`` with LoRA and layer decay: the adapters are saved in the run's checkpoints,
a killed run resumes to the same weights, and ``predict`` rebuilds the adapters from the checkpoint."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from test_fit_train import StopAfterSteps, fit, model_weights, small_cfg, small_labels, synth_dir  # noqa: F401

from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.predict import run_predict

MODEL = {"name": "python:tests.fake_hub:tiny_vit", "patch": 16, "pool": "attention",
         "lora": {"rank": 2, "alpha": 4, "targets": ["qkv"]}}  # fmt: skip
TRAIN = {"epochs": 2, "checkpoint_every": 3, "layer_decay": 0.5, "lr": 0.01}
ENGINE = {"tile_size": 64, "checkpoints": None}


@pytest.mark.heavy  # about 50 s on 2 CPU cores: three short fits
def test_lora_run_saves_adapters_and_resumes(synth_dir: Path, small_labels: Path, tmp_path: Path) -> None:  # noqa: F811
    full, _ = fit(small_cfg(synth_dir, small_labels, tmp_path, name="full", model=MODEL, train=TRAIN, engine=ENGINE))
    ck = load_checkpoint(full / "last.pt")["model"]
    adapters = [k for k in ck if ".lora_A." in k or ".lora_B." in k]
    assert len(adapters) == 4  # A and B of both blocks' qkv
    assert any(ck[k].abs().sum() > 0 for k in adapters if ".lora_B." in k)  # B starts at zero: it trained
    ft = json.loads((full / "fine_tuning.json").read_text())
    groups = {g["name"]: g["lr"] for g in ft["lr_groups"]}
    assert groups["head"] == pytest.approx(0.01) and groups["layer_2"] == pytest.approx(0.01 * 0.5)

    cfg = small_cfg(synth_dir, small_labels, tmp_path, name="killed", model=MODEL, train=TRAIN, engine=ENGINE)
    with pytest.raises(KeyboardInterrupt):
        fit(cfg, callbacks=[StopAfterSteps(4)])
    # the encoder's own weights never move (step 3 against the end); the adapters do
    mid = model_weights(tmp_path / "killed" / "last.pt")
    for k in ck:
        same = k.startswith("features.encoder.") and "lora_" not in k
        if same:
            torch.testing.assert_close(mid[k], ck[k], rtol=0, atol=0, msg=k)
    assert not all(torch.equal(mid[k], ck[k]) for k in adapters)
    fit(cfg, resume=tmp_path / "killed")
    a, b = model_weights(full / "last.pt"), model_weights(tmp_path / "killed" / "last.pt")
    assert set(a) == set(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)

    # predict rebuilds the adapters from the checkpoint's config and loads its state (strict) into them
    out = run_predict(cfg, checkpoint=full / "best.pt", slides=synth_dir, out=tmp_path / "p.csv",
                      console=Console(file=io.StringIO()))  # fmt: skip
    rows = list(csv.DictReader(out.open()))
    assert rows and all(0 <= float(r["prob_positive"]) <= 1 for r in rows)
