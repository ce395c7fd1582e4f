"""The plateau of near-constant outputs, reported: the validation's output spread, the warning fit prints below
``FLAT_SPREAD``, and the summary's ``val_output_spread``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from tiny_runs import config_file, invoke

from wsitrain.train.metrics import classification_metrics, output_spread
from wsitrain.train.plateau import FLAT_SPREAD, MIN_SLIDES, flat_outputs_note


def test_output_spread_is_the_largest_class_probability_std() -> None:
    two = np.array([[0.49, 0.51], [0.5, 0.5], [0.52, 0.48], [0.51, 0.49]])
    assert output_spread(two) == pytest.approx(np.std([0.51, 0.5, 0.48, 0.49]))
    three = np.array([[0.2, 0.3, 0.5], [0.2, 0.7, 0.1], [0.2, 0.5, 0.3]])
    assert output_spread(three) == pytest.approx(max(np.std([0.3, 0.7, 0.5]), np.std([0.5, 0.1, 0.3])))
    assert math.isnan(output_spread(np.array([[0.4, 0.6]])))  # one slide says nothing
    m = classification_metrics(np.array([0, 1, 0, 1]), two)
    assert m["output_spread"] == output_spread(two)


@pytest.mark.parametrize(
    ("spread", "n", "warned"),
    [(0.003, 24, True), (FLAT_SPREAD, 24, False), (0.2, 24, False), (0.003, MIN_SLIDES - 1, False),
     (math.nan, 24, False)],
)  # fmt: skip
def test_the_note_is_given_below_the_measured_threshold_only(spread: float, n: int, warned: bool) -> None:
    note = flat_outputs_note({"loss": 0.69, "accuracy": 0.5, "output_spread": spread, "n": n}, 3, 12)
    assert (note is not None) == warned
    if warned:
        assert note.startswith("epoch 3/12: the model gives the 24 validation slides about the same output")
        assert "0.0030" in note and "docs/research/plateau.md" in note
    assert flat_outputs_note({"loss": 0.1, "c_index": 0.7, "n": 24}, 1, 1) is None  # a task's metrics: no spread


def test_a_random_trunk_is_named_as_the_measured_cause() -> None:
    flat = {"loss": 0.69, "accuracy": 0.5, "output_spread": 0.001, "n": 24}
    random = flat_outputs_note(flat, 3, 12, random_trunk=True)
    pretrained = flat_outputs_note(flat, 3, 12, random_trunk=False)
    assert random is not None and pretrained is not None and random.startswith(pretrained)
    assert "started from random weights" in random and "model.weights: imagenet" in random
    assert "random weights" not in pretrained


def test_fit_warns_when_its_outputs_are_flat(tmp_path: Path) -> None:
    """A tiny model barely moved from its initial weights answers every slide alike: fit says so after the
    validation, and the summary and metrics.jsonl record the spread."""
    cfg = config_file(tmp_path, tmp_path / "synth")
    text = cfg.read_text().replace("n: 4, size: 128", "n: 8, size: 128").replace("lr: 0.003", "lr: 1.0e-9")
    cfg.write_text(text)
    res = invoke("fit", str(cfg))
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert "epoch 1/1: the model gives the 4 validation slides about the same output" in said
    assert "its trunk started from random weights" in said  # the config sets no model.weights
    run = tmp_path / "runs" / "exp"
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["val_output_spread"] < FLAT_SPREAD
    val = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "val"' in x]
    assert val[-1]["output_spread"] == summary["val_output_spread"]
