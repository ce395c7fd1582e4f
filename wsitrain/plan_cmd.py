"""``wsitrain plan``: what the SFT engine would do with a model, an image size and a GPU, from shapes alone.

The model is built on the meta device, so planning a 100000 x 100000 image allocates nothing. The
readable output and ``--json`` are rendered from one dict of facts, so they cannot disagree.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from wsitrain.errors import WsiTrainError
from wsitrain.gpus import Budget, resolve_budget
from wsitrain.models import MODEL_NAMES, build
from wsitrain.units import format_bytes

PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PLAN_NUM_CLASSES = 2  # the head is tiny next to the trunk; any class count plans the same


def parse_size(size: str | int, stride: int, model: str) -> tuple[int, int]:
    """``"20480"`` or ``"20480x10240"`` (height x width) into (H, W); each edge at least the model's stride."""
    text = str(size).strip().lower().replace(" ", "")
    parts = text.split("x")
    if len(parts) not in (1, 2) or not all(p.lstrip("-").isdigit() for p in parts):
        raise WsiTrainError(
            f"--size: cannot read {size!r} as an image size", hint="give one edge (20480) or HEIGHTxWIDTH (20480x10240)"
        )
    edges = [int(p) for p in parts]
    h, w = (edges[0], edges[0]) if len(edges) == 1 else (edges[0], edges[1])
    if h <= 0 or w <= 0:
        raise WsiTrainError(f"--size: {size!r} must be positive", hint="give pixels, e.g. --size 20480")
    if h < stride or w < stride:
        raise WsiTrainError(
            f"--size: {size!r} is smaller than {model}'s stride of {stride} px",
            hint=f"give at least {stride} px per edge",
        )
    return h, w


