"""Global pooling fused into the last tiled segment: exact against plain autograd, and the map never exists whole."""

from __future__ import annotations

import pytest
import torch
from sft_models import tied_trunk
from torch import nn

from wsitrain.models import build
from wsitrain.sft import SFT, plan

F64 = {"rtol": 1e-10, "atol": 1e-11}


class Reduce(nn.Module):
    """Functional global pooling as user models write it."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "mean":
            return x.mean((2, 3))
        if self.how == "amax":
            return torch.amax(x, dim=(-2, -1), keepdim=True).flatten(1)
        return torch.nn.functional.adaptive_max_pool2d(x, 1).flatten(1)


def net(pool: str) -> nn.Sequential:
    """Convs with a constant channel (weights 0, bias 0.3, after ReLU): its maximum ties at every position."""
    trunk = tied_trunk()
    pools = {
        "avg": [nn.AdaptiveAvgPool2d(1), nn.Flatten(1)],
        "max": [nn.AdaptiveMaxPool2d(1), nn.Flatten(1)],
        "mean": [Reduce("mean")],
        "amax": [Reduce("amax")],
        "fmax": [Reduce("fmax")],
    }[pool]
    return nn.Sequential(trunk, *pools, nn.Linear(5, 3)).double()


def run(model: nn.Module, x: torch.Tensor, sft: SFT | None) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    model.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    y = (sft or model)(xr)
    (y * torch.arange(1.0, 4.0, dtype=y.dtype)).sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad


@pytest.mark.parametrize("pool", ["avg", "max", "mean", "amax", "fmax"])
@pytest.mark.parametrize("tile", [16, 24])
def test_fused_pool_is_exact(pool: str, tile: int) -> None:
    model = net(pool)
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)  # ragged tiles, non-square, batch 2
    ref = run(model, x, None)
    sft = SFT(model, tile_size=tile, memory_budget="1GiB")
    got = run(model, x, sft)
    p = sft.plan_for(tuple(x.shape), input_dtype=torch.float64)
    assert p.segments[-1].mode == "tiled" and p.segments[-1].fused_pool is not None
    assert p.segments[-1].n_tiles > 1, "the test must really tile"
    torch.testing.assert_close(got[0], ref[0], **F64)
    for a, b in zip(got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, **F64)
    torch.testing.assert_close(got[2], ref[2], **F64)


def test_fused_pool_never_builds_the_feature_map() -> None:
    """With a fused pool nothing of the last map's full size is made: observe the tiles, and the plan's head."""
    model = net("avg")
    x = torch.randn(1, 3, 64, 96, dtype=torch.float64)
    sft = SFT(model, tile_size=16, memory_budget="1GiB")
    seen = []
    with sft.observe_trunk(lambda t, rows, cols: seen.append(t.shape[2] * t.shape[3])):
        y = sft(x)
    torch.testing.assert_close(y, model(x), **F64)
    full = (64 // 2) * (96 // 2)
    assert len(seen) > 1 and max(seen) < full and sum(seen) == full


def test_fusion_removes_the_head_from_the_plan() -> None:
    """VGG-16 at 100,000 px: the 37 GiB last feature map and its gradient were the part that did not shrink."""
    with torch.device("meta"):
        m = build("vgg16", 2)
    p = plan(m, (1, 3, 100_000, 100_000), "11GiB", device="cuda")
    assert p.segments[-1].fused_pool == "avg"
    assert p.breakdown["head"] < 2**20 and p.breakdown["gradient_buffers"] < 2**30
