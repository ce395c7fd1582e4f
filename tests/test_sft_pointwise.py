"""A tile's 1x1 layers as matrix products (ops/pointwise_conv.py): the layer's arithmetic, chosen by the plan and the
tile's shape, exact against plain autograd in float64 (reference vs variant)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from sft_models import dense_net, small_resnet
from test_sft_exact import F64, assert_same, reference, variant
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from wsitrain.gpu_speed import GpuSpeed
from wsitrain.sft import SFT, plan
from wsitrain.sft.ops import pointwise_conv
from wsitrain.sft.ops.pointwise_conv import PointwiseMatmul, is_pointwise_conv, pointwise_matmul, unaligned
from wsitrain.sft.planning import session as plan_session
from wsitrain.sft.simulate.clock import OpClock

aten = torch.ops.aten


class Ops(TorchDispatchMode):
    """Counts the aten operators run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[Any] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[func._overloadpacket] += 1
        return func(*args, **(kwargs or {}))


# ---- the product against the layer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_product_is_the_layer(batch: int, bias: bool) -> None:
    """Output and the gradients of input, weight and bias equal the convolution's (float64, odd non-square map)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(6, 5, 1, bias=bias).double()
    x = torch.randn(batch, 6, 7, 9, dtype=torch.float64, requires_grad=True)
    g = torch.randn(batch, 5, 7, 9, dtype=torch.float64)
    ref = F.conv2d(x, conv.weight, conv.bias)
    got = pointwise_matmul(x, conv.weight, conv.bias)
    torch.testing.assert_close(got, ref, **F64)
    params = [x, conv.weight, *([conv.bias] if bias else [])]
    for a, b in zip(torch.autograd.grad(ref, params, g), torch.autograd.grad(got, params, g), strict=True):
        torch.testing.assert_close(b, a, **F64)


def test_which_layers_may_switch() -> None:
    class Standardized(nn.Conv2d):  # a subclass with its own forward (timm's weight-standardized convolutions)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    assert is_pointwise_conv(nn.Conv2d(4, 8, 1))
    assert is_pointwise_conv(nn.Conv2d(4, 8, 1, padding="valid", bias=False))
    assert not is_pointwise_conv(nn.Conv2d(4, 8, 3, padding=1))
    assert not is_pointwise_conv(nn.Conv2d(4, 8, 1, stride=2))
    assert not is_pointwise_conv(nn.Conv2d(4, 8, 1, groups=2))
    assert not is_pointwise_conv(nn.Conv2d(4, 8, 1, padding=1))
    assert not is_pointwise_conv(Standardized(4, 8, 1))
    assert not is_pointwise_conv(nn.ReLU())
    assert not is_pointwise_conv(None)
    with pytest.raises(ValueError, match="not a plain 1x1"):
        PointwiseMatmul(nn.Conv2d(4, 8, 3))


def test_a_tile_decides_by_its_shape() -> None:
    """Aligned maps, batches, crops (not contiguous) and layers with hooks run the layer; one image's unaligned map
    the product."""
    conv = nn.Conv2d(4, 8, 1)
    call = PointwiseMatmul(conv)

    def ops(x: torch.Tensor) -> Counter[Any]:
        with Ops() as seen:
            call(x)
        return seen.seen

    assert unaligned(torch.zeros(1, 4, 3, 5)) and not unaligned(torch.zeros(1, 4, 4, 6))
    assert ops(torch.zeros(1, 4, 4, 6))[aten.convolution] == 1  # 24 pixels
    assert ops(torch.zeros(1, 4, 3, 5))[aten.mm] == 1  # 15 pixels
    assert ops(torch.zeros(2, 4, 3, 5))[aten.convolution] == 1  # a batch: no faster as a product
    crop = torch.zeros(1, 4, 6, 6)[:, :, :3, :5]
    assert not unaligned(crop) and ops(crop)[aten.convolution] == 1  # a product would copy it first
    conv.register_forward_hook(lambda m, i, o: None)
    assert ops(torch.zeros(1, 4, 3, 5))[aten.convolution] == 1


# ---- the plan says where -------------------------------------------------------------------------------------------
def _bottleneck() -> nn.Module:
    torch.manual_seed(0)
    return small_resnet(bottleneck=True)


def test_plans_for_cuda_in_half_precision_name_the_layers() -> None:
    model = _bottleneck()
    names = {n for n, m in model.named_modules() if is_pointwise_conv(m)}
    assert names, "the model must have 1x1 layers"
    kw: dict[str, Any] = {"tile_size": 16, "memory_budget": "4GiB", "input_dtype": torch.float32}
    half = plan(model, (1, 3, 45, 62), dtype=torch.bfloat16, device="cuda", **kw)
    tiled = [s for s in half.segments if s.mode == "tiled"]
    assert tiled and all(s.pointwise_matmul for s in tiled)
    for s in tiled:
        layers = {s.layers[i - s.start - 1] for i in s.pointwise_matmul}
        assert layers <= names and layers == {n for n in s.layers if n in names}
    assert all(not s.pointwise_matmul for s in half.segments if s.mode != "tiled")
    for dtype, device in ((torch.float32, "cuda"), (torch.bfloat16, "cpu")):
        other = plan(model, (1, 3, 45, 62), dtype=dtype, device=device, **kw)
        assert all(not s.pointwise_matmul for s in other.segments)


# ---- exact, tile by tile -------------------------------------------------------------------------------------------
@pytest.fixture
def every_map_unaligned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans on this CPU in float64 switch as CUDA ones in bf16 do, and every map counts as unaligned."""
    monkeypatch.setattr(plan_session, "switches_to_matmul", lambda device, dtype: True)
    monkeypatch.setattr(pointwise_conv, "ALIGN", 1 << 40)


