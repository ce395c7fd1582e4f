"""The device a plan is for: what the planner must know about it beyond a byte budget.

A plan for CUDA depends on the GPU's generation (the kernel workspaces cuBLAS and cuDNN take), on whether its
cuDNN runs convolutions above 2^31 elements per sample, and on its host link and FLOP rate (what a byte moved
to host memory costs in the time model). ``TargetDevice`` carries these as frozen planning facts that the plan
prints; GPU presets (``wsitrain.gpus``) and the detected device both build one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from wsitrain.gpu_speed import gpu_speed, speed_preset_of
from wsitrain.units import format_bytes

MiB = 2**20

# cuDNN (and PyTorch's convolution dispatch) index a sample with 32-bit integers below cuDNN 9.3 with torch 2.6:
# a convolution whose input or output holds 2^31 elements per sample or more falls back to PyTorch's im2col
# ("slow_conv2d"), whose column buffer is about kernel-area (9 for 3x3) times the input: a plan made without
# that buffer runs out of memory. From cuDNN 9.3 such a convolution runs on slow 64-bit-index kernels: DarkNet-19's
# first layer on a whole 8192 px map, 32 x 8192 x 8192 = exactly 2^31 elements, ran at 1 TFLOP/s on an H200 against
# 13 on tiles (measured, 2026-11-27). Plans keep every convolution at or below this, the largest 32-bit index.
CONV_ELEMENTS_LIMIT = 2**31 - 1
LARGE_CONV_TORCH = (2, 6)
LARGE_CONV_CUDNN = 90300


@dataclass(frozen=True)
class Generation:
    """What a GPU generation's kernels hold besides tensors, and its CUDA context."""

    name: str
    runtime_bytes: int  # cuBLAS/cuBLASLt/cuDNN workspaces of a training step (forward and backward threads)
    context_bytes: int  # the CUDA context and loaded kernels, out of the card's memory before any tensor
    why: str


# Workspaces: PyTorch gives each (thread, stream) its own cuBLAS handle and workspace, and autograd runs backward
# on its own thread, so a step holds two. PyTorch's default cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG) is
# ":4096:2:16:8" (8.125 MiB) below Hopper and ":4096:8" (32 MiB) on Hopper and later; cuBLASLt takes its own
# (1 MiB by default below Hopper, up to the cuBLAS size on Hopper); cuDNN's convolution workspaces come on top
# (PyTorch lets cuDNN pick algorithms whose workspace fits free memory; 32 MiB covers the usual 3x3 kernels).
# Context: the CUDA context with lazy module loading (CUDA >= 11.7, PyTorch's default) and the kernels a CNN
# step loads: a few hundred MiB, more on newer generations (larger kernel images). Hopper's is measured: an H100
# (torch 2.11, CUDA 13.0, cuDNN 9.19) held 769 MiB outside PyTorch's allocator after a DarkNet-19 step and 921 MiB
# after six backbones had loaded their kernels (benchmarks/bench_measured.py); 1 GiB leaves room. The workspaces are
# published defaults; under the allocator cap that fit sets, cuDNN picks algorithms whose workspace fits (an
# uncapped H100 gave one 3x3 convolution 514 MiB, `wsitrain doctor`). The older generations' figures are typical
# ones, to be replaced by `wsitrain doctor`'s measurements.
GENERATIONS: dict[str, Generation] = {
    "volta-turing": Generation(
        "Volta/Turing (sm 7.x)", 64 * MiB, 300 * MiB, "2 x 8.1 MiB cuBLAS + 2 x 1 MiB cuBLASLt + 32 MiB cuDNN, rounded"
    ),
    "ampere-ada": Generation(
        "Ampere/Ada (sm 8.x)", 96 * MiB, 400 * MiB,
        "2 x 8.1 MiB cuBLAS + 2 x 1 MiB cuBLASLt + 32 MiB cuDNN, with room for TF32/bf16 kernels' larger workspaces",
    ),  # fmt: skip
    "hopper+": Generation(
        "Hopper or later (sm >= 9.0)", 160 * MiB, 1024 * MiB, "2 x 32 MiB cuBLAS + 2 x 32 MiB cuBLASLt + 32 MiB cuDNN"
    ),
}
# A CUDA device of unknown generation (a bare --memory figure) is planned with the largest allowance.
UNKNOWN_GENERATION = "hopper+"
# CPU: oneDNN scratchpads and reordered weight copies (measured: VGG-16 at 64 px, 30 MiB with twice its largest
# weight on top; costs.memory_terms adds that).
CPU_RUNTIME_BYTES = 12 * MiB
# The time model's CUDA device when none is named: a 2080 Ti's nominal 13.4 TFLOP/s (fp32) on PCIe 3.0 x16.
DEFAULT_CUDA_TFLOPS = 13.4
DEFAULT_LINK_GB_S = 12.0
# CPU: host checkpoints are the same memory; a byte "moved" costs a copy, the time model's traffic price
CPU_HOST_BYTE_FLOPS = 8.0


