"""The doctor's in-process checks: exactness of the engine on a device, a training step's peak under a memory cap
against its plan and the simulated device, and the device's kernel workspaces."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from wsitrain.memory import PeakMeter, cap_cuda_allocator
from wsitrain.models import build
from wsitrain.sft import SFT
from wsitrain.sft.target import detected_target
from wsitrain.units import format_bytes

NO_CUDA = "not run: no CUDA device"
# float64 on both sides: the tiled and the plain step differ only by summation order (as tests/test_gpu.py).
F64 = {"rtol": 1e-10, "atol": 1e-11}


@dataclass
class Check:
    """One line of the doctor's report: what was checked, its outcome and the figures behind it."""

    name: str
    status: str  # "passed", "failed", "measured", "error", or "not run: <why>"
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status not in ("failed", "error")


def not_run(name: str, why: str = NO_CUDA) -> Check:
    return Check(name, why if why.startswith("not run") else f"not run: {why}")


def _step(net: nn.Module, params: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Forward, a fixed loss, backward: the output, every parameter gradient and the input gradient."""
    params.zero_grad(set_to_none=True)
    y = net(x)
    (y.square().sum() + y.sum()).backward()
    return {"y": y.detach(), "grads": [p.grad.clone() for p in params.parameters()],
            "x_grad": None if x.grad is None else x.grad.clone()}  # fmt: skip


def exactness(device: torch.device, size: int = 128, tile: int = 32) -> Check:
    """The tiny model tiled (``tile`` px tiles, two segments) against plain autograd in float64 on ``device``:
    outputs, every parameter gradient and the input gradient; then a uint8 image on the host (streamed per tile)."""
    t0 = time.perf_counter()
    name = f"exactness on {device.type} (float64, tiled vs plain)"
    try:
        torch.manual_seed(0)
        plain = build("tiny", 2).to(device, torch.float64)
        tiled_model = copy.deepcopy(plain)
        sft = SFT(tiled_model, memory_budget="4GiB", tile_size=tile, checkpoints=["features.pool2"])
        x = torch.rand(1, 3, size, size, dtype=torch.float64, device=device)
        ref = _step(plain, plain, x.clone().requires_grad_(True))
        var = _step(sft, tiled_model, x.clone().requires_grad_(True))
        torch.testing.assert_close(var["y"], ref["y"], **F64)
        for a, b in zip(ref["grads"], var["grads"], strict=True):
            torch.testing.assert_close(b, a, **F64)
        torch.testing.assert_close(var["x_grad"], ref["x_grad"], **F64)
        image = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8)  # on the host, as the loader gives it
        ref = _step(plain, plain, image.to(device))
        var = _step(sft, tiled_model, image)
        torch.testing.assert_close(var["y"], ref["y"], **F64)
        for a, b in zip(ref["grads"], var["grads"], strict=True):
            torch.testing.assert_close(b, a, **F64)
        tiles = sum(s.n_tiles for s in sft.plan_of(image).segments if s.mode == "tiled")
    except AssertionError as e:
        return Check(name, "failed", str(e).splitlines()[0][:300], seconds=time.perf_counter() - t0)
    except Exception as e:  # the report must say what broke, whatever it is
        return Check(name, "error", f"{type(e).__name__}: {e}".splitlines()[0][:300], seconds=time.perf_counter() - t0)
    return Check(name, "passed", f"outputs and all gradients equal plain autograd ({tiles} tiles; also with a "
                 "uint8 image streamed from the host)", {"tiles": tiles}, time.perf_counter() - t0)  # fmt: skip


def simulated_peak(model_name: str, shape: tuple[int, ...], budget: int) -> int:
    """The simulated device's peak for one steady-state training step (Adam) of the same plan."""
    from wsitrain.sft.simulate import simulate_step  # fake tensors: imported only where a GPU check runs

    with torch.device("meta"):
        net = build(model_name, 2)
    return int(simulate_step(net, shape, budget, optimizer="adam").device_peak.bytes)


def peak_under_cap(device: torch.device, model_name: str, size: int, cap: int) -> Check:
    """One fit-like step (uint8 image on the host, cross entropy, backward, Adam) with the device capped at ``cap``:
    the measured peak against the plan's estimate and the simulated device's peak."""
    name = f"peak under a {format_bytes(cap)} cap: {model_name} at {size} px"
    if device.type != "cuda":
        return not_run(name)
    t0 = time.perf_counter()
    torch.cuda.empty_cache()  # earlier checks' cached blocks would count against the cap
    cap_cuda_allocator(device, cap)
    figures: dict[str, Any] = {"cap_bytes": cap}
    try:
        _capped_step(device, model_name, size, cap, figures)
    except torch.OutOfMemoryError as e:
        figures["oom"] = str(e).splitlines()[0][:200]
    except Exception as e:
        return Check(name, "error", f"{type(e).__name__}: {e}".splitlines()[0][:300], figures, time.perf_counter() - t0)
    finally:
        cap_cuda_allocator(device, None)
        torch.cuda.empty_cache()
    try:
        figures["simulated_peak_bytes"] = simulated_peak(model_name, (1, 3, size, size), cap)
    except Exception as e:  # the simulation is a second opinion; its failure is reported, not fatal
        figures["simulated_peak_bytes"] = None
        figures["simulation_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    return _cap_verdict(name, figures, time.perf_counter() - t0)


def _capped_step(device: torch.device, model_name: str, size: int, cap: int, figures: dict[str, Any]) -> None:
    """The step itself, in its own frame: its tensors are gone when it returns or raises."""
    model = build(model_name, 2).to(device)
    sft = SFT(model, memory_budget=cap, optimizer="adam")
    image = torch.randint(0, 256, (1, 3, size, size), dtype=torch.uint8).pin_memory()  # (B, C, H, W) on the host
    figures["planned_peak_bytes"] = sft.plan_of(image).estimated_peak_bytes
    opt = torch.optim.Adam(model.parameters())
    meter = PeakMeter(device)
    meter.start()
    # two steps: from the second on, Adam's state is live through forward and backward (measured on an H100:
    # 0.1-0.2 GiB higher than the first step for ResNet-50 / DarkNet-19)
    for _ in range(2):
        loss = nn.functional.cross_entropy(sft(image).float(), torch.zeros(1, dtype=torch.long, device=device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    figures["measured_peak_bytes"] = meter.peak()
    figures["measured_reserved_bytes"] = meter.peak_reserved()


def _cap_verdict(name: str, f: dict[str, Any], seconds: float) -> Check:
    sim = f.get("simulated_peak_bytes")
    sim_text = f"simulated {format_bytes(sim)}" if sim else f"not simulated ({f.get('simulation_error', '?')})"
    if "oom" in f:
        return Check(name, "failed", f"out of memory under the cap (planned {format_bytes(f.get('planned_peak_bytes'))}"
                     f", {sim_text}): {f['oom']}", f, seconds)  # fmt: skip
    peak, planned = f["measured_peak_bytes"], f["planned_peak_bytes"]
    f["measured_over_planned"] = peak / planned if planned else None
    status = "passed" if peak <= f["cap_bytes"] else "failed"
    return Check(name, status, f"measured {format_bytes(peak)}, planned {format_bytes(planned)} "
                 f"({peak / planned:.2f}x), {sim_text}", f, seconds)  # fmt: skip


def workspaces(device: torch.device) -> Check:
    """cuBLAS/cuDNN workspaces: allocator growth around the first conv and matmul forward + backward."""
    name = "cuBLAS / cuDNN workspaces and headroom"
    if device.type != "cuda":
        return not_run(name)
    t0 = time.perf_counter()
    f: dict[str, Any] = {}
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    for kind, make in (("conv", _conv_step), ("matmul", _matmul_step)):
        a0, r0 = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        tensor_bytes = make(device)  # the largest set of tensors the step holds at once
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - a0
        f[f"{kind}_transient_bytes"] = max(0, peak - tensor_bytes)  # held during the step beyond its tensors
        f[f"{kind}_kept_bytes"] = torch.cuda.memory_allocated(device) - a0  # kept after it (cuBLAS keeps its own)
        f[f"{kind}_reserved_growth_bytes"] = torch.cuda.memory_reserved(device) - r0
    free, total = torch.cuda.mem_get_info(device)
    allowance = detected_target(device).runtime_bytes  # the planner's workspace allowance for this generation
    f.update(free_bytes=int(free), total_bytes=int(total), planned_runtime_base_bytes=allowance)
    largest = max(f["conv_transient_bytes"], f["matmul_transient_bytes"]) + f["matmul_kept_bytes"]
    f["measured_workspace_bytes"] = largest
    # Uncapped, cuDNN takes the workspace of its fastest algorithm (an H100: 514 MiB for this conv); under the
    # allocator cap fit sets it picks one that fits, so a figure above the allowance is information, not a failure.
    note = "within" if largest <= allowance else "above; under fit's allocator cap cuDNN picks algorithms that fit"
    return Check(name, "measured", f"uncapped workspaces up to {format_bytes(largest)} ({note}; the planner allows "
                 f"{format_bytes(allowance)}); {format_bytes(free)} of {format_bytes(total)} free", f,
                 time.perf_counter() - t0)  # fmt: skip


def _conv_step(device: torch.device) -> int:
    conv = nn.Conv2d(64, 64, 3, padding=1).to(device)
    x = torch.randn(1, 64, 1024, 1024, device=device, requires_grad=True)  # (B, C, H, W)
    y = conv(x)
    y.backward(torch.ones_like(y))
    # x, y, its gradient and x.grad live at once at the end of backward (weights are a few KiB)
    return 4 * x.numel() * x.element_size()


def _matmul_step(device: torch.device) -> int:
    a = torch.randn(4096, 4096, device=device, requires_grad=True)
    b = torch.randn(4096, 4096, device=device, requires_grad=True)
    y = a @ b
    y.backward(torch.ones_like(y))
    return 6 * a.numel() * a.element_size()  # a, b, y, its gradient, a.grad and b.grad at the end of backward
