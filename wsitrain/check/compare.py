"""One check: a training step with plain autograd and with SFT, compared tensor by tensor.

The error of a tensor is max |SFT - plain| / max |plain| (relative to the tensor's scale, so a near-zero
element does not blow it up); the check's error is the worst over the output, the input gradient, every
parameter gradient and every floating-point buffer (train-mode BatchNorm updates its running statistics).

A gradient that is zero in exact arithmetic (the bias of a convolution followed by train-mode BatchNorm, which
removes the mean) is rounding noise in both runs, 1e-16 of the other gradients: its own scale would call noise
against noise wrong. Gradients are therefore measured against at least ``GRAD_FLOOR`` times the largest gradient
scale; a gradient that is really wrong still shows (one at 1e-9 of the largest, entirely wrong, measures 1e-7).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from wsitrain.errors import InternalEngineError, PlanError, WsiTrainError

EXACT = "exact"
REFUSED = "refused"
WRONG = "wrong"
ERROR = "error"  # the engine crashed (an internal error or an exception while running): a bug to report
TOLERANCE = 1e-12  # float64 relative error; exact runs measure 1e-16 to 1e-14
SHOWN = 8  # wrong tensors listed, worst first
GRAD_FLOOR = 1e-2  # gradients are measured against at least this share of the largest gradient's scale
# An ill-conditioned step (train-mode BatchNorm over a few pixels: ResNeSt at 64 x 96 moves its gradients by 3.5e-12
# when the image moves by one ulp) is exact within this many times what rounding alone does to plain's step.
NOISE_FACTOR = 100.0


@dataclass(frozen=True)
class TensorError:
    name: str  # "output", "input gradient", "grad features.3.weight", "buffer features.4.running_mean"
    error: float  # relative error; inf when one side has a gradient and the other none


@dataclass
class CheckResult:
    check: str  # "tiles" (forced small tiles) or "budget" (the planner's choice at a share of plain's memory)
    setting: str  # what the engine was given, e.g. "tile_size=32" or "memory_budget=12.3 MiB (45% ...)"
    verdict: str = EXACT
    worst_error: float | None = None
    errors: list[TensorError] = field(default_factory=list)  # over tolerance, worst first (wrong only)
    message: str = ""  # why refused, or the crash
    tiled_segments: int = 0
    tiles: int = 0
    seconds: float = 0.0
    tolerance: float = TOLERANCE  # the largest error called exact: ``--tol``, or more for an ill-conditioned model
    noise: float = 0.0  # plain against plain on the image moved by one ulp (``Reference.noise``)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "setting": self.setting,
            "verdict": self.verdict,
            "worst_error": self.worst_error,
            "tolerance": self.tolerance,
            "rounding_noise": self.noise,
            "wrong": [{"name": e.name, "error": e.error} for e in self.errors],
            "message": self.message,
            "tiled_segments": self.tiled_segments,
            "tiles": self.tiles,
            "seconds": round(self.seconds, 3),
        }

    def line(self) -> str:
        """One line for the terminal, e.g. ``tiles (tile_size=32): exact, worst relative error 2.1e-16 ...``."""
        head = f"{self.check} ({self.setting}): {self.verdict}"
        if self.verdict == EXACT:
            within = f", within {self.tolerance:.2g} (100x the model's own rounding noise)" if (
                NOISE_FACTOR * self.noise >= self.tolerance) else ""  # fmt: skip
            return (
                f"{head}, worst relative error {self.worst_error:.2g}{within} ({self.tiled_segments} tiled segments, "
                f"{self.tiles} tiles, {self.seconds:.1f}s)"
            )
        if self.verdict == WRONG:
            worst = ", ".join(f"{e.name} {e.error:.3g}" for e in self.errors[:SHOWN])
            more = f" and {len(self.errors) - SHOWN} more" if len(self.errors) > SHOWN else ""
            return (
                f"{head}: {len(self.errors)} tensors differ by more than {self.tolerance:.2g}, worst first: "
                f"{worst}{more}"
            )
        return f"{head}: {self.message}"


def tensor_errors(
    plain: nn.Module, tiled: nn.Module, outputs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]]
) -> list[TensorError]:
    """The relative error of every compared tensor, worst first."""
    pairs = list(outputs)
    for (name, p), (_, q) in zip(plain.named_parameters(), tiled.named_parameters(), strict=True):
        if p.grad is not None or q.grad is not None:
            pairs.append((f"grad {name}", p.grad, q.grad))
    for (name, b), (_, c) in zip(plain.named_buffers(), tiled.named_buffers(), strict=True):
        if b.is_floating_point():
            pairs.append((f"buffer {name}", b, c))
    def scale_of(t: torch.Tensor | None) -> float:
        return float(t.detach().abs().max()) if t is not None and t.numel() else 0.0

    grads = {name for name, _, _ in pairs if name == "input gradient" or name.startswith("grad ")}
    grad_floor = GRAD_FLOOR * max((scale_of(ref) for name, ref, _ in pairs if name in grads), default=0.0)
    out = []
    for name, ref, got in pairs:
        if ref is None or got is None:
            out.append(TensorError(name, 0.0 if ref is got else float("inf")))
            continue
        scale = max(scale_of(ref), grad_floor if name in grads else 0.0, 1e-300)
        diff = float((got.detach() - ref.detach()).abs().max()) if ref.numel() else 0.0
        out.append(TensorError(name, diff / scale if diff == diff else float("inf")))  # NaN: wrong
    return sorted(out, key=lambda e: -e.error)


def classify(e: Exception) -> tuple[str, str]:
    """The verdict and message of an engine failure: a PlanError is a refusal, anything else a bug."""
    if isinstance(e, InternalEngineError):
        return ERROR, e.message
    if isinstance(e, PlanError):
        return REFUSED, e.message
    return ERROR, f"{type(e).__name__}: {e}"


def _step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward and backward under fit's loss for a classifier's logits (B, K), cross-entropy, which lets a last
    segment run in one pass (wsitrain/sft/execution/one_pass.py); the sum of squares for any other output."""
    y = model(x)
    if y.dim() == 2 and y.shape[1] >= 2:
        target = torch.arange(y.shape[0], device=y.device) % y.shape[1]
        nn.functional.cross_entropy(y, target).backward()
    else:
        y.square().sum().backward()
    return y.detach()


