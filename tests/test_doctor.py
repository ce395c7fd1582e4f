"""`wsitrain doctor` on a CPU (fast mode), time-model calibration files (round trip, picked up by plan and fit for
the matching device only, a bad file is exit 2 naming it), and the doctor's verdicts on GPU figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from wsitrain.cli import app
from wsitrain.doctor import checks
from wsitrain.doctor.calibrate import fit_constants
from wsitrain.errors import WsiTrainError
from wsitrain.models import build
from wsitrain.plan.command import make_plan
from wsitrain.sft.planning.calibration import (
    CALIBRATION_ENV,
    CLOCK_SOURCE,
    Calibration,
    calibration_path,
    cpu_name,
    read_calibration,
    time_model_for,
    write_calibration,
)
from wsitrain.sft.planning.costs import DEFAULT_TIME_MODEL, default_time_model

H100 = "NVIDIA H100 80GB HBM3"
runner = CliRunner()


def cal_for(name: str, device: str = "cuda", byte_flops: float = 40.0, call_flops: float = 3e8) -> Calibration:
    return Calibration(device_name=name, device=device, date="2026-11-23", byte_flops=byte_flops,
                       call_flops=call_flops, tile_call_flops=0.0, flops_per_second=5e13)  # fmt: skip


@pytest.fixture
def cal_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "calibration"
    monkeypatch.setenv(CALIBRATION_ENV, str(folder))
    return folder


def test_doctor_on_cpu_fast_reports_what_it_could_not_check(tmp_path: Path, cal_dir: Path) -> None:
    out = tmp_path / "report"
    res = runner.invoke(app, ["doctor", "--fast", "--cpu", "--calibrate", "--out", str(out)],
                        env={"COLUMNS": "200", "NO_COLOR": "1"})  # fmt: skip
    assert res.exit_code == 0, res.output
    md = (out / "doctor.md").read_text()
    report = json.loads((out / "doctor.json").read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["exactness on cpu (float64, tiled vs plain)"]["status"] == "passed"
    for gpu_check in ("exactness on cuda (float64, tiled vs plain)", "gpu tests (pytest -m gpu tests/test_gpu.py)",
                      "cuBLAS / cuDNN workspaces and headroom", "peak under a memory cap against the plan"):
        assert by_name[gpu_check]["status"] == "not run: no CUDA device"
        assert f"- {gpu_check}: not run: no CUDA device" in md
    assert "## Not checked on this machine" in md and "| exactness on cpu (float64, tiled vs plain) | passed |" in md
    # CPU calibration ran (asked for); fast mode writes it beside the report and not where the planner looks
    assert by_name["time model calibration"]["status"] == "measured"
    assert (out / calibration_path(cpu_name()).name).is_file() and not cal_dir.exists()
    assert "## Time model calibrated on cpu: " in md and "not installed" in md
    assert "doctor.md" in res.output


def test_doctor_without_calibrate_on_cpu_says_it_is_behind_the_flag(
    tmp_path: Path, cal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passed = checks.Check("exactness on cpu (float64, tiled vs plain)", "passed")
    monkeypatch.setattr("wsitrain.doctor.command.exactness", lambda device, size=128: passed)
    from wsitrain.doctor.command import run_doctor

    assert run_doctor(out=tmp_path, cpu=True, fast=True) == 0
    report = json.loads((tmp_path / "doctor.json").read_text())
    cal = [c for c in report["checks"] if c["name"] == "time model calibration"][0]
    assert cal["status"] == "not run: no CUDA device; CPU calibration is behind --calibrate"
    used = [c for c in report["checks"] if c["name"] == "time model plan and fit use"][0]
    assert used["figures"]["source"] == DEFAULT_TIME_MODEL and used["detail"].startswith(DEFAULT_TIME_MODEL)
    failing = checks.Check("exactness on cpu (float64, tiled vs plain)", "failed", "outputs differ")
    monkeypatch.setattr("wsitrain.doctor.command.exactness", lambda device, size=128: failing)
    assert run_doctor(out=tmp_path / "2", cpu=True, fast=True) == 1  # a failed check is exit 1
    assert "| **failed** | outputs differ |" in (tmp_path / "2" / "doctor.md").read_text()


def test_calibration_round_trips_and_matches_only_its_device(cal_dir: Path) -> None:
    path = write_calibration(cal_for(H100))
    assert path == cal_dir / "nvidia-h100-80gb-hbm3.json"
    assert read_calibration(path) == cal_for(H100)
    tm = time_model_for("cuda", H100)
    assert (tm.byte_flops, tm.call_flops, tm.tile_call_flops) == (40.0, 3e8, 0.0)
    assert tm.source == f"calibrated on {H100} on 2026-11-23"
    assert time_model_for("cuda", "NVIDIA A100-SXM4-80GB") == default_time_model("cuda")  # no file for it
    assert time_model_for("cuda", "nvidia h100 80gb hbm3") == default_time_model("cuda")  # same file, other name
    assert time_model_for("cpu", H100) == default_time_model("cpu")  # a GPU's constants never plan a CPU
    assert time_model_for("cuda", None).source == DEFAULT_TIME_MODEL


def test_doctor_names_the_time_model_plan_and_fit_use_on_a_card(cal_dir: Path) -> None:
    from wsitrain.doctor.command import time_model_in_use

    preset = time_model_in_use(torch.device("cuda"), H100)  # a device object only: no CUDA call
    assert preset.figures["source"].startswith(CLOCK_SOURCE) and "h100 preset" in preset.figures["source"]
    assert "simulated clock: the h100 preset's constants" in preset.detail
    write_calibration(cal_for(H100))
    calibrated = time_model_in_use(torch.device("cuda"), H100)
    assert calibrated.figures["source"] == f"calibrated on {H100} on 2026-11-23"
    assert calibrated.figures["byte_flops"] == 40.0 and "byte = 40 FLOPs" in calibrated.detail


def test_plan_uses_the_calibration_of_the_card_it_plans_for(cal_dir: Path) -> None:
    default = make_plan(model="vgg16", size="2048", gpu="2080ti", memory=None, with_max_size=False)
    # an uncalibrated preset plans with its simulated clock's constants (wsitrain/gpu_speed.py), which doctor refines
    assert default.time_model.startswith(CLOCK_SOURCE) and "doctor --calibrate" in default.time_model
    assert "2080ti preset" in default.time_model
    # a calibration for another card changes nothing
    write_calibration(cal_for(H100, byte_flops=500.0))
    assert make_plan(model="vgg16", size="2048", gpu="2080ti", memory=None, with_max_size=False).plan == default.plan
    write_calibration(cal_for("NVIDIA GeForce RTX 2080 Ti", byte_flops=500.0, call_flops=1e9))
    calibrated = make_plan(model="vgg16", size="2048", gpu="2080ti", memory=None, with_max_size=False)
    assert calibrated.time_model == "calibrated on NVIDIA GeForce RTX 2080 Ti on 2026-11-23"
    assert "time model: calibrated on NVIDIA GeForce RTX 2080 Ti on 2026-11-23" in str(calibrated)
    assert calibrated.to_dict()["time_model"] == calibrated.time_model
    assert calibrated.plan.time_plain > default.plan.time_plain  # bytes and calls cost more under these constants


def test_fit_engine_uses_this_devices_calibration(cal_dir: Path) -> None:
    from wsitrain.config import EngineConfig
    from wsitrain.models import build
    from wsitrain.train.engine import wrap_engine

    def engine():  # noqa: ANN202
        return wrap_engine(build("tiny", 2), EngineConfig(device="cpu"), torch.device("cpu"), 2**30, "sgd")

    assert engine().time_model == default_time_model("cpu")
    write_calibration(cal_for(cpu_name(), device="cpu", byte_flops=9.0, call_flops=2e6))
    tm = engine().time_model
    assert tm is not None and tm.byte_flops == 9.0 and tm.source.startswith(f"calibrated on {cpu_name()}")
    p = engine().plan_for((1, 3, 128, 128))
    ref = wrap_engine(build("tiny", 2), EngineConfig(device="cpu"), torch.device("cpu"), 2**30, "sgd")
    ref.time_model = default_time_model("cpu")
    assert p.time_plain != ref.plan_for((1, 3, 128, 128)).time_plain


@pytest.mark.parametrize(
    "text, problem",
    [("{not json", "cannot be read"), ('{"format": 1, "device_name": "x"}', "lacks"),
     ('[1, 2]', "not a wsitrain calibration"), (None, "byte_flops is -1")],
)  # fmt: skip
def test_bad_calibration_file_is_exit_2_naming_the_file(cal_dir: Path, text: str | None, problem: str) -> None:
    path = calibration_path(cpu_name())
    if text is None:
        write_calibration(cal_for(cpu_name(), device="cpu", byte_flops=-1.0))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    with pytest.raises(WsiTrainError, match=problem) as info:
        read_calibration(path)
    assert str(path) in info.value.message and "doctor --calibrate" in (info.value.hint or "")
    res = runner.invoke(app, ["plan", "--model", "tiny", "--size", "256", "--memory", "1GiB", "--gpu", "cpu"],
                        env={"COLUMNS": "300", "NO_COLOR": "1"})  # fmt: skip
    assert res.exit_code == 2, res.output
    assert str(path) in res.output.replace("\n", "") and problem in res.output


def test_least_squares_recovers_known_constants() -> None:
    truth = [1e-11, 2e-10, 1e-5]  # seconds per FLOP, byte, call
    terms = torch.tensor([[1e9, 1e6, 10], [1e7, 1e8, 20], [1e5, 1e4, 500], [5e8, 5e7, 100]], dtype=torch.float64)
    seconds = terms @ torch.tensor(truth, dtype=torch.float64)
    got = fit_constants(terms.numpy(), seconds.numpy())
    assert got == pytest.approx(truth, rel=1e-6)


# An H100's micro-model steps, as `wsitrain doctor` measured them (torch 2.11, TF32 convolutions): FLOPs, bytes and
# calls as the planner counts them, and the best step's seconds. Bytes and calls alone explain every row.
H100_ROWS = [
    (176076882436.0, 3230665752.0, 22.0, 0.0034231), (120057757956.0, 4869588504.0, 18.0, 0.0049383),
    (26306675204.0, 30639393816.0, 44.0, 0.0610360), (8925479940.0, 10478426136.0, 32.0, 0.0134854),
    (26165316.0, 23826840.0, 248.0, 0.0088350), (1062731908.0, 510198552.0, 168.0, 0.0074433),
    (19657654788.0, 2739145752.0, 20.0, 0.0062176), (697915410436.0, 3223597080.0, 22.0, 0.0047337),
    (700046115844.0, 6451894296.0, 22.0, 0.0066648),
]  # fmt: skip


def test_a_fast_gpu_still_gets_a_flop_rate() -> None:
    """Where FLOPs explain none of the times, the fastest FLOP-bound step sets the rate (not 0 FLOP/s, as the
    clamped least squares gave on the H100), and bytes and calls are fitted to the rest, non-negative."""
    rows = torch.tensor(H100_ROWS, dtype=torch.float64).numpy()
    terms, seconds = rows[:, :3], rows[:, 3]
    sec_flop, sec_byte, sec_call = fit_constants(terms, seconds)
    assert 1 / sec_flop == pytest.approx(max(terms[:, 0] / seconds))  # 147 TFLOP/s: the 256-channel convs
    assert sec_byte > 0 and sec_call >= 0
    assert (terms @ [sec_flop, sec_byte, sec_call] <= 2 * seconds).all()


def test_non_negative_fit_beats_clamping() -> None:
    """Times a negative coefficient would fit best: the fit drops that term and refits the others."""
    terms = torch.tensor([[1e9, 1e6, 10], [2e9, 1e8, 20], [1e5, 1e4, 500], [5e8, 5e7, 100]], dtype=torch.float64)
    seconds = (terms @ torch.tensor([1e-11, 2e-10, 1e-5], dtype=torch.float64)) * torch.tensor([1.0, 0.5, 1.0, 1.0])
    got = fit_constants(terms.numpy(), seconds.numpy())
    assert (got >= 0).all()
    a, ones = (terms / seconds[:, None]).numpy(), torch.ones(4, dtype=torch.float64).numpy()
    for drop in range(3):  # no non-negative fit on fewer terms does better
        keep = [i for i in range(3) if i != drop]
        sub = torch.linalg.lstsq(torch.from_numpy(a[:, keep]), torch.from_numpy(ones)).solution.numpy()
        if (sub >= 0).all():
            assert ((a @ got - ones) ** 2).sum() <= ((a[:, keep] @ sub - ones) ** 2).sum() + 1e-12


def test_a_calibration_without_a_flop_rate_is_not_installed(
    tmp_path: Path, cal_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsitrain.doctor import command
    from wsitrain.doctor.calibrate import MicroRow

    def no_rate(device: torch.device, name: str, runs: int = 5, micro: object = None) -> tuple[Calibration, list]:
        return Calibration(name, device.type, "2026-11-24", 22.0, 2e8, 0.0, 0.0), [MicroRow("m", (1, 1, 1), 1, 1)]

    monkeypatch.setattr(command, "calibrate", no_rate)
    extra: dict[str, object] = {}
    check = command._calibrate(torch.device("cpu"), "cpu: test", False, tmp_path, extra)
    assert check.status == "failed" and "nothing installed" in check.detail
    assert not list(cal_dir.glob("*.json")) and "calibration_path" not in extra


def test_cap_verdicts_from_gpu_figures() -> None:
    ok = checks._cap_verdict("c", {"cap_bytes": 100, "planned_peak_bytes": 80, "measured_peak_bytes": 88,
                                   "simulated_peak_bytes": 85}, 1.0)  # fmt: skip
    assert ok.status == "passed" and ok.figures["measured_over_planned"] == pytest.approx(1.1)
    assert "simulated 85 B" in ok.detail
    over = checks._cap_verdict("c", {"cap_bytes": 100, "planned_peak_bytes": 80, "measured_peak_bytes": 101,
                                     "simulated_peak_bytes": None}, 1.0)  # fmt: skip
    assert over.status == "failed" and "not simulated" in over.detail
    oom = checks._cap_verdict("c", {"cap_bytes": 100, "planned_peak_bytes": 80, "oom": "CUDA out of memory"}, 1.0)
    assert oom.status == "failed" and "out of memory under the cap" in oom.detail
    assert checks.peak_under_cap(torch.device("cpu"), "tiny", 64, 2**30).status == "not run: no CUDA device"
    assert checks.workspaces(torch.device("cpu")).status == "not run: no CUDA device"


def test_simulated_peak_is_the_simulated_devices_steady_state_step() -> None:
    from wsitrain.sft.simulate import simulate_step

    with torch.device("meta"):
        net = build("tiny", 2)
    want = simulate_step(net, (1, 3, 64, 64), 2**30, optimizer="adam").device_peak.bytes
    assert checks.simulated_peak("tiny", (1, 3, 64, 64), 2**30) == want > 0


def test_figure8_pipeline_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--figure8 in fast mode on a CPU: tiny model, 64 and 128 px, each configuration in its own process."""
    passed = checks.Check("exactness on cpu (float64, tiled vs plain)", "passed")
    monkeypatch.setattr("wsitrain.doctor.command.exactness", lambda device, size=128: passed)
    from wsitrain.doctor.command import run_doctor

    assert run_doctor(out=tmp_path, cpu=True, fast=True, figure8=True, cap="256MiB") == 0
    rows = json.loads((tmp_path / "doctor.json").read_text())["figure8"]["rows"]
    assert {(r["size"], r["strategy"]) for r in rows} == {(s, k) for s in (64, 128) for k in ("base", "checkpoint",
                                                                                             "sft")}  # fmt: skip
    for r in rows:
        assert r["status"] == "ok", r
        assert r["mean_ms"] > 0 and r["ms_per_mpix"] > 0 and r["peak_bytes"] > 0 and r["planned_peak_bytes"] > 0
    md = (tmp_path / "doctor.md").read_text()
    assert "## Figure 8 protocol" in md and "| 128 | sft |" in md
    assert (tmp_path / "figure8.png").stat().st_size > 0
