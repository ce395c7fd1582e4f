"""Checkpoints in host memory: the same gradients, with the checkpoint and its gradient buffer off the device.

On CPU "host" is the same memory, so the planner never chooses it there by itself; ``host_checkpoints="always"``
runs the very code that stages tiles in and adds gradient tiles back on the host, so these tests cover it.
"""

from __future__ import annotations

import pytest
import torch
from sft_models import MODELS, weighted_step

from wsitrain.models import build
from wsitrain.sft import SFT, plan
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph

F64 = {"rtol": 1e-10, "atol": 1e-11}
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")


step = weighted_step


@pytest.mark.parametrize(("name", "tile"), [("vgg_chain", 16), ("resnet_basic", 16), ("odd_ops", 12), ("dense", 24)])
def test_host_checkpoints_are_exact(name: str, tile: int) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)
    ref = step(model, model, x)
    facts = annotate(ModelGraph(model), tuple(x.shape), torch.float64, torch.float64, True)
    cuts = [facts.name(i) for i in facts.candidates[1:-1]][::2]  # a few checkpoints after the image
    sft = SFT(model, tile_size=tile, memory_budget="1GiB", host_checkpoints="always", checkpoints=cuts)
    got = step(model, sft, x)
    p = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    host = [s for s in p.segments if s.start and s.checkpoint_location == "host"]
    assert host, "the test must place a checkpoint in host memory"
    assert all(p.segments[s.index - 1].output_location == "host" for s in host)
    torch.testing.assert_close(got[0], ref[0], **F64)
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, **F64)
    torch.testing.assert_close(got[2], ref[2], **F64)


def test_host_checkpoints_leave_the_device_budget() -> None:
    """Placed on the host, checkpoints stop counting against the device budget and show as host memory."""
    with torch.device("meta"):
        m = build("vgg16", 2)
    shape = (1, 3, 16384, 16384)
    # without one pass (planning/one_pass.py), whose single segment would leave no checkpoint after the image
    kw = {"device": "cuda", "tile_size": 2048, "one_pass": False}
    on_dev = plan(m, shape, "11GiB", host_checkpoints="never", **kw)
    on_host = plan(m, shape, "11GiB", host_checkpoints="always", **kw)
    moved = sum(s.checkpoint_bytes for s in on_host.segments if s.start and s.checkpoint_location == "host")
    assert moved > 0
    assert on_host.breakdown["checkpoints"] == 0 < on_dev.breakdown["checkpoints"]
    assert on_host.host_bytes >= on_dev.host_bytes + 2 * moved  # checkpoint and its gradient buffer
    assert on_host.transfer_bytes > on_dev.transfer_bytes
    assert on_host.estimated_peak_bytes < on_dev.estimated_peak_bytes


def test_cpu_plans_never_choose_host_memory() -> None:
    with torch.device("meta"):
        m = build("vgg16", 2)
    p = plan(m, (1, 3, 4096, 4096), "2GiB", device="cpu", input_dtype=torch.float32)
    assert all(s.checkpoint_location == "device" for s in p.segments)
