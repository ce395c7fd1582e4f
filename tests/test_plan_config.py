"""`wsitrain plan --config RUN.yaml`: the run's model section planned as fit builds it (wsitrain.plan.from_config).

Reference against variant: the plan of a config equals the engine's plan of the model ``fit``'s own builder makes from
that config, and the named options' plan where they can say the same; bad combinations are one clear error (exit 2).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.config import load_config
from wsitrain.gpus import resolve_budget
from wsitrain.plan.command import run_plan
from wsitrain.precision import activation_dtype
from wsitrain.sft import plan as plan_model
from wsitrain.train.engine import build_model

MiB = 1024**2


def _config(tmp_path: Path, model: dict, **sections: dict) -> Path:
    data = {"data": {"synthetic": {"n": 8, "size": 512}}, "model": model, **sections}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plan(**kw) -> tuple[int, dict]:
    buf = io.StringIO()
    args = dict(model=None, size=None, gpu=None, memory=None, batch=1, precision=None, tile=None, with_max_size=False)
    args.update(kw)
    code = run_plan(**args, as_json=True, console=Console(file=buf, width=250, color_system=None))
    return code, json.loads(buf.getvalue())


def _facts(out: dict) -> dict:
    """The plan's own facts without where the budget came from (the config names itself there)."""
    return {k: v for k, v in out["plan"].items() if k != "budget_source"}


def test_a_config_plans_as_the_named_options_that_say_the_same(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"name": "tiny", "pool": "max", "map_norm": "slide"},
                  engine={"memory_budget": "48MiB", "tile_size": 128})  # fmt: skip
    code, out = _plan(config=cfg)
    code_named, named = _plan(model="tiny", pool="max", map_norm="slide", memory="48MiB", size="512", tile=128)
    assert code == code_named == 0
    assert _facts(out) == _facts(named)
    assert out["budget_source"] == f"engine.memory_budget 48MiB ({cfg})" and named["budget_source"] == "--memory 48MiB"


@pytest.mark.parametrize(
    "model",
    [
        # CLAM-MB with the instance loss's carried scores, the slide norm's extra sweep and the instance stream
        {"name": "tiny", "pool": "attention", "attention": {"branches": "per_class", "instance_loss": 0.1,
                                                            "norm": "slide", "instance_stream": True}},
        # BatchNorm in training mode: its statistics take sweeps of their own
        {"name": "tiny_bn", "pool": "gated_attention", "freeze_bn": False, "attention": {"dim": 16}},
    ],
    ids=["clam_mb_stream", "train_mode_bn"],
)
def test_a_config_plans_the_model_fit_builds(tmp_path: Path, model: dict) -> None:
    cfg_path = _config(tmp_path, model, engine={"memory_budget": "40MiB"}, train={"optimizer": "sgd"})
    code, out = _plan(config=cfg_path, size="768x512")
    cfg = load_config(cfg_path)
    with torch.device("meta"):
        net = build_model(cfg.model, 2)
    budget = resolve_budget(None, "40MiB")
    # the command plans the image as fit reads it (uint8; on CPU inside the budget), so the reference does too
    ref = plan_model(net, input_shape=(1, 3, 768, 512), memory_budget=budget.bytes, dtype=activation_dtype("fp32"),
                     optimizer="sgd", device=budget.device, target=budget.target, input_dtype=torch.uint8)  # fmt: skip
    assert out["plan"]["flops_sft"] == ref.flops_sft
    assert out["plan"]["estimated_peak_bytes"] == ref.estimated_peak_bytes
    # the default head of the same trunk plans less: the config's keys were not dropped on the way
    _, plain = _plan(model=model["name"], pool=model["pool"], memory="40MiB", size="768x512")
    assert plain["plan"]["flops_sft"] < out["plan"]["flops_sft"]


def test_command_line_options_win_over_the_config(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"name": "tiny", "pool": "avg", "freeze": {"until": "features.pool2"}},
                  engine={"memory_budget": "48MiB", "tile_size": 128}, train={"precision": "bf16"})  # fmt: skip
    code, out = _plan(config=cfg, gpu="h100", size="1024", precision="fp32", tile=256)
    assert code == 0 and out["precision"] == "fp32" and out["gpu"] == "h100"
    assert "h100" in out["budget_source"].lower() and out["plan"]["segments"][0]["tile_grid"] == [4, 4]  # 1024 / 256
    # model.freeze is planned with its saving beside it, as --freeze shows it
    assert out["freeze"]["frozen_modules"][-1] == "features.pool2" and out["freeze"]["flops_saving"] > 0
    (tmp_path / "spill").mkdir()
    spill = _config(tmp_path / "spill", {"name": "tiny"}, engine={"memory_budget": "48MiB", "host_memory": "1MiB"})
    _, small_host = _plan(config=spill, size="1024")
    assert small_host["plan"]["host_budget_bytes"] == 1024**2  # engine.host_memory planned as --host-memory 1MiB
    _, cfg_precision = _plan(config=cfg, gpu="h100")
    assert cfg_precision["precision"] == "bf16" and cfg_precision["plan"]["input_shape"] == [1, 3, 512, 512]
    assert cfg_precision["plan"]["segments"][0]["tile_grid"] == [4, 4]  # engine.tile_size 128 on data.synthetic.size


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["plan", *args])
    return result.exit_code, result.output


def test_bad_combinations_are_one_clear_error(tmp_path: Path) -> None:
    cfg = _config(tmp_path, {"name": "tiny", "pool": "max"})
    code, out = _cli("--config", str(cfg), "--pool", "attention", "--memory", "64MiB")
    assert code == 2 and "--pool" in out and "model section" in out
    code, out = _cli("--size", "1024", "--memory", "64MiB")
    assert code == 2 and "--model" in out and "--config" in out
    no_size = tmp_path / "slides.yaml"
    no_size.write_text(yaml.safe_dump({"data": {"labels": "labels.csv", "slides_dir": "."}, "model": {"name": "tiny"}}))
    code, out = _cli("--config", str(no_size), "--memory", "64MiB")
    assert code == 2 and "--size" in out
    bad = _config(tmp_path, {"name": "tiny", "pool": "max", "map_norm": "cell"})
    code, out = _cli("--config", str(bad), "--memory", "64MiB")
    assert code == 2 and "model.map_norm" in out and str(bad) in out
    bf16 = _config(tmp_path, {"name": "tiny"}, train={"precision": "bf16"})
    code, out = _cli("--config", str(bf16), "--gpu", "2080ti")
    assert code == 2 and f"train.precision ({bf16}) bf16" in out and "older than Ampere" in out
    code, out = _cli("--config", str(tmp_path / "missing.yaml"), "--memory", "64MiB")
    assert code == 2 and "missing.yaml" in out and "file not found" in out


def test_the_weights_file_is_never_read(tmp_path: Path) -> None:
    """A plan needs shapes only: a config whose weights file is elsewhere (the cluster's disk) still plans."""
    cfg = _config(tmp_path, {"name": "tiny", "pool": "max", "weights": str(tmp_path / "not-here.pt")},
                  engine={"memory_budget": "64MiB"})  # fmt: skip
    code, out = _plan(config=cfg)
    assert code == 0 and out["plan"]["fits"] is True
    assert MiB < out["plan"]["estimated_peak_bytes"] <= 64 * MiB
