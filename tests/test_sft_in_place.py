"""Activations run in place inside tiles (wsitrain/sft/in_place.py): exact, only where planned, counted as run.

Reference vs variant in float64: SFT with its in-place activations against plain autograd on the same weights and
input (output, every parameter gradient, input gradient, BatchNorm running statistics), ragged sizes, batch 2.
A forward hook records which activation calls wrote into their input, so the tests see what the executor really
ran, and the tile replay must shrink by exactly the maps the in-place calls no longer hold.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
from test_sft_exact import F64, assert_same, reference, variant
from torch import nn

from wsitrain.sft import SFT
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph
from wsitrain.sft.in_place import segment_in_place
from wsitrain.sft.planning.planner import new_session
from wsitrain.sft.planning.tile_memory import tile_choice


def _head(channels: int) -> list[tuple[str, nn.Module]]:
    return [("pool", nn.AdaptiveAvgPool2d(1)), ("flat", nn.Flatten()), ("fc", nn.Linear(channels, 3))]


def _bn(c: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():  # non-trivial statistics, so a wrong value shows
        bn.running_mean.uniform_(-0.2, 0.2)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.2, 0.2)
    return bn


def dark_like() -> nn.Module:
    """DarkNet-19's conv-BN-LeakyReLU blocks with a max pool, plus ReLU6 and a functional ReLU after an add."""
    trunk = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(3, 6, 3, padding=1, bias=False),
            bn1=_bn(6),
            act1=nn.LeakyReLU(0.1, inplace=True),
            pool1=nn.MaxPool2d(2, 2),
            conv2=nn.Conv2d(6, 8, 3, padding=1, bias=False),
            bn2=_bn(8),
            act2=nn.LeakyReLU(0.1),
            conv3=nn.Conv2d(8, 8, 3, padding=1, bias=False),
            bn3=_bn(8),
            act3=nn.ReLU6(),
        )
    )
    return nn.Sequential(OrderedDict([("features", trunk), *_head(8)])).eval()


class Branch(nn.Module):
    """``a = bn(conv(x))`` read twice, inside a tile: by a ReLU and by the residual add. The ReLU must stay out of
    place (writing into ``a`` would change the add's operand); the ReLU after the adds may run in place."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1, self.relu1 = nn.Conv2d(c, c, 3, padding=1, bias=False), _bn(c), nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.bn1(self.conv1(x))
        return self.relu2(self.conv2(self.relu1(a)) + a + x)  # x read again: no checkpoint can sit at ``a``


class Saved(nn.Module):
    """A ReLU after a sigmoid (which keeps its output for backward) and after a convolution (sliced in tiles):
    neither may run in place."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.relu_a, self.relu_b = nn.ReLU(), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu_b(torch.sigmoid(self.relu_a(self.conv(x))) * 2.0 - 0.5)


def residual_net() -> nn.Module:
    trunk = nn.Sequential(
        OrderedDict(stem=nn.Conv2d(3, 6, 3, 2, 1), stem_act=nn.LeakyReLU(0.2), b1=Branch(6), b2=Branch(6), s=Saved(6))
    )
    return nn.Sequential(OrderedDict([("features", trunk), *_head(6)])).eval()


def train_bn_net() -> nn.Module:
    """Train-mode BatchNorm (a barrier: multi-pass tiles, which stay out of place); running statistics change."""
    trunk = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(3, 6, 3, padding=1),
            bn1=nn.BatchNorm2d(6),
            act1=nn.ReLU(inplace=True),
            conv2=nn.Conv2d(6, 6, 3, padding=1),
            act2=nn.LeakyReLU(0.1),
        )  # fmt: skip
    )
    return nn.Sequential(OrderedDict([("features", trunk), *_head(6)])).train()


MODELS = {"dark_like": dark_like, "residual": residual_net, "train_bn": train_bn_net}
IN_PLACE = {
    "dark_like": {"features.act1", "features.act2", "features.act3"},
    "residual": {"features.b1.relu2", "features.b2.relu2"},
    "train_bn": set(),
}


class WritesLog:
    """Forward hooks on every activation: which ones returned their input's storage (ran in place)."""

    def __init__(self, model: nn.Module) -> None:
        self.in_place: set[str] = set()
        self.out_of_place: set[str] = set()
        self.handles = [
            m.register_forward_hook(self._hook(name))
            for name, m in model.named_modules()
            if isinstance(m, (nn.ReLU, nn.LeakyReLU, nn.Hardtanh))
        ]

    def _hook(self, name: str):  # noqa: ANN202 - a hook factory
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if out.device.type == "meta":  # planning's shape propagation: no storage to compare
                return
            same = out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
            (self.in_place if same else self.out_of_place).add(name)

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _make(name: str, shape: tuple[int, ...], seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[name]().double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        target = torch.randn_like(copy.deepcopy(model)(x))
    return model, x, target


def _buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers()]


