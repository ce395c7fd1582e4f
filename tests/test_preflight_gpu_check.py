"""scripts/gpu_check.py end to end in its CPU smoke mode: the gpu tests (skipped here, with the reason recorded)
and the Figure 8 pipeline (tiny model, two small sizes, each configuration in its own process), one report.

The script runs in this process (importing it costs no second torch start-up); its pytest run and its benchmark
configurations still run in their own processes, as on a GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture
def gpu_check(repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # The script puts the checkout first on sys.path and PYTHONPATH for its subprocesses: undone after the test.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", str(repo_root))
    spec = importlib.util.spec_from_file_location("gpu_check", repo_root / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_check_cpu_smoke_writes_one_report(gpu_check: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert gpu_check.main(["--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["meta"]["cpu_smoke"] and report["meta"]["device"] == "cpu"

    tests = report["tests"]
    assert tests["returncode"] == 0, tests["output_tail"]
    cases = tests["cases"]
    names = " ".join(c["name"] for c in cases)
    for test in ("float64_exact_on_cuda", "host_staged", "budget_honoured", "demo_fit_on_cuda"):
        assert test in names
    if not torch.cuda.is_available():  # a CPU machine: every gpu test is skipped and says why
        assert all(c["outcome"] == "skipped" and "needs a CUDA GPU" in c["message"] for c in cases)

    rows = report["figure8"]["rows"]
    expected = {(s, k) for s in (64, 128) for k in ("base", "checkpoint", "sft")}
    assert {(r["size"], r["strategy"]) for r in rows} == expected
    for r in rows:
        assert r["status"] == "ok", r
        assert r["mean_ms"] > 0 and r["ms_per_mpix"] > 0 and r["peak_bytes"] > 0 and r["planned_peak_bytes"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "## GPU tests" in md and "## Figure 8 protocol" in md and "| 128 | sft |" in md
    assert (out / "figure8.png").stat().st_size > 0


def test_gpu_check_without_a_gpu_says_how_to_smoke_test(
    gpu_check: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: without --cpu-smoke the script runs the full check")
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and "--cpu-smoke" in err
    assert not any(tmp_path.iterdir()), "nothing is written when the check cannot run"


def test_junit_parsing_keeps_outcomes_messages_and_properties(gpu_check: ModuleType, tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_gpu" name="ok_case" time="1.5">'
        '<properties><property name="sft_peak_bytes" value="123"/></properties></testcase>'
        '<testcase classname="tests.test_gpu" name="bad_case" time="0.2"><failure message="assert 2 &lt;= 1">'
        "trace</failure></testcase>"
        '<testcase classname="tests.test_gpu" name="skip_case" time="0"><skipped message="needs a CUDA GPU"/>'
        "</testcase></testsuite></testsuites>"
    )
    cases = {c["name"]: c for c in gpu_check.parse_junit(xml)}
    assert cases["ok_case"]["outcome"] == "passed" and cases["ok_case"]["properties"] == {"sft_peak_bytes": "123"}
    assert cases["bad_case"]["outcome"] == "failed" and cases["bad_case"]["message"] == "assert 2 <= 1"
    assert cases["skip_case"]["outcome"] == "skipped" and "CUDA" in cases["skip_case"]["message"]