def _precision(precision: str) -> torch.dtype:
    if precision not in PRECISIONS:
        raise WsiTrainError(f"--precision: unknown {precision!r}", hint=f"choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[precision]


def _check_model(model: str) -> None:
    if model not in MODEL_NAMES:
        raise WsiTrainError(f"unknown model {model!r}", hint=f"choose one of: {', '.join(MODEL_NAMES)}")


def _listify(value: Any) -> Any:
    """Tuples (shapes, grids) as JSON lists, recursively."""
    if isinstance(value, (tuple, list)):
        return [_listify(v) for v in value]
    if isinstance(value, dict):
        return {k: _listify(v) for k, v in value.items()}
    return value


_SEGMENT_FIELDS = (
    "index", "layers", "mode", "tile_grid", "tile_edge", "tile_shape", "halo", "input_shape", "output_shape", "n_tiles",
    "checkpoint_bytes", "checkpoint_location", "tile_activation_bytes", "peak_bytes", "flops",
)  # fmt: skip


def plan_facts(plan: Any, *, model: str, budget: Budget, precision: str, max_size: int | None) -> dict[str, Any]:
    """Every fact ``wsitrain plan`` shows, as one JSON-serializable dict (also the ``--json`` output)."""
    budget_bytes = int(plan.budget_bytes)
    facts: dict[str, Any] = {
        "model": model,
        "input_shape": list(plan.input_shape),
        "precision": precision,
        "dtype": str(plan.dtype),
        "device": str(plan.device),
        "gpu": budget.gpu,
        "budget_source": budget.source,
        "budget_bytes": budget_bytes,
        "fits": bool(plan.fits),
        "estimated_peak_bytes": int(plan.estimated_peak_bytes),
        "baseline_peak_bytes": int(plan.baseline_peak_bytes),
        "baseline_fits": int(plan.baseline_peak_bytes) <= budget_bytes,
        "checkpoint_peak_bytes": int(plan.checkpoint_peak_bytes),
        "checkpoint_segments": int(plan.checkpoint_segments),
        "checkpoint_fits": int(plan.checkpoint_peak_bytes) <= budget_bytes,
        "overhead": float(plan.overhead),
        "flops_plain": int(plan.flops_plain),
        "flops_sft": int(plan.flops_sft),
        "recomputed_tiles": int(plan.recomputed_tiles),
        "max_size": max_size,
        "breakdown": {k: int(v) for k, v in dict(plan.breakdown).items()},
        "input_on_host": bool(getattr(plan, "input_on_host", False)),
        "segments": [{f: _listify(getattr(s, f, None)) for f in _SEGMENT_FIELDS} for s in plan.segments],
        "notes": list(getattr(plan, "notes", ())),
    }
    return facts


def make_plan(
    *,
    model: str,
    size: str,
    gpu: str | None,
    memory: str | None,
    batch: int = 1,
    precision: str = "fp32",
    tile: int | None = None,
    optimizer: str | None = None,
    with_max_size: bool = True,
) -> dict[str, Any]:
    """Validate the inputs, plan on the meta device, and return :func:`plan_facts`."""
    from wsitrain.sft import max_square_size, plan  # the engine; imported late so `--help` stays fast

    _check_model(model)
    dtype = _precision(precision)
    budget = resolve_budget(gpu, memory)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise WsiTrainError(f"--batch: {batch!r} must be a positive integer", hint="use --batch 1 (the default)")
    if tile is not None and tile <= 0:
        raise WsiTrainError(f"--tile: {tile!r} must be positive", hint="give a tile edge in pixels, or omit --tile")
    with torch.device("meta"):  # shapes only: no parameter or activation is ever allocated
        net = build(model, PLAN_NUM_CLASSES)
    h, w = parse_size(size, net.stride, model)
    p = plan(
        net, input_shape=(batch, 3, h, w), memory_budget=budget.bytes, dtype=dtype, tile_size=tile,
        optimizer=optimizer, device=budget.device,
    )  # fmt: skip
    max_size = None
    if with_max_size:
        max_size = int(
            max_square_size(net, budget.bytes, dtype=dtype, batch=batch, optimizer=optimizer, device=budget.device)
        )
    return plan_facts(p, model=model, budget=budget, precision=precision, max_size=max_size)


def _layers_text(layers: list[str]) -> str:
    if len(layers) <= 3:
        return ", ".join(layers)
    return f"{layers[0]} … {layers[-1]} ({len(layers)})"


def _shape_text(shape: list[int] | None) -> str:
    return "x".join(str(int(v)) for v in shape) if shape else "-"


def _flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e6:.1f} MFLOP"


def _fits_text(ok: bool) -> str:
    return "[green]fits[/]" if ok else "[red]does not fit[/]"


