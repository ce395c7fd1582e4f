"""Fit the planner's time model (``wsitrain.sft.planning.costs``: BYTE_FLOPS, CALL_FLOPS) on this machine.

The model says a training step costs FLOPs + BYTE_FLOPS x bytes read and written + CALL_FLOPS x operator
calls. This script times plain training steps of micro-models that are each bound by one of the three
(big convolutions, depthwise convolutions and element-wise layers on large maps, many layers on tiny maps),
counts the three terms with the planner's own accounting (``costs.node_terms``), and fits
seconds = a x FLOPs + b x bytes + c x calls by least squares. It prints a, b, c, the constants as
FLOP-equivalents (b / a, c / a) and how well each micro-model is explained.

Usage:
    python scripts/calibrate_costs.py [--device cpu|cuda] [--threads 1] [--runs 5] [--out calib.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.planning.costs import node_terms


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
        nn.Conv2d(3, c, 3, padding=1),
        nn.BatchNorm2d(c).eval(),
        nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1, groups=c),
        nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, stride=2, padding=1),
        nn.ReLU(),
        *_head(2 * c),
    )


MICRO: dict[str, tuple[Callable[[], nn.Module], tuple[int, int]]] = {
    "convs 64ch 128px": (convs, (128, 128)),
    "convs 32ch 256px": (lambda: convs(32, 2), (256, 256)),
    "depthwise 64ch 256px": (depthwise, (256, 256)),
    "depthwise 128ch 128px": (lambda: depthwise(128, 4), (128, 128)),
    "tiny layers 8px": (tiny_layers, (8, 8)),
    "tiny layers 32px": (lambda: tiny_layers(16, 40), (32, 32)),
    "mixed 192px": (mixed, (192, 192)),
}


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
            torch.cuda.synchronize()

    step()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    rows, times, names = [], [], []
    for name, (make, (h, w)) in MICRO.items():
        model = make().to(device)
        shape = (1, 3, h, w)
        rows.append(terms_of(model, shape))
        times.append(step_seconds(model, shape, device, args.runs))
        names.append(name)
    a_mat, y = np.array(rows), np.array(times)
    # relative least squares: each micro-model counts the same whatever its step time
    coef, *_ = np.linalg.lstsq(a_mat / y[:, None], np.ones_like(y), rcond=None)
    coef = np.maximum(coef, 0.0)
    sec_flop, sec_byte, sec_call = coef
    fit = a_mat @ coef
    print(f"{'micro-model':<24s} {'measured':>10s} {'model':>10s}  GFLOP   MB     calls")
    for n, r, t, p in zip(names, rows, times, fit, strict=True):
        print(f"{n:<24s} {1e3 * t:8.2f}ms {1e3 * p:8.2f}ms  {r[0] / 1e9:5.2f} {r[1] / 1e6:6.1f} {r[2]:6.0f}")
    result = {
        "device": args.device,
        "threads": args.threads,
        "flops_per_second": 1.0 / sec_flop if sec_flop else None,
        "seconds_per_byte": sec_byte,
        "seconds_per_call": sec_call,
        "BYTE_FLOPS": sec_byte / sec_flop if sec_flop else None,
        "CALL_FLOPS": sec_call / sec_flop if sec_flop else None,
        "rows": {n: {"terms": r.tolist(), "seconds": t} for n, r, t in zip(names, rows, times, strict=True)},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
