"""Fit the simulated clock's two fitted factors to the measured H200 table, and check the rest.

PYTHONPATH=. python benchmarks/fit_clock.py           # ~3 min on one core: records four steps, fits, prints the table
PYTHONPATH=. python benchmarks/fit_clock.py --host-op-us 8 27 80   # also: how the fit moves with the host's cost
PYTHONPATH=. python benchmarks/fit_clock.py --kit docs/benchmarks/gpu_session.jsonl   # a GPU kit's cases, refitted

With ``--kit``, the measured figures are the GPU kit's (benchmarks/gpu_session.py, whichever card ran it): every case
it measured is replayed on the clock of the card's speed preset, with the plan's own budget, time model and target,
and the replayed plan is checked against the plan the card ran. Both factors are then refitted, on the first
model's plain NCHW step and its capped step (``cudnn.benchmark`` off, the run's constants), and every case is shown
with the preset's constants and with the refitted ones.

The H200 figures are *measured* (issue 36: one H200, torch 2.11.0+cu130, cuDNN 9.19, ResNet-50, 2 classes, batch
1, bf16 autocast, AdamW foreach). The clock's steps are *simulated* (the real executor on fake tensors, priced by
``wsitrain.sft.simulate.clock``). CONV_EFFICIENCY is fitted on the plain 8192 px step alone; every other case is
a check it was not fitted to. TILE_CONV_EFFICIENCY is then fitted on the capped SFT step (the one tiled step
measured); the first table shows what the clock predicts for it without that factor.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from wsitrain.errors import PlanError
from wsitrain.gpu_speed import GpuSpeed, gpu_speed, speed_preset_of
from wsitrain.gpus import gpu_preset
from wsitrain.models import build
from wsitrain.sft.planning.costs import TimeModel
from wsitrain.sft.simulate.clock import OpClock
from wsitrain.sft.simulate.timing import clock_plain_step, clock_sft_step, patch_training_model
from wsitrain.sft.target import TargetDevice

# (case, measured seconds on the H200, what the case is)
MEASURED = {
    "plain 8192 px NCHW": 0.419,
    "SFT 8192 px, no budget": 0.420,
    "SFT 8192 px, capped 10.47 GiB": 0.766,
    "plain 256 x 224 px (channels_last)": 0.075,
}
FIT_ON = "plain 8192 px NCHW"

PAGE = "docs/research/simulated-clock.md"  # where this script's figures are documented (named in --help)


def record() -> dict[str, OpClock]:
    speed = gpu_speed("h200")
    assert speed is not None
    preset = gpu_preset("h200")
    with torch.device("meta"):
        model = build("resnet50", 2)
    clocks: dict[str, OpClock] = {}
    clocks["plain 8192 px NCHW"] = clock_plain_step(model, (1, 3, 8192, 8192), speed, "bf16")[1]
    clocks["plain 256 x 224 px (channels_last)"] = clock_plain_step(model, (256, 3, 224, 224), speed, "bf16")[1]
    sft_cases = (("SFT 8192 px, no budget", preset.usable_bytes), ("SFT 8192 px, capped 10.47 GiB", "10.47GiB"))
    for case, budget in sft_cases:
        _, sim, clock = clock_sft_step(model, (1, 3, 8192, 8192), budget, speed, "bf16", target=preset.target(True))
        grids = [s.tile_grid for s in sim.plan.segments]
        segs = ", ".join("plain" if g == (1, 1) else f"{g[0]}x{g[1]}" for g in grids)
        print(f"{case}: plan {segs}, planned overhead {sim.plan.overhead:+.1%}, slowdown {sim.plan.slowdown:.3f}x")
        clocks[case] = clock
    return clocks


FIT_BOUNDS = (0.01, 1.0)  # an efficiency fitted at either end: the clock cannot reach the measured time with it


def fit(clock: OpClock, measured: float, speed: GpuSpeed, key: str = "conv_efficiency") -> float:
    lo, hi = FIT_BOUNDS  # time falls as the efficiency rises: bisect
    for _ in range(40):
        mid = (lo + hi) / 2
        t = clock.reading(dataclasses.replace(speed, **{key: mid}), "bf16").seconds
        lo, hi = (mid, hi) if t > measured else (lo, mid)
    return (lo + hi) / 2


def table(clocks: dict[str, OpClock], speed: GpuSpeed, title: str) -> None:
    print(
        f"\n{title} (conv_efficiency {speed.conv_efficiency:.4f}, unaligned_conv_efficiency "
        f"{speed.unaligned_conv_efficiency:.4f})"
    )
    print("| case | measured (H200) | simulated | off |")
    print("| --- | --- | --- | --- |")
    for case, clock in clocks.items():
        r = clock.reading(speed, "bf16")
        print(f"| {case} | {MEASURED[case]:.3f} s | {r.seconds:.3f} s | {r.seconds / MEASURED[case] - 1:+.1%} |")
    for case, clock in clocks.items():
        print(f"\n{case}:\n{clock.reading(speed, 'bf16').text()}")


def host_sensitivity(clocks: dict[str, OpClock], base: GpuSpeed, host_op_us: list[float]) -> None:
    """Refit both factors with another host cost per operator (views cost a quarter of it, as by default): how much
    of the capped step's unexplained time host dispatch could carry, if the H200's host issued operators that slowly
    (the host-time measurement gives this CPU's figure: ``wsitrain plan --simulate`` prints it)."""
    capped = "SFT 8192 px, capped 10.47 GiB"
    print("\n| host per operator | conv_efficiency (plain) | unaligned_conv_efficiency (capped) "
          "| capped: host, GPU waits |")
    print("| --- | --- | --- | --- |")
    for us in host_op_us:
        speed = dataclasses.replace(base, host_op_us=us, view_host_us=us / 4)
        eff = fit(clocks[FIT_ON], MEASURED[FIT_ON], speed)
        speed = dataclasses.replace(speed, conv_efficiency=eff)
        tile = fit(clocks[capped], MEASURED[capped], speed, "unaligned_conv_efficiency")
        r = clocks[capped].reading(dataclasses.replace(speed, unaligned_conv_efficiency=tile), "bf16")
        print(f"| {us:g} us | {eff:.4f} | {tile:.3f} | {r.host_seconds:.3f} s, {r.host_bound_seconds:.3f} s |")


# ---- a GPU kit's cases (benchmarks/gpu_session.py's JSONL) -----------------------------------------------------------

KIT_CLASSES, KIT_PRECISION = 2, "bf16"  # as the kit runs every case


@dataclass(frozen=True)
class KitReplay:
    """One measured case of the kit and its replay on the clock (``clock`` None: the replay's plan did not fit)."""

    row: dict[str, Any]  # the kit's JSONL line
    clock: OpClock | None
    plan: str | None  # the replayed plan (SFT cases), to compare with row["plan"]
    note: str = ""

    @property
    def measured(self) -> float:
        return float(self.row["step_s"])

    @property
    def same_plan(self) -> bool:
        return self.plan == self.row.get("plan")


# what every measured case of the kit records, and what its SFT cases add (benchmarks/gpu_session.py, run_case)
KIT_KEYS = ("model", "run", "size", "device", "patches", "patch", "channels_last", "cudnn_benchmark", "constants",
            "step_s")  # fmt: skip
KIT_SFT_KEYS = ("budget", "budget_bytes", "time_model", "large_conv")


class KitError(Exception):
    """A kit file the replay cannot use; the message names the file (and line) and how to fix it."""


def kit_rows(path: Path) -> list[dict[str, Any]]:
    """The cases a kit measured (status ok), without its breakdown line; KitError for a line that is not a case of
    the kit's format (not JSON, or written by a kit older than the replay)."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise KitError(f"{path}:{n}: not JSON ({e.msg}); pass the gpu_session.jsonl benchmarks/gpu_session.py "
                           "wrote") from None  # fmt: skip
        if not isinstance(row, dict) or "run" not in row or row.get("status") != "ok":
            continue
        missing = [k for k in KIT_KEYS + (KIT_SFT_KEYS if "plan" in row else ()) if k not in row]
        if missing:
            raise KitError(f"{path}:{n}: case {row['run']!r} lacks {', '.join(missing)}: written by a kit older than "
                           "the replay; run benchmarks/gpu_session.py again")  # fmt: skip
        rows.append(row)
    return rows


def kit_speed(path: Path, rows: list[dict[str, Any]]) -> tuple[str, GpuSpeed]:
    """The speed preset (and its constants) of the one card the kit ran on; KitError naming the file otherwise."""
    names = sorted({str(r["device"]) for r in rows})
    if len(names) != 1:
        raise KitError(f"{path}: expected the cases of one card, found {names or 'no measured case'}")
    preset = speed_preset_of(names[0])
    speed = gpu_speed(preset)
    if preset is None or speed is None:
        raise KitError(f"{path}: the card {names[0]!r} matches no speed preset of wsitrain/gpu_speed.py "
                         "(add its constants there first)")  # fmt: skip
    return preset, speed


def replay(row: dict[str, Any], preset: str, speed: GpuSpeed) -> KitReplay:
    """The kit's case ``row`` on the simulated clock: plain PyTorch on the same input, or SFT planned with the same
    budget, time model and target as on the card."""
    with torch.device("meta"):
        model = build(row["model"], KIT_CLASSES)
    if "plan" not in row:
        n, edge = (row["patches"], row["patch"]) if row["patches"] else (1, row["size"])
        if row.get("patch_bn_train"):  # patch training as users run it: BatchNorm in training mode (issue 57)
            model = patch_training_model(model)
        return KitReplay(row, clock_plain_step(model, (n, 3, edge, edge), speed, KIT_PRECISION)[1], None)
    tm = TimeModel(**row["time_model"]) if row["time_model"] else None
    # the card's own target where the kit recorded it (host link, nominal rate, usable memory), else the preset's
    target = TargetDevice(**row["target"]) if row.get("target") else gpu_preset(preset).target(row["large_conv"])
    if "pointwise_matmul" not in (row.get("target") or {}):  # a row from before tiles ran 1x1 layers as products
        target = replace(target, pointwise_matmul=False)
    try:
        # the optimizer the card's plan held: a kit of before 2026-11-27 planned with none (and trained AdamW)
        # and whether its one-pass segments fell back to a recompute: every bf16 step of a kit before 2026-11-27 did
        falls_back = bool(row.get("one_pass_fallbacks", "plan_optimizer" not in row))
        _, sim, clock = clock_sft_step(model, (1, 3, row["size"], row["size"]), row["budget_bytes"], speed,
                                       KIT_PRECISION, target=target, time_model=tm,
                                       plan_optimizer=row.get("plan_optimizer"),
                                       one_pass_falls_back=falls_back,
                                       # a kit from before issue 57 ran no fold and the earlier copies
                                       fold_bn=bool(row.get("fold_bn", False)),
                                       copy_free=bool(row.get("copy_free", False)))  # fmt: skip
    except PlanError as e:
        return KitReplay(row, None, None, f"not replayed: {str(e).split('. ')[0]}")
    return KitReplay(row, clock, sim.plan.brief)


def _fit_rows(replays: list[KitReplay]) -> tuple[KitReplay, KitReplay | None]:
    """The two cases the factors are fitted on: the first model's plain NCHW step and its capped step (benchmark
    off, the run's constants); every other case is a check."""
    first = replays[0].row["model"]
    mine = [r for r in replays if r.row["model"] == first and r.clock is not None]
    plain = [r for r in mine if r.plan is None and not r.row["patches"] and not r.row["channels_last"]]
    capped = [r for r in mine if r.plan is not None and r.row.get("budget") and not r.row["cudnn_benchmark"]
              and r.row["constants"] == "run"]  # fmt: skip
    if not plain:
        raise KitError(f"the kit has no measured plain NCHW step of {first} to fit the convolution rate on; run "
                       "benchmarks/gpu_session.py with its default cases")
    return plain[0], capped[0] if capped else None


def _not_modelled(row: dict[str, Any]) -> str:
    if row["channels_last"] and not row["patches"]:
        return "the clock has no memory-format term"
    if row["cudnn_benchmark"]:
        return "the clock prices the heuristics' algorithms, not benchmark's"
    return ""


# the capped replay's unaligned 1x1 convolutions must hold at least this share of its convolution FLOPs for their rate
# to be refitted on it: since tiles run such layers as matrix products (ops/pointwise_conv.py) only a few stride-2 and
# cropped ones remain, and a fit on them would charge the step's other unpriced time to those few layers
UNALIGNED_FIT_SHARE = 0.05


def _has_unaligned(clock: OpClock) -> bool:
    convs = [(o.flops, o.unaligned) for w in clock.windows for o in w.ops if o.conv_px]
    total = sum(f for f, _ in convs)
    return total > 0 and sum(f for f, u in convs if u) >= UNALIGNED_FIT_SHARE * total


def kit_table(path: Path) -> str:
    """Every measured case of the kit at ``path`` against the clock, with the preset's constants and refitted."""
    rows = kit_rows(path)
    preset, speed = kit_speed(path, rows)
    replays = [replay(r, preset, speed) for r in rows]
    plain, capped = _fit_rows(replays)
    assert plain.clock is not None
    refit = dataclasses.replace(speed, conv_efficiency=fit(plain.clock, plain.measured, speed))
    # the capped step's excess is its tiles' unaligned 1x1 layers (docs/benchmarks/traces); a model without them keeps
    # the factor
    unaligned = capped is not None and capped.clock is not None and _has_unaligned(capped.clock)
    if unaligned:
        assert capped is not None and capped.clock is not None
        eff = fit(capped.clock, capped.measured, refit, "unaligned_conv_efficiency")
        refit = dataclasses.replace(refit, unaligned_conv_efficiency=eff)
    fitted = (("conv_efficiency", refit.conv_efficiency),
              ("unaligned_conv_efficiency", refit.unaligned_conv_efficiency))  # fmt: skip
    at_bound = [f"{k} {v:.4f}" for k, v in fitted[: 1 + unaligned] if min(abs(v - b) for b in FIT_BOUNDS) < 1e-3]
    lines = [
        f"Measured: {path} ({rows[0]['device']}). Simulated: the clock of preset {preset}, {KIT_PRECISION}, each case "
        f"replayed (SFT: the plan's own budget, time model and target).",
        "",
        f"Preset constants: conv_efficiency {speed.conv_efficiency:.4f}, unaligned_conv_efficiency "
        f"{speed.unaligned_conv_efficiency:.4f}. Refitted: conv_efficiency {refit.conv_efficiency:.4f} (on "
        f"{plain.row['model']}, {plain.row['run']}), unaligned_conv_efficiency {refit.unaligned_conv_efficiency:.4f} "
        + (f"(on {capped.row['model']}, {capped.row['run']})." if unaligned and capped is not None else
           "(kept: no capped case whose unaligned 1x1 convolutions hold 5% of its convolution FLOPs)."),
        *([f"At the end of its range, {', '.join(at_bound)}: the clock cannot reach that measured time."]
          if at_bound else []),
        "",
        "| model | run | measured | simulated, preset | off | simulated, refitted | off | plan: measured / replayed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in replays:
        plan = "" if r.plan is None and "plan" not in r.row else (
            r.row["plan"] if r.same_plan else f"{r.row['plan']} / **{r.plan or 'none'}**")
        if r.clock is None:
            lines.append(f"| {r.row['model']} | {r.row['run']} | {r.measured:.3f} s | {r.note} | | | | {plan} |")
            continue
        a, b = r.clock.reading(speed, KIT_PRECISION).seconds, r.clock.reading(refit, KIT_PRECISION).seconds
        why = _not_modelled(r.row)
        run = f"{r.row['run']} ({why})" if why else r.row["run"]
        lines.append(f"| {r.row['model']} | {run} | {r.measured:.3f} s | {a:.3f} s | {a / r.measured - 1:+.1%} | "
                     f"{b:.3f} s | {b / r.measured - 1:+.1%} | {plan} |")  # fmt: skip
    if any(r.plan is not None and not r.same_plan for r in replays):
        lines += ["", "A plan in **bold** differs from the one the card ran: that case's figures compare two plans."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host-op-us", type=float, nargs="*", default=[], help="host costs per operator to refit at")
    parser.add_argument("--kit", type=Path, help="a GPU kit's JSONL (benchmarks/gpu_session.py): replay its cases")
    args = parser.parse_args(argv)
    if args.kit is not None:
        try:
            if not args.kit.is_file():
                raise KitError(f"--kit {args.kit}: no such file (benchmarks/gpu_session.py writes gpu_session.jsonl)")
            rows = kit_rows(args.kit)  # every line checked before the first (minutes long) replay
            kit_speed(args.kit, rows)
            print(kit_table(args.kit))
        except KitError as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    base = gpu_speed("h200")
    assert base is not None
    clocks = record()
    if args.host_op_us:
        host_sensitivity(clocks, base, args.host_op_us)
    eff = fit(clocks[FIT_ON], MEASURED[FIT_ON], base)
    one = dataclasses.replace(base, conv_efficiency=eff)
    table(clocks, one, f"conv_efficiency fitted on {FIT_ON} alone")
    capped = "SFT 8192 px, capped 10.47 GiB"
    tile = fit(clocks[capped], MEASURED[capped], one, "unaligned_conv_efficiency")
    table(clocks, dataclasses.replace(one, unaligned_conv_efficiency=tile),
          f"and unaligned_conv_efficiency fitted on {capped}")


if __name__ == "__main__":
    main()
