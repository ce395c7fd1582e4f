"""Checks that need a CUDA GPU: exactness on the device, the host-staged image, the budget under a memory cap, and
the demo fit. Every test here is marked ``gpu`` and skipped, with the reason, where CUDA is absent.

Run them on a GPU machine with ``pytest -m gpu tests/test_gpu.py`` (``wsitrain doctor`` does, and adds the
SFT paper's Figure 8 benchmark to its report). Memory figures are recorded as junit properties
(``--junitxml``), so the report can show measured against planned peaks.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sft_models import MODELS
from torch import nn

from wsitrain.sft import SFT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"
    ),
    # odd_ops uses padding='same' with an even kernel on purpose; PyTorch warns that it pads a copy.
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel"),
]

F64 = {"rtol": 1e-10, "atol": 1e-11}
GiB = 2**30
REPO = Path(__file__).resolve().parents[1]


def _step(net: nn.Module, params: nn.Module, x: torch.Tensor, target: torch.Tensor) -> dict[str, object]:
    """One training step of ``net``; outputs, parameter gradients, input gradient and buffers of ``params``."""
    params.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    y = net(xr)
    nn.functional.mse_loss(y, target).backward()
    return {
        "y": y.detach(),
        "grads": [p.grad.clone() for p in params.parameters()],
        "x_grad": xr.grad,
        "buffers": [b.clone() for b in params.buffers()],
    }


def _assert_same(ref: dict[str, object], var: dict[str, object]) -> None:
    torch.testing.assert_close(var["y"], ref["y"], **F64)
    assert len(var["grads"]) == len(ref["grads"]) > 0
    for a, b in zip(ref["grads"], var["grads"], strict=True):
        torch.testing.assert_close(b, a, **F64)
    if ref["x_grad"] is not None:
        assert var["x_grad"] is not None, "SFT returned no input gradient"
        torch.testing.assert_close(var["x_grad"], ref["x_grad"], **F64)
    for a, b in zip(ref["buffers"], var["buffers"], strict=True):
        torch.testing.assert_close(b, a, **F64)


@pytest.mark.parametrize(("name", "tile"), [("vgg_chain", 16), ("resnet_basic", 24), ("dense", 16), ("odd_ops", 12)])
def test_float64_exact_on_cuda_with_forced_tiles(name: str, tile: int) -> None:
    """SFT on the GPU gives plain autograd's outputs, gradients (parameters and input) and buffers in float64."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = MODELS[name]().double().to(dev)
    x = torch.randn(1, 3, 45, 62, dtype=torch.float64, device=dev, requires_grad=True)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    twin = copy.deepcopy(model)
    ref = _step(model, model, x, target)
    sft = SFT(twin, tile_size=tile, memory_budget="4GiB")
    var = _step(sft, twin, x, target)
    _assert_same(ref, var)
    plan = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert plan.device == "cuda" and any(s.n_tiles > 1 for s in plan.segments), "the test must really tile"


def test_host_staged_uint8_image_is_exact() -> None:
    """A uint8 image in (pinned) host memory, the model on the GPU: tiles are cut on the host, results exact."""
    from wsitrain.models import build

    dev = torch.device("cuda")
    torch.manual_seed(1)
    model = build("tiny", 3).double().to(dev)
    x_host = torch.randint(0, 256, (1, 3, 96, 80), dtype=torch.uint8).pin_memory()
    with torch.no_grad():
        target = torch.randn_like(model(x_host.to(dev)))
    twin = copy.deepcopy(model)
    ref = _step(model, model, x_host.to(dev), target)  # plain: the whole image on the device
    sft = SFT(twin, tile_size=32, memory_budget="1GiB")
    var = _step(sft, twin, x_host, target)  # engine: the image stays on the host
    _assert_same(ref, var)
    plan = sft.plan_for(tuple(x_host.shape), torch.float64, torch.uint8, input_on_host=True)
    first = plan.segments[0]
    assert plan.input_on_host and first.mode == "tiled" and first.checkpoint_location == "host"
    # the image is the first checkpoint: its bytes are host memory (plan.host_bytes), none of the device's checkpoints
    assert first.checkpoint_bytes == x_host.numel() and plan.host_bytes >= x_host.numel()
    on_device = [s for s in plan.tiled_segments if s.checkpoint_location == "device"]
    assert first not in on_device and plan.breakdown["checkpoints"] == sum(s.checkpoint_bytes for s in on_device)


