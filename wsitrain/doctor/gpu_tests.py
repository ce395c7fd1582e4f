"""The checkout's ``gpu`` tests (``pytest -m gpu tests/test_gpu.py``) in a subprocess, when the checkout has them.

An installed wsitrain has no tests folder; the doctor's in-process checks (``wsitrain.doctor.checks``) cover
exactness and the memory cap there. In a source checkout the test file adds the demo fit on CUDA and more models.
"""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import wsitrain

REPO = Path(wsitrain.__file__).resolve().parents[1]
GPU_TESTS = REPO / "tests" / "test_gpu.py"


def run_gpu_tests(out: Path, timeout_s: float) -> dict[str, Any]:
    """Each test's outcome, time, message and recorded properties (junit XML), the exit code and output tail."""
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", str(GPU_TESTS.relative_to(REPO)), "-q", "-rs",
           "-p", "no:cacheprovider", f"--junitxml={xml}"]  # fmt: skip
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        rc, tail = done.returncode, (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = None, f"timed out after {timeout_s:.0f} s\n{(e.stdout or b'')[-2000:]!r}"
    return {"command": " ".join(cmd), "returncode": rc, "seconds": time.perf_counter() - t0,
            "cases": parse_junit(xml) if xml.is_file() else [], "output_tail": tail}  # fmt: skip


def parse_junit(path: Path) -> list[dict[str, Any]]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                text = (el.get("message") or el.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                      "message": message, "properties": props})  # fmt: skip
    return cases


def tests_markdown(tests: dict[str, Any]) -> list[str]:
    counts: dict[str, int] = {}
    for c in tests["cases"]:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test ran"
    lines = [f"## GPU tests (`pytest -m gpu tests/test_gpu.py`): {summary}, exit code {tests['returncode']}", "",
             "| test | outcome | s | note / recorded |", "| --- | --- | ---: | --- |"]  # fmt: skip
    for c in tests["cases"]:
        props = ", ".join(f"{k}={v}" for k, v in c["properties"].items())
        note = "; ".join(x for x in (c["message"], props) if x).replace("|", "/")
        lines.append(f"| {c['name']} | {c['outcome']} | {c['seconds']:.1f} | {note} |")
    return [*lines, ""]
