"""Read the GPU kit's Chrome traces (``gpu_session.py --trace``) offline: where the device's time went.

    python benchmarks/trace_tables.py docs/benchmarks/traces/h200_resnet50_capped.json.gz    # by launching operator
    python benchmarks/trace_tables.py docs/benchmarks/traces/h200_resnet50_capped.json.gz \\
        --against docs/benchmarks/traces/h200_resnet50_plain.json.gz                     # convolutions, side by side

The first table charges every kernel (and device copy or fill) to the operator that launched it, named with the
operators and profiler ranges around it (``aten::copy_ < _CropBackward < ... < sft.tile_backward``). The second
sums the kernel time of every convolution (forward: ``aten::cudnn_convolution``; backward:
``aten::convolution_backward``) by weight shape and gives its rate in TFLOP/s (forward 2*Cout*Cin/g*kh*kw*Ho*Wo;
backward the same per gradient asked for), for the traced step and, with ``--against``, another (the plain step).
No GPU needed: the traces carry the kernels' times as measured.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

Event = dict[str, Any]

PAGE = "docs/benchmarks/gpu_time_breakdown.md"  # where this script's figures are documented (named in --help)


def load(path: Path) -> list[Event]:
    with gzip.open(path) if path.suffix == ".gz" else path.open("rb") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def launches(events: list[Event]) -> list[tuple[Event, Event | None, list[str]]]:
    """Each device event (kernel, copy, fill) with the operator that launched it and the names around that operator,
    innermost first (operators and profiler ranges on the launching thread, by time containment)."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    by_id: dict[int, Event] = {}
    for e in ops:
        ext = e.get("args", {}).get("External id")
        if ext is not None and e["cat"] == "cpu_op":
            by_id.setdefault(ext, e)
    parent: dict[int, Event | None] = {}
    threads: dict[Any, list[Event]] = defaultdict(list)
    for e in ops:
        threads[e["tid"]].append(e)
    for run in threads.values():
        run.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[Event] = []
        for e in run:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            parent[id(e)] = stack[-1] if stack else None
            stack.append(e)
    out = []
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        op = by_id.get(k.get("args", {}).get("External id"))
        names, p = [], op
        while p is not None:
            names.append(p["name"])
            p = parent.get(id(p))
        out.append((k, op, names))
    return out


def by_launcher(events: list[Event], depth: int = 4) -> list[tuple[str, float, int]]:
    """(launching operator and its ``depth - 1`` enclosing names, kernel seconds, kernels), costliest first."""
    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for k, _, names in launches(events):
        key = " < ".join(names[:depth]) or "(no operator)"
        seconds[key] += k["dur"] / 1e6
        calls[key] += 1
    return [(key, s, calls[key]) for key, s in seconds.most_common()]


def _arg(concrete: list[str], i: int, default: list[int]) -> list[int]:
    return list(ast.literal_eval(concrete[i])) if len(concrete) > i and concrete[i] else default


