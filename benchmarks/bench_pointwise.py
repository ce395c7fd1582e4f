"""A tile's 1x1 layers on a GPU: as cuDNN convolutions against as matrix products (wsitrain/sft/ops/pointwise_conv.py).

    python benchmarks/bench_pointwise.py --out docs/benchmarks          # a CUDA GPU, bf16: about 15 s

For each map shape (ResNet-50's tiles in the capped 8192 px step on an H200, from its trace, and two whole maps), one
1x1 layer in bf16, NCHW: forward alone and forward with backward (input and weight gradients), as ``F.conv2d``, as
``pointwise_matmul`` (what a tile runs on unaligned maps) and as a channels-last convolution with the layout copies
around it. Fastest of 8 timed runs after 3 warm-ups, CUDA events. Also the largest difference between the
convolution's and the product's forward outputs. Writes ``pointwise_matmul.md`` and ``pointwise_matmul.jsonl``
into ``--out``. Every figure is *measured* on the card that runs it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from wsitrain.sft.ops.pointwise_conv import pointwise_matmul

# (Cin, Cout, H, W): the capped ResNet-50 step's tiles (odd and even unaligned maps), then aligned whole maps
SHAPES = [
    (128, 512, 387, 387), (128, 512, 322, 322), (128, 512, 323, 389), (512, 128, 321, 387), (256, 1024, 321, 321),
    (1024, 256, 193, 321), (64, 256, 662, 782), (256, 64, 662, 662), (1024, 512, 319, 319), (128, 512, 1024, 1024),
    (256, 1024, 512, 512),
]  # fmt: skip
Layer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

PAGE = "docs/benchmarks/pointwise_matmul.md"  # where this script's figures are documented (named in --help)


def _conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w)


def _product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return pointwise_matmul(x, w, None)


def _channels_last(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    cl = torch.channels_last
    return F.conv2d(x.contiguous(memory_format=cl), w.contiguous(memory_format=cl)).contiguous()


LAYERS: dict[str, Layer] = {"conv": _conv, "product": _product, "channels_last": _channels_last}


def best_ms(layer: Layer, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, backward: bool) -> float:
    def once() -> None:
        y = layer(x, w)
        if backward:
            torch.autograd.grad(y, (x, w), g)

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(8):
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def measure(cin: int, cout: int, h: int, w: int, batch: int = 1) -> dict[str, Any]:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(batch, cin, h, w, device=dev, dtype=dt, requires_grad=True)
    wt = (torch.randn(cout, cin, 1, 1, device=dev, dtype=dt) / cin**0.5).requires_grad_()
    g = torch.randn(batch, cout, h, w, device=dev, dtype=dt)
    row: dict[str, Any] = {"cin": cin, "cout": cout, "h": h, "w": w, "batch": batch, "aligned": h * w % 8 == 0}
    for name, layer in LAYERS.items():
        row[f"{name}_forward_ms"] = best_ms(layer, x, wt, g, False)
        row[f"{name}_both_ms"] = best_ms(layer, x, wt, g, True)
    flops = 3 * 2.0 * batch * cin * cout * h * w  # forward, input gradient, weight gradient
    for name in LAYERS:
        row[f"{name}_tflops"] = flops / (row[f"{name}_both_ms"] * 1e-3) / 1e12
    with torch.no_grad():
        row["max_forward_difference"] = (_conv(x, wt).float() - _product(x, wt).float()).abs().max().item()
    return row


def markdown(rows: list[dict[str, Any]], device: str) -> str:
    out = [
        "# A tile's 1x1 layers: convolution against matrix product",
        "",
        f"*Measured* on {device}, torch {torch.__version__}, by `python benchmarks/bench_pointwise.py`: one 1x1 layer, "
        "bf16, NCHW, fastest of 8 runs; \"both\" is forward with the input and weight gradients; TFLOP/s of both.",
        "",
        "| Cin | Cout | map | batch | pixels aligned | conv: forward / both | product: forward / both | "
        "channels-last conv with copies: both | conv TFLOP/s | product TFLOP/s | product speed-up | forward max diff |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        out.append(
            f"| {r['cin']} | {r['cout']} | {r['h']} x {r['w']} | {r['batch']} | {'yes' if r['aligned'] else 'no'} | "
            f"{r['conv_forward_ms']:.3f} / {r['conv_both_ms']:.3f} ms | "
            f"{r['product_forward_ms']:.3f} / {r['product_both_ms']:.3f} ms | {r['channels_last_both_ms']:.3f} ms | "
            f"{r['conv_tflops']:.0f} | {r['product_tflops']:.0f} | {r['conv_both_ms'] / r['product_both_ms']:.2f}x | "
            f"{r['max_forward_difference']:.3g} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_pointwise.py needs a CUDA GPU (cuDNN's kernels are what it measures)")
        return 2
    torch.backends.cudnn.benchmark = False  # as fit runs
    rows = [measure(*s) for s in SHAPES] + [measure(128, 512, 323, 389, batch=2)]
    device = torch.cuda.get_device_name()
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "pointwise_matmul.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps({**r, "device": device, "torch": torch.__version__}) + "\n")
    (args.out / "pointwise_matmul.md").write_text(markdown(rows, device))
    print(markdown(rows, device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
