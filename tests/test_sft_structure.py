"""The engine's structure: hooks that see tiles, one budget per run, bounded caches, an untouched user model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from sft_models import MODELS
from torch import nn

from wsitrain.errors import PlanError
from wsitrain.memory import DeviceMemory, PeakMeter, detect_budget
from wsitrain.sft import SFT
from wsitrain.sft.api import PLAN_CACHE_SIZE
from wsitrain.sft.execution.staging import HostStager
from wsitrain.sft.facts import annotate
from wsitrain.sft.graph import ModelGraph

F64 = {"rtol": 1e-10, "atol": 1e-11}
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
SFT_DIR = Path(__file__).resolve().parents[1] / "wsitrain" / "sft"


def _model(name: str = "vgg_chain", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().double()


# ---- hooks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tile", [16, None])
def test_observe_trunk_tiles_reassemble_the_feature_map(tile: int | None) -> None:
    """Tiles seen by the observer cover the trunk's last feature map exactly once and equal it."""
    model = _model("resnet_basic")
    x = torch.randn(2, 3, 45, 62, dtype=torch.float64)
    with torch.no_grad():
        fmap = model.features(x)  # (B, C, h, w)
    m = SFT(model, tile_size=tile, memory_budget="1GiB")
    got = torch.full_like(fmap, float("nan"))
    calls = []

    def fn(t: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        assert not t.requires_grad
        assert torch.isnan(got[:, :, rows[0] : rows[1], cols[0] : cols[1]]).all(), "each position once"
        got[:, :, rows[0] : rows[1], cols[0] : cols[1]] = t
        calls.append((rows, cols))

    with m.observe_trunk(fn):
        out = m(x)
    torch.testing.assert_close(got, fmap, **F64)
    torch.testing.assert_close(out, model(x), **F64)
    assert (len(calls) > 1) == (tile is not None)
    m(x)  # outside the block the observer is gone
    assert len(calls) == len(set(calls))


@pytest.mark.parametrize("tile", [16, None])
def test_input_gradient_sink_shares_add_up_to_the_input_gradient(tile: int | None) -> None:
    model = _model("odd_ops")
    x = torch.randn(1, 3, 45, 62, dtype=torch.float64, requires_grad=True)
    model(x).square().sum().backward()
    expected = x.grad.clone()
    model.zero_grad()
    xr = x.detach().clone().requires_grad_(True)
    m = SFT(model, tile_size=tile, memory_budget="1GiB")
    acc = torch.zeros_like(expected)
    n = [0]

    def sink(g: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> None:
        acc[:, :, rows[0] : rows[1], cols[0] : cols[1]] += g
        n[0] += 1

    loss = m(xr).square().sum()
    with m.input_gradient_sink(sink):
        loss.backward()
    torch.testing.assert_close(acc, expected, **F64)
    if tile is not None:
        assert n[0] > 1 and xr.grad is None, "tiled: shares only, no full-size input gradient"
    else:
        assert n[0] == 1


# ---- one budget per run ----------------------------------------------------------------------------
class _ShrinkingProbe:
    """A CUDA-like device: each call, the caching allocator holds more and free memory is less."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, device: torch.device | str) -> DeviceMemory:
        self.calls += 1
        held = self.calls * 64 * 2**20
        return DeviceMemory(free=2 * 2**30 - held, held=held)


def test_detection_counts_the_allocators_reserve_as_ours() -> None:
    probe = _ShrinkingProbe()
    first, second = detect_budget("cpu", probe), detect_budget("cpu", probe)
    assert first == second == int(2 * 2**30 * 0.85)


def test_budget_is_detected_once_for_many_shapes() -> None:
    probe = _ShrinkingProbe()
    model = _model()
    m = SFT(model, memory_probe=probe)
    budgets = set()
    for k in range(10):
        shape = (1, 3, 24 + 3 * k, 40 - 2 * k)
        with torch.no_grad():
            m(torch.randn(shape, dtype=torch.float64))
        budgets.add(m.plan_for(shape).budget_bytes)
    assert probe.calls == 1
    assert budgets == {int(2 * 2**30 * 0.85)}, "every shape planned against the one budget detected first"


# ---- bounded caches --------------------------------------------------------------------------------
def test_plan_cache_is_bounded_over_many_shapes() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
    m = SFT(model, memory_budget="1GiB")
    for k in range(1000):
        m.plan_for((1, 3, 8 + k % 40, 8 + k // 40))
    assert m.cached_plans == PLAN_CACHE_SIZE
    assert m.staging_buffers == 0  # nothing staged on CPU


def test_staging_keeps_two_buffers_whatever_the_shapes() -> None:
    stager = HostStager()
    img = torch.randint(0, 255, (1, 3, 300, 300), dtype=torch.uint8)
    for k in range(1000):
        h, w = 5 + k % 97, 7 + k % 89
        region = img[:, :, k % 50 : k % 50 + h, 3 : 3 + w]  # strided views of many shapes
        _, packed = stager.pack(region)
        assert torch.equal(packed, region)
    assert stager.buffers == 2
    assert stager.pinned_bytes <= 2 * img[:, :, :101, :96].numel()


# ---- one peak meter, never reset behind the caller's back -------------------------------------------
def test_engine_does_not_restart_the_callers_peak_meter() -> None:
    meter = PeakMeter("cpu")
    if not meter.resettable:
        pytest.skip("this platform cannot reset the resident high-water mark (/proc/self/clear_refs)")
    meter.start()
    big = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, mmapped: freed back to the OS on del
    big_bytes = big.numel() * 4
    del big
    m = SFT(_model(), tile_size=16, memory_budget="1GiB")
    x = torch.randn(1, 3, 40, 40, dtype=torch.float64)
    m(x).sum().backward()
    assert meter.peak() >= big_bytes, "the engine restarted the caller's peak counter"
    assert all(t.peak_bytes is None for t in m.last_stats.tiles)


# ---- facts -----------------------------------------------------------------------------------------
def test_planning_never_runs_the_users_modules() -> None:
    """Shapes come from a meta copy: the user's layers are not called (or their weights swapped) to plan."""
    model = _model()
    conv = model.features[0]
    calls: list[str] = []
    conv.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].device.type) if mod is conv else None)
    weight = conv.weight
    m = SFT(model, tile_size=16, memory_budget="1GiB")
    m.plan_for((1, 3, 37, 41))
    assert calls == [] and conv.weight is weight and weight.device.type == "cpu"


