"""benchmarks/trace_tables.py on the H200 trace the project keeps (docs/benchmarks/traces): what it reads from a real
profile."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script

PLAIN = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "traces" / "h200_resnet50_plain.json.gz"


def test_kernels_are_charged_to_their_launching_operators() -> None:
    t = load_script("trace_tables")
    events = t.load(PLAIN)
    rows = t.by_launcher(events)
    top, seconds, kernels = rows[0]
    assert top.startswith("aten::native_batch_norm_backward < NativeBatchNormBackward0")
    assert seconds == pytest.approx(0.1425, abs=5e-4) and kernels == 53
    # every kernel is charged somewhere: the sum is the device's kernel time
    total = sum(e["dur"] for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")) / 1e6
    assert sum(s for _, s, _ in rows) == pytest.approx(total)


def test_convolution_rates_and_batch_norm_bandwidth() -> None:
    t = load_script("trace_tables")
    events = t.load(PLAIN)
    convs = t.conv_rates(events)
    seconds, flops, calls = convs[("forward", (64, 3, 7, 7))]  # the stem: one call, 8192 -> 4096 px, stride 2
    assert calls == 1 and flops == 2.0 * 64 * 3 * 7 * 7 * 4096 * 4096
    assert 20e12 < flops / seconds < 30e12
    assert sum(s for s, _, _ in convs.values()) == pytest.approx(0.1297, abs=5e-4)
    norms = t.memory_rates(events, t.NORMS)
    s, b, n = norms["aten::native_batch_norm_backward"]
    assert n == 53 and b / s / 4800e9 == pytest.approx(0.130, abs=0.002)  # gpu_speed.NORM_BACKWARD_EFFICIENCY
