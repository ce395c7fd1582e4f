"""The doctor's one markdown report (to paste into an issue) and its JSON twin."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from wsitrain.doctor.checks import Check
from wsitrain.doctor.figure8 import figure8_markdown
from wsitrain.doctor.gpu_tests import tests_markdown
from wsitrain.units import format_bytes
from wsitrain.write_errors import named_write_errors


def markdown(meta: dict[str, Any], checks: list[Check], extra: dict[str, Any]) -> str:
    lines = [
        "# wsitrain doctor",
        "",
        f"- device: {meta['device_name']} ({meta['device']}); torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"cuDNN {meta['cudnn']}; wsitrain {meta['wsitrain']}; host {meta['host']}",
        f"- started {meta['started']}, finished {meta['finished']}; `{meta['command']}`",
        f"- mode: {meta['mode']}",
        "",
        "## Checks",
        "",
        "| check | status | detail | s |",
        "| --- | --- | --- | ---: |",
    ]
    for c in checks:
        status = f"**{c.status}**" if not c.ok else c.status
        lines.append(f"| {c.name} | {status} | {c.detail.replace('|', '/')} | {c.seconds:.1f} |")
    skipped = [c for c in checks if c.status.startswith("not run")]
    if skipped:
        lines += ["", "## Not checked on this machine", ""]
        lines += [f"- {c.name}: {c.status}" for c in skipped]
    lines.append("")
    cal = extra.get("calibration")
    if cal is not None:
        fast = meta["mode"].startswith("fast")
        installed = "fast mode: a smoke test, not installed" if fast else "used by `wsitrain plan` and `fit` here"
        lines += [
            f"## Time model calibrated on {cal['device_name']} ({cal['date']})",
            "",
            f"byte = {cal['byte_flops']:.3g} FLOPs, call = {cal['call_flops']:.3g} FLOPs, "
            f"{cal['flops_per_second']:.3g} FLOP/s; written to `{extra['calibration_path']}` "
            f"({installed}).",
            "",
            "| micro-model | measured ms | model ms | GFLOP | MB | calls |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in extra["micro_rows"]:
            f, b, n = r["terms"]
            lines.append(f"| {r['name']} | {1e3 * r['seconds']:.2f} | {1e3 * r['modelled']:.2f} | {f / 1e9:.2f} | "
                         f"{b / 1e6:.1f} | {n:.0f} |")  # fmt: skip
        lines.append("")
    if extra.get("tests") is not None:
        lines += tests_markdown(extra["tests"])
    if extra.get("figure8") is not None:
        lines += figure8_markdown(extra["figure8"], meta["figure8_model"], meta["cap_bytes"], meta["figure8_runs"])
    cap_rows = [c for c in checks if "measured_peak_bytes" in c.figures or "oom" in c.figures]
    if cap_rows:
        lines += ["## Peaks under the cap", "", "| check | measured | planned | simulated | measured/planned |",
                  "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for c in cap_rows:
            f = c.figures
            ratio = f.get("measured_over_planned")
            lines.append(f"| {c.name} | {format_bytes(f.get('measured_peak_bytes'))} | "
                         f"{format_bytes(f.get('planned_peak_bytes'))} | {format_bytes(f.get('simulated_peak_bytes'))}"
                         f" | {'-' if ratio is None else f'{ratio:.2f}'} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def write_json(path: Path, obj: Any) -> None:
    with named_write_errors(path):
        path.write_text(json.dumps(obj, indent=1, default=_json_default))


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)