@pytest.mark.parametrize(("name", "shape", "tile"), [
    ("dark_like", (2, 3, 45, 62), 16),
    ("dark_like", (1, 3, 37, 29), 12),
    ("residual", (2, 3, 45, 62), 8),
    ("residual", (1, 3, 53, 41), 12),
    ("train_bn", (2, 3, 33, 47), 16),
])  # fmt: skip
def test_in_place_tiles_are_exact_and_run_where_planned(name: str, shape: tuple[int, ...], tile: int) -> None:
    model, x, t = _make(name, shape)
    ref_model = copy.deepcopy(model)
    ref = reference(ref_model, x, t)
    log = WritesLog(model)
    try:
        # BatchNorm unfolded: folded into its convolution (ops/fold_bn.py) it leaves no fresh map to overwrite
        var = variant(model, x, t, tile_size=tile, memory_budget="4GiB", fold_bn=False)
    finally:
        log.close()
    assert_same(ref, var)
    for a, b in zip(_buffers(model), _buffers(ref_model), strict=True):  # BatchNorm running statistics
        torch.testing.assert_close(a, b, **F64)
    plan = var[3].plan_for(tuple(x.shape), input_dtype=torch.float64)
    tiled = [s for s in plan.segments if s.mode == "tiled"]
    assert tiled and all(s.n_tiles > 1 for s in tiled), "the test must really tile"
    graph = ModelGraph(model, fold_bn=False)
    planned = {graph.nodes[i].name for s in tiled for i in s.in_place}
    assert planned == IN_PLACE[name]
    # what the executor ran: the planned activations wrote into their input, the others never did (plain segments
    # outside the tiles run the model's own modules; these models tile their whole trunk)
    assert log.in_place == IN_PLACE[name]
    expected_out = {"features.b1.relu1", "features.b2.relu1", "features.s.relu_a", "features.s.relu_b"}
    assert log.out_of_place >= (expected_out if name == "residual" else set())


def test_the_branch_value_and_saved_values_are_never_overwritten() -> None:
    """The per-node fact: a value read twice (residual branch), kept by its producer (sigmoid) or cut out of a
    convolution's sliced output is never written in place; the ReLU after a residual add is."""
    graph = ModelGraph(residual_net().double())
    facts = annotate(graph, (1, 3, 32, 32), torch.float64, torch.float64)
    marked = {n.name for n in facts.nodes if n.in_place_in_tile}
    assert marked == {"features.b1.relu2", "features.b2.relu2"}
    # the segment's own input (a view of its checkpoint) is never overwritten either
    relu2 = next(n.index for n in facts.nodes if n.name == "features.b1.relu2")
    add = facts.nodes[relu2].inputs[0]
    assert relu2 not in segment_in_place(facts.nodes, add, facts.trunk_end)
    assert relu2 in segment_in_place(facts.nodes, 0, facts.trunk_end)


def test_the_tile_replay_holds_one_map_less_per_in_place_leaky_relu() -> None:
    """Memory truth: out of place, LeakyReLU keeps its input and makes an output; in place one storage. The tile
    replay's forward-with-grad peak drops by exactly those maps, which the executor no longer allocates."""
    graph = ModelGraph(dark_like().double(), fold_bn=False)  # a folded BatchNorm leaves no map to overwrite
    shape = (1, 3, 64, 64)
    sess = new_session(graph, shape, torch.float64, torch.float64, "cpu", False)
    end = sess.facts.trunk_end
    with_ip = tile_choice(sess, 0, end, 8)
    sess_off = new_session(graph, shape, torch.float64, torch.float64, "cpu", False)
    sess_off._in_place[(0, end)] = frozenset()  # the replay as before: every activation out of place
    without = tile_choice(sess_off, 0, end, 8)
    assert with_ip.bwd_peak < without.bwd_peak
    assert with_ip.fwd_peak <= without.fwd_peak


def test_in_place_plans_and_runs_with_sft_on_a_ragged_batch() -> None:
    """The executor reads the plan's in-place set; a second step with the cached plan gives the same result."""
    model, x, t = _make("dark_like", (2, 3, 41, 50), seed=3)
    ref = reference(copy.deepcopy(model), x, t)
    m = SFT(model, tile_size=12, memory_budget="4GiB")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        xr = x.detach().clone().requires_grad_(True)
        y = m(xr)
        torch.nn.functional.mse_loss(y, t).backward()
        assert_same(ref, (y.detach(), [p.grad.clone() for p in model.parameters()], xr.grad))
