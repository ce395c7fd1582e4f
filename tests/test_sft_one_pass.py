"""The last tiled segment in one pass (wsitrain/sft/execution/one_pass.py): reference vs variant in float64.

Each case asserts the plan chose one pass (a test whose plan stopped choosing it would otherwise pass on the old
path) and counts the tiles each phase visited: one pass visits every tile once, in forward, and never recomputes;
a pooled gradient off the head's direction recomputes every tile in backward and is still exact.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from sft_models import MODELS
from torch import nn

from wsitrain.models import build
from wsitrain.sft import SFT
from wsitrain.sft.plan_api import plan
from wsitrain.sft.plan_types import Plan

F64 = {"rtol": 1e-10, "atol": 1e-12}
SHAPE = (1, 3, 90, 124)  # one slide, non-square, ragged tiles
Loss = Callable[[torch.Tensor], torch.Tensor]


def cross_entropy(y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(y, torch.tensor([1]), weight=torch.tensor([0.7, 1.6], dtype=y.dtype))


def smoothed(y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(y, torch.tensor([0]), label_smoothing=0.1)


def squared(y: torch.Tensor) -> torch.Tensor:
    return (y - torch.linspace(0.2, -0.4, y.shape[1], dtype=y.dtype)).square().sum()


def with_head(name: str, outputs: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]()
    model.fc = nn.Linear(model.fc.in_features, outputs)
    return model.double()


def step(model: nn.Module, net: nn.Module, x: torch.Tensor, loss: Loss) -> tuple:
    model.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(x.requires_grad)
    y = net(xr)
    loss(y).backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad


def run(model: nn.Module, x: torch.Tensor, loss: Loss, **sft_kw: object) -> tuple[Plan, dict[tuple[int, str], int]]:
    """A step of ``SFT`` around a copy of ``model`` checked against plain autograd on ``model``: output, every
    parameter gradient, the input gradient, the buffers. Returns the plan it ran and its tile visits per phase."""
    ref = step(model, model, x, loss)
    twin = copy.deepcopy(model)
    engine = SFT(twin, **{"memory_budget": "1GiB", "tile_size": 24, **sft_kw})  # type: ignore[arg-type]
    visits: dict[tuple[int, str], int] = {}

    def on_tile(seg: int, r: int, c: int, phase: str) -> None:
        visits[(seg, phase)] = visits.get((seg, phase), 0) + 1

    engine._hooks.on_tile = on_tile
    got = step(twin, engine, x, loss)
    torch.testing.assert_close(got[0], ref[0], **F64)
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, got[1], ref[1], strict=True):
        torch.testing.assert_close(a, b, **F64, msg=lambda m, n=name: f"{n}: {m}")
    if x.requires_grad:
        torch.testing.assert_close(got[2], ref[2], **F64)
    for (name, a), b in zip(twin.named_buffers(), model.buffers(), strict=True):
        torch.testing.assert_close(a, b, **F64, msg=lambda m, n=name: f"buffer {n}: {m}")
    return next(reversed(engine._cache.values())).plan, visits


def last(p: Plan):  # noqa: ANN201
    return p.segments[-1]


@pytest.mark.parametrize("name", ["resnet_basic", "resnet_bottleneck", "vgg_chain", "dense", "odd_ops", "gated"])
@pytest.mark.parametrize("outputs,loss", [(2, cross_entropy), (2, smoothed), (1, squared)])
def test_one_pass_is_exact(name: str, outputs: int, loss: Loss) -> None:
    """Two classes under a softmax loss (weighted, smoothed) and one output under any loss: one pass, exact."""
    model = with_head(name, outputs)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    p, visits = run(model, x, loss)
    s = last(p)
    assert s.mode == "tiled" and s.one_pass and s.fused_pool == "avg", p.describe()
    assert visits[(s.index, "forward")] == s.n_tiles and (s.index, "backward") not in visits, visits


@pytest.mark.parametrize("tile", [16, 40])
def test_one_pass_is_exact_on_other_grids(tile: int) -> None:
    model = with_head("resnet_basic", 2, seed=3)
    x = torch.randn(1, 3, 97, 71, dtype=torch.float64)
    p, _ = run(model, x, cross_entropy, tile_size=tile)
    assert last(p).one_pass and last(p).n_tiles > 1
    g = last(p).tile_grid
    assert p.brief.endswith(f"tiled {g[0]}x{g[1]} one pass")  # what the GPU kit records and fit_clock.py replays


def test_input_gradient_through_a_one_pass_segment() -> None:
    """A later segment in one pass hands its input gradient (held from forward, scaled in backward) to the earlier
    segments: the image's gradient is exact. The first segment itself never runs in one pass for such an image."""
    model = with_head("resnet_basic", 2, seed=1)
    x = torch.randn(*SHAPE, dtype=torch.float64, requires_grad=True)
    p, _ = run(model, x, cross_entropy)
    assert last(p).one_pass and last(p).start > 0
    assert not any(s.one_pass for s in p.segments if s.start == 0)


