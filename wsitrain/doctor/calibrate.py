"""Fit the planner's time model (``wsitrain.sft.planning.costs``: bytes and calls in FLOP-equivalents) on a device.

The model says a training step costs FLOPs + byte_flops x bytes read and written + call_flops x operator calls.
This times plain training steps of micro-models that are each bound by one of the three (big convolutions,
depthwise convolutions and element-wise layers on large maps, many layers on tiny maps), counts the three terms
with the planner's own accounting (``costs.node_terms``), and fits seconds = a x FLOPs + b x bytes + c x calls by
least squares, relative to each step's time. The constants are b / a and c / a. The executor's own per-call cost
(tile_call_flops) is not fitted here (plain steps make no executor calls): the device's default is recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.planning.calibration import Calibration
from wsitrain.sft.planning.costs import default_time_model, node_terms


def _head(c: int) -> list[nn.Module]:
    return [nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(c, 2)]


def convs(c: int = 64, n: int = 3) -> nn.Module:  # FLOP-bound
    layers: list[nn.Module] = [nn.Conv2d(3, c, 3, padding=1), nn.ReLU()]
    for _ in range(n):
        layers += [nn.Conv2d(c, c, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, *_head(c))


def depthwise(c: int = 64, n: int = 6) -> nn.Module:  # traffic-bound
    layers: list[nn.Module] = [nn.Conv2d(3, c, 1)]
    for _ in range(n):
        layers += [nn.Conv2d(c, c, 3, padding=1, groups=c), nn.BatchNorm2d(c).eval(), nn.ReLU()]
    return nn.Sequential(*layers, *_head(c))


def tiny_layers(c: int = 8, n: int = 60) -> nn.Module:  # call-bound
    layers: list[nn.Module] = [nn.Conv2d(3, c, 1)]
    for _ in range(n):
        layers += [nn.Conv2d(c, c, 1), nn.ReLU()]
    return nn.Sequential(*layers, *_head(c))


def mixed(c: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c).eval(), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1, groups=c), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(), *_head(2 * c),
    )  # fmt: skip


Micro = dict[str, tuple[Callable[[], nn.Module], tuple[int, int]]]

# CPU sizes (measured on the 2-core CI machine: each step 5-200 ms). A GPU runs them 4x larger per edge, so that
# kernels, not launches alone, dominate the FLOP- and traffic-bound ones.
MICRO: Micro = {
    "convs 64ch 128px": (convs, (128, 128)),
    "convs 32ch 256px": (lambda: convs(32, 2), (256, 256)),
    "depthwise 64ch 256px": (depthwise, (256, 256)),
    "depthwise 128ch 128px": (lambda: depthwise(128, 4), (128, 128)),
    "tiny layers 8px": (tiny_layers, (8, 8)),
    "tiny layers 32px": (lambda: tiny_layers(16, 40), (32, 32)),
    "mixed 192px": (mixed, (192, 192)),
}
# The doctor's fast mode: one model per term, small (well under a second each on the CI machine).
FAST_MICRO: Micro = {
    "convs 32ch 64px": (lambda: convs(32, 2), (64, 64)),
    "depthwise 32ch 96px": (lambda: depthwise(32, 3), (96, 96)),
    "tiny layers 8px": (lambda: tiny_layers(8, 20), (8, 8)),
}


@dataclass(frozen=True)
class MicroRow:
    name: str
    terms: tuple[float, float, float]  # FLOPs, bytes, calls
    seconds: float  # best of the timed steps
    modelled: float  # the fit's prediction


def terms_of(model: nn.Module, shape: tuple[int, ...]) -> np.ndarray:
    """FLOPs, bytes and calls of one plain training step, as the planner counts them."""
    facts = annotate(ModelGraph(model), shape, torch.float32, torch.float32, False)
    total = np.zeros(3)
    for i in range(1, facts.n):
        node = facts.nodes[i]
        n_out = float(np.prod(node.shape)) if node.shape else 0.0
        n_in = sum(float(np.prod(facts.nodes[v].shape)) if facts.nodes[v].shape else 0.0 for v in node.inputs)
        t = node_terms(facts, i, n_out, n_in, 1)
        total += (t.flops, t.traffic, t.calls)
    return total


def step_seconds(model: nn.Module, shape: tuple[int, ...], device: torch.device, runs: int) -> float:
    x = torch.randn(shape, device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up: kernel selection, allocator growth
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def fit_constants(terms: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Seconds per FLOP, byte and call (each >= 0) by least squares relative to each step's time."""
    coef, *_ = np.linalg.lstsq(terms / seconds[:, None], np.ones_like(seconds), rcond=None)
    return np.maximum(coef, 0.0)


def calibrate(
    device: torch.device, device_name: str, runs: int = 5, micro: Micro | None = None, scale: int | None = None
) -> tuple[Calibration, list[MicroRow]]:
    """Time the micro-models on ``device`` and fit the constants; ``scale`` multiplies each edge (GPU: 4)."""
    micro = micro or MICRO
    scale = scale or (4 if device.type == "cuda" else 1)
    torch.manual_seed(0)
    names, rows, times = [], [], []
    for name, (make, (h, w)) in micro.items():
        model = make().to(device)
        shape = (1, 3, h * scale, w * scale)
        rows.append(terms_of(model, shape))
        times.append(step_seconds(model, shape, device, runs))
        names.append(name)
    a_mat, y = np.array(rows), np.array(times)
    sec_flop, sec_byte, sec_call = fit_constants(a_mat, y)
    fit = a_mat @ np.array([sec_flop, sec_byte, sec_call])
    default = default_time_model(device.type)
    cal = Calibration(
        device_name=device_name, device=device.type, date=time.strftime("%Y-%m-%d"),
        byte_flops=float(sec_byte / sec_flop) if sec_flop else default.byte_flops,
        call_flops=float(sec_call / sec_flop) if sec_flop else default.call_flops,
        tile_call_flops=default.tile_call_flops, flops_per_second=float(1.0 / sec_flop) if sec_flop else 0.0,
        torch=torch.__version__, threads=torch.get_num_threads(),
    )  # fmt: skip
    out = [MicroRow(n, (float(r[0]), float(r[1]), float(r[2])), float(t), float(p))
           for n, r, t, p in zip(names, rows, times, fit, strict=True)]  # fmt: skip
    return cal, out
