"""GPU check: the ``gpu`` tests and the SFT paper's Figure 8 protocol, in one report (JSON + markdown).

On a machine with a CUDA GPU, from the repository root:

    python scripts/gpu_check.py --out gpu-check-out

1. ``pytest -m gpu tests/test_gpu.py`` (float64 exactness on CUDA, the host-staged image, the budget under
   ``torch.cuda.set_per_process_memory_fraction``, the demo fit on CUDA); outcomes and recorded peaks.
2. Figure 8: VGG-16 training steps (forward, MSE loss, backward; batch 1, fp32) from 2048 to 20480 px with plain
   PyTorch, ``torch.utils.checkpoint.checkpoint_sequential`` (every segment count tried, the best kept) and SFT,
   every configuration capped at 11 GiB (``set_per_process_memory_fraction``) in its own process, so an out of
   memory error ends only that configuration (wsitrain.bench's worker and runner). Recorded: time per step,
   time per megapixel, measured peak (``max_memory_allocated``) against the planned peak, out-of-memory marks.

Writes ``gpu_check.json``, ``gpu_check.md`` and ``figure8.png`` into ``--out``. ``--cpu-smoke`` runs the same
pipeline on a CPU in seconds (tiny model, 64 and 128 px, one run; the gpu tests are then skipped, with the
reason recorded) so the script itself can be checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Run the checkout's wsitrain (not another installed copy), here and in every subprocess and bench worker.
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

import torch  # noqa: E402

from wsitrain.bench.configs import BenchConfig, checkpoint_segment_counts, sft_tiles  # noqa: E402
from wsitrain.bench.report import best_rows, result_row  # noqa: E402
from wsitrain.bench.runner import Predictor, machine_free_bytes, run_worker  # noqa: E402
from wsitrain.models import build  # noqa: E402
from wsitrain.units import format_bytes, parse_bytes  # noqa: E402

FIG8_SIZES = (2048, 4096, 8192, 10240, 12288, 16384, 20480)
SMOKE_SIZES = (64, 128)


# --------------------------------------------------------------------------------------------------- tests


def run_gpu_tests(out: Path, timeout_s: float) -> dict[str, Any]:
    """``pytest -m gpu tests/test_gpu.py`` in a subprocess; each test's outcome, time, message and properties."""
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-rs", "-p", "no:cacheprovider",
           f"--junitxml={xml}"]  # fmt: skip
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


# --------------------------------------------------------------------------------------------------- figure 8


def figure8_configs(
    model: str, sizes: list[int], cap: int, device: str, runs: int, segments: list[int] | None, tiles: bool
) -> list[BenchConfig]:
    """Per size: plain, checkpoint_sequential at each segment count, SFT with the planner's tiles (and forced)."""
    with torch.device("meta"):
        net = build(model, 2)
    n_layers = 1 + len(net.features)  # what checkpoint_sequential splits: normalize + the trunk's layers
    counts = segments or checkpoint_segment_counts(n_layers, device)
    common = dict(model=model, budget_bytes=cap, device=device, precision="fp32", runs=runs)
    out: list[BenchConfig] = []
    for size in sizes:
        out.append(BenchConfig(size=size, strategy="base", **common))
        out += [BenchConfig(size=size, strategy="checkpoint", segments=s, **common) for s in counts if s <= n_layers]
        out.append(BenchConfig(size=size, strategy="sft", **common))
        if tiles:
            out += [BenchConfig(size=size, strategy="sft", tile=t, **common) for t in sft_tiles(size, net.stride)]
    return out


def run_figure8(configs: list[BenchConfig], timeout_s: float, log: Any) -> list[dict[str, Any]]:
    """Each configuration in its own process; a variant that ran out of memory is not retried at larger sizes."""
    if not configs:
        return []
    c0 = configs[0]
    predictor = Predictor(c0.model, c0.budget_bytes or 0, c0.device, c0.precision)
    free = machine_free_bytes(c0.device)
    oom_from: dict[str, int] = {}
    rows = []
    for i, cfg in enumerate(configs, 1):
        key = f"{cfg.strategy}:{cfg.variant}"
        planned = predictor.planned_peak(cfg)
        if key in oom_from and cfg.strategy != "sft":
            result = {"status": "oom", "note": f"not run: out of memory at {oom_from[key]} px already"}
        elif planned is not None and planned > free:
            result = {"status": "predicted_oom", "note": f"not run: planned {format_bytes(planned)} > free memory"}
        else:
            result = run_worker(cfg, timeout_s=timeout_s)
        if result["status"] == "oom":
            oom_from.setdefault(key, cfg.size)
        row = result_row(cfg, result, planned)
        mpix = cfg.size * cfg.size / 1e6
        row["ms_per_mpix"] = row["mean_ms"] / mpix if row["mean_ms"] is not None else None
        peak, plan = row["peak_bytes"], row["planned_peak_bytes"]
        row["measured_over_planned"] = peak / plan if peak and plan else None
        rows.append(row)
        timing = f", {row['mean_ms'] / 1000:.2f} s/step, peak {format_bytes(peak)}" if row["mean_ms"] else ""
        log(f"[{i}/{len(configs)}] {cfg.size} px {cfg.strategy} {cfg.variant}: {row['status']}{timing}")
    return rows


# --------------------------------------------------------------------------------------------------- report


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.3f}"