@pytest.mark.parametrize(("size", "budget_gib"), [(2048, 1.5), (4096, 2.0)])
def test_budget_honoured_under_a_memory_cap(size: int, budget_gib: float, record_property) -> None:
    """VGG-16 with ``set_per_process_memory_fraction`` at the budget: SFT trains within it, plain runs out.

    Each configuration runs in its own process (the bench worker), so the cap and the peak counter belong to it.
    """
    from wsitrain.bench.configs import BenchConfig
    from wsitrain.bench.runner import run_worker

    budget = int(budget_gib * GiB)
    common = dict(model="vgg16", size=size, budget_bytes=budget, device="cuda", runs=2)
    sft = run_worker(BenchConfig(strategy="sft", **common), timeout_s=600)
    plain = run_worker(BenchConfig(strategy="base", **common), timeout_s=600)
    record_property("sft_peak_bytes", sft.get("peak_bytes"))
    record_property("sft_planned_peak_bytes", sft.get("planned_peak_bytes"))
    record_property("budget_bytes", budget)
    record_property("plain_status", plain["status"])
    assert sft["status"] == "ok", sft
    assert sft["planned_peak_bytes"] <= budget
    assert sft["peak_bytes"] <= budget, f"measured {sft['peak_bytes']} > budget {budget}"
    # The cap is real: plain PyTorch needs several times this budget at these sizes.
    assert plain["status"] == "oom", plain


@pytest.mark.parametrize("size", [20480])
def test_vgg16_20480_within_11gib_as_planned(size: int, record_property) -> None:
    """The promise the docs make on plans only (docs/engine/measured-and-planned.md): VGG-16 at 20480 px trains
    under an 11 GiB cap.

    One step in its own process; ``max_memory_allocated`` against the plan's peak and the budget.
    """
    from wsitrain.bench.configs import BenchConfig
    from wsitrain.bench.runner import run_worker

    budget = 11 * GiB
    sft = run_worker(BenchConfig(strategy="sft", model="vgg16", size=size, budget_bytes=budget, device="cuda", runs=1),
                     timeout_s=1800)  # fmt: skip
    record_property("sft_peak_bytes", sft.get("peak_bytes"))
    record_property("sft_planned_peak_bytes", sft.get("planned_peak_bytes"))
    record_property("seconds_per_megapixel", sft.get("mean_ms", 0) / 1000 / (size * size / 1e6))
    assert sft["status"] == "ok", sft
    assert sft["peak_bytes"] <= budget, f"measured {sft['peak_bytes']} > budget {budget}"
    assert sft["peak_bytes"] <= 1.15 * sft["planned_peak_bytes"], "the plan underestimates CUDA's peak"