def test_facts_are_frozen_printable_and_name_module_paths() -> None:
    model = _model("resnet_basic")
    facts = annotate(ModelGraph(model), (1, 3, 45, 62), torch.float64, torch.float64, True)
    text = str(facts)
    assert "features.4.conv1" in text and "features.4 (add)" in text
    node = facts.nodes[3]
    with pytest.raises(AttributeError):
        node.nbytes = 0  # type: ignore[misc]
    assert facts.nodes[0].requires_grad and facts.nodes[facts.trunk_end].is_cut
    assert facts.nodes[1].param_bytes == sum(p.numel() * 8 for p in model.features[0].parameters())


def test_shape_errors_name_the_module_path() -> None:
    model = _model()
    with pytest.raises(PlanError, match=r"features\.0"):
        SFT(model, memory_budget="1GiB").plan_for((1, 4, 32, 32))  # 4 channels into a 3-channel conv


def test_unknown_optimizer_is_an_error_not_adam() -> None:
    with pytest.raises(PlanError, match="optimizer 'lion'"):
        SFT(_model(), memory_budget="1GiB", optimizer="lion").plan_for((1, 3, 32, 32))


# ---- layout ----------------------------------------------------------------------------------------
def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _closure(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every wsitrain module ``module`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for n in graph.get(todo.pop(), set()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _import_graph() -> dict[str, set[str]]:
    root = SFT_DIR.parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        mod = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[mod] = {m for m in _imports(path) if m.startswith("wsitrain")}
    return graph


def test_execution_reads_plans_and_never_imports_planning() -> None:
    """Not directly, nor through a shared module: execution sees a plan only as a frozen ``Plan``."""
    graph = _import_graph()
    execution = [m for m in graph if m.startswith("wsitrain.sft.execution")]
    assert len(execution) >= 8
    for mod in execution:
        bad = {m for m in _closure(mod, graph) if m.startswith("wsitrain.sft.planning")}
        assert not bad, f"{mod} imports {sorted(bad)}"


def test_engine_has_a_folder_per_idea() -> None:
    """Operators, planning, execution and the simulator are sub-packages; no file-name prefix stands in for one."""
    for pkg in ("ops", "planning", "execution", "simulate"):
        assert (SFT_DIR / pkg / "__init__.py").is_file(), pkg
    for folder in [SFT_DIR, *(p for p in SFT_DIR.iterdir() if p.is_dir() and p.name != "__pycache__")]:
        stems = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        prefixes = [s.split("_")[0] for s in stems if "_" in s]
        shared = {x for x in prefixes if prefixes.count(x) + stems.count(x) >= 3}
        assert not shared, f"{folder.name}/: file names share the prefix(es) {sorted(shared)}: a sub-package waiting"


def test_no_import_circles_in_the_package() -> None:
    graph = _import_graph()
    for mod in graph:  # a module's own package __init__ imports it; that edge is not a circle
        graph[mod] = {m for m in graph[mod] if m in graph and not mod.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(n) :] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_engine_modules_stay_small() -> None:
    for path in SFT_DIR.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path.name