@pytest.mark.parametrize(
    ("build", "batch", "tile"), [(_bottleneck, 1, 16), (_bottleneck, 2, 24), (dense_net, 2, 16), (dense_net, 1, 24)]
)
@pytest.mark.usefixtures("every_map_unaligned")
def test_products_in_tiles_are_exact(build: Any, batch: int, tile: int) -> None:
    """Outputs, every parameter and input gradient and BatchNorm's running statistics, against plain autograd."""
    torch.manual_seed(1)
    model = build().double()
    x = torch.randn(batch, 3, 45, 62, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        target = torch.randn_like(copy.deepcopy(model)(x))
    twin = copy.deepcopy(model)
    ref = reference(model, x, target)
    products = Counter[str]()

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        products[str(tuple(x.shape))] += 1
        return pointwise_matmul(x, weight, bias)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pointwise_conv, "pointwise_matmul", counted)
        var = variant(twin, x, target, tile_size=tile, memory_budget="4GiB")
    assert_same(ref, var)
    for a, b in zip(model.buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(b, a, **F64)
    sft: SFT = var[3]
    p = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert any(s.pointwise_matmul for s in p.segments), "the plan must switch some layer"
    # one image's tiles run products; a batch's run the layer (pointwise_conv.unaligned)
    assert (sum(products.values()) > 0) == (batch == 1), f"products on {dict(products)}"


# ---- the clock prices them -----------------------------------------------------------------------------------------
def test_clock_prices_unaligned_products_at_their_rate() -> None:
    """A product over an unaligned map is priced at ``unaligned_matmul_efficiency``, an aligned one at the usual."""
    speed = GpuSpeed("test", 1000.0, 500.0, 60.0, 4e9, 50.0, kernel_floor_us=0.0)  # FLOP-bound: bytes are free
    w = torch.empty(512, 128, device="meta")

    def seconds(pixels: int) -> float:
        clock = OpClock(low_precision=True)
        with clock:
            torch.mm(w, torch.empty(128, pixels, device="meta"))
        return clock.reading(speed, "bf16").by_kind["matrix products"]

    flops = 2 * 512 * 128 * 387 * 387
    assert seconds(387 * 387) == pytest.approx(flops / (1e12 * 1000 * speed.unaligned_matmul_efficiency))
    assert seconds(384 * 384) == pytest.approx(2 * 512 * 128 * 384 * 384 / (1e12 * 1000 * speed.matmul_efficiency))
