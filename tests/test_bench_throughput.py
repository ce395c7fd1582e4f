"""benchmarks/bench_throughput.py: the quick run end to end (files, keys, the equality check, reuse on a masked
image), the synthetic masked slide, and a step that differs with reuse being refused. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from script_module import load_script

STEP_KEYS = {
    "case", "model", "size", "pool", "tile_size", "grids", "tissue_pixel_fraction", "tiles_forward", "tiles_backward",
    "tiles_reused_forward", "tiles_reused_backward", "tiles_skipped_backward", "tiles_skipped_backward_without",
    "step_s_without", "step_s_with", "mean_step_s_without", "mean_step_s_with", "speedup", "fixed_s",
    "computed_fraction", "target_s", "target_holds", "target_as_stated_holds", "equal_with_without", "torch", "nproc",
    "measured_on",
}  # fmt: skip


def _load() -> ModuleType:
    return load_script("bench_throughput")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load()


@pytest.mark.heavy  # 30-50 s on 2 cores (measured 2026-11-27); CI runs it, `make test` does not
def test_quick_run_writes_rows_table_and_plot(bench: ModuleType, tmp_path: Path) -> None:
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "bench_throughput.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    reads = [r for r in rows if r["kind"] == "read"]
    assert [(r["model"], r["size"], r["pool"]) for r in steps] == [("tiny", 2048, "avg"), ("tiny", 2048, "max")]
    for r in steps:
        assert STEP_KEYS <= set(r), STEP_KEYS - set(r)
        assert r["equal_with_without"] is True  # the logits and every gradient compared with torch.equal
        assert r["torch"] == torch.__version__ and r["nproc"] >= 1 and "CPU" in r["measured_on"]
        assert 0.3 <= r["tissue_pixel_fraction"] <= 0.5
        assert len(r["step_s_without"]) == len(r["step_s_with"]) == 1
    avg, mx = steps
    assert avg["tiles_reused_forward"] > 0 and avg["tiles_reused_backward"] > 0  # the masked background
    assert avg["computed_fraction"] < 1
    assert mx["tiles_skipped_backward"] > 0 and mx["tiles_skipped_backward_without"] == 0  # skip off without
    readers = {(r["slide"], r["reader"], r.get("threads")) for r in reads}
    for slide in ("masked", "tissue everywhere"):
        assert {(slide, "openslide fill_region", 1), (slide, "openslide fill_region", 2)} <= readers
        assert (slide, "openslide read_region (one call)", 1) in readers
        assert any(s == slide and name == "pyvips" for s, name, _ in readers)  # measured, or why not
    assert all(r["mpx_per_s_best"] > 0 for r in reads if "error" not in r and r["reader"] != "pyvips")
    md = (tmp_path / "bench_throughput.md").read_text()
    assert "(measured)" in md and "2048 px" in md and f"torch {torch.__version__}" in md
    assert "| case |" in md and "target holds?" in md and "| slide | reader |" in md
    assert (tmp_path / "bench_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_masked_slide_is_flat_outside_the_tissue(bench: ModuleType) -> None:
    img, tissue = bench.masked_slide(512)
    assert img.shape == (512, 512, 3) and img.dtype == np.uint8
    background = (img == np.array(bench.BACKGROUND, dtype=np.uint8)).all(-1)
    assert 0.3 <= tissue <= 0.5 and abs((1 - background.mean()) - tissue) < 0.01
    assert background[0].all() and background[:, 0].all()  # the border is background, as on slides


def test_a_step_that_differs_with_reuse_is_refused(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    real = bench.grads_of
    calls: list[int] = []

    def perturbed(model: torch.nn.Module) -> list[torch.Tensor]:
        grads = real(model)
        calls.append(1)
        if len(calls) == 2:  # the step with reuse
            grads[0] = grads[0] + 1
        return grads

    monkeypatch.setattr(bench, "grads_of", perturbed)
    monkeypatch.setitem(bench.TILING, "tiny", {"tile_size": 64, "checkpoints": []})
    img, tissue = bench.masked_slide(256)
    x = torch.from_numpy(img).permute(2, 0, 1).unsqueeze(0).contiguous()
    with pytest.raises(SystemExit, match="differs"):
        bench.bench_case("tiny", 256, "avg", x, tissue, 1, None)
