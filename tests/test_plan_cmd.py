"""`wsitrain plan`: the plan's own text and JSON plus the command's envelope; bad input is one clear error."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from wsitrain.errors import WsiTrainError
from wsitrain.gpus import GPU_NAMES, GPU_PRESETS, gpu_preset, resolve_budget
from wsitrain.models import MODEL_NAMES
from wsitrain.plan.command import parse_size, run_plan
from wsitrain.units import format_bytes, parse_bytes

GiB = 1024**3


def _run(as_json: bool, **kw) -> tuple[int, str]:
    buf = io.StringIO()
    console = Console(file=buf, width=250, color_system=None)
    args = dict(model="vgg16", size="20480", gpu="2080ti", memory=None, batch=1, precision="fp32", tile=None)
    args.update(kw)
    code = run_plan(**args, as_json=as_json, console=console)
    return code, buf.getvalue()


@pytest.fixture(scope="module")
def vgg16_2080ti() -> tuple[int, str, int, dict]:
    code_text, text = _run(False)
    code_json, out = _run(True)
    return code_text, text, code_json, json.loads(out)


def test_vgg16_20480_fits_a_2080ti(vgg16_2080ti) -> None:
    code_text, text, code_json, out = vgg16_2080ti
    assert code_text == 0 and code_json == 0
    # the command's envelope; predicted_seconds: the plan's time in seconds where the time model is a preset's clock
    assert set(out) == {"budget_source", "gpu", "precision", "max_size", "time_model", "predicted_seconds", "plan"}
    assert out["predicted_seconds"] > 0 and "the simulated clock's constants, 2080ti preset" in out["time_model"]
    facts = out["plan"]
    assert facts["fits"] is True and ": fits" in text
    usable = GPU_PRESETS["2080ti"].usable_bytes  # 10.76 GiB the driver reports minus the CUDA context
    assert facts["budget_bytes"] == usable and out["gpu"] == "2080ti" and "2080 Ti" in out["budget_source"]
    assert "usable 10.47 GiB of nominal 11.00 GiB" in text and facts["target"]["generation"] == "volta-turing"
    assert facts["estimated_peak_bytes"] <= facts["budget_bytes"] < facts["baseline_peak_bytes"]
    for key in ("fits", "budget_bytes", "estimated_peak_bytes", "baseline_peak_bytes", "checkpoint_peak_bytes",
                "feature_map_bytes", "overhead", "segments"):  # fmt: skip
        assert key in facts, key
    assert out["max_size"] >= 20480 and out["max_size"] % 32 == 0
    assert facts["segments"] and all(
        {"layers", "tile_grid", "tile_shape", "halo"} <= set(s) and len(s["tile_grid"]) == 2 for s in facts["segments"]
    )


def test_text_states_the_json_facts(vgg16_2080ti) -> None:
    _, text, _, out = vgg16_2080ti
    facts = out["plan"]
    for key in ("budget_bytes", "estimated_peak_bytes", "baseline_peak_bytes", "checkpoint_peak_bytes"):
        assert format_bytes(facts[key]) in text, key
    assert f"{out['max_size']} x {out['max_size']} px" in text
    assert f"budget source: {out['budget_source']}" in text and "gpu preset: 2080ti" in text
    assert f"{facts['overhead'] * 100:+.1f}%" in text
    assert f"({facts['checkpoint_segments']} segments)" in text
    seg_lines = [line for line in text.splitlines() if line.lstrip().startswith("segment ")]
    assert len(seg_lines) == len(facts["segments"])
    for line, seg in zip(seg_lines, facts["segments"], strict=True):
        assert seg["layers"][0] in line and seg["layers"][-1] in line
        if seg["mode"] == "tiled":
            rows, cols = seg["tile_grid"]
            assert f"tiled {rows}x{cols}" in line
            assert "x".join(map(str, seg["tile_shape"])) in line and "/".join(map(str, seg["halo"])) in line


def test_does_not_fit_exit_code_and_json_agree() -> None:
    code, out = _run(True, model="tiny", size="1024", gpu=None, memory="100KiB")
    report = json.loads(out)
    assert code == 1 and report["plan"]["fits"] is False and report["max_size"] == 0 and report["gpu"] is None
    code, text = _run(False, model="tiny", size="1024", gpu=None, memory="100KiB")
    assert code == 1 and "DOES NOT FIT" in text and "no square image fits" in text
    assert "budget source: --memory 100KiB" in text


def test_no_max_size_skips_the_largest_square_search(monkeypatch) -> None:  # noqa: ANN001
    import wsitrain.plan.command as command

    def refuse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the largest-square search ran")

    monkeypatch.setattr(command, "max_square_size", refuse)
    code, out = _run(True, model="tiny", size="1024", gpu=None, memory="100KiB", with_max_size=False)
    assert code == 1 and json.loads(out)["max_size"] is None  # the plan's own answer stands: it does not fit
    code, text = _run(False, model="tiny", size="1024", gpu=None, memory="2GiB", with_max_size=False)
    assert code == 0 and "square image" not in text
    from typer.testing import CliRunner

    from wsitrain.cli import app

    r = CliRunner().invoke(app, ["plan", "--model", "tiny", "--size", "1024", "--memory", "2GiB", "--no-max-size",
                                 "--json"])  # fmt: skip
    assert r.exit_code == 0 and json.loads(r.output)["max_size"] is None


def test_rectangular_size_and_memory_override() -> None:
    code, out = _run(True, model="tiny", size="256x512", gpu=None, memory="2GiB")
    facts = json.loads(out)["plan"]
    assert code == 0 and facts["input_shape"] == [1, 3, 256, 512] and facts["budget_bytes"] == 2 * GiB


def test_huge_size_plans_from_shapes_only() -> None:
    # 100000 x 100000 x 3 float32 would be 120 GB: the plan must come from shapes on the meta device.
    code, out = _run(True, model="tiny", size="100000", gpu="h100")
    facts = json.loads(out)["plan"]
    assert facts["input_shape"] == [1, 3, 100000, 100000] and code in (0, 1)


def _one_line_error(**kw) -> WsiTrainError:
    with pytest.raises(WsiTrainError) as info:
        _run(False, **kw)
    err = info.value
    assert err.exit_code == 2 and "\n" not in err.message
    return err


def test_unknown_gpu_lists_presets() -> None:
    err = _one_line_error(gpu="gtx480")
    assert "gtx480" in err.message and all(name in err.hint for name in GPU_NAMES)


def test_unknown_model_lists_models() -> None:
    err = _one_line_error(model="vgg61")
    text = f"{err.message} {err.hint}"
    assert "vgg61" in err.message and all(name in text for name in MODEL_NAMES) and "torchvision/<name>" in text


@pytest.mark.parametrize("size", ["0", "-512", "16", "abc", "512x", "20x20x20"])
def test_bad_size(size: str) -> None:
    err = _one_line_error(size=size)
    assert "--size" in err.message


def test_size_below_stride_names_the_stride() -> None:
    assert "stride of 32" in _one_line_error(size="16").message


@pytest.mark.parametrize("memory", ["lots", "12 parsecs", "-1GiB", "0"])
def test_bad_memory(memory: str) -> None:
    assert "--memory" in _one_line_error(memory=memory).message


def test_bad_precision_batch_tile() -> None:
    assert "--precision" in _one_line_error(precision="fp8").message
    assert "--batch" in _one_line_error(batch=0).message
    assert "--tile" in _one_line_error(tile=-4).message


def test_parse_size() -> None:
    assert parse_size("20480", 32, "vgg16") == (20480, 20480)
    assert parse_size("1024X2048", 32, "vgg16") == (1024, 2048)
    assert parse_size(" 64 ", 16, "tiny") == (64, 64)


def test_gpu_presets() -> None:
    # budgets are usable memory: the driver's total minus the CUDA context of the card's generation
    assert GPU_PRESETS["2080ti"].nominal_bytes == 11 * GiB and GPU_PRESETS["h100"].nominal_bytes == 80 * GiB
    assert GPU_PRESETS["2080ti"].memory_bytes == int(10.76 * GiB) - 300 * 2**20
    assert GPU_PRESETS["h100"].memory_bytes == 85_017_493_504 - 1024 * 2**20  # both measured on an H100
    for p in GPU_PRESETS.values():
        assert 0.85 * p.nominal_bytes < p.usable_bytes < p.total_bytes <= p.nominal_bytes * 1.001
    assert {"2080ti", "t4", "v100-16", "v100-32", "a100-40", "a100-80", "rtx3090", "rtx4090", "a6000", "l40s",
            "h100", "h200"} == set(GPU_NAMES)  # fmt: skip
    assert gpu_preset("A100_80").name == "a100-80"
    b = resolve_budget("2080ti", "24GiB")  # --memory wins over the preset's figure
    assert b.bytes == 24 * GiB and b.device == "cuda"
    assert resolve_budget("cpu", None).device == "cpu"


def test_run_budget_is_the_config_value_or_one_detection() -> None:
    import torch

    from wsitrain.gpus import run_budget
    from wsitrain.memory import SAFETY_MARGIN, DeviceMemory

    calls: list[str] = []

    def probe(device: torch.device | str) -> DeviceMemory:
        calls.append(str(device))
        return DeviceMemory(free=6 * GiB, held=2 * GiB)  # the caching allocator's reserve counts as ours

    cpu = torch.device("cpu")
    b = run_budget(None, cpu, probe=probe)
    assert b.bytes == int(8 * GiB * SAFETY_MARGIN) and "detected" in b.source and calls == ["cpu"]
    given = run_budget("3GiB", cpu, probe=probe)
    assert given.bytes == 3 * GiB and given.source == "engine.memory_budget 3GiB" and calls == ["cpu"]
    assert "3.00 GiB" in given.describe()


# ---- --simulate -----------------------------------------------------------------------------------
# The two real simulations below take 10-14 s each (measured): CI runs them (`make test-heavy`), `make test` does not.
@pytest.mark.heavy
def test_simulate_runs_one_step_and_reports_it_beside_the_plan() -> None:
    code, out = _run(True, model="tiny", size="4096", memory="200MiB", simulate=True)
    d = json.loads(out)
    sim = d["simulated"]
    assert code == 0 and d["plan"]["fits"]
    assert 0 < sim["device_peak"]["bytes"] <= sim["budget_bytes"] == d["plan"]["budget_bytes"]
    assert sim["replayed_peak_bytes"] == d["plan"]["replayed_peak_bytes"] > 0
    assert abs(sim["over_replay"]) <= 0.03 and sim["within_budget"] and sim["host_within_plan"]
    assert sim["stream_order"] == "checked" and sim["accesses_checked"] > 0
    code, text = _run(False, model="tiny", size="4096", memory="200MiB", simulate=True)
    assert code == 0 and "device peak, simulated:" in text and "not simulated:" in text


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"gpu": "cpu", "memory": "1GiB"}, "needs a GPU budget"),
        # bf16 is timed (not memory-simulated) on presets with speed constants; the A6000 has none
        ({"precision": "bf16", "gpu": "a6000"}, "float32 steps only"),
    ],
)
def test_simulate_refuses_what_it_cannot_simulate(kw: dict, message: str) -> None:
    with pytest.raises(WsiTrainError, match=message):
        _run(False, model="tiny", size="1024", simulate=True, **kw)


@pytest.mark.heavy
def test_simulate_bf16_times_the_bf16_plan_on_a_preset() -> None:
    """bf16 on a preset with speed constants: the bf16 plan's simulated time and plain's; memory said unsimulated."""
    code, out = _run(True, model="tiny", size="1024", gpu="h100", memory="170MiB", precision="bf16", simulate=True)
    d = json.loads(out)
    clock = d["clock"]
    assert code == 0 and "simulated" not in d and d["precision"] == "bf16"
    assert clock["sft"]["precision"] == "bf16" and clock["sft"]["seconds"] > 0 and clock["plain"]["seconds"] > 0
    assert clock["slowdown"] == pytest.approx(clock["sft"]["seconds"] / clock["plain"]["seconds"])
    assert clock["plan_slowdown"] == d["plan"]["slowdown"]
    # patch training as users run it (issue 57): 256 patches of 224 px, and the whole slide's share of its Mpx/s
    patches = clock["patch_training"]
    assert (patches["patches"], patches["patch"]) == (256, 224) and patches["seconds"] > 0
    assert patches["mpx_s"] == pytest.approx(256 * 224 * 224 / patches["seconds"] / 1e6)
    assert clock["whole_slide_mpx_s"] == pytest.approx(1024 * 1024 / clock["sft"]["seconds"] / 1e6)
    assert clock["share_of_patch_training"] == pytest.approx(clock["whole_slide_mpx_s"] / patches["mpx_s"])
    # tiny_bn's BatchNorm folds: the step prices no BatchNorm kernel, patch training (batch statistics) does
    _, out = _run(True, model="tiny_bn", size="1024", gpu="h100", memory="170MiB", precision="bf16", simulate=True)
    bn = json.loads(out)["clock"]
    assert bn["sft"]["norm_kernels"] == 0 and bn["sft"]["unused_constants"] == ["norm_efficiency",
                                                                              "norm_backward_efficiency"]
    assert bn["patch_training"]["norm_kernels"] > 0 and bn["patch_training"]["unused_constants"] == []
    _, off = _run(True, model="tiny_bn", size="1024", gpu="h100", memory="170MiB", precision="bf16", simulate=True,
                  fold_bn=False)  # fmt: skip
    assert json.loads(off)["clock"]["sft"]["norm_kernels"] > 0
    _, text = _run(False, model="tiny", size="1024", gpu="h100", memory="170MiB", precision="bf16", simulate=True)
    assert "memory: not simulated in bf16" in text and "simulated step time on the h100 preset (bf16)" in text
    assert "of patch training's" in text


@pytest.mark.parametrize(
    ("model", "size", "gpu", "memory"),
    [("tiny", "4096", None, "100KiB"), ("resnet18", "8192", "2080ti", "300MiB")],
)
def test_does_not_fit_names_a_budget_that_fits(model: str, size: str, gpu: str | None, memory: str) -> None:
    """The figure "needs at least X" prints is what to give --memory: copied as printed, the plan fits. (Without the
    largest-square search, each a dozen plans more: the vgg16 cases above and test_no_max_size_... cover it.)"""
    kw = {"model": model, "size": size, "gpu": gpu, "with_max_size": False}
    code, text = _run(False, memory=memory, **kw)
    m = re.search(r"DOES NOT FIT: needs at least ([0-9.]+ [KMGT]?i?B)", text)
    assert code == 1 and m, text
    _, out = _run(True, memory=memory, **kw)
    assert json.loads(out)["plan"]["min_budget_bytes"] == parse_bytes(m.group(1))
    code, text = _run(False, memory=m.group(1), **kw)
    assert code == 0 and ": fits" in text


def test_plan_holds_the_optimizer_fit_trains_with() -> None:
    """`wsitrain plan` plans AdamW's state and step as `fit` (and `plan --simulate`) do: the plan printed is the plan
    a run executes. Before, it planned without an optimizer, and an H200 ran another plan than the one printed."""
    from wsitrain.plan.command import DEFAULT_OPTIMIZER, make_plan
    from wsitrain.sft.plan_api import plan as plan_model

    report = make_plan(model="tiny", size="512", gpu=None, memory="64MiB", with_max_size=False)
    assert DEFAULT_OPTIMIZER == "adamw" and report.plan.breakdown["optimizer"] > 0
    import torch

    from wsitrain.models import build

    with torch.device("meta"):
        net = build("tiny", 2)
    budget = resolve_budget(None, "64MiB")
    kw = {"input_shape": (1, 3, 512, 512), "memory_budget": budget.bytes, "device": budget.device,
          "target": budget.target, "input_dtype": torch.uint8}  # fmt: skip
    with_adamw = plan_model(net, optimizer="adamw", **kw)
    assert report.plan.breakdown == with_adamw.breakdown
    assert plan_model(net, **kw).breakdown["optimizer"] == 0  # the library's own default stays "no optimizer"