def generation_of(capability: tuple[int, int]) -> str:
    """The generation key of a compute capability (Pascal and older are planned as Volta/Turing)."""
    major = capability[0]
    return "volta-turing" if major < 8 else "ampere-ada" if major == 8 else "hopper+"


def large_conv_supported(torch_version: str, cudnn_version: int | None) -> bool:
    """Does this PyTorch + cuDNN run convolutions above 2^31 elements per sample in cuDNN (no im2col fallback)?"""
    parts = torch_version.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) >= LARGE_CONV_TORCH and cudnn_version is not None and cudnn_version >= LARGE_CONV_CUDNN


@dataclass(frozen=True)
class TargetDevice:
    """The planning facts of the device a plan is for (frozen; printed with the plan)."""

    kind: str  # "cpu" | "cuda"
    label: str  # for people: "NVIDIA H100 80 GB (preset h100)", "cuda:1 NVIDIA ... (detected)", "CPU"
    generation: str | None = None  # a GENERATIONS key (CUDA); None on CPU
    large_conv: bool = False  # convolutions above CONV_ELEMENTS_LIMIT elements per sample are safe (CUDA)
    large_conv_source: str = ""  # why large_conv holds or not, for the plan text
    host_link_gb_s: float = 0.0  # pinned host <-> device copies (CUDA); 0 on CPU
    tflops: float = 0.0  # nominal fp32 rate (CUDA), the time model's FLOP rate for pricing transfers
    nominal_bytes: int = 0  # the card's memory as sold (0: not known)
    usable_bytes: int = 0  # what tensors can use: total as cudaMemGetInfo reports it, minus the CUDA context
    # tiles run 1x1 layers on unaligned half-precision maps as matrix products (ops/pointwise_conv.py); False: as
    # convolutions, as every executor before 2026-11-27 did (a replay of a GPU kit's older rows)
    pointwise_matmul: bool = True
    # convolutions above CONV_ELEMENTS_LIMIT run whole where ``large_conv`` allows: the planner's second search, when
    # no plan keeps every convolution within the limit (``conv_elements_limit``)
    whole_large_conv: bool = False

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def runtime_bytes(self) -> int:
        """Kernel workspaces of a step, besides twice the largest weight (costs.memory_terms)."""
        if not self.cuda:
            return CPU_RUNTIME_BYTES
        return GENERATIONS[self.generation or UNKNOWN_GENERATION].runtime_bytes

    @property
    def conv_elements_limit(self) -> int | None:
        """Per-sample elements a convolution's input and output may hold (None: no limit).

        On every CUDA device: below cuDNN 9.3 (``large_conv`` False) a larger one takes im2col memory no plan counts;
        from 9.3 cuDNN runs it, but on slow 64-bit-index kernels. Measured on an H200
        (docs/benchmarks/gpu_time_breakdown.md): whole 8192 px maps of VGG-16's and DarkNet-19's first convolutions (3
        input channels) ran at 1 TFLOP/s against 13 on tiles, VGG-16's 64-channel ones 1.2-2x slower than on tiles. Only
        where no plan keeps every convolution within the limit may one run whole (``whole_large_conv``, set by the
        planner's second search).
        """
        if not self.cuda or (self.large_conv and self.whole_large_conv):
            return None
        return CONV_ELEMENTS_LIMIT

    @property
    def host_byte_flops(self) -> float:
        """A byte moved between host and device in the time model's FLOP-equivalents: the device's FLOP rate
        over the link's byte rate (a 2080 Ti on PCIe 3.0: 13.4e12 / 12e9 = 1117)."""
        if not self.cuda:
            return CPU_HOST_BYTE_FLOPS
        tflops = self.tflops or DEFAULT_CUDA_TFLOPS
        link = self.host_link_gb_s or DEFAULT_LINK_GB_S
        return tflops * 1e12 / (link * 1e9)

    def lines(self) -> tuple[str, ...]:
        """The plan's text about its device."""
        if not self.cuda:
            return (f"device: {self.label}",)
        gen = GENERATIONS[self.generation or UNKNOWN_GENERATION]
        mem = ""
        if self.usable_bytes and self.nominal_bytes:
            mem = f"; usable {format_bytes(self.usable_bytes)} of nominal {format_bytes(self.nominal_bytes)}"
        gen_name = gen.name if self.generation else f"generation unknown, planned as {gen.name}"
        conv = (
            "convolutions above 2^31 elements per sample run whole (no plan keeps them within it; cuDNN's slow path)"
            if self.conv_elements_limit is None
            else "every convolution kept at or below 2^31 elements per sample ("
            + ("cuDNN's slow 64-bit-index kernels" if self.large_conv else "im2col fallback")
            + " otherwise)"
        )
        return (
            f"device: {self.label} ({gen_name}){mem}",
            f"  kernel workspaces {format_bytes(self.runtime_bytes)} ({gen.why}); {conv}: {self.large_conv_source}",
            f"  host link {self.host_link_gb_s or DEFAULT_LINK_GB_S:g} GB/s at {self.tflops or DEFAULT_CUDA_TFLOPS:g} "
            f"TFLOP/s: a byte moved to or from host memory costs {self.host_byte_flops:.0f} FLOPs in the time model",
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["runtime_bytes"] = self.runtime_bytes
        d["conv_elements_limit"] = self.conv_elements_limit
        d["host_byte_flops"] = self.host_byte_flops
        return d


CPU_TARGET = TargetDevice("cpu", "CPU")


def cuda_target_unknown(large_conv: bool = False) -> TargetDevice:
    """A CUDA device known only by a byte figure: the largest allowance, the convolution limit unless told."""
    return TargetDevice(
        "cuda",
        "CUDA device (not named)",
        None,
        large_conv,
        "told so" if large_conv else "assumed for a device not named (cuDNN >= 9.3, torch >= 2.6 run more)",
    )


def detected_target(device: torch.device) -> TargetDevice:
    """The target of a CUDA device this process can see (the model's device, not the current one)."""
    if device.type != "cuda":
        return CPU_TARGET
    cap = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    ok = large_conv_supported(torch.__version__, cudnn)
    # a card with speed constants plans its host transfers at its preset's rates, as `plan --gpu` does for it: with
    # the defaults' (a 2080 Ti's 13.4 TFLOP/s on PCIe 3.0) an H200 priced a byte to or from the host 20% cheaper and
    # chose another plan than `plan --gpu h200` printed (measured, 2026-11-27: docs/benchmarks/gpu_time_breakdown.md)
    speed = gpu_speed(speed_preset_of(name))
    return TargetDevice(
        "cuda",
        f"{device} {name} (detected)",
        generation_of(cap),
        ok,
        f"torch {torch.__version__.split('+')[0]}, cuDNN {cudnn} on this machine",
        speed.link_gb_s if speed is not None else 0.0,
        speed.fp32_tflops if speed is not None else 0.0,
    )


def target_for(device: torch.device | str) -> TargetDevice:
    """The default target of a device type or device: detected where it is a visible GPU, else by kind."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return detected_target(dev) if torch.cuda.is_available() else cuda_target_unknown()
    return CPU_TARGET


def detection_device(device: torch.device, plan_device: str) -> torch.device | str:
    """Where a budget and a target are detected for a model on ``device`` planned as ``plan_device``: the model's
    own device (cuda:1, not the current one), or the device type a simulated runtime plans as."""
    return device if device.type == plan_device else plan_device
