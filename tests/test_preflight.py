"""Preflight: every slide opened, every shape bucket planned, every problem named at once, before a run folder."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import tifffile
from rich.console import Console
from typer.testing import CliRunner

import wsitrain.preflight as pf
from wsitrain.cli import app
from wsitrain.config import WsiTrainConfig
from wsitrain.preflight import PreflightError, random_batchnorm_warnings, run_preflight, slide_shape
from wsitrain.slides.stream import read_slide_region
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.units import parse_bytes

MiB = 2**20
# The tiny model on CPU (adamw, fp32): a 256 px slide plans within 15 MiB, a 1024 px one needs ~17 MiB.
BUDGET = "15MiB"
runner = CliRunner()


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Slides: two fine ones, one too large for BUDGET, one without mpp, one that is not a slide; labels.csv."""
    d = tmp_path_factory.mktemp("cohort")
    write_synthetic_slide(d / "good.svs", size=256, positive=True, seed=1)
    write_synthetic_slide(d / "good2.svs", size=320, positive=False, seed=2)
    write_synthetic_slide(d / "big.svs", size=1024, positive=False, seed=3)
    tifffile.imwrite(d / "nompp.tif", np.full((300, 400, 3), 200, np.uint8))  # no resolution tags: no mpp
    (d / "broken.svs").write_bytes(b"this is not a slide\n" * 50)
    rows = ["slide,label", "good.svs,positive", "good2.svs,negative", "big.svs,negative", "nompp.tif,positive",
            "broken.svs,negative"]  # fmt: skip
    (d / "labels.csv").write_text("\n".join(rows) + "\n")
    (d / "good-labels.csv").write_text("\n".join(rows[:3]) + "\n")
    return d


def make_cfg(cohort: Path, labels: str = "labels.csv", **data: object) -> WsiTrainConfig:
    raw = {
        "data": {"labels": str(cohort / labels), "mpp": 0.5, "region": "whole", **data},
        "model": {"name": "tiny"},
        "engine": {"memory_budget": BUDGET, "device": "cpu"},
    }
    return WsiTrainConfig.model_validate(raw)


def subjects(err: PreflightError) -> list[str]:
    return [p.subject for p in err.problems]


def test_three_bad_slides_named_in_one_error(cohort: Path) -> None:
    cfg = make_cfg(cohort)
    with pytest.raises(PreflightError) as info:
        run_preflight(cfg, 15 * MiB, "cpu")
    err = info.value
    assert err.exit_code == 2
    assert sorted(subjects(err)) == ["big.svs", "broken.svs", "nompp.tif"]
    by = {p.subject: p for p in err.problems}
    assert "does not fit engine.memory_budget 15.00 MiB" in by["big.svs"].message
    assert "1024 x 1024" in by["big.svs"].message
    assert "no mpp" in by["nompp.tif"].message and "data.fallback_mpp" in by["nompp.tif"].hint
    assert "not a readable slide" in by["broken.svs"].message
    text = str(err)
    assert "3 problems" in text and all(name in text for name in ("big.svs", "nompp.tif", "broken.svs"))
    assert "good.svs" not in text
    # The report travels with the error: the good slides were measured and planned.
    assert {s.slide for s in err.report.slides} == {"good.svs", "good2.svs", "big.svs"}


def test_too_big_slide_names_the_budget_that_fits(cohort: Path) -> None:
    """The figure the message and hint give is a budget under which the slide plans: not the best plan's peak."""
    cfg = make_cfg(cohort)
    with pytest.raises(PreflightError) as info:
        run_preflight(cfg, 15 * MiB, "cpu")
    big = next(p for p in info.value.problems if p.subject == "big.svs")
    m = re.search(r"raise engine.memory_budget to at least ([0-9.]+ [KMGT]?i?B)", big.hint)
    assert m and f"needs at least {m.group(1)}" in big.message, (big.message, big.hint)
    with pytest.raises(PreflightError) as info:  # the broken slides remain; the big one fits now
        run_preflight(cfg, parse_bytes(m.group(1)), "cpu")
    assert sorted(subjects(info.value)) == ["broken.svs", "nompp.tif"]


