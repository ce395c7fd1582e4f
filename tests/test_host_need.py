"""Host RAM per node: slides, host checkpoints, the stager's page-locked buffers and their rounding, times ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import wsitrain.preflight as pf
from wsitrain.config import WsiTrainConfig
from wsitrain.errors import WsiTrainError
from wsitrain.host_need import host_need, pinned_size, ranks_per_node, staging_buffers
from wsitrain.models import build
from wsitrain.preflight import PreflightError, run_preflight
from wsitrain.sft import plan
from wsitrain.slides.synth import write_synthetic_slide

GiB = 2**30


def test_pinned_allocator_rounds_to_powers_of_two() -> None:
    assert pinned_size(9 * 10**9) == 16 * GiB  # a 9 GB slide pins 16 GiB
    assert pinned_size(4096) == 4096 and pinned_size(4097) == 8192 and pinned_size(0) == 0


def test_ranks_per_node_from_torchrun() -> None:
    assert ranks_per_node({}) == 1 and ranks_per_node({"LOCAL_WORLD_SIZE": "4"}) == 4
    for bad in ("0", "four", "-2"):
        with pytest.raises(WsiTrainError, match="LOCAL_WORLD_SIZE"):
            ranks_per_node({"LOCAL_WORLD_SIZE": bad})


@pytest.fixture(scope="module")
def host_plan():
    """The tiny model on a GPU budget that forces tiling, with every eligible checkpoint in host memory."""
    with torch.device("meta"):
        net = build("tiny", 2)
    return plan(net, (1, 3, 2048, 2048), "300MiB", torch.float32, device="cuda", host_checkpoints="always",
                checkpoints=["features.pool1"], tile_size=512)  # fmt: skip


def test_cuda_need_counts_host_checkpoints_and_staging(host_plan) -> None:
    p = host_plan
    host_ck = [s for s in p.segments if s.start and s.checkpoint_location == "host"]
    assert p.fits and p.input_on_host and host_ck, str(p)
    bufs = staging_buffers(p)
    # three lanes (tiles up, gradient tiles up, tiles down), two buffers each
    assert len(bufs) == 6 and all(n > 0 for n in bufs)
    first = p.segments[0]
    assert bufs[0] >= first.tile_shape[0] * first.tile_shape[1] * 3  # the image's uint8 tile region at least
    need = host_need(p, 3 * 2048 * 2048, 2, "cuda", ranks=3)
    assert need.plan == sum(2 * s.checkpoint_bytes for s in host_ck)  # each checkpoint and its gradient buffer
    assert need.staging == sum(bufs) and need.rounding == sum(pinned_size(n) - n for n in bufs)
    assert need.total == 3 * (2 * 3 * 2048 * 2048 + need.plan + need.staging + need.rounding)
    assert "x 3 processes on this node" in need.describe()


def test_cpu_need_is_the_plans_peak(host_plan) -> None:
    need = host_need(host_plan, 100, 2, "cpu")
    assert need.total == 100 + host_plan.estimated_peak_bytes and need.staging == 0


@pytest.fixture(scope="module")
def one_slide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("slides")
    write_synthetic_slide(d / "a.svs", size=256, positive=True, seed=1)
    (d / "labels.csv").write_text("slide,label\na.svs,positive\n")
    return d


def test_preflight_multiplies_by_the_ranks_on_the_node(one_slide: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = WsiTrainConfig.model_validate(
        {"data": {"labels": str(one_slide / "labels.csv"), "mpp": 0.5}, "model": {"name": "tiny"},
         "engine": {"device": "cpu"}}
    )  # fmt: skip
    one = run_preflight(cfg, GiB, "cuda").host_needed_bytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(pf, "available_host_bytes", lambda: 3 * one)
    with pytest.raises(PreflightError) as info:
        run_preflight(cfg, GiB, "cuda")
    (problem,) = info.value.problems
    assert "x 4 processes on this node" in problem.message and "fewer processes per node" in problem.hint
