"""`wsitrain bench`: a tiny benchmark end to end, out-of-memory marking, and input checks."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from wsitrain.bench import configs as bench_configs
from wsitrain.bench import runner
from wsitrain.bench.configs import checkpoint_segment_counts, parse_sizes, parse_strategies, sft_tiles
from wsitrain.bench.report import best_rows
from wsitrain.bench.worker import _is_oom, run_config
from wsitrain.errors import WsiTrainError


def _bench(tmp_path: Path, **kw) -> tuple[Path, str]:
    buf = io.StringIO()
    args = dict(gpu=None, model="tiny", sizes="64,128", strategies="base,checkpoint,sft", runs=1,
                out=tmp_path / "bench", memory=None, precision="fp32")  # fmt: skip
    args.update(kw)
    out = runner.run_bench(**args, console=Console(file=buf, width=160, color_system=None))
    return out, buf.getvalue()


def test_tiny_bench_end_to_end(tmp_path: Path) -> None:
    out, text = _bench(tmp_path)
    assert out == tmp_path / "bench"
    data = json.loads((out / "bench.json").read_text())
    rows = data["results"]
    # base + checkpoint s in {2, 4, 13} + SFT planner + tiles (64 px: 32; 128 px: 64, 32), at two sizes
    # (the test may run on a GPU machine: same counts there, since the tiny model limits them)
    assert len(rows) == 2 * (1 + 3 + 1) + 1 + 2
    assert all(r["status"] == "ok" for r in rows), [(r["strategy"], r["variant"], r["note"]) for r in rows]
    for r in rows:
        assert r["runs"] == 1 and r["mean_ms"] > 0 and r["peak_bytes"] > 0 and r["within_budget"] is True
    assert {(b["series"], b["size"]) for b in data["best"]} == {
        (s, n) for s in ("base", "checkpoint", "sft", "sft-planner") for n in (64, 128)
    }
    assert data["meta"]["model"] == "tiny" and data["meta"]["device"] in ("cpu", "cuda")
    with (out / "bench.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == len(rows) and {"size", "strategy", "variant", "status", "mean_ms"} <= set(csv_rows[0])
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "wsitrain bench" in text and "tile=32" in text and "s=13" in text


def test_over_budget_is_marked_out_of_memory(tmp_path: Path) -> None:
    out, text = _bench(tmp_path, strategies="base", memory="1KiB")
    rows = json.loads((out / "bench.json").read_text())["results"]
    assert [r["status"] for r in rows] == ["oom", "oom"]
    assert rows[0]["runs"] == 1 and rows[0]["within_budget"] is False  # it ran, then exceeded the budget
    assert "not run" in rows[1]["note"]  # a larger size of a strategy that already ran out is not run
    assert "out of memory" in text
    assert (out / "bench.png").exists()


def test_planned_peak_above_free_memory_is_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "machine_free_bytes", lambda device: 1000)
    ran: list[object] = []
    monkeypatch.setattr(runner, "run_worker", lambda cfg: ran.append(cfg) or {})
    out, text = _bench(tmp_path, strategies="base,sft", sizes="64")
    rows = json.loads((out / "bench.json").read_text())["results"]
    assert not ran
    assert {r["status"] for r in rows} == {"predicted_oom"}
    assert all(r["planned_peak_bytes"] > 1000 for r in rows)
    assert "predicted OOM" in text


@pytest.mark.parametrize("strategy", ["base", "checkpoint", "sft"])
def test_worker_in_process(strategy: str) -> None:
    r = run_config({"model": "tiny", "size": 64, "strategy": strategy, "segments": 3, "runs": 2})
    assert r["status"] == "ok", r.get("traceback")
    assert len(r["times_ms"]) == 2 and len(r["peaks_bytes"]) == 2 and r["peak_bytes"] > 0
    if strategy == "sft":
        assert r["planned_peak_bytes"] > 0


def test_worker_reports_errors_as_results() -> None:
    r = run_config({"model": "tiny", "size": 64, "strategy": "nonsense", "runs": 1})
    assert r["status"] == "error" and "nonsense" in r["note"]


def test_oom_detection() -> None:
    assert _is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert _is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert not _is_oom(RuntimeError("shape mismatch"))


def test_bad_input(tmp_path: Path) -> None:
    with pytest.raises(WsiTrainError, match="alexnet"):
        _bench(tmp_path, model="alexnet")
    with pytest.raises(WsiTrainError, match="--sizes"):
        _bench(tmp_path, sizes="64,abc")
    with pytest.raises(WsiTrainError, match="stride"):
        _bench(tmp_path, sizes="8")
    with pytest.raises(WsiTrainError, match="--strategies"):
        _bench(tmp_path, strategies="base,magic")
    with pytest.raises(WsiTrainError, match="--runs"):
        _bench(tmp_path, runs=0)
    with pytest.raises(WsiTrainError, match="2080"):
        _bench(tmp_path, gpu="gtx480")


def test_config_helpers() -> None:
    assert parse_sizes("512, 128,128", 32) == [128, 512]
    assert parse_strategies("sft,base") == ["base", "sft"]
    assert checkpoint_segment_counts(32, "cpu") == [2, 6, 32]
    assert checkpoint_segment_counts(32, "cuda") == [2, 3, 4, 6, 8, 16, 32]
    assert checkpoint_segment_counts(3, "cpu") == [2, 3]
    assert sft_tiles(1024, 32) == [512, 256, 128, 64]
    assert sft_tiles(1024, 32, "cpu") == [512, 256]
    assert sft_tiles(64, 16) == [32]
    cfgs = bench_configs.make_configs(
        model="tiny", sizes=[64], strategies=["checkpoint", "sft"], n_layers=13, stride=16, budget_bytes=10**9,
        device="cpu", precision="fp32", runs=1,
    )  # fmt: skip
    assert [c.variant for c in cfgs] == ["s=2", "s=4", "s=13", "planner", "tile=32"]
    assert {c.budget_bytes for c in cfgs} == {10**9} and {c.size for c in cfgs} == {64}


def test_best_rows_prefers_fastest_ok_and_keeps_oom() -> None:
    def row(strategy: str, variant: str, status: str, ms: float | None, size: int = 64) -> dict:
        return {"strategy": strategy, "variant": variant, "status": status, "mean_ms": ms, "size": size}

    best = best_rows([row("checkpoint", "s=2", "ok", 30.0), row("checkpoint", "s=4", "ok", 20.0),
                      row("base", "-", "oom", None), row("sft", "planner", "ok", 50.0),
                      row("sft", "tile=32", "ok", 40.0)])  # fmt: skip
    by = {b["series"]: b for b in best}
    assert by["checkpoint"]["variant"] == "s=4" and by["base"]["status"] == "oom"
    assert by["sft"]["variant"] == "tile=32" and by["sft-planner"]["variant"] == "planner"


def test_bench_reports_the_plan_the_worker_ran() -> None:
    """The worker measures a uint8 image; its reported plan is planned for that image, not a float32 one.

    (Before: VGG-16 at 2048 px ran a 1.10 GiB plan and reported a 1.38 GiB one with other segments.)
    """
    from wsitrain.models import build
    from wsitrain.sft import SFT

    cfg = {"model": "tiny", "size": 256, "strategy": "sft", "device": "cpu", "precision": "fp32", "runs": 1,
           "budget_bytes": 14 * 2**20, "tile": None}  # fmt: skip
    result = run_config(cfg)
    # ran (its CPU peak may exceed the emulated 14 MiB card: then marked oom, with the plan still reported)
    assert result["status"] in ("ok", "oom") and result["times_ms"], result.get("note")
    ran = result["plan"]
    assert ran["input_dtype"] == "uint8" and ran["input_on_host"] is False  # CPU: the image is in the budget
    assert result["planned_peak_bytes"] == ran["estimated_peak_bytes"]
    # the same plan an SFT gets for the worker's input, and not the one for a float32 image of that shape
    engine = SFT(build("tiny", 2), memory_budget=14 * 2**20, one_pass=False)  # as the worker builds it
    x = torch.zeros(1, 3, 256, 256, dtype=torch.uint8)
    assert engine.plan_of(x).to_dict() == ran
    as_float = engine.plan_for((1, 3, 256, 256), torch.float32)
    assert [sg.mode for sg in as_float.segments] != [sg["mode"] for sg in ran["segments"]]  # other segments here
    # the runner's prediction (shapes only) plans that same input
    predicted = runner.Predictor("tiny", 14 * 2**20, "cpu", "fp32")._plan(256, None)
    assert predicted.to_dict() == ran
    row = runner.result_row(bench_configs.BenchConfig(size=256, strategy="sft", model="tiny", device="cpu",
                                                      budget_bytes=14 * 2**20), result, 1)  # fmt: skip
    assert row["planned_peak_bytes"] == ran["estimated_peak_bytes"] and row["plan"] == ran


def test_sft_planner_rows_carry_the_hosts_share_for_a_gpu_budget(tmp_path: Path) -> None:
    """With a GPU preset's budget, the SFT planner row says the host time, launches and syncs of its CUDA plan's step
    (sft/simulate/host_time.py on the meta device); fixed-tile rows do not."""
    out, text = _bench(tmp_path, gpu="h100", memory="200MiB", strategies="sft", sizes="128")
    rows = json.loads((out / "bench.json").read_text())["results"]
    planner = [r for r in rows if r["variant"] == "planner"]
    assert len(planner) == 1 and planner[0]["launches_per_step"] > 0 and planner[0]["host_ms_per_step"] > 0
    assert planner[0]["syncs_per_step"] >= 0
    assert all("launches_per_step" not in r for r in rows if r["variant"] != "planner")
    assert "host side per step" in text
