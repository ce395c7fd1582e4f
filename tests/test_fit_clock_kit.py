"""benchmarks/fit_clock.py --kit: a GPU kit's measured cases replayed on the simulated clock, and both factors refitted.

The kit's JSONL is written here by hand, as benchmarks/gpu_session.py writes it on a card (its CPU run is tested in
test_gpu_session.py); the "measured" seconds are made up, so what is checked is the replay and the refit, not a card.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
from script_module import load_script

from wsitrain.sft.planning.calibration import run_time_model
from wsitrain.sft.simulate.clock import OpClock, OpRecord

H200 = "NVIDIA H200"
CAPPED_PLAN = "tiled 3x3 (forward 2x2), tiled 2x2 (forward 1x1), plain"  # tiny, 1024 px, 175 MiB, the H200 preset


def _row(run: str, step_s: float, **kw: object) -> dict[str, object]:
    base = {"model": "tiny", "run": run, "size": 1024, "device": H200, "patches": 0, "patch": 64,
            "channels_last": False, "cudnn_benchmark": False, "constants": "run", "budget": None, "status": "ok",
            "step_s": step_s, "mpx_per_s": 1.0, "first_step_s": 1.0}  # fmt: skip
    return {**base, **kw}


def _kit(path: Path, device: str = H200) -> Path:
    tm = dataclasses.asdict(run_time_model("cuda", H200, True)[0])
    sft = {"budget": "175MiB", "budget_bytes": 175 * 2**20, "time_model": tm, "large_conv": False}
    rows = [
        _row("plain, 4 patches of 64 px, channels_last", 0.001, patches=4, channels_last=True),
        _row("plain, one image, NCHW", 0.0008),
        _row("plain, one image, channels_last", 0.003, channels_last=True),
        _row("SFT, capped at 175MiB, cudnn.benchmark off", 0.005, plan=CAPPED_PLAN, **sft),
        # the kit recorded another plan than the replay makes: flagged, not hidden
        _row("SFT, capped at 175MiB, default constants' plan", 0.008, plan="plain",
             **{**sft, "time_model": None}, constants="default"),  # fmt: skip
        _row("SFT, capped at 10MiB", 0.5, plan="plain", **{**sft, "budget": "10MiB", "budget_bytes": 10 * 2**20}),
        {**_row("SFT, capped at 1KiB", 0.0), "status": "oom"},  # not measured: not replayed
    ]
    for r in rows:
        r["device"] = device
    path.write_text("\n".join(json.dumps(r) for r in [*rows, {"breakdown": {"seconds": {}}}]) + "\n")
    return path


def _off(cell: str) -> float:
    return float(cell.rstrip("%"))


def _cells(table: str, run: str) -> list[str]:
    line = next(x for x in table.splitlines() if x.startswith(f"| tiny | {run}"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_every_measured_case_is_replayed_and_the_plain_fit_case_is_met(tmp_path: Path) -> None:
    """The plain case refits conv_efficiency; the capped case refits unaligned_conv_efficiency only where its tiles
    run unaligned 1x1 layers in half precision (what the H200's profile named), which the tiny model has none of:
    the factor is kept and the capped case stays off."""
    fc = load_script("fit_clock")
    table = fc.kit_table(_kit(tmp_path / "kit.jsonl"))
    rows = [x for x in table.splitlines() if x.startswith("| tiny |")]
    assert len(rows) == 6  # the oom row and the breakdown line are not cases
    plain = _cells(table, "plain, one image, NCHW")
    capped = _cells(table, "SFT, capped at 175MiB, cudnn.benchmark off")
    assert plain[2] == "0.001 s" and abs(_off(plain[6])) < 0.05  # refitted on it
    assert capped[7] == CAPPED_PLAN  # replayed with the plan the card ran
    assert abs(_off(capped[4])) > 1  # the preset's constants do not meet made-up figures
    fitted = re.search(r"Refitted: conv_efficiency ([0-9.]+) .* unaligned_conv_efficiency ([0-9.]+) \(kept: no capped "
                       r"case whose unaligned 1x1 convolutions", table)  # fmt: skip
    assert fitted is not None and 0 < float(fitted[1]) < 1 and float(fitted[2]) == pytest.approx(
        fc.GpuSpeed.__dataclass_fields__["unaligned_conv_efficiency"].default, abs=1e-4)
    default = _cells(table, "SFT, capped at 175MiB, default constants' plan")
    assert default[7].startswith("plain / **tiled") and "differs from the one the card ran" in table
    assert "not replayed" in _cells(table, "SFT, capped at 10MiB")[3]
    assert "memory-format" in _cells(table, "plain, one image, channels_last (")[1]


def _exit_2(fc: ModuleType, path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        fc.main(["--kit", str(path)])
    assert e.value.code == 2
    out = capsys.readouterr()
    assert out.out == ""  # no table, nothing half written
    return out.err


def test_a_card_without_speed_constants_is_refused_naming_the_file(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    fc = load_script("fit_clock")
    path = _kit(tmp_path / "kit.jsonl", device="Some Future GPU")
    with pytest.raises(fc.KitError, match=r"kit\.jsonl: the card 'Some Future GPU' matches no speed preset"):
        fc.kit_table(path)
    assert "the card 'Some Future GPU' matches no speed preset" in _exit_2(fc, path, capsys)


def test_a_kit_file_the_replay_cannot_read_is_exit_2_naming_file_and_line(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    fc = load_script("fit_clock")
    assert "no such file" in _exit_2(fc, tmp_path / "absent.jsonl", capsys)
    path = _kit(tmp_path / "kit.jsonl")
    lines = path.read_text().splitlines()
    (tmp_path / "cut.jsonl").write_text("\n".join(lines[:2] + ['{"run": "SFT', *lines[2:]]) + "\n")
    assert "cut.jsonl:3: not JSON" in _exit_2(fc, tmp_path / "cut.jsonl", capsys)
    old = [json.loads(x) for x in lines]
    del old[3]["time_model"]  # the capped SFT case, as a kit before the replay wrote it
    (tmp_path / "old.jsonl").write_text("\n".join(json.dumps(r) for r in old) + "\n")
    err = _exit_2(fc, tmp_path / "old.jsonl", capsys)
    assert "old.jsonl:4: case 'SFT, capped at 175MiB, cudnn.benchmark off' lacks time_model" in err
    assert "run benchmarks/gpu_session.py again" in err


@pytest.mark.parametrize(("extra", "target_label", "plan_optimizer", "falls_back"), [
    ({}, "NVIDIA H200 (preset h200)", None, True),  # a row of before 2026-11-27: no optimizer, the pass fell back
    ({"target": "recorded", "plan_optimizer": "adamw", "one_pass_fallbacks": 0}, "recorded card", "adamw", False),
])  # fmt: skip
def test_a_replay_runs_the_cards_own_step(monkeypatch: pytest.MonkeyPatch, extra: dict, target_label: str,
                                         plan_optimizer: str | None, falls_back: bool) -> None:  # fmt: skip
    """The replay plans for the target, the optimizer and the one-pass fallbacks the kit recorded; a row that
    recorded none of them is one of the first H200 session's (the preset's target, no optimizer, fallen back)."""
    from wsitrain.gpus import gpu_preset

    fc = load_script("fit_clock")
    seen: dict[str, object] = {}

    def fake_step(*a: object, **kw: object) -> tuple:
        seen.update(kw)
        raise fc.PlanError("stop here")

    monkeypatch.setattr(fc, "clock_sft_step", fake_step)
    tm = dataclasses.asdict(run_time_model("cuda", H200, True)[0])
    if extra.get("target") == "recorded":
        extra = {**extra, "target": dataclasses.asdict(dataclasses.replace(gpu_preset("h200").target(True),
                                                                            label="recorded card"))}  # fmt: skip
    row = _row("SFT, capped", 0.5, plan="plain", budget="175MiB", budget_bytes=175 * 2**20, time_model=tm,
               large_conv=False, **extra)  # fmt: skip
    r = fc.replay(row, "h200", fc.gpu_speed("h200"))
    assert r.clock is None and "not replayed" in r.note
    assert seen["target"].label == target_label  # type: ignore[attr-defined]
    assert seen["plan_optimizer"] == plan_optimizer and seen["one_pass_falls_back"] is falls_back


def test_unaligned_rate_is_refitted_only_where_such_layers_carry_the_step() -> None:
    """Since tiles run unaligned 1x1 layers as matrix products, a capped replay keeps a few unaligned convolutions
    (stride 2, cropped inputs): under 5% of its convolution FLOPs they are not what the fit may charge the step to."""
    fc = load_script("fit_clock")

    def clock(unaligned_flops: float, aligned_flops: float) -> OpClock:
        c = OpClock(low_precision=True)
        c.windows[0].ops += [OpRecord("convolution forward", unaligned_flops, 0.0, 1, 100.0, True, "convolution", True),
                             OpRecord("convolution forward", aligned_flops, 0.0, 1, 100.0, True, "convolution"),
                             OpRecord("matrix products", 1e12, 0.0, 1, 0.0, True, "mm", True)]  # fmt: skip
        return c

    assert fc._has_unaligned(clock(5.0, 95.0)) and fc._has_unaligned(clock(50.0, 50.0))
    assert not fc._has_unaligned(clock(4.0, 96.0)) and not fc._has_unaligned(clock(0.0, 100.0))