def markdown(report: dict[str, Any]) -> str:
    m = report["meta"]
    lines = [
        "# wsitrain GPU check",
        "",
        f"- device: {m['device_name']} ({m['device']}), torch {m['torch']}, CUDA {m['cuda']}, host {m['host']}",
        f"- started {m['started']}, finished {m['finished']}; command `{m['command']}`",
        f"- mode: {'CPU smoke (tiny model, not a measurement of anything)' if m['cpu_smoke'] else 'full'}",
        "",
    ]
    tests = report.get("tests")
    if tests is not None:
        counts: dict[str, int] = {}
        for c in tests["cases"]:
            counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no test ran"
        lines += [f"## GPU tests (`pytest -m gpu tests/test_gpu.py`): {summary}, exit code {tests['returncode']}", "",
                  "| test | outcome | s | note / recorded |", "| --- | --- | ---: | --- |"]  # fmt: skip
        for c in tests["cases"]:
            props = ", ".join(f"{k}={v}" for k, v in c["properties"].items())
            note = "; ".join(x for x in (c["message"], props) if x).replace("|", "/")
            lines.append(f"| {c['name']} | {c['outcome']} | {c['seconds']:.1f} | {note} |")
        lines.append("")
    fig = report.get("figure8")
    if fig is not None:
        lines += [
            f"## Figure 8 protocol: {m['model']}, cap {format_bytes(m['cap_bytes'])} "
            f"(set_per_process_memory_fraction on CUDA; emulated on CPU), {m['runs']} timed runs after 1 warm-up",
            "",
            "Best configuration per series and size. Peaks: measured = max_memory_allocated (CUDA) or RSS growth "
            "(CPU); planned = the engine's estimate (for plain and checkpoint: its model of them).",
            "",
            "| size | series | variant | status | s/step | ms/MPix | measured peak | planned peak | measured/planned |",
            "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        planner_only = {r["size"] for r in fig["best"] if r["series"] == "sft" and r["variant"] == "planner"}
        for r in fig["best"]:
            if r["series"] == "sft-planner" and r["size"] in planner_only:
                continue  # the same row as "sft" when no forced tile beat the planner's choice
            ratio = f"{r['measured_over_planned']:.2f}" if r.get("measured_over_planned") else "-"
            mpix = f"{r['ms_per_mpix']:.1f}" if r.get("ms_per_mpix") is not None else "-"
            status = {"oom": "**OOM**", "predicted_oom": "OOM (planned)"}.get(r["status"], r["status"])
            lines.append(
                f"| {r['size']} | {r['series']} | {r['variant']} | {status} | {_s(r['mean_ms'])} | {mpix} | "
                f"{format_bytes(r['peak_bytes'])} | {format_bytes(r['planned_peak_bytes'])} | {ratio} |"
            )
        lines += ["", f"All {len(fig['rows'])} configurations are in gpu_check.json; the plot is figure8.png.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="output folder [gpu-check-out/<time>]")
    ap.add_argument("--cpu-smoke", action="store_true", help="check the pipeline on a CPU: tiny model, 2 small sizes")
    ap.add_argument("--sizes", default=None, help=f"image edges [{','.join(map(str, FIG8_SIZES))}]")
    ap.add_argument("--cap", default="11GiB", help="memory cap of every configuration [11GiB, the RTX 2080 Ti]")
    ap.add_argument("--runs", type=int, default=3, help="timed steps after one warm-up [3]")
    ap.add_argument("--segments", default=None, help="checkpoint_sequential segment counts, e.g. 2,4,8 [2..L]")
    ap.add_argument("--sft-tiles", action="store_true", help="also run SFT with forced tiles size/2 .. size/32")
    ap.add_argument("--skip-tests", action="store_true", help="skip the pytest -m gpu part")
    ap.add_argument("--skip-bench", action="store_true", help="skip the Figure 8 part")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration (and for the tests x2)")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print(
            "error: no CUDA GPU is visible (torch.cuda.is_available() is False)\n"
            "hint: run this on a GPU machine, or add --cpu-smoke to check the script here",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if args.cpu_smoke else "cuda"
    model = "tiny" if args.cpu_smoke else "vgg16"
    cap = parse_bytes("256MiB" if args.cpu_smoke and args.cap == "11GiB" else args.cap, what="--cap")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else list(SMOKE_SIZES if args.cpu_smoke
                                                                              else FIG8_SIZES)  # fmt: skip
    runs = 1 if args.cpu_smoke else args.runs
    segments = [int(s) for s in args.segments.split(",")] if args.segments else ([2] if args.cpu_smoke else None)
    out = args.out or REPO / "gpu-check-out" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)

    meta: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else f"main({argv})",
        "device": device, "device_name": torch.cuda.get_device_name(0) if cuda and not args.cpu_smoke else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "host": f"{platform.node()} ({os.cpu_count()} cores)",
        "cpu_smoke": args.cpu_smoke, "model": model, "cap_bytes": cap, "sizes": sizes, "runs": runs,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip
    report: dict[str, Any] = {"meta": meta}
    if not args.skip_tests:
        print("gpu tests: pytest -m gpu tests/test_gpu.py", flush=True)
        report["tests"] = run_gpu_tests(out, 2 * args.timeout)
    if not args.skip_bench:
        configs = figure8_configs(model, sizes, cap, device, runs, segments, args.sft_tiles)
        print(f"figure 8: {len(configs)} configurations, {model} on {device}, cap {format_bytes(cap)}", flush=True)
        rows = run_figure8(configs, args.timeout, lambda text: print(text, flush=True))
        best = best_rows(rows)
        report["figure8"] = {"rows": rows, "best": best}
        if rows:
            from wsitrain.bench.plot import plot_bench

            plot_bench(out / "figure8.png", best, {**meta, "budget_bytes": cap, "precision": "fp32"})
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=_json_default))
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    failed = "tests" in report and report["tests"]["returncode"] not in (0, 5)  # 5: no test collected; None: timeout
    bench_errors = [r for r in report.get("figure8", {}).get("rows", []) if r["status"] in ("error", "timeout")]
    return 1 if failed or bench_errors else 0


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
