"""Peak memory of a patch-encoder step does not grow with the number of patches (measured on CPU, VmHWM growth of a
fresh process per size; benchmarks/bench_patch_memory.py), and the plan says so from shapes alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("timm", reason="the encoder is a timm ViT")

ROOT = Path(__file__).resolve().parents[1]


def test_planned_peak_is_flat_in_patch_count() -> None:
    """Same budget, 4x and 16x the patches of ViT-B/16 on the 2080 Ti preset in fp16: the planned peak stays within
    10% of the smaller slide's (shapes only, seconds)."""
    from wsitrain.gpus import resolve_budget
    from wsitrain.models import build
    from wsitrain.sft import plan

    budget = resolve_budget("2080ti", None)
    with torch.device("meta"):
        net = build("timm/vit_base_patch16_224", 2, pool="gated_attention")
    peaks = []
    for size in (11200, 22400, 44800):  # 2,500, 10,000 and 40,000 patches
        p = plan(net, input_shape=(1, 3, size, size), memory_budget=budget.bytes, dtype=torch.float16,
                 optimizer="adamw", device="cuda", target=budget.target)  # fmt: skip
        assert p.fits and any(s.mode == "tiled" for s in p.segments)
        peaks.append(p.estimated_peak_bytes)
    assert max(peaks) <= 1.10 * peaks[0] and max(peaks) <= budget.bytes, peaks


@pytest.mark.heavy
def test_measured_peak_is_flat_in_patch_count() -> None:
    """Two fresh processes (about 15 s each, timm's import most of it): 16 and 64 patches under a budget below
    plain training of the smaller slide; the larger slide's peak growth at most 10% above the smaller's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_patch_memory as bench
    finally:
        sys.path.pop(0)
    small, large = bench.measured([256, 512], "24MiB")
    assert small["chunk"] is not None and large["chunk"] is not None, (small, large)
    assert large["growth"] <= 1.10 * small["growth"], (small, large)


def test_benchmark_script_runs_its_help() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_patch_memory.py"), "--help"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0 and "VmHWM" in r.stdout