@dataclass
class Reference:
    """Plain autograd's step, once per model, and how much rounding alone moves it."""

    model: nn.Module  # untouched: every check runs SFT on a copy
    x: torch.Tensor
    plain: nn.Module  # a copy after the plain step: its gradients and buffers
    y: torch.Tensor
    x_grad: torch.Tensor | None
    noise: float  # worst relative error of plain against plain on the image moved by one ulp

    def tolerance(self, tol: float) -> float:
        return max(tol, NOISE_FACTOR * self.noise)


def reference(model: nn.Module, shape: tuple[int, ...], seed: int) -> Reference:
    """The plain step on a seeded random image; plain PyTorch failing is the user's problem (WsiTrainError)."""
    x = torch.rand(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    plain, moved = copy.deepcopy(model), copy.deepcopy(model)
    xp, xm = x.clone().requires_grad_(True), (x * (1 + 2**-52)).requires_grad_(True)
    try:
        y, ym = _step(plain, xp), _step(moved, xm)
    except Exception as e:  # the model itself fails: nothing to compare the engine with
        raise WsiTrainError(
            f"plain PyTorch fails on input {tuple(shape)}: {type(e).__name__}: {e}",
            hint="check the model on its own; a larger --size (a multiple of its stride) may be needed",
        ) from e
    noise = tensor_errors(plain, moved, [("output", y, ym), ("input gradient", xp.grad, xm.grad)])
    return Reference(model, x, plain, y, xp.grad, noise[0].error if noise else 0.0)


def run_check(check: str, setting: str, ref: Reference, tol: float = TOLERANCE, **engine: Any) -> CheckResult:
    """One training step of a copy of the model under ``SFT(copy, **engine)``, compared with plain's."""
    from wsitrain.sft import SFT

    res = CheckResult(check, setting, tolerance=ref.tolerance(tol), noise=ref.noise)
    t0 = time.perf_counter()
    tiled = copy.deepcopy(ref.model)
    xt = ref.x.clone().requires_grad_(True)
    try:
        sft = SFT(tiled, **engine)
        yt = _step(sft, xt)
        p = sft.plan_of(xt)
    except Exception as e:  # noqa: BLE001 - a crash inside the engine is this check's finding, not the command's
        res.verdict, res.message = classify(e)
    else:
        errs = tensor_errors(ref.plain, tiled, [("output", ref.y, yt), ("input gradient", ref.x_grad, xt.grad)])
        res.worst_error = errs[0].error if errs else 0.0
        res.errors = [e for e in errs if not e.error <= res.tolerance]
        res.verdict = WRONG if res.errors else EXACT
        res.tiled_segments = len(p.tiled_segments)
        res.tiles = sum(s.n_tiles for s in p.tiled_segments)
    res.seconds = time.perf_counter() - t0
    return res
