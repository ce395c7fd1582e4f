"""GPU presets and the memory budget a command plans or benchmarks against.

A preset names a card so a plan can be made for a GPU this machine does not have (``--gpu 2080ti`` on a
laptop): its budget is the memory tensors can really use (the total the driver reports minus the CUDA
context), not the nominal size the card is sold with; the plan says "usable X of nominal Y". ``--memory``
sets any other figure, and with neither the detected device's free memory is used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from wsitrain.errors import WsiTrainError
from wsitrain.memory import SAFETY_MARGIN, DeviceMemory, detect_budget, probe_device_memory
from wsitrain.sft.target import CPU_TARGET, GENERATIONS, TargetDevice, generation_of, target_for
from wsitrain.units import format_bytes, parse_bytes

GiB = 1024**3


# Host-to-device bandwidth of pinned copies, GB/s: the links' usual effective rates (PCIe 3.0 x16 ~12,
# 4.0 ~24, 5.0 ~48), not measured here. The plan divides the bytes it stages per step by them.
PCIE3, PCIE4, PCIE5 = 12.0, 24.0, 48.0
MiB = 1024**2


@dataclass(frozen=True)
class GpuPreset:
    """A card as the planner sees it. ``nominal_bytes`` is the memory it is sold with; ``total_bytes`` what
    ``torch.cuda.mem_get_info`` reports as total (less than nominal: ECC and the driver's reserve); the plan's
    budget is ``usable_bytes``, that total minus the CUDA context of the card's generation."""

    name: str
    label: str
    nominal_bytes: int
    total_bytes: int
    host_link_gb_s: float
    capability: tuple[int, int]  # CUDA compute capability
    tflops: float  # published fp32 (non-tensor-core) rate, TFLOP/s

    @property
    def generation(self) -> str:
        return generation_of(self.capability)

    @property
    def usable_bytes(self) -> int:
        return self.total_bytes - GENERATIONS[self.generation].context_bytes

    @property
    def memory_bytes(self) -> int:
        """The budget a plan for this card gets: its usable memory."""
        return self.usable_bytes

    def target(self, large_conv: bool = False) -> TargetDevice:
        """The planning facts of this card. Whether its cuDNN runs convolutions above 2^31 elements per sample
        is a fact of the machine it will run on, not of the card: assumed not, unless told."""
        why = "told so" if large_conv else "assumed for a preset (cuDNN >= 9.3 with torch >= 2.6 runs more)"
        return TargetDevice(
            "cuda", f"{self.label} (preset {self.name})", self.generation, large_conv, why, self.host_link_gb_s,
            self.tflops, self.nominal_bytes, self.usable_bytes,
        )  # fmt: skip


def _gib(x: float) -> int:
    return int(x * GiB)


# Totals as cudaMemGetInfo (torch.cuda.mem_get_info) reports them, i.e. the "total capacity" of PyTorch's
# out-of-memory messages (published figures from users' reports): 2080 Ti 10.76 GiB, T4 14.75 GiB, V100 15.78 /
# 31.75 GiB, A100 39.59 / 79.15 GiB, RTX 3090 23.69 GiB, RTX 4090 23.65 GiB, A6000 47.54 GiB, L40S 44.52 GiB (ECC on),
# H200 143771 MiB (nvidia-smi's "Total"). H100 SXM measured: 85,017,493,504 B (79.18 GiB) from cudaMemGetInfo,
# where nvidia-smi says 81559 MiB, 480 MiB more (driver 580.159, 2026-11-24): nvidia-smi's figure overstates it,
# so the H200's may too.
# fp32 rates are NVIDIA's published boost figures (H100/H200: SXM).
GPU_PRESETS: dict[str, GpuPreset] = {
    p.name: p
    for p in (
        GpuPreset("2080ti", "NVIDIA GeForce RTX 2080 Ti", 11 * GiB, _gib(10.76), PCIE3, (7, 5), 13.4),
        GpuPreset("t4", "NVIDIA T4", 16 * GiB, _gib(14.75), PCIE3, (7, 5), 8.1),
        GpuPreset("v100-16", "NVIDIA V100 16 GB", 16 * GiB, _gib(15.78), PCIE3, (7, 0), 15.7),
        GpuPreset("v100-32", "NVIDIA V100 32 GB", 32 * GiB, _gib(31.75), PCIE3, (7, 0), 15.7),
        GpuPreset("a100-40", "NVIDIA A100 40 GB", 40 * GiB, _gib(39.59), PCIE4, (8, 0), 19.5),
        GpuPreset("a100-80", "NVIDIA A100 80 GB", 80 * GiB, _gib(79.15), PCIE4, (8, 0), 19.5),
        GpuPreset("rtx3090", "NVIDIA GeForce RTX 3090", 24 * GiB, _gib(23.69), PCIE4, (8, 6), 35.6),
        GpuPreset("rtx4090", "NVIDIA GeForce RTX 4090", 24 * GiB, _gib(23.65), PCIE4, (8, 9), 82.6),
        GpuPreset("a6000", "NVIDIA RTX A6000", 48 * GiB, _gib(47.54), PCIE4, (8, 6), 38.7),
        GpuPreset("l40s", "NVIDIA L40S", 48 * GiB, _gib(44.52), PCIE4, (8, 9), 91.6),
        GpuPreset("h100", "NVIDIA H100 80 GB", 80 * GiB, 85_017_493_504, PCIE5, (9, 0), 67.0),
        # Sold as "141 GB"; nvidia-smi reports 143771 MiB.
        GpuPreset("h200", "NVIDIA H200", 141 * GiB, 143771 * MiB, PCIE5, (9, 0), 67.0),
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
    target: TargetDevice = CPU_TARGET  # the device's planning facts (generation, workspaces, link)

    def describe(self) -> str:
        return f"{format_bytes(self.bytes)} ({self.source})"


def resolve_budget(gpu: str | None = None, memory: str | int | None = None) -> Budget:
    """Budget from ``--memory`` (wins), else a ``--gpu`` preset, else the detected GPU, else the CPU's free RAM.

    ``gpu="cpu"`` means this machine's CPU even where a GPU is present.
    """
    preset = gpu_preset(gpu) if gpu is not None and gpu.strip().lower() != "cpu" else None
    want_cpu = gpu is not None and gpu.strip().lower() == "cpu"
    if preset is not None:
        target = preset.target()
    else:
        target = target_for("cuda") if not want_cpu and torch.cuda.is_available() else CPU_TARGET
    if memory is not None:
        n = parse_bytes(memory, what="--memory")
        return Budget(n, target.kind, f"--memory {memory}", preset.name if preset else None, target)
    if preset is not None:
        source = (
            f"preset {preset.name}: {preset.label}, usable {format_bytes(preset.usable_bytes)} of nominal "
            f"{format_bytes(preset.nominal_bytes)} (driver total {format_bytes(preset.total_bytes)} minus "
            f"the CUDA context {format_bytes(GENERATIONS[preset.generation].context_bytes)})"
        )
        return Budget(preset.usable_bytes, "cuda", source, preset.name, target)
    if target.cuda:
        name = torch.cuda.get_device_name()
        return Budget(detect_budget("cuda"), "cuda", f"detected GPU {name}, free memory", None, target)
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
        return Budget(n, device.type, f"engine.memory_budget {memory_budget}", target=_run_target(device))
    what = "free memory plus the caching allocator's reserve" if device.type == "cuda" else "available RAM"
    n = detect_budget(device, probe)
    source = f"detected on {device} at the start of the run: {what} x {SAFETY_MARGIN:g}"
    return Budget(n, device.type, source, target=_run_target(device))


def _run_target(device: torch.device) -> TargetDevice:
    return target_for(device)  # the run's device (the model's), detected where visible
