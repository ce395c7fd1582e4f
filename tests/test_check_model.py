"""`wsitrain check-model`: exact, refused and wrong verdicts, model loading, and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from wsitrain.check import check_model
from wsitrain.check.compare import ERROR, EXACT, REFUSED, WRONG
from wsitrain.cli import app
from wsitrain.sft.execution.tiled import TiledSegment

NETS = Path(__file__).with_name("check_model_nets.py")
SMALL = ("--size", "32x48", "--tile", "8")


def invoke(*args: str):
    # COLUMNS: rich wraps at the terminal width; a wide one keeps each message on one line for the asserts.
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


pytestmark = pytest.mark.usefixtures("one_thread")


def test_builtin_tiny_is_exact_in_both_checks() -> None:
    result = check_model("tiny", (32, 48), batch=2, tile=8)
    assert [r.check for r in result.results] == ["tiles", "budget"]
    assert all(r.verdict == EXACT for r in result.results), [r.line() for r in result.results]
    assert result.ok and result.worst_error is not None and result.worst_error < 1e-13
    tiles = result.results[0]
    assert tiles.tiled_segments >= 1 and tiles.tiles > tiles.tiled_segments, "forced tiles really tile"


def test_cli_exact_exits_0_and_prints_each_check() -> None:
    res = invoke("check-model", "tiny", *SMALL)
    assert res.exit_code == 0, res.output
    assert "tiny on 2x3x32x48 float64, BatchNorm in eval mode" in res.output
    assert "tiles (tile_size=8): exact, worst relative error" in res.output
    assert "budget (memory_budget=" in res.output and "of plain's activation memory): exact" in res.output


def test_broken_engine_is_reported_wrong_and_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiled backward that scales its first parameter's gradient by 1.01: which gradients, worst first."""
    original = TiledSegment.add_tile_grads

    def corrupt(self, res, need_x, *args):  # noqa: ANN001, ANN002, ANN202
        k = 1 if need_x else 0
        res = tuple(g * 1.01 if i == k and g is not None else g for i, g in enumerate(res))
        return original(self, res, need_x, *args)

    monkeypatch.setattr(TiledSegment, "add_tile_grads", corrupt)
    result = check_model("tiny", (32, 48), tile=8)
    tiles = result.results[0]
    assert tiles.verdict == WRONG and not result.ok
    assert tiles.errors[0].name.startswith("grad features.") and tiles.errors[0].error > 1e-3
    assert all(e.name.startswith("grad ") for e in tiles.errors), "only parameter gradients were corrupted"
    res = invoke("check-model", "tiny", *SMALL, "--json")
    assert res.exit_code == 1, res.output
    checks = json.loads(res.output)["checks"]
    assert checks[0]["verdict"] == "wrong" and checks[0]["wrong"][0]["name"].startswith("grad features.")
    text = invoke("check-model", "tiny", *SMALL)
    assert text.exit_code == 1 and "tiles (tile_size=8): wrong: " in text.output and "worst first: grad" in text.output


def test_unsupported_layer_is_refused_with_the_layer_and_why() -> None:
    result = check_model("check_model_nets:flip_net", (32, 48), tile=8, train_bn=True)
    tiles = result.results[0]
    assert tiles.verdict == REFUSED and result.ok, tiles.line()
    assert "layer '3 (flip)'" in tiles.message and "cannot be tiled" in tiles.message
    res = invoke("check-model", f"{NETS}:flip_net", *SMALL)
    assert res.exit_code == 0 and "tiles (tile_size=8): refused: layer '3 (flip)'" in res.output, res.output


@pytest.mark.parametrize("train_bn", [False, True])
def test_module_function_models_load_and_run(train_bn: bool) -> None:
    result = check_model("check_model_nets:small_net", (32, 48), tile=8, train_bn=train_bn)
    assert result.ok and all(r.verdict == EXACT for r in result.results), [r.line() for r in result.results]
    res = invoke("check-model", f"{NETS}:small_net", *SMALL, "--json", *(["--train-bn"] if train_bn else []))
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["batchnorm"] == ("train" if train_bn else "eval") and out["input_shape"] == [2, 3, 32, 48]


def test_engine_crash_is_an_error_not_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    import wsitrain.sft.facts as facts

    def broken(*args: object) -> None:
        raise KeyError(33)

    monkeypatch.setattr(facts, "mark_barriers", broken)
    result = check_model("tiny", (32, 48), tile=8)
    assert {r.verdict for r in result.results} == {ERROR} and not result.ok
    assert "internal error in the SFT engine" in result.results[0].message


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("timm/not_a_model_at_all", "is not a timm model"),
        ("resnet_nine", "is not a valid choice"),
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        ("check_model_nets:missing", "has no function 'missing'"),
        ("check_model_nets:not_a_model", "returned str, not a torch.nn.Module"),
        ("does/not/exist.py:build", "does not exist"),
    ],
)
def test_bad_names_exit_2_with_a_clear_message(name: str, said: str) -> None:
    res = invoke("check-model", name, *SMALL)
    assert res.exit_code == 2, res.output
    assert said in res.output and "hint:" in res.output


def test_bad_size_exits_2() -> None:
    res = invoke("check-model", "tiny", "--size", "big")
    assert res.exit_code == 2 and "--size 'big'" in res.output