def conv_rates(events: list[Event]) -> dict[tuple[str, tuple[int, ...]], tuple[float, float, int]]:
    """(direction, weight shape) -> (kernel seconds, FLOPs, operator calls) of the step's convolutions."""
    per_op: dict[int, float] = defaultdict(float)
    ops: dict[int, Event] = {}
    for k, op, _ in launches(events):
        if op is not None and op["name"] in ("aten::cudnn_convolution", "aten::convolution_backward"):
            per_op[id(op)] += k["dur"] / 1e6
            ops[id(op)] = op
    out: dict[tuple[str, tuple[int, ...]], list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for key, seconds in per_op.items():
        op = ops[key]
        dims, concrete = op["args"]["Input Dims"], op["args"].get("Concrete Inputs", [])
        if op["name"] == "aten::cudnn_convolution":  # (input, weight, padding, stride, dilation, groups, ...)
            (n, _, h, w), wt = dims[0], dims[1]
            pad, stride, dil = _arg(concrete, 2, [0, 0]), _arg(concrete, 3, [1, 1]), _arg(concrete, 4, [1, 1])
            ho = (h + 2 * pad[0] - dil[0] * (wt[2] - 1) - 1) // stride[0] + 1
            wo = (w + 2 * pad[1] - dil[1] * (wt[3] - 1) - 1) // stride[1] + 1
            flops, way = 2.0 * n * wt[0] * wt[1] * wt[2] * wt[3] * ho * wo, "forward"
        else:  # (grad_output, input, weight, ..., output_mask)
            g, wt = dims[0], dims[2]
            mask = concrete[-1] if concrete else "[True, True, False]"
            grads = sum(1 for part in mask.strip("[]").split(",")[:2] if part.strip() == "True")
            flops, way = 2.0 * g[0] * g[1] * g[2] * g[3] * wt[1] * wt[2] * wt[3] * grads, "backward"
        acc = out[(way, tuple(wt))]
        acc[0] += seconds
        acc[1] += flops
        acc[2] += 1
    return {k: (v[0], v[1], int(v[2])) for k, v in out.items()}


def memory_rates(events: list[Event], ops: tuple[str, ...]) -> dict[str, tuple[float, float, int]]:
    """operator -> (kernel seconds, bytes, operator calls) for memory-bound operators, counting bytes as the
    simulated clock does: every tensor argument read and every output written, 2 bytes per element (bf16). The
    outputs' shapes are not in the trace; each operator here writes what its first argument holds (a map) plus
    per-channel vectors, so an output is counted as one more map for forward operators and for backward ones
    (grad_input) alike."""
    per_op: dict[int, float] = defaultdict(float)
    found: dict[int, Event] = {}
    for k, op, _ in launches(events):
        if op is not None and op["name"] in ops:
            per_op[id(op)] += k["dur"] / 1e6
            found[id(op)] = op
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for key, seconds in per_op.items():
        op = found[key]
        dims = [d for d in op["args"]["Input Dims"] if d]
        read = sum(2.0 * _numel(d) for d in dims)
        acc = out[op["name"]]
        acc[0] += seconds
        acc[1] += read + 2.0 * _numel(dims[0])
        acc[2] += 1
    return {k: (v[0], v[1], int(v[2])) for k, v in out.items()}


def _numel(shape: list[int]) -> float:
    n = 1.0
    for d in shape:
        n *= d
    return n


NORMS = ("aten::native_batch_norm", "aten::native_batch_norm_backward", "aten::clamp_min_", "aten::threshold_backward")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("trace", type=Path)
    ap.add_argument("--against", type=Path, help="a second trace (the plain step): convolutions side by side")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--bandwidth", type=float, help="GB/s: the share of it BatchNorm and ReLU reach (4800: H200)")
    a = ap.parse_args(argv)
    events = load(a.trace)
    if a.bandwidth:
        print("| operator | kernel time | calls | bytes (the clock's count) | GB/s | share of bandwidth |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, (s, b, n) in sorted(memory_rates(events, NORMS).items(), key=lambda kv: -kv[1][0]):
            print(f"| {name} | {s * 1e3:.1f} ms | {n} | {b / 1e9:.1f} GB | {b / s / 1e9:.0f} | "
                  f"{b / s / 1e9 / a.bandwidth:.3f} |")
        return 0
    if a.against is None:
        print("| kernel time | kernels | launching operator < enclosing |\n| --- | --- | --- |")
        for key, s, n in by_launcher(events)[: a.rows]:
            print(f"| {s * 1e3:.1f} ms | {n} | {key.replace('|', '/')} |")
        return 0
    mine, other = conv_rates(events), conv_rates(load(a.against))
    print(f"| direction | weight | {a.trace.name}: ms | calls | TFLOP/s | {a.against.name}: ms | calls | TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in sorted(set(mine) | set(other), key=lambda k: -mine.get(k, (0.0, 0.0, 0))[0])[: a.rows]:
        cells = []
        for table in (mine, other):
            s, f, n = table.get(key, (0.0, 0.0, 0))
            cells.append(f"{s * 1e3:.2f} | {n} | {f / s / 1e12:.0f}" if s else "- | 0 | -")
        print(f"| {key[0]} | {'x'.join(map(str, key[1]))} | {cells[0]} | {cells[1]} |")
    totals = [sum(v[0] for v in t.values()) for t in (mine, other)]
    print(f"\nConvolution kernel time: {totals[0] * 1e3:.1f} ms against {totals[1] * 1e3:.1f} ms.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
