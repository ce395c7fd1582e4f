"""One benchmark configuration in its own process.

A fresh process per configuration keeps peak-memory figures honest (nothing cached from an earlier
configuration) and lets an out-of-memory kill take down only that configuration. The runner forks each
worker from a forkserver that has imported torch once (:func:`child_main`); by hand,
``python -m wsitrain.bench.worker '<json config>'`` prints one line ``WSITRAIN_BENCH_RESULT {json}``.

Protocol (the SFT paper's): one training step = forward, MSE loss against a fixed target, backward;
batch 1; one warm-up step, then ``runs`` timed steps, each with its own peak.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from wsitrain.errors import PlanError
from wsitrain.memory import PeakMeter, tune_owned_process
from wsitrain.models import build, parameter_bytes
from wsitrain.precision import activation_dtype
from wsitrain.sft import SFT

RESULT_PREFIX = "WSITRAIN_BENCH_RESULT "
# The image of every step: uint8 on the measured device, as a slide's pixels are (the runner plans the same input).
INPUT_DTYPE = torch.uint8
NUM_CLASSES = 2
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT)


def _forward_fn(model: nn.Module, cfg: dict[str, Any]) -> tuple[Callable[[torch.Tensor], torch.Tensor], SFT | None]:
    """The forward of one strategy, and the SFT module (or None) for its plan and stats."""
    strategy = cfg["strategy"]
    if strategy == "base":
        return model, None
    if strategy == "checkpoint":
        trunk = nn.Sequential(model.normalize, *model.features)
        # checkpoint_sequential fails when a segment starts with an in-place op (it modifies the saved
        # segment input); out-of-place ReLUs at the chain level cost no saved memory, only a transient.
        for m in trunk:
            if getattr(m, "inplace", False):
                m.inplace = False
        head = nn.Sequential(model.pool, model.flatten, model.classifier)
        segments = min(int(cfg["segments"]), len(trunk))
        return (lambda x: head(checkpoint_sequential(trunk, segments, x, use_reentrant=False))), None
    if strategy == "sft":
        # the protocol's MSE on two outputs gives the pooled gradient no direction known in forward: one pass
        # (execution/one_pass.py) would recompute after it every step, so the engine recomputes from the start
        sft = SFT(model, memory_budget=cfg.get("budget_bytes"), tile_size=cfg.get("tile"), one_pass=False)
        return sft, sft
    raise ValueError(f"unknown strategy {strategy!r}")


def _plan_that_ran(sft: SFT, x: torch.Tensor, dtype: torch.dtype) -> dict[str, Any] | None:
    """The plan the engine ran on ``x`` (a uint8 image on the device, inside the budget)."""
    try:
        return sft.plan_of(x, dtype).to_dict()
    except Exception:  # the plan is extra information; a failure here must not hide the measurement
        return None


def run_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in this process and return its result dict (status ok / oom / error)."""
    device = torch.device(cfg.get("device", "cpu"))
    if device.type == "cuda" and device.index is None:  # the memory-fraction cap needs an index (torch 2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = activation_dtype(cfg.get("precision", "fp32"))
    budget = cfg.get("budget_bytes")
    torch.manual_seed(int(cfg.get("seed", 0)))
    # every strategy measured with the allocator fit uses; on CUDA capped at the budget to emulate a smaller card
    tune_owned_process(device, budget if budget and cfg.get("cap_gpu", True) else None)
    result: dict[str, Any] = {"status": "ok", "times_ms": [], "peaks_bytes": []}
    meter = PeakMeter(device)  # this worker owns the measurement: it alone starts (resets) the meter
    try:
        model = build(cfg["model"], NUM_CLASSES).to(device)
        size = int(cfg["size"])
        x = torch.randint(0, 256, (1, 3, size, size), dtype=INPUT_DTYPE, device=device)
        target = torch.zeros(1, NUM_CLASSES, device=device)
        forward, sft = _forward_fn(model, cfg)
        autocast = torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
        # What the step adds on top of the loaded model and input; CUDA counts them in max_memory_allocated.
        static_bytes = parameter_bytes(model) + x.numel() * x.element_size()

        def step() -> None:
            with autocast:
                y = forward(x)
            F.mse_loss(y.float(), target).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        for i in range(1 + int(cfg.get("runs", 1))):
            model.zero_grad(set_to_none=True)  # gradients are allocated inside every measured step
            # CPU: a baseline per run, after the warm-up, so one-time allocations (thread pools, kernel caches)
            # are not the step's memory. CUDA counts the model and input in the allocated peak itself.
            base = meter.current() if device.type == "cpu" else 0
            meter.start()
            t0 = time.perf_counter()
            step()
            ms = (time.perf_counter() - t0) * 1000
            peak = meter.peak() if device.type == "cuda" else max(0, meter.peak() - base) + static_bytes
            if i == 0:
                result["warmup_ms"] = ms
                continue
            result["times_ms"].append(ms)
            result["peaks_bytes"].append(peak)
            if device.type == "cuda":  # allocated peak above; what the caching allocator held (side-stream blocks)
                result.setdefault("reserved_peaks_bytes", []).append(meter.peak_reserved())
        if sft is not None:
            plan = _plan_that_ran(sft, x, dtype)
            result["plan"] = plan
            result["planned_peak_bytes"] = None if plan is None else plan["estimated_peak_bytes"]
            result["sft_stats"] = json.loads(json.dumps(sft.last_stats.summary(), default=str))
    except Exception as e:
        if isinstance(e, PlanError) and "does not fit" in str(e):
            # The engine refuses a budget it cannot meet: the planner's out-of-memory verdict, nothing ran.
            result["status"] = "predicted_oom"
            result["note"] = str(e).splitlines()[0][:300]
        elif _is_oom(e):
            result["status"] = "oom"
            result["note"] = str(e).splitlines()[0][:200]
        else:
            result["status"] = "error"
            result["note"] = f"{e.__class__.__name__}: {e}".splitlines()[0][:300]
            result["traceback"] = traceback.format_exc()[-4000:]
        return result
    times = result["times_ms"]
    result["mean_ms"] = sum(times) / len(times)
    result["std_ms"] = math.sqrt(sum((t - result["mean_ms"]) ** 2 for t in times) / len(times))
    result["peak_bytes"] = max(result["peaks_bytes"])
    if device.type == "cpu" and budget and result["peak_bytes"] > budget:
        # On CPU the budget is emulated: a step that needed more than the card has is out of memory there.
        result["status"] = "oom"
        result["note"] = "peak above the budget"
    return result


def child_main(conn: Any, cfg: dict[str, Any]) -> None:
    """Entry point of a forked worker: run ``cfg`` and send the result dict through ``conn``."""
    try:
        result = run_config(cfg)
    except BaseException as e:  # anything but a kill must come back as a result, never a silent exit
        result = {"status": "error", "note": f"{e.__class__.__name__}: {e}".splitlines()[0][:300]}
    conn.send(result)
    conn.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m wsitrain.bench.worker '<json config>'", file=sys.stderr)
        return 2
    result = run_config(json.loads(args[0]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
