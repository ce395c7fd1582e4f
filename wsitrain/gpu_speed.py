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
# Share of the tensor-core rate cuDNN reaches on wide convolutions in eager PyTorch (NCHW, bf16), narrower ones reaching
# less (CONV_CHANNELS_HALF): FITTED to the plain ResNet-50 step at 8192 px measured on an H200 (0.414 s, 2026-11-27;
# docs/research/simulated-clock.md), with BatchNorm priced at its own measured rate (NORM_EFFICIENCY). Before the
# channel curve one factor for every layer fitted there at 0.2413 (the profile: 130 ms for 33 TFLOP, 0.25 of the data
# sheet), which priced VGG-16's and DarkNet-19's wide layers 2-3x too slowly.
CONV_EFFICIENCY = 0.7017
# Share of the tensor-core rate aligned half-precision matrix products reach (a tile's 1x1 layers on aligned maps, the
# heads): MEASURED on an H200, forward and backward of two aligned 1x1 layers as products, 363 and 583 TFLOP/s
# (``benchmarks/bench_pointwise.py``, docs/benchmarks/pointwise_matmul.md).
MATMUL_EFFICIENCY = 0.48
# The planner's time model ranks plans with the constants of the clock before BatchNorm and unaligned 1x1 layers had
# rates of their own (conv 0.1039, TILE_CONV_EFFICIENCY below): its shapes-only costs price every byte alike and
# tiles by one factor, so with the clock's single convolution factor of then (0.2413) it chose a plan the clock
# prices 3% slower (0.668 against 0.646 s, ResNet-50 8192 px capped under 10.47 GiB, simulated), while these chose
# the plan measured fastest of two on the H200 (0.86 s against 1.35 s for the default constants'). FITTED on the
# H200 step of 2026-11-24.
PLAN_CONV_EFFICIENCY = 0.1039
# Share of the data sheet's memory bandwidth that element-wise kernels (BatchNorm, ReLU, adds, copies) reach:
# ASSUMED, not fitted: 0.8 is what STREAM-like copies reach on HBM cards (public reports for A100/H100: 80-90%).
MEMORY_EFFICIENCY = 0.8
# Share of the bandwidth BatchNorm's own kernels reach, forward and backward: FITTED to the kernels of the plain 8192 px
# ResNet-50 step profiled on an H200 (bf16, NCHW, one image; docs/benchmarks/traces, ``benchmarks/trace_tables.py
# --bandwidth 4800``): 834 and 626 GB/s of the bytes the clock counts, where ReLU's kernels reach 0.90 of the bandwidth.
# The capped SFT step's tiles gave 0.207 and 0.141 (a check, not fitted). Half of that plain step's device time is
# BatchNorm (214 of 415 ms), so pricing it at MEMORY_EFFICIENCY had put its time into CONV_EFFICIENCY, and
# convolution-heavy models (VGG-16) were priced four times too slow.
NORM_EFFICIENCY = 0.174
NORM_BACKWARD_EFFICIENCY = 0.130
# A kernel occupies the GPU for at least this long (launch latency, tail of the grid), microseconds: ASSUMED,
# the usual 2-5 us of a small CUDA kernel.
KERNEL_FLOOR_US = 3.0
# Host time to dispatch one aten operator through eager PyTorch (Python, autograd bookkeeping, the launch),
# microseconds, on a current server CPU: ASSUMED from the usual 5-15 us per eager op; views and other
# metadata-only operators cost VIEW_HOST_US.
HOST_OP_US = 8.0
VIEW_HOST_US = 2.0
# Work the executor does per tile visit in Python beyond the operators (interval lookups, region bookkeeping,
# stager calls), microseconds: FITTED to the capped SFT step (H200, 0.766 s; docs/research/simulated-clock.md).
TILE_HOST_US = 0.0
# Convolutions on small or odd tiles run below the rate of large maps (cuDNN's heuristics, partial waves):
# a convolution whose output has ``p`` pixels per channel runs at p / (p + SMALL_MAP_PX) of the large-map
# rate. FITTED with TILE_HOST_US (see above).
SMALL_MAP_PX = 0.0
# The planner's factor for tiled FLOPs (its time model's ``tile_flop_factor`` is 1 / this): the average slowdown of a
# tile's work against the whole map's, FITTED to the capped SFT step of 2026-11-24 (0.766 s). The clock no longer uses
# it: the profile (docs/benchmarks/traces) showed the tiles' 3x3 layers at the whole map's rate and named the slowdown,
# unaligned 1x1 layers (UNALIGNED_CONV_EFFICIENCY), plus the recompute's BatchNorm.
TILE_CONV_EFFICIENCY = 0.663
# 1x1 convolutions in half precision on maps whose pixel count is not a multiple of 8 (a tile's halo makes 263 x 263,
# 129 x 129): cuDNN cannot use Hopper's matrix kernels on them and runs old generic ones
# (``cutlass_75_tensorop_s1688gemm``) with layout transforms, at this share of the rate the same layers reach on aligned
# maps. FITTED to the capped SFT step on an H200 (docs/research/simulated-clock.md; replayed as it ran, its one-pass
# segment recomputing after its pass, which every bf16 step did before 2026-11-27); the profile of that step
# (docs/benchmarks/traces) shows it directly: the tiles' large 1x1 layers ran at 55-180 TFLOP/s where the whole image's
# same layers ran at 520-710 (``benchmarks/trace_tables.py ... --against``).
UNALIGNED_CONV_EFFICIENCY = 0.2938
# Matrix products in half precision whose operands' rows are not 16 bytes aligned (a tile's 1x1 layers run as
# products on such maps: wsitrain/sft/ops/pointwise_conv.py), as a share of the tensor rate: MEASURED on an H200
# (bf16, forward and backward of nine of ResNet-50's tile shapes: 85-124 TFLOP/s, mean 98, in the script's first run;
# 96-145, mean 108, in the run docs/benchmarks/pointwise_matmul.md keeps; the same layers as convolutions 8-61;
# ``benchmarks/bench_pointwise.py``). The first run's figure stands: the clock's tables were made with it.
UNALIGNED_MATMUL_EFFICIENCY = 0.099
# A convolution's rate grows with its narrower channel count c = min(input channels per group, output channels): it
# reaches c / (c + CONV_CHANNELS_HALF) of the large-channel rate (CONV_EFFICIENCY). FITTED to the kernel rates of the
# layer shapes in the H200's traces of 2026-11-27 (docs/benchmarks/traces: ResNet-50, VGG-16, DarkNet-19; bf16, aligned
# maps below 2^31 elements): c = 3 ran at 9-24 TFLOP/s, 32 at 102-135, 64 at 160-257, 128 at 308-415, 256 at 501-693,
# 512 at 513-711; this curve with the refitted CONV_EFFICIENCY gives 14, 125, 210, 340, 470, 570
# (docs/research/simulated-clock.md).
CONV_CHANNELS_HALF = 150.0
# A convolution whose input or output holds 2^31 elements per sample or more (a whole map; plans keep tiles below:
# sft/target.py CONV_ELEMENTS_LIMIT) runs on cuDNN's 64-bit-index kernels at this share of its rate: MEASURED on an H200
# (docs/benchmarks/traces/h200_vgg16_plain against ..._capped): VGG-16's 64- and 128-channel layers at 0.70-0.82 of the
# same layers on tiles; layers with fewer than THIN_CONV_CHANNELS input channels (the first, on RGB) at
# LARGE_THIN_CONV_EFFICIENCY (VGG-16: 0.8 TFLOP/s forward and 0.2 backward against 13-14 on tiles; DarkNet-19: 0.7
# against 13).
LARGE_CONV_EFFICIENCY = 0.76
LARGE_THIN_CONV_EFFICIENCY = 0.04
THIN_CONV_CHANNELS = 16
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
    plan_conv_efficiency: float = PLAN_CONV_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    norm_efficiency: float = NORM_EFFICIENCY
    norm_backward_efficiency: float = NORM_BACKWARD_EFFICIENCY
    kernel_floor_us: float = KERNEL_FLOOR_US
    host_op_us: float = HOST_OP_US
    view_host_us: float = VIEW_HOST_US
    tile_host_us: float = TILE_HOST_US
    small_map_px: float = SMALL_MAP_PX
    tile_conv_efficiency: float = TILE_CONV_EFFICIENCY
    unaligned_conv_efficiency: float = UNALIGNED_CONV_EFFICIENCY
    unaligned_matmul_efficiency: float = UNALIGNED_MATMUL_EFFICIENCY
    matmul_efficiency: float = MATMUL_EFFICIENCY
    conv_channels_half: float = CONV_CHANNELS_HALF
    large_conv_efficiency: float = LARGE_CONV_EFFICIENCY
    large_thin_conv_efficiency: float = LARGE_THIN_CONV_EFFICIENCY
    host_copy_gb_s: float = HOST_COPY_GB_S
    source: str = "published rates, shared efficiency factors (docs/research/simulated-clock.md)"

    def conv_rate(self, low_precision: bool) -> float:
        """FLOP/s a large convolution reaches: tensor cores in bf16/fp16, TF32 in float32 where the card has it,
        else its CUDA cores."""
        return self._conv_rate(low_precision, self.conv_efficiency)

    def conv_shape_factor(self, channels: int, large: bool) -> float:
        """The share of ``conv_rate`` a convolution of narrower channel count ``channels`` (0: not known) reaches;
        ``large``: on a map of 2^31 elements per sample or more (``LARGE_CONV_EFFICIENCY``)."""
        share = channels / (channels + self.conv_channels_half) if channels else 1.0
        if large:
            share *= self.large_thin_conv_efficiency if channels < THIN_CONV_CHANNELS else self.large_conv_efficiency
        return share

    def plan_conv_rate(self, low_precision: bool) -> float:
        """The convolution rate the planner's time model counts in (``PLAN_CONV_EFFICIENCY``)."""
        return self._conv_rate(low_precision, self.plan_conv_efficiency)

    def _conv_rate(self, low_precision: bool, efficiency: float) -> float:
        if low_precision:
            return 1e12 * self.tensor_tflops * efficiency
        if self.tf32_tflops > self.fp32_tflops:
            return 1e12 * self.tf32_tflops * efficiency
        return 1e12 * self.fp32_tflops * SIMT_EFFICIENCY

    def matmul_rate(self, low_precision: bool, unaligned: bool = False) -> float:
        """Matrix products: tensor cores in bf16/fp16 (``unaligned``: rows not 16 bytes aligned,
        ``UNALIGNED_MATMUL_EFFICIENCY``); float32 ones on CUDA cores (PyTorch's default: no TF32)."""
        if low_precision:
            share = self.unaligned_matmul_efficiency if unaligned else self.matmul_efficiency
            return 1e12 * self.tensor_tflops * share
        return 1e12 * self.fp32_tflops * SIMT_EFFICIENCY

    @property
    def bytes_per_second(self) -> float:
        return 1e9 * self.memory_gb_s * self.memory_efficiency

    def norm_bytes_per_second(self, backward: bool) -> float:
        """What BatchNorm's kernels move per second (``NORM_EFFICIENCY``, ``NORM_BACKWARD_EFFICIENCY``)."""
        return 1e9 * self.memory_gb_s * (self.norm_backward_efficiency if backward else self.norm_efficiency)

    def refined(self, conv_efficiency: float, memory_efficiency: float, source: str) -> GpuSpeed:
        """These rates with factors measured on a real card (``wsitrain doctor --calibrate``); the planner's
        convolution factor moves with the clock's by the same ratio."""
        plan = self.plan_conv_efficiency * conv_efficiency / self.conv_efficiency
        return replace(self, conv_efficiency=conv_efficiency, plan_conv_efficiency=plan,
                       memory_efficiency=memory_efficiency, source=source)  # fmt: skip


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
    rate = speed.plan_conv_rate(low_precision)
    byte_flops = rate / speed.bytes_per_second
    call_flops = rate * 1e-6 * max(speed.kernel_floor_us, speed.host_op_us)
    return byte_flops, call_flops, rate * 1e-6 * speed.tile_host_us