def render_plan(facts: dict[str, Any], console: Console) -> None:
    """The readable form of :func:`plan_facts`."""
    b, h, w = facts["input_shape"][0], facts["input_shape"][2], facts["input_shape"][3]
    console.print(
        f"[bold]{facts['model']}[/] on {h} x {w} px (batch {b}, {facts['precision']}, device {facts['device']})"
    )
    console.print(f"budget: [bold]{format_bytes(facts['budget_bytes'])}[/] ({facts['budget_source']})")
    if facts["input_on_host"]:
        console.print("the input image stays in host memory; tiles are copied to the device as they run")

    seg = Table(title="segments", title_justify="left")
    for col in ("#", "layers", "mode", "tile grid", "tile (incl. halo)", "halo", "checkpoint", "tile activations",
                "peak"):  # fmt: skip
        seg.add_column(col, justify="left" if col in ("layers", "mode") else "right", no_wrap=col == "layers")
    for s in facts["segments"]:
        tiled = s["mode"] == "tiled"
        seg.add_row(
            str(s["index"]),
            _layers_text(s["layers"]),
            s["mode"],
            f"{s['tile_grid'][0]} x {s['tile_grid'][1]}" if tiled else "-",
            _shape_text(s["tile_shape"]) if tiled else "-",
            _shape_text(s["halo"]) if tiled else "-",
            f"{format_bytes(s['checkpoint_bytes'])} on {s['checkpoint_location']}",
            format_bytes(s["tile_activation_bytes"]),
            format_bytes(s["peak_bytes"]),
        )
    console.print(seg)

    bd = facts["breakdown"]
    # The parts peak at different moments (a tile's activations live only while that tile runs), so the
    # estimated peak is the largest sum at any one moment, not the sum of this column.
    mem = Table(title="estimated memory by part (each part's largest size)", title_justify="left")
    mem.add_column("part")
    mem.add_column("bytes", justify="right")
    parts = [
        ("weights", bd.get("parameters", 0)),
        ("gradients", bd.get("gradients", 0)),
        ("optimizer state", bd.get("optimizer", 0)),
        ("kernel workspaces (cuDNN / oneDNN)", bd.get("runtime", 0)),
        ("checkpoints", bd.get("checkpoints", 0)),
        ("gradient buffers", bd.get("gradient_buffers", 0)),
        ("one tile's activations", bd.get("tile_activations", 0)),
        ("untiled segments' activations", bd.get("plain_activations", 0)),
        ("head", bd.get("head", 0)),
    ]
    for name, n in parts:
        mem.add_row(name, format_bytes(n))
    mem.add_row("[bold]estimated peak[/]", f"[bold]{format_bytes(facts['estimated_peak_bytes'])}[/]")
    console.print(mem)

    console.print(
        f"extra compute (recomputation and halos): [bold]{facts['overhead'] * 100:+.1f}%[/] of plain training "
        f"({_flops(facts['flops_sft'])} vs {_flops(facts['flops_plain'])} per step; "
        f"{facts['recomputed_tiles']} tiles recomputed)"
    )

    cmp = Table(title="side by side", title_justify="left")
    for col in ("strategy", "peak memory", "verdict"):
        cmp.add_column(col, justify="right" if col == "peak memory" else "left")
    cmp.add_row("plain PyTorch", format_bytes(facts["baseline_peak_bytes"]), _fits_text(facts["baseline_fits"]))
    cmp.add_row(
        f"checkpoint_sequential (best: {facts['checkpoint_segments']} segments)",
        format_bytes(facts["checkpoint_peak_bytes"]),
        _fits_text(facts["checkpoint_fits"]),
    )
    cmp.add_row("SFT", format_bytes(facts["estimated_peak_bytes"]), _fits_text(facts["fits"]))
    console.print(cmp)

    verdict = (
        f"[bold green]FITS[/]: SFT needs {format_bytes(facts['estimated_peak_bytes'])} "
        f"of {format_bytes(facts['budget_bytes'])}"
        if facts["fits"]
        else f"[bold red]DOES NOT FIT[/]: SFT needs at least {format_bytes(facts['estimated_peak_bytes'])}, "
        f"the budget is {format_bytes(facts['budget_bytes'])}"
    )
    console.print(verdict)
    if facts["max_size"] is not None:
        edge = facts["max_size"]
        console.print(
            f"largest square image that fits this budget: [bold]{edge} x {edge} px[/]"
            if edge
            else "no square image fits this budget: the weights alone need more"
        )
    for note in facts["notes"]:
        console.print(f"note: {note}")


def run_plan(
    *,
    model: str,
    size: str,
    gpu: str | None,
    memory: str | None,
    batch: int,
    precision: str,
    tile: int | None,
    as_json: bool,
    console: Console,
    optimizer: str | None = None,
) -> int:
    """``wsitrain plan``: print the plan (readable, or one JSON object); exit code 0 when it fits, 1 when not.

    Bad input raises WsiTrainError (the CLI prints it and exits 2).
    """
    facts = make_plan(
        model=model, size=size, gpu=gpu, memory=memory, batch=batch, precision=precision, tile=tile,
        optimizer=optimizer,
    )  # fmt: skip
    if as_json:
        # Plain print, not console.print: rich would wrap and highlight the JSON.
        console.file.write(json.dumps(facts) + "\n")
        console.file.flush()
    else:
        render_plan(facts, console)
    return 0 if facts["fits"] else 1