def test_demo_fit_on_cuda(tmp_path: Path, record_property) -> None:
    """``wsitrain fit configs/demo.yaml`` on the GPU, into a temporary log folder, end to end, within its budget."""
    from wsitrain.config import load_config

    demo = load_config(REPO / "configs" / "demo.yaml")
    cmd = [
        sys.executable, "-m", "wsitrain", "fit", str(REPO / "configs" / "demo.yaml"),
        "--set", "engine.device=cuda", "--set", f"log.dir={tmp_path / 'runs'}",
        "--set", f"data.synthetic.cache_dir={tmp_path / 'synthetic'}", "--name", "demo-gpu",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "runs" / "demo-gpu"
    summary = json.loads((run / "summary.json").read_text())
    versions = json.loads((run / "versions.json").read_text())
    assert (run / "last.pt").is_file()
    assert versions["device"] == torch.cuda.get_device_name(0)
    assert summary["epochs"] == demo.train.epochs and summary["optimizer_steps"] > 0
    budget = demo.engine.memory_budget_bytes
    record_property("demo_peak_bytes", summary["peak_bytes"])
    record_property("budget_bytes", budget)
    assert budget is not None and 0 < summary["peak_bytes"] <= budget


@pytest.mark.parametrize(("name", "tile"), [("vgg_chain", 16), ("resnet_basic", 16)])
def test_host_checkpoints_exact_on_cuda_with_side_streams(name: str, tile: int) -> None:
    """Checkpoints in host memory on the GPU: exact in float64, every tile copied on the stager's side streams."""
    from wsitrain.sft.execution.runtime import CudaRuntime
    from wsitrain.sft.execution.staging import HostStager
    from wsitrain.sft.execution.transfers import CopyEvent, StreamCopies
    from wsitrain.sft.facts import annotate
    from wsitrain.sft.graph import ModelGraph

    class CountingCopies(StreamCopies):
        """CUDA copies that also record which stream was current when each one was issued."""

        def __init__(self, device: torch.device) -> None:
            super().__init__(CudaRuntime(), device)
            self.calls = {"up": 0, "down": 0}
            self.compute: set[int] = set()

        def down(self, dst: torch.Tensor, src: torch.Tensor, what: str = "") -> CopyEvent:
            self.calls["down"] += 1
            self.compute.add(torch.cuda.current_stream().cuda_stream)
            return super().down(dst, src, what)

        def up(self, src: torch.Tensor, device: torch.device, what: str = "") -> tuple[torch.Tensor, CopyEvent]:
            self.calls["up"] += 1
            self.compute.add(torch.cuda.current_stream().cuda_stream)
            return super().up(src, device, what)

    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = MODELS[name]().double().to(dev)
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64, device=dev, requires_grad=True)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    twin = copy.deepcopy(model)
    ref = _step(model, model, x, target)
    facts = annotate(ModelGraph(model), tuple(x.shape), torch.float64, torch.float64, True)
    cuts = [facts.name(i) for i in facts.candidates[1:-1]][::2]
    sft = SFT(twin, tile_size=tile, memory_budget="1GiB", host_checkpoints="always", checkpoints=cuts)
    copies = CountingCopies(dev)
    sft._stager = HostStager(copies)  # before the first call: segments take the stager when compiled
    var = _step(sft, twin, x, target)
    _assert_same(ref, var)
    plan = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert any(s.start and s.checkpoint_location == "host" for s in plan.segments), "must place a host checkpoint"
    assert copies.calls["up"] > 0 and copies.calls["down"] > 0, copies.calls
    side = {copies.up_stream.cuda_stream, copies.down_stream.cuda_stream}
    assert len(side) == 2 and not side & copies.compute, "copies run on side streams, not the compute stream"
    assert torch.cuda.current_stream().cuda_stream not in side
    assert sft._stager.max_in_flight <= 2