def test_too_big_slide_on_cpu_names_stream_tiles_when_it_fits(cohort: Path) -> None:
    """On CPU the whole image counts inside the budget: the hint names data.stream_tiles with the streamed plan's
    peak, and that setting does make the slide plan within the same budget."""
    with pytest.raises(PreflightError) as info:
        run_preflight(make_cfg(cohort), 15 * MiB, "cpu")
    big = next(p for p in info.value.problems if p.subject == "big.svs")
    assert big.hint.startswith("set data.stream_tiles: true"), big.hint
    assert re.search(r"planned peak of ([0-9.]+) MiB", big.hint)
    with pytest.raises(PreflightError) as info:  # the broken slides remain; the big one fits when streamed
        run_preflight(make_cfg(cohort, stream_tiles=True), 15 * MiB, "cpu")
    assert sorted(subjects(info.value)) == ["broken.svs", "nompp.tif"]


def test_fit_fails_in_preflight_and_creates_no_run_folder(cohort: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    logs = tmp_path / "logs"
    config.write_text(
        f"data: {{labels: {cohort / 'labels.csv'}, mpp: 0.5, region: whole}}\nmodel: {{name: tiny}}\n"
        f"engine: {{memory_budget: {BUDGET}, device: cpu}}\ntrain: {{epochs: 1}}\nlog: {{dir: {logs}}}\n"
    )
    result = runner.invoke(app, ["fit", str(config)], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    for name in ("big.svs", "nompp.tif", "broken.svs"):
        assert name in result.output
    assert "Traceback" not in result.output
    assert not logs.exists() or not any(logs.iterdir()), "a run folder was created before the preflight failed"


def test_validate_runs_preflight(cohort: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        f"data: {{labels: {cohort / 'labels.csv'}, mpp: 0.5, region: whole}}\nmodel: {{name: tiny}}\n"
        f"engine: {{memory_budget: {BUDGET}, device: cpu}}\n"
    )
    env = {"COLUMNS": "200", "NO_COLOR": "1"}
    bad = runner.invoke(app, ["validate", str(config), "--shapes-only"], env=env)
    assert bad.exit_code == 2 and "is valid" not in bad.output
    assert all(name in bad.output for name in ("big.svs", "nompp.tif", "broken.svs"))
    good = runner.invoke(app, ["validate", str(config), "--set", f"data.labels={cohort / 'good-labels.csv'}"], env=env)
    assert good.exit_code == 0, good.output
    assert "is valid" in good.output and "preflight: 2 slides in 2 shape buckets" in good.output
    assert "320 x 320" in good.output  # the bucket table


def test_every_slide_fits_its_bucket_and_buckets_are_planned(cohort: Path) -> None:
    report = run_preflight(make_cfg(cohort, "good-labels.csv"), 15 * MiB, "cpu")
    assert report.ok and report.seconds > 0
    assert {s.slide: s.shape for s in report.slides} == {"good.svs": (256, 256), "good2.svs": (320, 320)}
    for s in report.slides:
        assert s.bucket[0] >= s.shape[0] and s.bucket[1] >= s.shape[1]
        assert s.bucket[0] % 16 == 0 and s.bucket[1] % 16 == 0  # the tiny model's stride
    assert all(b.plan is not None and b.plan.fits for b in report.buckets)
    assert {b.bucket for b in report.buckets} == {s.bucket for s in report.slides}
    assert 0 < report.host_needed_bytes <= report.host_available_bytes


@pytest.mark.parametrize(
    "data",
    [
        {"region": "whole", "mpp": 0.5},
        {"region": "tissue", "mpp": 1.0},
        {"region": "tissue", "mpp": None, "level": 1},
        {"region": "fixed", "size": [200, 300], "mpp": 0.5},
    ],
)
def test_shape_matches_what_the_reader_reads(cohort: Path, data: dict) -> None:
    """The preflight's shape arithmetic is the reader's: read the slide for real and compare."""
    cfg = make_cfg(cohort, **data)
    path = cohort / "big.svs"
    got = slide_shape(cfg, path, 16)
    assert not isinstance(got, pf.Problem), got
    d = cfg.data
    size = tuple(d.size) if isinstance(d.size, list) else d.size
    read = read_slide_region(path, level=d.level, mpp=d.mpp, region=d.region, size=size, pad_multiple=16)
    assert got.shape == tuple(read.image.shape[-2:])
    assert got.level == read.level


def test_shapes_only_plans_the_whole_level(cohort: Path) -> None:
    cfg = make_cfg(cohort, region="tissue")
    tissue = slide_shape(cfg, cohort / "big.svs", 16)
    whole = slide_shape(cfg, cohort / "big.svs", 16, shapes_only=True)
    assert not isinstance(tissue, pf.Problem) and not isinstance(whole, pf.Problem)
    assert whole.shape == (1024, 1024)
    assert tissue.shape[0] < 1024 or tissue.shape[1] < 1024  # the synthetic tissue does not fill the slide


def test_level_that_does_not_exist_is_named(cohort: Path) -> None:
    got = slide_shape(make_cfg(cohort, mpp=None, level=5), cohort / "good.svs", 16)
    assert isinstance(got, pf.Problem)
    assert got.subject == "good.svs" and "level 5 does not exist" in got.message and "data.level" in got.hint


def test_budget_too_small_is_one_problem_about_the_key(cohort: Path) -> None:
    with pytest.raises(PreflightError) as info:
        run_preflight(make_cfg(cohort, "good-labels.csv"), 1 * MiB, "cpu")
    assert subjects(info.value) == ["engine.memory_budget"]
    assert "less than the model alone needs" in info.value.problems[0].message
    # the hint names the least budget that fits, and with it the same slides pass
    least = info.value.problems[0].hint.split("to at least ")[1].split(" (")[0]
    run_preflight(make_cfg(cohort, "good-labels.csv"), parse_bytes(least), "cpu")


def test_forced_checkpoint_that_is_not_a_cut_point(cohort: Path) -> None:
    cfg = make_cfg(cohort, "good-labels.csv")
    cfg.engine.checkpoints = ["features.relu1", "features.nope"]
    with pytest.raises(PreflightError) as info:
        run_preflight(cfg, 15 * MiB, "cpu")
    assert subjects(info.value) == ["engine.checkpoints"]  # once, not once per bucket
    assert "['features.nope'] are not cut points" in info.value.problems[0].message
    assert "valid: normalize, features.conv1" in info.value.problems[0].hint


def test_train_mode_batchnorm_is_tiled_in_sweeps(cohort: Path) -> None:
    """Training-mode BatchNorm no longer blocks tiling: multi-pass segments tile it."""
    raw = make_cfg(cohort, "good-labels.csv").model_dump()
    raw["model"] = {"name": "resnet18", "freeze_bn": False}
    raw["engine"]["tile_size"] = 128
    cfg = WsiTrainConfig.model_validate(raw)
    run_preflight(cfg, 2**30, "cpu")  # raises PreflightError on any problem


def test_missing_weights_file_is_named(cohort: Path, tmp_path: Path) -> None:
    cfg = make_cfg(cohort, "good-labels.csv")
    cfg.model.weights = tmp_path / "absent.pt"
    with pytest.raises(PreflightError) as info:
        run_preflight(cfg, 15 * MiB, "cpu")
    assert subjects(info.value) == ["model.weights"]


def test_host_memory_for_the_largest_slide(cohort: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pf, "available_host_bytes", lambda: 100_000)
    with pytest.raises(PreflightError) as info:
        # For a GPU only the images stay on the host: the larger slide needs the most.
        run_preflight(make_cfg(cohort, "good-labels.csv"), 2**30, "cuda")
    (problem,) = info.value.problems
    assert problem.subject == "good2.svs"
    assert "320 x 320 px" in problem.message and "97.66 KiB is available" in problem.message
    assert "data.prefetch" in problem.hint


def test_host_bytes_count_images_and_the_cpu_plan(cohort: Path) -> None:
    report = run_preflight(make_cfg(cohort, "good-labels.csv"), 15 * MiB, "cpu")
    bucket = report.buckets[-1]
    h, w = bucket.bucket
    cfg = make_cfg(cohort, "good-labels.csv")
    assert pf.host_bytes_needed(cfg, bucket, "cuda") == 2 * 3 * h * w  # this slide and the one read ahead
    assert pf.host_bytes_needed(cfg, bucket, "cpu") == 3 * h * w + bucket.plan.estimated_peak_bytes
    cfg.data.prefetch = False
    assert pf.host_bytes_needed(cfg, bucket, "cuda") == 3 * h * w


def test_rot90_plans_the_transposed_bucket_too(cohort: Path) -> None:
    cfg = make_cfg(cohort, "good-labels.csv", region="fixed", size=[128, 256], mpp=0.5)
    report = run_preflight(cfg, 15 * MiB, "cpu")
    assert {b.bucket for b in report.buckets} == {(128, 256), (256, 128)}
    # the summary says what a bucket is, and why a slide is in two
    assert report.summary().startswith("preflight: 2 slides in 2 shape buckets (a bucket is an input shape slides are "
                                       "padded up to, planned once for all of them: 1 as the slides are read and 1 "
                                       "turned a quarter by data.augment.rot90), each planned within")
    cfg.data.augment.rot90 = False
    report = run_preflight(cfg, 15 * MiB, "cpu")
    assert {b.bucket for b in report.buckets} == {(128, 256)}
    assert report.summary().startswith("preflight: 2 slides in 1 shape bucket, each planned within")


def test_progress_bar_appears_when_slow(cohort: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pf, "PROGRESS_DELAY_S", 0.0)
    out = io.StringIO()
    run_preflight(make_cfg(cohort, "good-labels.csv"), 15 * MiB, "cpu",
                  progress=Console(file=out, force_terminal=True, width=100))  # fmt: skip
    assert "preflight: reading slides" in out.getvalue()


def test_cuda_plan_stages_the_image_on_the_host(cohort: Path) -> None:
    """Planning for a GPU works on a machine without one (shapes only) and keeps the image off the device."""
    report = run_preflight(make_cfg(cohort, "good-labels.csv"), 2**30, "cuda")
    assert all(b.plan is not None and b.plan.input_on_host and b.plan.device == "cuda" for b in report.buckets)
    assert report.device == "cuda"


def test_no_objective_power_for_a_magnification_is_named(cohort: Path) -> None:
    got = slide_shape(make_cfg(cohort, mpp=None, magnification=10), cohort / "nompp.tif", 16)
    assert isinstance(got, pf.Problem) and got.subject == "nompp.tif"
    assert "neither objective power" in got.message and "data.fallback_mpp" in got.hint


def test_bucket_null_plans_each_shape_rounded_to_the_stride(cohort: Path) -> None:
    cfg = make_cfg(cohort, "good-labels.csv", bucket=None, mpp=0.7)  # 256 and 320 px at 0.5 um: 183 and 229 px
    report = run_preflight(cfg, 15 * MiB, "cpu")
    assert {s.slide: s.bucket for s in report.slides} == {"good.svs": (192, 192), "good2.svs": (240, 240)}
    cfg.data.bucket = 1  # one edge per doubling: powers of two (in stride units)
    assert {s.bucket for s in run_preflight(cfg, 15 * MiB, "cpu").slides} == {(256, 256)}


@pytest.mark.parametrize(
    ("model", "warned"),
    [
        ({"name": "resnet18"}, True),  # random weights, BatchNorm frozen at them: the default
        ({"name": "resnet18", "freeze_bn": False}, False),  # BatchNorm trains: it normalises each slide
        ({"name": "tiny"}, False),  # no BatchNorm
    ],
)
def test_frozen_batchnorm_on_random_weights_is_warned(cohort: Path, model: dict, warned: bool) -> None:
    """ResNet-18 from random weights with its BatchNorm frozen started at a loss of 37 to 290,000 (measured): the
    preflight says so, and names both ways out; validate prints it."""
    cfg = make_cfg(cohort, "good-labels.csv").model_copy(update={"model": make_cfg(cohort).model.model_validate(model)})
    report = run_preflight(cfg, parse_bytes("2GiB"), "cpu", shapes_only=True)  # ResNet-18's weights need more
    lines = [w for w in report.warnings if "BatchNorm layers are frozen" in w]
    assert len(lines) == warned
    if warned:
        assert "resnet18's 20 BatchNorm layers" in lines[0] and "model.weights: imagenet" in lines[0]
        assert "model.freeze_bn: false with model.bn_stats: slide" in lines[0]
    with_weights = cfg.model_copy(update={"model": cfg.model.model_copy(update={"weights": cohort / "w.pt"})})
    assert not random_batchnorm_warnings(with_weights, pf._meta_model(with_weights, 2))  # pretrained statistics


@pytest.mark.parametrize(
    ("model", "warned"),
    [
        ({"name": "tiny_bn", "freeze_bn": False}, True),  # trains on each slide, predicts on running averages
        ({"name": "tiny_bn", "freeze_bn": False, "bn_stats": "slide"}, False),  # each slide's own, both ways
        ({"name": "tiny_bn"}, False),  # frozen (the default): the same statistics both ways
        ({"name": "tiny", "freeze_bn": False}, False),  # no BatchNorm
    ],
)
def test_batchnorm_that_predicts_on_running_averages_is_warned(cohort: Path, model: dict, warned: bool) -> None:
    cfg = make_cfg(cohort, "good-labels.csv").model_copy(update={"model": make_cfg(cohort).model.model_validate(model)})
    report = run_preflight(cfg, parse_bytes("2GiB"), "cpu", shapes_only=True)
    lines = [w for w in report.warnings if "predict with their running averages" in w]
    assert len(lines) == warned
    if warned:
        assert "tiny_bn's 4 BatchNorm layers" in lines[0] and "set model.bn_stats: slide" in lines[0]


def test_validate_prints_the_random_batchnorm_warning(cohort: Path, tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        f"data: {{labels: {cohort / 'good-labels.csv'}, mpp: 0.5, region: whole}}\nmodel: {{name: resnet18}}\n"
        "engine: {memory_budget: 2GiB, device: cpu}\n"
    )
    res = runner.invoke(app, ["validate", str(config), "--shapes-only"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    assert "warning: model: resnet18's 20 BatchNorm layers are frozen" in res.output


def test_fit_quiet_keeps_the_preflight_warnings(cohort: Path, tmp_path: Path) -> None:
    """fit --quiet drops the setup chatter (the preflight's summary) but not its warnings."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"data: {{labels: {cohort / 'good-labels.csv'}, mpp: 0.5, region: whole}}\nmodel: {{name: resnet18}}\n"
        f"engine: {{memory_budget: 2GiB, device: cpu}}\ntrain: {{epochs: 1}}\nlog: {{dir: {tmp_path / 'runs'}}}\n"
    )
    res = runner.invoke(app, ["--quiet", "fit", str(config)], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    assert "warning: model: resnet18's 20 BatchNorm layers are frozen" in res.output
    assert "preflight: 2 slides" not in res.output
