"""Time-model calibrations: one JSON file per device, written by ``wsitrain doctor --calibrate``, read by the planner.

A file lives in the calibration folder (``$WSITRAIN_CALIBRATION_DIR``, else ``$XDG_CACHE_HOME/wsitrain/calibration``,
else ``~/.cache/wsitrain/calibration``) as ``<device-slug>.json``, and holds the device's name as torch reports it
(``torch.cuda.get_device_name``; for a CPU, ``cpu: <model name>``). ``time_model_for`` returns the calibrated
constants when the file's name matches the device planned for, and the defaults (``costs.default_time_model``)
otherwise; a file that exists but cannot be read is an error naming it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from wsitrain.errors import WsiTrainError
from wsitrain.gpu_speed import GpuSpeed, gpu_speed, speed_preset_of, time_model_constants
from wsitrain.sft.planning.costs import DEFAULT_TIME_MODEL, TimeModel, default_time_model, device_kind

CALIBRATION_ENV = "WSITRAIN_CALIBRATION_DIR"
CALIBRATION_FORMAT = 1
CLOCK_SOURCE = "the simulated clock's constants"  # how a time model made from a preset's clock constants begins


@dataclass(frozen=True)
class Calibration:
    """A device's fitted time-model constants (FLOP-equivalents) and the run that fitted them."""

    device_name: str  # torch's name of the GPU, or "cpu: <model name>"
    device: str  # "cuda" or "cpu"
    date: str  # YYYY-MM-DD
    byte_flops: float
    call_flops: float
    tile_call_flops: float  # not fitted (plain steps make no executor calls): the device's default, recorded
    flops_per_second: float
    torch: str = ""
    threads: int = 0
    format: int = CALIBRATION_FORMAT

    def time_model(self) -> TimeModel:
        return TimeModel(self.byte_flops, self.call_flops, self.tile_call_flops,
                         f"calibrated on {self.device_name} on {self.date}")  # fmt: skip


def calibration_dir() -> Path:
    env = os.environ.get(CALIBRATION_ENV)
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else Path.home() / ".cache") / "wsitrain" / "calibration"


def device_slug(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``: the file name of a device's calibration."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def calibration_path(device_name: str, folder: Path | None = None) -> Path:
    return (folder or calibration_dir()) / f"{device_slug(device_name)}.json"


def write_calibration(cal: Calibration, folder: Path | None = None) -> Path:
    path = calibration_path(cal.device_name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(cal), indent=2) + "\n")
    return path


def read_calibration(path: Path) -> Calibration:
    """The calibration in ``path``; WsiTrainError naming the file when it is not one."""
    fix = f"run `wsitrain doctor --calibrate` again on that device, or delete {path}"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WsiTrainError(f"calibration file {path} cannot be read: {e}", hint=fix) from e
    fields = Calibration.__dataclass_fields__
    if not isinstance(raw, dict) or raw.get("format") != CALIBRATION_FORMAT:
        raise WsiTrainError(f"calibration file {path} is not a wsitrain calibration (format {CALIBRATION_FORMAT})",
                            hint=fix)  # fmt: skip
    missing = [k for k in ("device_name", "device", "date", "byte_flops", "call_flops", "tile_call_flops",
                           "flops_per_second") if k not in raw]  # fmt: skip
    if missing:
        raise WsiTrainError(f"calibration file {path} lacks {', '.join(missing)}", hint=fix)
    for key in ("byte_flops", "call_flops", "tile_call_flops", "flops_per_second"):
        v = raw[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise WsiTrainError(f"calibration file {path}: {key} is {v!r}, not a finite number >= 0", hint=fix)
    return Calibration(**{k: v for k, v in raw.items() if k in fields})


def time_model_for(device: str, device_name: str | None, folder: Path | None = None) -> TimeModel:
    """The calibrated time model of ``device_name`` when its file exists and names it; else the defaults."""
    if device_name is None:
        return default_time_model(device)
    path = calibration_path(device_name, folder)
    if not path.is_file():
        return default_time_model(device)
    cal = read_calibration(path)
    if cal.device_name != device_name or device_kind(cal.device) != device_kind(device):
        return default_time_model(device)  # another device whose name has the same slug
    return cal.time_model()


def cpu_name() -> str:
    """This machine's CPU as a calibration names it: ``cpu: <model name>`` (from /proc/cpuinfo where there is one)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if not model:
        import platform

        model = platform.processor() or platform.machine() or "unknown"
    return f"cpu: {model}"


def device_name(device: torch.device) -> str:
    """The name a calibration and the speed presets know ``device`` by: the GPU's own (``NVIDIA H200``), or this
    machine's CPU (``cpu_name``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


# the narrower channel count of the convolutions a GPU calibration's FLOP rate is fitted on (128 and 256)
CALIBRATION_CHANNELS = 192


def clock_speed(preset: str | None, device_name: str | None, folder: Path | None = None) -> GpuSpeed | None:
    """The simulated clock's constants for a GPU preset (``wsitrain.gpu_speed``), refined by ``wsitrain doctor
    --calibrate`` where that card was calibrated: its fitted FLOP rate (float32 micro-models: TF32 convolutions)
    over the data sheet's TF32 rate gives the convolution efficiency, its byte rate over the data sheet's bandwidth
    the memory efficiency. None for a preset without speed constants."""
    speed = gpu_speed(preset)
    if speed is None or device_name is None:
        return speed
    path = calibration_path(device_name, folder)
    if not path.is_file():
        return speed
    cal = read_calibration(path)
    if cal.device_name != device_name or device_kind(cal.device) != "cuda" or not cal.flops_per_second:
        return speed
    # the calibration's FLOP rate is its 128- and 256-channel convolutions' (doctor/calibrate.py GPU_MICRO): the
    # clock's large-channel factor is that rate over the channel curve's share at their middle
    conv = cal.flops_per_second / (1e12 * speed.tf32_tflops) / speed.conv_shape_factor(CALIBRATION_CHANNELS, False)
    memory = cal.flops_per_second / cal.byte_flops / (1e9 * speed.memory_gb_s) if cal.byte_flops else None
    return speed.refined(conv, memory or speed.memory_efficiency, f"refined by `wsitrain doctor` on {cal.date}")


def clock_time_model(speed: GpuSpeed, low_precision: bool) -> TimeModel:
    """The planner's time model from the clock's constants: plans chosen by the clock that predicts the step."""
    byte_flops, call_flops, tile_call_flops = time_model_constants(speed, low_precision)
    source = (f"{CLOCK_SOURCE}, {speed.name} preset ({speed.source}; `wsitrain doctor --calibrate` refines them "
              "on your card)")  # fmt: skip
    return TimeModel(byte_flops, call_flops, tile_call_flops, source, 1.0 / speed.tile_conv_efficiency)


def run_time_model(
    device: str, device_name: str | None, low_precision: bool, preset: str | None = None
) -> tuple[TimeModel, GpuSpeed | None]:
    """The planner's time model, and the clock's constants where a GPU has them: the card's calibration where there
    is one (``wsitrain doctor --calibrate``), else the clock's constants of ``preset`` or of the preset the CUDA
    device's name is (``speed_preset_of``), else the device's defaults. ``wsitrain plan`` and ``fit`` both ask here,
    so a run plans with the constants ``plan`` printed for its card."""
    tm = time_model_for(device, device_name)
    key = preset if preset is not None else speed_preset_of(device_name) if device_kind(device) == "cuda" else None
    speed = clock_speed(key, device_name) if key is not None else None
    if speed is not None and tm.source == DEFAULT_TIME_MODEL:
        tm = clock_time_model(speed, low_precision)
    return tm, speed
