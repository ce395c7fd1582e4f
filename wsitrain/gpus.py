"""GPU presets and the memory budget a command plans or benchmarks against.

A preset names a card's memory so a plan can be made for a GPU this machine does not have
(``--gpu 2080ti`` on a laptop). The figure is the card's whole memory, as the SFT paper budgets it;
``--memory`` sets any other figure, and with neither the detected device's free memory is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from wsitrain.errors import WsiTrainError
from wsitrain.memory import SAFETY_MARGIN, DeviceMemory, detect_budget, probe_device_memory
from wsitrain.units import format_bytes, parse_bytes

GiB = 1024**3


# Host-to-device bandwidth of pinned copies, GB/s: the links' usual effective rates (PCIe 3.0 x16 ~12,
# 4.0 ~24, 5.0 ~48), not measured here. The plan divides the bytes it stages per step by them.
PCIE3, PCIE4, PCIE5 = 12.0, 24.0, 48.0


@dataclass(frozen=True)
class GpuPreset:
    name: str
    label: str
    memory_bytes: int
    host_link_gb_s: float


GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset("2080ti", "NVIDIA GeForce RTX 2080 Ti", 11 * GiB, PCIE3),
        GpuPreset("t4", "NVIDIA T4", 16 * GiB, PCIE3),
        GpuPreset("v100-16", "NVIDIA V100 16 GB", 16 * GiB, PCIE3),
        GpuPreset("v100-32", "NVIDIA V100 32 GB", 32 * GiB, PCIE3),
        GpuPreset("a100-40", "NVIDIA A100 40 GB", 40 * GiB, PCIE4),
        GpuPreset("a100-80", "NVIDIA A100 80 GB", 80 * GiB, PCIE4),
        GpuPreset("rtx3090", "NVIDIA GeForce RTX 3090", 24 * GiB, PCIE4),
        GpuPreset("rtx4090", "NVIDIA GeForce RTX 4090", 24 * GiB, PCIE4),
        GpuPreset("a6000", "NVIDIA RTX A6000", 48 * GiB, PCIE4),
        GpuPreset("l40s", "NVIDIA L40S", 48 * GiB, PCIE4),
        GpuPreset("h100", "NVIDIA H100 80 GB", 80 * GiB, PCIE5),
        # Sold as "141 GB"; nvidia-smi reports 143771 MiB.
        GpuPreset("h200", "NVIDIA H200", 143771 * 1024**2, PCIE5),
    )
}
GPU_NAMES = tuple(GPU_PRESETS)


def gpu_preset(name: str) -> GpuPreset:
    """The preset called ``name`` (case and spaces ignored); WsiTrainError listing the valid names otherwise."""
    key = name.strip().lower().replace(" ", "").replace("_", "-")
    if key not in GPU_PRESETS:
        raise WsiTrainError(
            f"unknown GPU {name!r}",
            hint=f"choose one of: {', '.join(GPU_NAMES)}; or give --memory SIZE (e.g. --memory 24GiB)",
        )
    return GPU_PRESETS[key]


@dataclass(frozen=True)
class Budget:
    """How many bytes to plan for, for which kind of device, and where the figure came from."""

    bytes: int
    device: str  # "cuda" or "cpu": the device type the plan is for
    source: str  # for people: "preset 2080ti (NVIDIA GeForce RTX 2080 Ti)", "--memory 24GiB", "detected CPU"
    gpu: str | None = None  # preset name, when one was given

    def describe(self) -> str:
        return f"{format_bytes(self.bytes)} ({self.source})"


def resolve_budget(gpu: str | None = None, memory: str | int | None = None) -> Budget:
    """Budget from ``--memory`` (wins), else a ``--gpu`` preset, else the detected GPU, else the CPU's free RAM.

    ``gpu="cpu"`` means this machine's CPU even where a GPU is present.
    """
    preset = gpu_preset(gpu) if gpu is not None and gpu.strip().lower() != "cpu" else None
    want_cpu = gpu is not None and gpu.strip().lower() == "cpu"
    if memory is not None:
        n = parse_bytes(memory, what="--memory")
        device = "cuda" if preset is not None or (not want_cpu and torch.cuda.is_available()) else "cpu"
        return Budget(n, device, f"--memory {memory}", preset.name if preset else None)
    if preset is not None:
        return Budget(preset.memory_bytes, "cuda", f"preset {preset.name}: {preset.label}", preset.name)
    if not want_cpu and torch.cuda.is_available():
        return Budget(detect_budget("cuda"), "cuda", f"detected GPU {torch.cuda.get_device_name()}, free memory")
    return Budget(detect_budget("cpu"), "cpu", "detected CPU, available RAM")


def run_budget(
    memory_budget: int | str | None,
    device: torch.device,
    probe: Callable[[torch.device | str], DeviceMemory] = probe_device_memory,
) -> Budget:
    """The one budget of a training or prediction run, resolved at its start and passed to the engine as bytes.

    ``engine.memory_budget`` when set; else detected once on ``device`` now (free memory plus what our caching
    allocator already holds, times the safety margin), so it does not shrink slide after slide as the
    allocator fills. ``probe`` is injectable for tests.
    """
    if memory_budget is not None:
        n = parse_bytes(memory_budget, what="engine.memory_budget")
        return Budget(n, device.type, f"engine.memory_budget {memory_budget}")
    what = "free memory plus the caching allocator's reserve" if device.type == "cuda" else "available RAM"
    n = detect_budget(device, probe)
    return Budget(n, device.type, f"detected on {device} at the start of the run: {what} x {SAFETY_MARGIN:g}")
