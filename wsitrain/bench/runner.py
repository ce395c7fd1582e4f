"""``wsitrain bench``: run every configuration in its own process, predict what cannot run, report as it goes."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from wsitrain.bench.configs import (
    DEFAULT_MODEL,
    DEFAULT_RUNS,
    DEFAULT_SIZES,
    BenchConfig,
    make_configs,
    parse_sizes,
    parse_strategies,
)
from wsitrain.bench.host import host_columns, host_share
from wsitrain.bench.report import result_row, write_outputs
from wsitrain.bench.simulated import simulated_ms
from wsitrain.bench.worker import INPUT_DTYPE, child_main
from wsitrain.errors import WsiTrainError
from wsitrain.gpus import gpu_preset, resolve_budget
from wsitrain.memory import SAFETY_MARGIN, available_host_bytes
from wsitrain.models import build
from wsitrain.models.registry import resolve_model_name
from wsitrain.precision import activation_dtype, check_precision
from wsitrain.sft.planning.calibration import clock_speed
from wsitrain.units import format_bytes

WORKER_TIMEOUT_S = 1800  # one configuration; a step that takes longer is reported as a timeout, not waited for


@dataclass
class Predictor:
    """Planned peaks from the engine (shapes only, meta device): used to skip what cannot run here."""

    model: str
    budget_bytes: int
    device: str
    precision: str
    _cache: dict[tuple[int, int | None], Any] = field(default_factory=dict)

    def _plan(self, size: int, tile: int | None) -> Any:
        key = (size, tile)
        if key not in self._cache:
            try:
                from wsitrain.sft import plan

                with torch.device("meta"):
                    net = build(self.model, 2)
                # The worker's input: uint8 created on the device, inside the budget (on CPU as on CUDA: SFT.forward)
                self._cache[key] = plan(
                    net, input_shape=(1, 3, size, size), memory_budget=self.budget_bytes,
                    dtype=activation_dtype(self.precision), tile_size=tile, device=self.device,
                    input_dtype=INPUT_DTYPE, input_on_host=False, one_pass=False,  # as the worker's SFT
                )  # fmt: skip
            except Exception:  # no engine or no plan for this shape: no prediction, the run decides
                self._cache[key] = None
        return self._cache[key]

    def planned_peak(self, cfg: BenchConfig) -> int | None:
        p = self._plan(cfg.size, cfg.tile if cfg.strategy == "sft" else None)
        if p is None:
            return None
        if cfg.strategy == "base":
            return int(p.baseline_peak_bytes)
        if cfg.strategy == "checkpoint":
            # The planner knows only the best segment count; other counts need at least as much.
            return int(p.checkpoint_peak_bytes)
        return int(p.estimated_peak_bytes)


def machine_free_bytes(device: str) -> int:
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    return int(available_host_bytes() * SAFETY_MARGIN)


_CONTEXT: Any = None


def _mp_context() -> Any:
    """A forkserver that has imported torch and the worker once: each configuration then starts in
    milliseconds instead of seconds, still in a fresh process that never ran a step before."""
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in mp.get_all_start_methods():
            _CONTEXT = mp.get_context("forkserver")
            # torch._dynamo: the engine's first shape pass (torch.func.functional_call) imports it, ~900
            # modules and seconds per process; psutil: wsitrain.memory's free-memory probe.
            _CONTEXT.set_forkserver_preload(["wsitrain.bench.worker", "wsitrain.sft", "torch._dynamo", "psutil"])
        else:
            _CONTEXT = mp.get_context("spawn")
    return _CONTEXT


def run_worker(cfg: BenchConfig, timeout_s: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
    """Run one configuration in a fresh process and return its result dict."""
    ctx = _mp_context()
    recv_conn, send_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child_main, args=(send_conn, cfg.to_worker()), daemon=True)
    proc.start()
    send_conn.close()  # only the child writes; EOF then tells us it died without a result
    result = None
    try:
        if recv_conn.poll(timeout_s):
            result = recv_conn.recv()
    except EOFError:
        result = None
    finally:
        recv_conn.close()
    if result is None and proc.is_alive():
        proc.kill()
        proc.join()
        return {"status": "timeout", "note": f"no result within {timeout_s:.0f} s"}
    proc.join()
    if result is not None:
        return result
    if proc.exitcode == -signal.SIGKILL:  # the kernel's OOM killer
        return {"status": "oom", "note": "killed by the operating system (out of memory)"}
    return {"status": "error", "note": f"worker exited with code {proc.exitcode} and no result"}


def _live_table(rows: list[dict[str, Any]], clock: str | None = None) -> Table:
    t = Table(title="wsitrain bench", title_justify="left")
    cols = ["size", "strategy", "variant", "status", "time (mean ± std)", "peak", "planned"]
    if clock is not None:
        cols.insert(5, clock)
    right = ("size", "time (mean ± std)", "peak", "planned", clock)
    for col in cols:
        t.add_column(col, justify="right" if col in right else "left")
    for r in rows:
        status = {"ok": "[green]ok[/]", "oom": "[red]out of memory[/]", "predicted_oom": "[red]predicted OOM[/]"}.get(
            r["status"], f"[yellow]{r['status']}[/]"
        )
        time_text = f"{r['mean_ms'] / 1000:.2f} ± {r['std_ms'] / 1000:.2f} s" if r["mean_ms"] is not None else "-"
        cells = [str(r["size"]), r["strategy"], r["variant"], status, time_text,
                 format_bytes(r["peak_bytes"]), format_bytes(r["planned_peak_bytes"])]  # fmt: skip
        if clock is not None:
            sim = r.get("simulated_ms")
            cells.insert(5, f"{sim / 1000:.3f} s" if sim is not None else "-")
        t.add_row(*cells)
    return t


def run_bench(
    *,
    gpu: str | None,
    model: str | None,
    sizes: str | None,
    strategies: str,
    runs: int | None,
    out: Path | None,
    memory: str | None,
    precision: str,
    console: Console,
) -> Path:
    """Benchmark base / checkpoint_sequential / SFT training steps; write bench.csv, bench.json, bench.png.

    ``model``, ``sizes`` and ``runs`` left as None take the defaults for this machine's device
    (see wsitrain.bench.configs). Returns the output directory.

    With a ``gpu`` preset that has speed constants (wsitrain/gpu_speed.py), each plain and SFT configuration is
    also run on the simulated device and its simulated time printed beside the measured one. Without a GPU here,
    nothing is measured: the table holds simulated times only, and says so.
    """
    cuda = torch.cuda.is_available()
    speed = clock_speed(gpu, gpu_preset(gpu).label) if gpu is not None and gpu.strip().lower() != "cpu" else None
    simulated_only = speed is not None and not cuda
    device = "cuda" if cuda or simulated_only else "cpu"
    model = model or DEFAULT_MODEL
    if not resolve_model_name(model, key="--model").is_builtin:
        raise WsiTrainError(
            f"--model {model}: bench measures the built-in models",
            hint="wsitrain models lists them; plan works for torchvision/<name> and timm/<name> too",
        )
    check_precision(precision)
    runs = DEFAULT_RUNS[device] if runs is None else runs
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise WsiTrainError(f"--runs: {runs!r} must be a positive integer", hint="e.g. --runs 5")
    budget = resolve_budget(gpu if gpu is not None or device == "cuda" else "cpu", memory)
    with torch.device("meta"):
        net = build(model, 2)
    size_list = parse_sizes(sizes, net.stride) if sizes else list(DEFAULT_SIZES[device])
    strategy_list = parse_strategies(strategies)
    n_layers = 1 + len(net.features)  # the checkpointed trunk: normalize + the features' top-level layers
    configs = make_configs(
        model=model, sizes=size_list, strategies=strategy_list, n_layers=n_layers, stride=net.stride,
        budget_bytes=budget.bytes, device=device, precision=precision, runs=runs,
    )  # fmt: skip
    out_dir = Path(out) if out is not None else Path("bench-out") / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    predictor = Predictor(model, budget.bytes, device, precision)
    free = 0 if simulated_only else machine_free_bytes(device)
    meta = {
        "model": model, "device": device, "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "gpu": budget.gpu, "budget_bytes": budget.bytes, "budget_source": budget.source, "precision": precision,
        "runs": runs, "sizes": size_list, "strategies": strategy_list, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine_free_bytes": free,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }  # fmt: skip
    clock = f"simulated ({speed.name})" if speed is not None else None
    if simulated_only:
        meta["device_name"] = f"none: simulated {speed.name if speed else ''} only"
        console.print(
            f"bench {model}: no GPU on this machine, so NOTHING IS MEASURED; simulated times on the "
            f"{budget.gpu} preset only (the real executor on fake tensors, priced by the simulated clock), budget "
            f"{budget.describe()}, {len(configs)} configurations -> {out_dir}"
        )
    else:
        console.print(
            f"bench {model} on {device} ({meta['device_name']}), budget {budget.describe()}, "
            f"{len(configs)} configurations, {runs} runs each after 1 warm-up -> {out_dir}"
            + (f"; beside each, its simulated time on the {budget.gpu} preset" if speed is not None else "")
        )
    rows: list[dict[str, Any]] = []
    hosts: list[str] = []  # the host's share per SFT planner step (bench.host)
    oom_from: dict[str, int] = {}  # strategy variant -> smallest size that ran out of memory
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    task = progress.add_task("starting", total=len(configs))
    live_view = Group(progress, _live_table(rows, clock))
    with Live(live_view, console=console, refresh_per_second=2, transient=False) as live:
        for cfg in configs:
            progress.update(task, description=f"{cfg.strategy} {cfg.variant} at {cfg.size} px")
            key = f"{cfg.strategy}/{cfg.variant}"
            planned = predictor.planned_peak(cfg)
            if simulated_only:
                result = {"status": "simulated", "note": "no GPU here: not measured"}
            elif key in oom_from and cfg.strategy != "sft":  # the planner adapts; fixed variants only grow
                result = {"status": "oom", "note": f"not run: ran out of memory at {oom_from[key]} px already"}
            elif planned is not None and planned > free:
                result = {"status": "predicted_oom", "note": f"planned {format_bytes(planned)} > free here"}
            else:
                result = run_worker(cfg)
            if result["status"] == "oom" and key not in oom_from:
                oom_from[key] = cfg.size
            row = result_row(cfg, result, planned)
            row["simulated_ms"] = simulated_ms(cfg, speed, budget.target) if speed is not None else None
            rows.append(row)
            if cfg.strategy == "sft" and cfg.tile is None and budget.device == "cuda":
                progress.update(task, description=f"host share of the SFT step at {cfg.size} px (meta device)")
                share = host_share(model, cfg.size, budget, precision)
                rows[-1].update(host_columns(share))
                if share is not None:
                    hosts.append(f"SFT at {cfg.size} px: " + share.text())
            progress.advance(task)
            live.update(Group(progress, _live_table(rows, clock)))
        progress.update(task, description="done")
    console.print()
    for line in hosts:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    paths = write_outputs(out_dir, rows, meta, plot=not simulated_only)
    errors = [r for r in rows if r["status"] == "error"]
    for r in errors:
        console.print(f"[yellow]error[/] {r['strategy']} {r['variant']} at {r['size']} px: {r['note']}")
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return out_dir
