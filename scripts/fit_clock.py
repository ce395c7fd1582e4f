"""Fit the simulated clock's two fitted factors to the measured H200 table, and check the rest.

PYTHONPATH=. python scripts/fit_clock.py           # ~3 min on one core: records four steps, fits, prints the table
PYTHONPATH=. python scripts/fit_clock.py --host-op-us 8 27 80   # also: how the fit moves with the host's cost

The H200 figures are *measured* (issue 36: one H200, torch 2.11.0+cu130, cuDNN 9.19, ResNet-50, 2 classes, batch
1, bf16 autocast, AdamW foreach). The clock's steps are *simulated* (the real executor on fake tensors, priced by
``wsitrain.sft.simulate.clock``). CONV_EFFICIENCY is fitted on the plain 8192 px step alone; every other case is
a check it was not fitted to. TILE_CONV_EFFICIENCY is then fitted on the capped SFT step (the one tiled step
measured); the first table shows what the clock predicts for it without that factor.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from wsitrain.gpu_speed import GpuSpeed, gpu_speed
from wsitrain.gpus import gpu_preset
from wsitrain.models import build
from wsitrain.sft.simulate.clock import OpClock
from wsitrain.sft.simulate.timing import clock_plain_step, clock_sft_step

# (case, measured seconds on the H200, what the case is)
MEASURED = {
    "plain 8192 px NCHW": 0.419,
    "SFT 8192 px, no budget": 0.420,
    "SFT 8192 px, capped 10.47 GiB": 0.766,
    "plain 256 x 224 px (channels_last)": 0.075,
}
FIT_ON = "plain 8192 px NCHW"


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


def fit(clock: OpClock, measured: float, speed: GpuSpeed, key: str = "conv_efficiency") -> float:
    lo, hi = 0.01, 1.0  # time falls as the efficiency rises: bisect
    for _ in range(40):
        mid = (lo + hi) / 2
        t = clock.reading(dataclasses.replace(speed, **{key: mid}), "bf16").seconds
        lo, hi = (mid, hi) if t > measured else (lo, mid)
    return (lo + hi) / 2


def table(clocks: dict[str, OpClock], speed: GpuSpeed, title: str) -> None:
    print(
        f"\n{title} (conv_efficiency {speed.conv_efficiency:.4f}, tile_conv_efficiency "
        f"{speed.tile_conv_efficiency:.4f})"
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
    print("\n| host per operator | conv_efficiency (plain) | tile_conv_efficiency (capped) | capped: host, GPU waits |")
    print("| --- | --- | --- | --- |")
    for us in host_op_us:
        speed = dataclasses.replace(base, host_op_us=us, view_host_us=us / 4)
        eff = fit(clocks[FIT_ON], MEASURED[FIT_ON], speed)
        speed = dataclasses.replace(speed, conv_efficiency=eff)
        tile = fit(clocks[capped], MEASURED[capped], speed, "tile_conv_efficiency")
        r = clocks[capped].reading(dataclasses.replace(speed, tile_conv_efficiency=tile), "bf16")
        print(f"| {us:g} us | {eff:.4f} | {tile:.3f} | {r.host_seconds:.3f} s, {r.host_bound_seconds:.3f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-op-us", type=float, nargs="*", default=[], help="host costs per operator to refit at")
    args = parser.parse_args()
    base = gpu_speed("h200")
    assert base is not None
    clocks = record()
    if args.host_op_us:
        host_sensitivity(clocks, base, args.host_op_us)
    eff = fit(clocks[FIT_ON], MEASURED[FIT_ON], base)
    one = dataclasses.replace(base, conv_efficiency=eff)
    table(clocks, one, f"conv_efficiency fitted on {FIT_ON} alone")
    capped = "SFT 8192 px, capped 10.47 GiB"
    tile = fit(clocks[capped], MEASURED[capped], one, "tile_conv_efficiency")
    table(clocks, dataclasses.replace(one, tile_conv_efficiency=tile), f"and tile_conv_efficiency fitted on {capped}")


if __name__ == "__main__":
    main()