def test_off_direction_gradient_recomputes_exactly() -> None:
    """A loss on two logits that is no softmax loss gives a pooled gradient off the head's direction: backward drops
    the sums and recomputes every tile, and the step is still exact."""
    model = with_head("resnet_basic", 2, seed=2)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    p, visits = run(model, x, squared)
    s = last(p)
    assert s.one_pass and visits[(s.index, "forward")] == s.n_tiles
    assert visits[(s.index, "backward")] == s.n_tiles, visits


def test_dropout_in_the_head_recomputes_exactly() -> None:
    """A dropout between the pool and the head is no head one pass reads (its mask would turn the direction): the plan
    recomputes, exact as ever."""
    torch.manual_seed(4)
    model = MODELS["resnet_basic"]()
    model.fc = nn.Sequential(nn.Dropout(0.5), nn.Linear(model.fc.in_features, 2))
    model = model.double().eval()
    p, _ = run(model, torch.randn(*SHAPE, dtype=torch.float64), cross_entropy)
    assert not any(s.one_pass for s in p.segments)


def test_masked_mean_skips_tiles_off_the_tissue() -> None:
    """wsitrain's own model with a tissue mask on its pool: tiles wholly off the mask add nothing and are not
    back-propagated; the step is exact."""
    torch.manual_seed(5)
    model = build("tiny", 2, pool="avg", mask_pool=True).double().eval()
    x = (torch.rand(1, 3, 256, 320) * 255).round().double()
    mask = torch.zeros(1, 1, 16, 20, dtype=torch.bool)
    mask[..., 3:12, 2:9] = True
    with model.pool.masked(mask):
        p, visits = run(model, x, cross_entropy, tile_size=64)
    s = last(p)
    assert s.one_pass and visits[(s.index, "forward")] == s.n_tiles


@pytest.mark.parametrize(
    "why,model,shape,kw",
    [
        ("two slides: one coefficient per slide", lambda: with_head("resnet_basic", 2), (2, 3, 90, 124), {}),
        ("three classes: two directions", lambda: with_head("resnet_basic", 3), SHAPE, {}),
        ("max pooling: no direction", lambda: build("tiny", 2, pool="max").double(), (1, 3, 256, 256), {}),
        ("switched off", lambda: with_head("resnet_basic", 2), SHAPE, {"one_pass": False}),
    ],
)
def test_one_pass_only_where_a_direction_is_known(why: str, model: Callable, shape: tuple, kw: dict) -> None:
    p = plan(model(), shape, "1GiB", torch.float64, tile_size=24, **kw)
    assert last(p).mode == "tiled" and not any(s.one_pass for s in p.segments), why


def test_one_pass_halves_planned_extra_compute_at_100k() -> None:
    """Issue 36's target, planned on shapes only: ResNet-50 on a 100,000 px slide under the 2080 Ti budget within
    +65% extra compute (+69% with a forward sweep and a recompute), the budget kept."""
    with torch.device("meta"):
        m = build("resnet50", 2)
    one = plan(m, (1, 3, 100_000, 100_000), "10.47GiB", device="cuda")
    assert one.fits and last(one).one_pass and one.estimated_peak_bytes <= one.budget_bytes
    assert one.overhead <= 0.65, one.describe()