@pytest.mark.parametrize(("model", "size"), [("torchvision/convnext_tiny", 8192), ("vgg16", 20480)])
def test_two_steps_under_the_2080ti_budget_do_not_fragment(model: str, size: int, tmp_path: Path,
                                                           record_property) -> None:  # fmt: skip
    """The first GPU run's failures: with PyTorch's fixed segments both cases ran out of memory under plans that fit
    (2.4 / 3.3 GiB reserved but unusable). Two steps in their own process, capped at the 2080 Ti preset's budget:
    no error, the reserved peak within the budget, the allocated peak within the plan's estimate."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_measured.py"), "--out", str(tmp_path), "--case",
           f"{model}:{size}", "--steps", "2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "bench_measured.jsonl").read_text().splitlines()[-1])
    assert "error" not in row, row.get("traceback", row)
    record_property("peak_bytes", row["measured_peak_bytes"])
    record_property("peak_reserved_bytes", row["measured_peak_reserved_bytes"])
    assert row["measured_peak_reserved_bytes"] <= row["budget_bytes"]
    assert row["measured_peak_bytes"] <= row["estimated_peak_bytes"]


@pytest.mark.parametrize("tile", [16, 24])
def test_products_in_tiles_exact_on_cuda(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile's 1x1 layers as cuBLAS products (ops/pointwise_conv.py), forced on every map in float64: plain
    autograd's outputs, gradients and buffers on the device, and the products really ran."""
    from sft_models import small_resnet

    from wsitrain.sft.ops import pointwise_conv
    from wsitrain.sft.planning import session

    monkeypatch.setattr(session, "switches_to_matmul", lambda device, dtype: True)
    monkeypatch.setattr(pointwise_conv, "ALIGN", 1 << 40)
    calls = []
    real = pointwise_conv.pointwise_matmul
    monkeypatch.setattr(pointwise_conv, "pointwise_matmul", lambda *a: calls.append(a[0].shape) or real(*a))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = small_resnet(bottleneck=True).double().to(dev)
    x = torch.randn(1, 3, 45, 62, dtype=torch.float64, device=dev, requires_grad=True)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    twin = copy.deepcopy(model)
    ref = _step(model, model, x, target)
    var = _step(SFT(twin, tile_size=tile, memory_budget="4GiB"), twin, x, target)
    _assert_same(ref, var)
    assert calls, "the tiles must run products"


def test_products_in_bf16_tiles_match_the_convolutions() -> None:
    """Under bf16 autocast on an unaligned image, tiles run their 1x1 layers as products (the plan allows it on
    CUDA) and give the convolutions' step to bf16's rounding."""
    from dataclasses import replace

    from sft_models import small_resnet

    from wsitrain.sft.target import target_for

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = small_resnet(bottleneck=True).to(dev)
    x = torch.randn(1, 3, 203, 317, device=dev)
    target = torch.randn(1, 3, device=dev)
    results = []
    for products in (True, False):
        twin = copy.deepcopy(model)
        sft = SFT(twin, tile_size=48, memory_budget="4GiB", target=replace(target_for(dev), pointwise_matmul=products))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = _step(sft, twin, x, target)
        plan = sft.plan_of(x, torch.bfloat16)
        assert any(s.pointwise_matmul for s in plan.segments) == products
        results.append(out)
    with_products, with_convs = results
    torch.testing.assert_close(with_products["y"], with_convs["y"], rtol=2e-2, atol=2e-2)
    for a, b in zip(with_convs["grads"], with_products["grads"], strict=True):
        torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2)


def attention_norm_and_stream_on(dev: torch.device, norm: str) -> SFT:
    """CLAM-MB with ``model.attention.norm`` and the instance stream, masked, batch 2, the border ring left out, tiled
    at 16 px on ``dev``: plain autograd's outputs, gradients and input gradient in float64. Returns the engine."""
    from test_attention_stream import net
    from test_sft_attention import SHAPE, assert_same, step, tissue

    torch.manual_seed(0)
    model = net(norm, stream=True, border=1, gated=True).double().to(dev)
    x = torch.randn(*SHAPE, dtype=torch.float64, device=dev)
    mask = tissue().to(dev)
    twin = copy.deepcopy(model)
    ref = step(model, x, mask)
    sft = SFT(twin, tile_size=16, memory_budget="1GiB")
    assert_same(step(sft, x, mask), ref, [n for n, _ in model.named_parameters()])
    return sft


@pytest.mark.parametrize("norm", ["slide", "cell"])
def test_attention_norm_and_stream_exact_on_cuda(norm: str) -> None:
    """The slide norm's two sweeps (a barrier across tiles) and the stream's top-k on the device, as plain."""
    from test_sft_attention import SHAPE
    from test_sft_multipass import multipass_segments

    sft = attention_norm_and_stream_on(torch.device("cuda"), norm)
    plan = sft.plan_for(SHAPE, input_dtype=torch.float64)
    assert plan.device == "cuda" and plan.segments[-1].n_tiles > 1, "the test must really tile"
    assert bool(multipass_segments(sft)) == (norm == "slide"), "the slide norm runs in sweeps, the cell norm in one"
