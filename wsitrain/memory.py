"""Device memory: detect a budget, read peak memory, tune the host allocator."""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

_log = logging.getLogger("wsitrain")

# Fraction of detected free memory the engine plans for: allocator fragmentation, CUDA context,
# and the transient workspace of cuDNN are not in the model.
SAFETY_MARGIN = 0.85


def available_host_bytes() -> int:
    """Memory a new allocation can take on the host (psutil's ``available``)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing: fall back to /proc/meminfo
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise


@dataclass(frozen=True)
class DeviceMemory:
    """What a device probe reports: memory free to allocate, and memory this process's allocator already holds."""

    free: int
    held: int  # CUDA: the caching allocator's reserved bytes (ours, reusable); CPU: 0


def probe_device_memory(device: torch.device | str) -> DeviceMemory:
    """Free memory of ``device`` now (CPU: available RAM), and what our own allocator already holds there."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return DeviceMemory(int(free), int(torch.cuda.memory_reserved(dev)))
    return DeviceMemory(available_host_bytes(), 0)


def detect_budget(
    device: torch.device | str | None = None,
    probe: Callable[[torch.device | str], DeviceMemory] = probe_device_memory,
) -> int:
    """Default memory budget: memory this process can use on ``device``, times a safety margin.

    Called once per run, at its start. On CUDA the caching allocator's reserved blocks count as ours
    (free memory alone shrinks as soon as a step has run, and the planner adds the weights, gradients
    and optimizer state on top of the budget's base itself). ``probe`` is injectable for tests.
    """
    mem = probe(device if device is not None else "cpu")
    return int((mem.free + mem.held) * SAFETY_MARGIN)


def peak_rss_bytes() -> int:
    """Process peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        import os

        return pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


class CpuPeak:
    """Peak resident memory of one step on Linux: reset the high-water mark, run, read VmHWM.

    ``ru_maxrss`` cannot be reset, so after the warm-up it would only ever show the largest step so far;
    writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS. Falls back to ru_maxrss elsewhere.
    """

    def __init__(self) -> None:
        self.resettable = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return peak_rss_bytes()

    def start(self) -> None:
        if self.resettable:
            self._reset()

    def peak(self) -> int:
        return self._hwm() if self.resettable else peak_rss_bytes()


# glibc serves allocations from this size up by mmap when wsitrain owns a CPU process. With its default,
# dynamic threshold the heap fragments by an amount that depends on tensor sizes (measured +0 to +35% over
# the tensors of a VGG-16 / DarkNet-19 step), and freed heap memory stays resident, so one step's peak
# would include what an earlier one left. Tensors of 1 MiB and more then return to the OS when freed.
CPU_MMAP_THRESHOLD = 1 << 20


def tune_cpu_allocator() -> bool:
    """Fix glibc's mmap threshold so resident memory follows live tensors (fit, predict and bench on CPU).

    Returns whether it was applied (not on other C libraries). Setting the threshold also turns off
    glibc's dynamic adjustment of it.
    """
    m_mmap_threshold = -3  # glibc's M_MMAP_THRESHOLD
    try:
        applied = bool(ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, CPU_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        applied = False
    _ALLOCATOR.tuned = _ALLOCATOR.tuned or applied
    return applied


@dataclass
class _AllocatorState:
    """Whether this process's glibc threshold was set: a mirror of process-wide state (mallopt is per process),
    so the library says it tuned the allocator once per process, not once per SFT."""

    tuned: bool = False
    said: bool = False


_ALLOCATOR = _AllocatorState()
# Used as a library (``SFT`` in a process wsitrain does not own), the engine tunes the allocator on first use
# on CPU, as fit does: with glibc's default dynamic threshold VGG-16 at 1024 px under 35% of plain's peak
# measured 45% of plain (benchmarks/bench_library_budget.py). Setting this variable to "default" leaves the
# allocator alone; plans then do not hold on CPU with glibc.
ALLOCATOR_ENV = "WSITRAIN_CPU_ALLOCATOR"


def tune_library_allocator(device: torch.device, env: dict[str, str] | None = None) -> bool:
    """Tune the allocator of ``device``'s kind for the engine's budget once per process, and say so once (a warning
    on the ``wsitrain`` logger): glibc's mmap threshold on CPU, expandable segments on CUDA. Returns whether it is
    tuned now."""
    if device.type == "cuda":
        return tune_cuda_allocator(env)
    if device.type != "cpu" or _ALLOCATOR.tuned:
        return _ALLOCATOR.tuned
    if (os.environ if env is None else env).get(ALLOCATOR_ENV, "") == "default":
        if not _ALLOCATOR.said:
            _ALLOCATOR.said = True
            _log.warning(
                "%s=default: glibc's allocator is left as it is; CPU memory budgets may be exceeded by heap "
                "fragmentation (measured up to +35%% of the step's tensors)", ALLOCATOR_ENV
            )
        return False
    applied = tune_cpu_allocator()
    if applied and not _ALLOCATOR.said:
        _ALLOCATOR.said = True
        _log.warning(
            "wsitrain set glibc's mmap threshold to %d KiB for this process (mallopt M_MMAP_THRESHOLD) so that CPU "
            "memory follows the engine's budget; set %s=default before the first step to keep the default",
            CPU_MMAP_THRESHOLD // 1024, ALLOCATOR_ENV,
        )  # fmt: skip
    return applied


# CUDA: with its default fixed-size segments, PyTorch's caching allocator fragments under the engine's mix of
# whole-map buffers (checkpoints, input gradients) and tile-sized ones. Measured on an H100 capped at the 2080 Ti
# preset's 10.47 GiB (benchmarks/bench_measured.py, torch 2.11): ConvNeXt-T at 8192 px and VGG-16 at 20480 px ran out
# of memory with 7.7 and 6.5 GiB allocated and 2.4 and 3.3 GiB reserved but unusable, although their plans and the
# simulated device said 9.0 and 8.7 GiB. Expandable segments map pages into one growing segment per stream, so
# freed memory serves a request of any size.
CUDA_ALLOCATOR_SETTING = "expandable_segments:True"
# "default" leaves PyTorch's allocator as configured; so does a PYTORCH_CUDA_ALLOC_CONF naming expandable_segments.
CUDA_ALLOCATOR_ENV = "WSITRAIN_CUDA_ALLOCATOR"
TORCH_ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
_CUDA_ALLOCATOR = _AllocatorState()


def cap_cuda_allocator(device: torch.device, budget_bytes: int | None) -> float:
    """Cap PyTorch's CUDA allocator of ``device`` at ``budget_bytes`` (None: no cap) and return the fraction of
    the card set. A process wsitrain owns runs capped: cuDNN then picks algorithms whose workspace fits under the
    budget instead of the free memory of a larger card (an H100 gave a 3x3 conv 514 MiB of workspace uncapped,
    `wsitrain doctor`), and a step that would exceed it fails there rather than on the user's smaller card."""
    if device.index is None:  # torch 2.11 needs an index for the fraction
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = 1.0 if budget_bytes is None else min(1.0, budget_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def tune_owned_process(device: torch.device, budget_bytes: int | None) -> str:
    """A process wsitrain owns (fit, predict, a bench worker): its allocator tuned for the engine's budget, without
    a warning (the command's own log says it). Returns that line for the log, or "" when nothing was done."""
    if device.type == "cpu":
        return "glibc's mmap threshold fixed" if tune_cpu_allocator() else ""
    if device.type != "cuda":
        return ""
    said = ["expandable segments"] if tune_cuda_allocator(say=False) else []
    if budget_bytes is not None:
        cap_cuda_allocator(device, budget_bytes)
        said.insert(0, "the CUDA allocator capped at it")
    return ", ".join(said)


def _set_cuda_allocator_settings(setting: str) -> None:
    """PyTorch's runtime allocator setting (private in torch 2.6-2.15; it applies to segments created after it)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def tune_cuda_allocator(env: dict[str, str] | None = None, say: bool = True) -> bool:
    """Turn on expandable segments in PyTorch's CUDA allocator once per process, unless the user chose otherwise
    (``WSITRAIN_CUDA_ALLOCATOR=default``, or ``PYTORCH_CUDA_ALLOC_CONF`` naming ``expandable_segments``); say once
    what was done (``say=False``: a process wsitrain owns, whose own log says it). Returns whether expandable
    segments are on as far as wsitrain knows."""
    if _CUDA_ALLOCATOR.tuned:
        return True
    if not say:
        _CUDA_ALLOCATOR.said = True
    env = os.environ if env is None else env
    user = env.get(TORCH_ALLOC_ENV, "")
    if "expandable_segments" in user:  # the user's own choice, either way
        _CUDA_ALLOCATOR.tuned = "expandable_segments:true" in user.replace(" ", "").lower()
        return _CUDA_ALLOCATOR.tuned
    choice = env.get(CUDA_ALLOCATOR_ENV, "")
    if choice not in ("", "default") and not _CUDA_ALLOCATOR.said:  # a typo must not pass for a choice
        _log.warning("%s=%s is not a setting wsitrain knows: set it to 'default' to keep PyTorch's CUDA allocator "
                     "as it is, or unset it", CUDA_ALLOCATOR_ENV, choice)  # fmt: skip
    if choice == "default":
        if not _CUDA_ALLOCATOR.said:
            _CUDA_ALLOCATOR.said = True
            _log.warning(
                "%s=default: PyTorch's CUDA allocator keeps fixed segments; a plan that fits may still run out of "
                "memory through fragmentation (measured: 2.4-3.3 GiB of 10.5 GiB reserved but unusable)",
                CUDA_ALLOCATOR_ENV,
            )
        return False
    try:
        _set_cuda_allocator_settings(CUDA_ALLOCATOR_SETTING)
    except (AttributeError, RuntimeError) as e:  # an allocator without the setting (a custom or future one)
        if not _CUDA_ALLOCATOR.said:
            _CUDA_ALLOCATOR.said = True
            _log.warning("could not turn on expandable segments in PyTorch's CUDA allocator (%s); set %s=%s "
                         "before starting Python", e, TORCH_ALLOC_ENV, CUDA_ALLOCATOR_SETTING)  # fmt: skip
        return False
    _CUDA_ALLOCATOR.tuned = True
    if not _CUDA_ALLOCATOR.said:
        _CUDA_ALLOCATOR.said = True
        _log.warning(
            "wsitrain turned on expandable segments in PyTorch's CUDA allocator for this process (%s) so that "
            "freed memory is reusable at any size and plans hold; set %s=default to keep PyTorch's default",
            CUDA_ALLOCATOR_SETTING, CUDA_ALLOCATOR_ENV,
        )  # fmt: skip
    return True


class PeakMeter:
    """The one peak-memory meter of fit, bench and the engine: peak bytes since ``start()``.

    CUDA: ``max_memory_allocated``, and ``peak_reserved()`` the caching allocator's reserved peak (blocks held
    for side streams and fragmentation show only there; what the OS sees); ``start()`` resets both, and only the owner
    of a measurement (the training step, a bench worker) calls it: nothing else resets it behind the
    caller's back. CPU: the process's resident high-water mark (VmHWM), reset through
    /proc/self/clear_refs; where that is impossible it falls back to ``ru_maxrss``, which only grows
    (``resettable`` says which).
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._cpu = None if self.cuda else CpuPeak()

    @property
    def resettable(self) -> bool:
        return self.cuda or (self._cpu is not None and self._cpu.resettable)

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            assert self._cpu is not None
            self._cpu.start()

    def peak(self) -> int:
        """Peak bytes since the last ``start()`` (allocated tensors on CUDA, resident memory on CPU)."""
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        assert self._cpu is not None
        return self._cpu.peak()

    def peak_reserved(self) -> int:
        """Peak bytes the process held since ``start()``: CUDA's reserved peak (allocated plus cached blocks,
        e.g. those freed on a copy stream and not yet reusable); on CPU the resident peak, as ``peak()``."""
        if self.cuda:
            return int(torch.cuda.max_memory_reserved(self.device))
        return self.peak()

    def current(self) -> int:
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        return current_rss_bytes()
