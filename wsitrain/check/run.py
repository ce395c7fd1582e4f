"""The checks of one model, and the command that prints them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import typer

from wsitrain.check.compare import (
    ERROR,
    EXACT,
    REFUSED,
    TOLERANCE,
    WRONG,
    CheckResult,
    classify,
    reference,
    run_check,
)
from wsitrain.check.models import load_model, parse_size
from wsitrain.sft.plan_types import Plan
from wsitrain.sft.planning.costs import HEADROOM
from wsitrain.units import format_bytes

DEFAULT_SIZE = "128x160"  # H x W: non-square, so a swapped axis shows; a multiple of 32
BUDGET_SHARES = (0.45, 0.7, 0.9)  # of plain's activation memory, above what tiling cannot shrink
PROBE_BUDGET = "64GiB"  # plenty: the probe plan only reports plain's memory and the fixed part
COLORS = {EXACT: "green", REFUSED: "yellow", WRONG: "red", ERROR: "red"}


@dataclass
class ModelCheck:
    """Every check of one model."""

    model: str
    shape: tuple[int, int, int, int]
    train_bn: bool
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every check exact or refused: the engine never gives a wrong answer for this model."""
        return all(r.verdict in (EXACT, REFUSED) for r in self.results)

    @property
    def verdict(self) -> str:
        """The worst verdict over the checks (error > wrong > refused > exact)."""
        order = [ERROR, WRONG, REFUSED, EXACT]
        return min((r.verdict for r in self.results), key=order.index, default=EXACT)

    @property
    def worst_error(self) -> float | None:
        errs = [r.worst_error for r in self.results if r.worst_error is not None]
        return max(errs) if errs else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "input_shape": list(self.shape),
            "batchnorm": "train" if self.train_bn else "eval",
            "ok": self.ok,
            "checks": [r.to_dict() for r in self.results],
        }


def _budget(model: torch.nn.Module, shape: tuple[int, ...]) -> tuple[int, str]:
    """A budget where the planner must tile, and how it was chosen.

    As the engine's tests choose it: the fixed part (parameters, gradients, runtime) plus 45% of plain's activation
    memory above it. On a small image the fixed part dominates and the planner's headroom leaves no plan there;
    then shares of the way from the smallest plan's need to plain's are tried (45%, 70%, 90%), plain's last.
    """
    from wsitrain.sft import plan

    def planned(budget: int | str) -> Plan:
        return plan(model, shape, budget, torch.float64, device="cpu", input_requires_grad=True)

    probe = planned(PROBE_BUDGET)
    fixed = sum(probe.breakdown.get(k, 0) for k in ("parameters", "runtime", "gradients"))
    budget = int(fixed + BUDGET_SHARES[0] * (probe.baseline_peak_bytes - fixed))
    if planned(budget).fits:
        return budget, f"memory_budget={format_bytes(budget)}: 45% of plain's activation memory"
    least, top = planned(1).estimated_peak_bytes, probe.estimated_peak_bytes
    # the budget a plan of estimated peak e needs: the planner keeps its headroom on what lies above the fixed part
    fixed = sum(probe.breakdown.get(k, 0) for k in ("parameters", "optimizer", "runtime"))
    need = lambda e: int(fixed + (e - fixed) / (1.0 - HEADROOM[probe.device])) + 1  # noqa: E731
    for share in BUDGET_SHARES:
        budget = need(least + share * (top - least))
        if planned(budget).fits:
            return budget, f"memory_budget={format_bytes(budget)}: {share:.0%} of the way from the least plan to plain"
    return need(top), f"memory_budget={format_bytes(need(top))}: plain's (no tiled plan worth running at this size)"


def check_model(
    name: str, size: tuple[int, int] | str = DEFAULT_SIZE, batch: int = 2, train_bn: bool = False,
    tile: int | None = None, tol: float = TOLERANCE, seed: int = 0, checks: tuple[str, ...] = ("tiles", "budget"),
) -> ModelCheck:
    """Check ``name`` (see ``load_model``) at ``batch`` x 3 x ``size``: forced tiles of ``tile`` px (default a
    quarter of the shorter edge) and a budget-driven plan. Bad names and models plain PyTorch cannot run raise a
    WsiTrainError; the engine's own failures are results."""
    h, w = parse_size(size) if isinstance(size, str) else size
    shape = (batch, 3, h, w)
    model = load_model(name, train_bn=train_bn, seed=seed)
    ref = reference(model, shape, seed)
    out = ModelCheck(name, shape, train_bn)
    for check in checks:
        if check == "tiles":
            edge = tile or max(4, min(h, w) // 4)
            kw: dict[str, Any] = {"tile_size": edge, "memory_budget": PROBE_BUDGET}
            setting = f"tile_size={edge}"
        else:
            try:
                budget, setting = _budget(model, shape)
            except Exception as e:  # noqa: BLE001 - refused (or crashed) while planning: that is the finding
                verdict, message = classify(e)
                out.results.append(CheckResult(check, "memory_budget at 45%", verdict, message=message))
                continue
            kw = {"memory_budget": budget}
        out.results.append(run_check(check, setting, ref, tol, **kw))
    return out


def run_check_model(name: str, size: str, batch: int, train_bn: bool, tile: int | None, tol: float,
                    as_json: bool) -> int:  # fmt: skip
    """``wsitrain check-model``: print each check's verdict (the result: even with --quiet); 0 when every check
    is exact or refused, else 1."""
    result = check_model(name, size, batch, train_bn, tile, tol)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return 0 if result.ok else 1
    b, _, h, w = result.shape
    typer.echo(f"{name} on {b}x3x{h}x{w} float64, BatchNorm in {'train' if train_bn else 'eval'} mode, random weights:")
    for r in result.results:
        typer.secho(f"  {r.line()}", fg=COLORS[r.verdict])
    return 0 if result.ok else 1
