"""How fast a GPU preset runs: the constants of the simulated clock and of the planner's time model, defined once.

Two kinds of figure live here. **Published** ones (NVIDIA's data sheets, dense, no sparsity): the tensor-core rate
in bf16 (fp16 with fp32 accumulation where the card has no bf16), the TF32 rate cuDNN uses for float32 convolutions
(PyTorch's default ``torch.backends.cudnn.allow_tf32 = True``), the plain fp32 rate, and the memory bandwidth.
**Efficiency factors**, the share of those rates eager PyTorch reaches, are *fitted* or *assumed*; each says which.
``wsitrain doctor --calibrate`` replaces the fitted factors with ones measured on the user's card
(``refined``), and both the clock (``wsitrain.sft.simulate.clock``) and the planner's time model
(``time_model_constants``) read the same object, so plans are chosen by the clock that predicts real time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# --- efficiency factors, shared by every preset (none is per card) -------------------------------------------------
# Share of the tensor-core rate cuDNN reaches on ResNet-50's convolutions at 8192 px in eager PyTorch (NCHW,
# bf16, one image): FITTED to the one measured plain step (H200, 0.419 s; docs/simulated-clock.md). It is low
# (~0.2) because eager bf16 NCHW convolutions of a 1-image batch run far below the data sheet's dense rate: the
# same card's patch training reached 84 TFLOP/s of ResNet-50 arithmetic (measured, 256 x 224 px, 0.075 s).
CONV_EFFICIENCY = 0.1039
# Share of the data sheet's memory bandwidth that element-wise kernels (BatchNorm, ReLU, adds, copies) reach:
# ASSUMED, not fitted: 0.8 is what STREAM-like copies reach on HBM cards (public reports for A100/H100: 80-90%).
MEMORY_EFFICIENCY = 0.8
# A kernel occupies the GPU for at least this long (launch latency, tail of the grid), microseconds: ASSUMED,
# the usual 2-5 us of a small CUDA kernel.
KERNEL_FLOOR_US = 3.0
# Host time to dispatch one aten operator through eager PyTorch (Python, autograd bookkeeping, the launch),
# microseconds, on a current server CPU: ASSUMED from the usual 5-15 us per eager op; views and other
# metadata-only operators cost VIEW_HOST_US.
HOST_OP_US = 8.0
VIEW_HOST_US = 2.0
# Work the executor does per tile visit in Python beyond the operators (interval lookups, region bookkeeping,
# stager calls), microseconds: FITTED to the capped SFT step (H200, 0.766 s; docs/simulated-clock.md).
TILE_HOST_US = 0.0
# Convolutions on small or odd tiles run below the rate of large maps (cuDNN's heuristics, partial waves):
# a convolution whose output has ``p`` pixels per channel runs at p / (p + SMALL_MAP_PX) of the large-map
# rate. FITTED with TILE_HOST_US (see above).
SMALL_MAP_PX = 0.0
# Convolutions the tile executor runs reach this share of the rate the same layer reaches on the whole map: tiles
# carry halos, so their maps have odd shapes (2,062 x 2,062 px where the whole map is 2,048 x 2,048) for which
# cuDNN's heuristics choose slower algorithms (measured on the H200: the capped step took 0.699 s with
# ``cudnn.benchmark`` on, 0.766 s off). FITTED to the capped SFT step, the one measured tiled step
# (docs/simulated-clock.md); it also absorbs whatever else tiles cost that the operator stream does not show
# (the content checks of background reuse synchronize on a real GPU and are skipped on fake tensors).
TILE_CONV_EFFICIENCY = 0.663
# Share of the plain fp32 rate (CUDA cores, no tensor cores) that convolutions reach on cards without TF32 (the
# 2080 Ti in float32): ASSUMED, the usual 50-70% of cuDNN's implicit-GEMM kernels on large maps.
SIMT_EFFICIENCY = 0.6
# Host memory copies (cropping the uint8 image into the pinned staging buffer): GB/s of one thread, ASSUMED.
HOST_COPY_GB_S = 8.0


@dataclass(frozen=True)
class GpuSpeed:
    """The rates of one card (published) and the efficiency factors of eager PyTorch on it."""

    name: str  # the preset's name (wsitrain.gpus.GPU_PRESETS)
    tensor_tflops: float  # dense bf16 (or fp16 with fp32 accumulation) tensor-core rate, TFLOP/s
    tf32_tflops: float  # dense TF32 tensor-core rate (float32 convolutions); the fp32 rate where there is none
    fp32_tflops: float  # plain fp32 rate (float32 matrix products)
    memory_gb_s: float  # memory bandwidth, GB/s
    link_gb_s: float  # host link (pinned copies), GB/s
    conv_efficiency: float = CONV_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    kernel_floor_us: float = KERNEL_FLOOR_US
    host_op_us: float = HOST_OP_US
    view_host_us: float = VIEW_HOST_US
    tile_host_us: float = TILE_HOST_US
    small_map_px: float = SMALL_MAP_PX
    tile_conv_efficiency: float = TILE_CONV_EFFICIENCY
    host_copy_gb_s: float = HOST_COPY_GB_S
    source: str = "published rates, shared efficiency factors (docs/simulated-clock.md)"

    def conv_rate(self, low_precision: bool) -> float:
        """FLOP/s a large convolution reaches: tensor cores in bf16/fp16, TF32 in float32 where the card has it,
        else its CUDA cores."""
        if low_precision:
            return 1e12 * self.tensor_tflops * self.conv_efficiency
        if self.tf32_tflops > self.fp32_tflops:
            return 1e12 * self.tf32_tflops * self.conv_efficiency
        return 1e12 * self.fp32_tflops * SIMT_EFFICIENCY

    def matmul_rate(self, low_precision: bool) -> float:
        """Matrix products: tensor cores in bf16/fp16; float32 ones on CUDA cores (PyTorch's default: no TF32)."""
        if low_precision:
            return 1e12 * self.tensor_tflops * self.conv_efficiency
        return 1e12 * self.fp32_tflops * SIMT_EFFICIENCY

    @property
    def bytes_per_second(self) -> float:
        return 1e9 * self.memory_gb_s * self.memory_efficiency

    def refined(self, conv_efficiency: float, memory_efficiency: float, source: str) -> GpuSpeed:
        """These rates with factors measured on a real card (``wsitrain doctor --calibrate``)."""
        return replace(self, conv_efficiency=conv_efficiency, memory_efficiency=memory_efficiency, source=source)


# Published dense rates (TFLOP/s: tensor bf16, TF32, fp32) and bandwidth (GB/s). H100/H200: SXM data sheets
# (989 / 494 / 67; 3350 and 4800 GB/s). A100 SXM: 312 / 156 / 19.5; 1555 GB/s (40 GB), 2039 GB/s (80 GB).
# RTX 2080 Ti (Turing, no bf16, no TF32): fp16 tensor cores with fp32 accumulation 53.8 (GeForce: half the
# Quadro rate), fp32 13.4, 616 GB/s.
GPU_SPEEDS: dict[str, GpuSpeed] = {
    s.name: s
    for s in (
        GpuSpeed("h100", 989.0, 494.0, 67.0, 3350.0, 48.0),
        GpuSpeed("h200", 989.0, 494.0, 67.0, 4800.0, 48.0),
        GpuSpeed("a100-40", 312.0, 156.0, 19.5, 1555.0, 24.0),
        GpuSpeed("a100-80", 312.0, 156.0, 19.5, 2039.0, 24.0),
        GpuSpeed("2080ti", 53.8, 13.4, 13.4, 616.0, 12.0),
    )
}


# The presets with speed constants, by the name a card reports (``torch.cuda.get_device_name``): "NVIDIA H200",
# "NVIDIA H100 80GB HBM3" (SXM; measured on our runs), "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA
# GeForce RTX 2080 Ti". First match wins; an H100 PCIe or NVL is priced as the SXM part (the data sheets' rates).
_NAMED_SPEEDS = (("H200", "h200"), ("H100", "h100"), ("A100 SXM4 80GB", "a100-80"), ("A100 PCIE 80GB", "a100-80"),
                 ("A100 80GB", "a100-80"), ("A100", "a100-40"), ("2080 TI", "2080ti"))  # fmt: skip


def speed_preset_of(device_name: str | None) -> str | None:
    """The speed preset a CUDA device's reported name is (``GPU_SPEEDS``), or None for a card without constants."""
    if not device_name:
        return None
    name = device_name.upper().replace("-", " ")
    return next((preset for part, preset in _NAMED_SPEEDS if part in name), None)


def gpu_speed(preset: str | None) -> GpuSpeed | None:
    """The speed constants of a preset, or None for a preset (or device) without them."""
    return GPU_SPEEDS.get(preset) if preset is not None else None


def time_model_constants(speed: GpuSpeed, low_precision: bool) -> tuple[float, float, float]:
    """The planner's time model from the clock's constants (costs.TimeModel's three FLOP-equivalents): a byte
    moved costs FLOP-rate / byte-rate, an operator call its kernel floor plus (host-bound tiles) its host time,
    an executor call the tile's extra host time."""
    rate = speed.conv_rate(low_precision)
    byte_flops = rate / speed.bytes_per_second
    call_flops = rate * 1e-6 * max(speed.kernel_floor_us, speed.host_op_us)
    return byte_flops, call_flops, rate * 1e-6 * speed.tile_host_us