@pytest.mark.parametrize("name", ["torchvision/resnet18", "timm/resnet10t", "timm/resnext26ts"])
def test_one_pass_on_the_backbones_users_bring(name: str) -> None:
    """torchvision and timm backbones as wsitrain builds them (frozen BatchNorm statistics, average pool, a two-class
    linear head): one pass, exact against plain autograd in float64."""
    torch.manual_seed(6)
    model = build(name, 2, pool="avg").double().eval()
    x = torch.randn(1, 3, 150, 190, dtype=torch.float64)
    p, visits = run(model, x, cross_entropy, tile_size=64)
    s = last(p)
    assert s.one_pass and s.n_tiles > 1 and (s.index, "backward") not in visits


def test_bf16_one_pass_no_worse_than_plain_bf16() -> None:
    """Under bf16 autocast the direction's shares are scaled near the map's positions before they are spread
    (execution/one_pass.py): every parameter gradient of the one-pass step is as close to float64's as plain bf16's."""
    from test_sft_multipass import assert_bf16_no_worse

    model = with_head("resnet_basic", 2, seed=7).float()
    plain, tiled, ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(*SHAPE)
    cross_entropy(ref(x.double())).backward()
    # BatchNorm unfolded: this checks the one pass's rounding against plain bf16's; folded, a BatchNorm weight's
    # gradient carries its convolution weight gradient's bf16 rounding too (docs/guide/fold-batchnorm.md)
    engine = SFT(tiled, tile_size=24, memory_budget="1GiB", fold_bn=False)
    visits: dict[tuple[int, str], int] = {}
    engine._hooks.on_tile = lambda seg, r, c, phase: visits.__setitem__((seg, phase), visits.get((seg, phase), 0) + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cross_entropy(plain(x).float()).backward()
        cross_entropy(engine(x).float()).backward()
    s = last(engine.plan_of(x, torch.bfloat16))
    assert s.one_pass and s.n_tiles > 1
    # the pass held: the head's bf16 rounding is within the half-precision share (linear_head.HALF_RESIDUAL_SHARE),
    # so the segment neither recomputes nor back-propagates again (it did both on every bf16 step before)
    assert (s.index, "forward") in visits and (s.index, "backward") not in visits, visits
    assert_bf16_no_worse(ref, plain, tiled)


def test_background_tiles_are_computed_once_within_the_pass() -> None:
    """Flat background tiles reuse the first one's output, share and results inside the one pass (reuse.py): the step
    is bitwise the one that computes every tile, exact against plain autograd, and the reuse happened."""
    from test_tile_reuse import BLOBS, masked_image, vgg

    torch.manual_seed(9)
    model = vgg("avg").double()
    model.fc = nn.Linear(12, 2).double()
    x = masked_image((1, 3, 200, 232), BLOBS)
    ref = step(model, model, x, cross_entropy)
    got: dict[bool, tuple] = {}
    for reuse in (False, True):
        twin = copy.deepcopy(model)
        engine = SFT(twin, memory_budget="1GiB", tile_size=32, reuse_tiles=reuse)
        got[reuse] = step(twin, engine, x, cross_entropy)
        assert last(engine.plan_of(x)).one_pass
        assert (engine.last_stats.reused_forward > 0) == reuse
    assert torch.equal(got[True][0], got[False][0])
    for a, b, r in zip(got[True][1], got[False][1], ref[1], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, **F64)


def test_one_pass_from_a_host_checkpoint() -> None:
    """The segment's input checkpoint in host memory (its gradient sum too, filled through the stager and scaled
    there): the image's gradient through it is exact."""
    model = with_head("resnet_basic", 2, seed=10)
    x = torch.randn(*SHAPE, dtype=torch.float64, requires_grad=True)
    p, _ = run(model, x, cross_entropy, host_checkpoints="always")
    s = last(p)
    assert s.one_pass and s.start > 0 and s.checkpoint_location == "host", p.describe()


@pytest.mark.parametrize(("loss", "fallbacks"), [(cross_entropy, 0), (squared, 1)])
def test_the_step_counts_its_one_pass_fallbacks(loss: Loss, fallbacks: int) -> None:
    """``last_stats.one_pass_fallbacks``: the GPU kit records it, and fit_clock.py replays a step that fell back."""
    model = with_head("resnet_basic", 2, seed=2)
    engine = SFT(copy.deepcopy(model), memory_budget="1GiB", tile_size=24)
    x = torch.randn(*SHAPE, dtype=torch.float64)
    step(engine.model, engine, x, loss)
    assert last(engine.plan_of(x)).one_pass
    assert engine.last_stats.one_pass_fallbacks == fallbacks
