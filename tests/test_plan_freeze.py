"""`wsitrain plan --freeze`: the plan with layers frozen, beside the same plan unfrozen; bad names are exit 2."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.errors import WsiTrainError
from wsitrain.plan.command import parse_freeze, run_plan


def _plan(freeze: str | None, as_json: bool = True) -> tuple[int, str]:
    buf = io.StringIO()
    console = Console(file=buf, width=400, color_system=None)
    code = run_plan(model="resnet18", size="2048", gpu="2080ti", memory=None, batch=1, precision="fp32", tile=None,
                    as_json=as_json, console=console, freeze=freeze)  # fmt: skip
    return code, buf.getvalue()


def test_freeze_shows_the_saving() -> None:
    code, out = _plan("layer2")
    d = json.loads(out)
    s = d["freeze"]
    assert code == 0 and s["frozen_modules"][-1] == "features.layer2"
    # forward-only layers: no recompute, no backward; the JSON's plan is the frozen one
    assert s["flops_frozen"] < s["flops_unfrozen"] and s["time_frozen"] < s["time_unfrozen"]
    assert d["plan"]["flops_sft"] == s["flops_frozen"]
    assert s["flops_saving"] == pytest.approx(1 - s["flops_frozen"] / s["flops_unfrozen"])
    _, text = _plan("layer2", as_json=False)
    assert "freezing normalize, features.conv1" in text and "TFLOP per step" in text
    assert "freeze" not in json.loads(_plan(None)[1])


def test_freeze_forms_and_errors() -> None:
    assert parse_freeze("layer2").until == "layer2"
    assert parse_freeze("conv1, layer1").modules == ("conv1", "layer1")
    with pytest.raises(WsiTrainError, match="--freeze"):
        parse_freeze("layer1,,")
    result = CliRunner().invoke(app, ["plan", "--model", "resnet18", "--size", "1024", "--gpu", "2080ti",
                                      "--freeze", "layer9"])  # fmt: skip
    assert result.exit_code == 2
    assert "no module 'layer9'" in result.output and "layer4" in result.output
