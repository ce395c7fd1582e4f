"""Fit the planner's time model (``wsitrain.sft.planning.costs``: bytes and calls in FLOP-equivalents) on a device.

The model says a training step costs FLOPs + byte_flops x bytes read and written + call_flops x operator calls.
This times plain training steps of micro-models that are each bound by one of the three (big convolutions,
depthwise convolutions and element-wise layers on large maps, many layers on tiny maps), counts the three terms
with the planner's own accounting (``costs.node_terms``), and fits seconds = a x FLOPs + b x bytes + c x calls by
least squares, relative to each step's time. The constants are b / a and c / a. The executor's own per-call cost
(tile_call_flops) is not fitted here (plain steps make no executor calls): the device's default is recorded.
"""

from __future__ import annotations

import itertools
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
# A GPU adds wide convolutions: at the CPU's channel counts an H100 is bound by memory traffic even in the
# 64-channel 3x3 convolutions (measured: 176 GFLOPs a step in 3.5 ms, explained by bytes alone), so without them
# no FLOP rate can be fitted. 256 channels at 256 px: 0.7 TFLOPs a step (measured: 4.7 ms on an H100).
GPU_MICRO: Micro = {
    **MICRO,
    "convs 256ch 64px": (lambda: convs(256, 3), (64, 64)),
    "convs 128ch 128px": (lambda: convs(128, 3), (128, 128)),
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


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0, exact for a few columns: the best least-squares fit over every subset of the
    columns whose coefficients are all non-negative."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(b**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(a.shape[1])
            full[list(cols)] = coef
            err = float(np.sum((a @ full - b) ** 2))
            if err < best_err - 1e-12:
                best, best_err = full, err
    return best


def fit_constants(terms: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Seconds per FLOP, byte and call (each >= 0): non-negative least squares relative to each step's time.

    The model is in FLOP-equivalents, so it needs a FLOP rate. Where FLOPs explain none of the times (an H100
    with TF32 convolutions: bytes and calls alone fitted every micro-model, measured), the FLOP-bound micro-models
    are taken at their word: the fastest FLOP rate seen is the rate, and bytes and calls are fitted to what
    remains. (Fitting all three and clamping a negative one to zero, as before, gave 0 s per FLOP there.)
    """
    coef = _nnls(terms / seconds[:, None], np.ones_like(seconds))
    if coef[0] > 0:
        return coef
    sec_flop = float(np.min(seconds / np.maximum(terms[:, 0], 1.0)))  # the fastest rate seen, as seconds per FLOP
    rest = np.maximum(seconds - sec_flop * terms[:, 0], 0.0)
    tail = _nnls(terms[:, 1:] / seconds[:, None], rest / seconds)
    return np.concatenate([[sec_flop], tail])


def calibrate(
    device: torch.device, device_name: str, runs: int = 5, micro: Micro | None = None, scale: int | None = None
) -> tuple[Calibration, list[MicroRow]]:
    """Time the micro-models on ``device`` and fit the constants; ``scale`` multiplies each edge (GPU: 4)."""
    micro = micro or (GPU_MICRO if device.type == "cuda" else MICRO)
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
