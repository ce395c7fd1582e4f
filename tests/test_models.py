"""wsitrain.models: shapes, parameter sizes, normalization, frozen BatchNorm, weights files, fx tracing."""

from __future__ import annotations

import pytest
import torch
import torch.fx
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.models import (
    MODEL_NAMES,
    FrozenBatchNorm2d,
    InputNormalization,
    build,
    count_parameters,
    freeze_batchnorm,
    parameter_bytes,
)
from wsitrain.models.weights import load_weights


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {name: build(name, num_classes=3).eval() for name in MODEL_NAMES}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_shape_and_chain_layout(models: dict[str, nn.Module], name: str) -> None:
    model = models[name]
    assert model.name == name
    assert list(dict(model.named_children())) == ["normalize", "features", "pool", "flatten", "classifier"]
    assert isinstance(model.normalize, InputNormalization)
    with torch.no_grad():
        y = model(torch.rand(2, 3, 64, 64))
        trunk = model.features(model.normalize(torch.rand(1, 3, 64, 64)))
    assert y.shape == (2, 3)
    assert trunk.shape[-1] == 64 // model.stride


def test_strides() -> None:
    expected = {
        "tiny": 16,
        "tiny_bn": 16,
        "tiny_ln": 16,
        "vgg16": 32,
        "vgg19": 32,
        "darknet19": 32,
        "resnet18": 32,
        "resnet34": 32,
        "resnet50": 32,
    }
    assert {n: build(n, 2).stride for n in MODEL_NAMES} == expected


@pytest.mark.parametrize(
    ("name", "expected", "tol"), [("vgg16", 58.9e6, 0.02), ("vgg19", 80.1e6, 0.02), ("darknet19", 79.5e6, 0.03)]
)
def test_parameter_bytes_match_paper(models: dict[str, nn.Module], name: str, expected: float, tol: float) -> None:
    model = models[name]
    assert parameter_bytes(model) == pytest.approx(expected, rel=tol)
    assert parameter_bytes(model) == 4 * count_parameters(model)


def test_darknet19_layout(models: dict[str, nn.Module]) -> None:
    convs = [m for m in models["darknet19"].features if isinstance(m, nn.Conv2d)]
    assert len(convs) == 18  # DarkNet-19 = 18 trunk convs + the classifier
    assert [c.kernel_size[0] for c in convs] == [3, 3, 3, 1, 3, 3, 1, 3, 3, 1, 3, 1, 3, 3, 1, 3, 1, 3]
    assert all(c.bias is None for c in convs)


@pytest.mark.parametrize("name", ["tiny", "resnet18"])
def test_uint8_and_float_inputs_agree(models: dict[str, nn.Module], name: str) -> None:
    x8 = torch.randint(0, 256, (1, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        a = models[name](x8)
        b = models[name](x8.float() / 255)
    torch.testing.assert_close(a, b)


def test_input_normalization_math_and_dtypes() -> None:
    norm = InputNormalization(mean=(0.5, 0.25, 0.0), std=(0.5, 0.25, 1.0))
    x8 = torch.tensor([[[[255]], [[0]], [[51]]]], dtype=torch.uint8)
    torch.testing.assert_close(norm(x8), torch.tensor([[[[1.0]], [[-1.0]], [[0.2]]]]))
    assert norm(x8).dtype == torch.float32
    assert norm(torch.rand(1, 3, 2, 2, dtype=torch.float64)).dtype == torch.float64
    norm = norm.double()
    assert norm.mean.dtype == torch.float64 and norm(x8).dtype == torch.float64
    assert set(dict(norm.named_buffers())) == {"mean", "std"}


@pytest.mark.parametrize("name", ["resnet18", "darknet19"])
def test_freeze_bn_keeps_eval_and_running_stats(name: str) -> None:
    model = build(name, 2, freeze_bn=True)
    model.train()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(isinstance(m, FrozenBatchNorm2d) and not m.training for m in bns)
    assert all(m.weight.requires_grad and m.bias.requires_grad for m in bns)
    before = [(m.running_mean.clone(), m.running_var.clone()) for m in bns]
    model(torch.rand(2, 3, 64, 64)).sum().backward()
    for m, (mean, var) in zip(bns, before, strict=True):
        assert torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)
    assert bns[0].weight.grad is not None


def test_freeze_bn_false_trains_bn() -> None:
    model = build("resnet18", 2, freeze_bn=False).train()
    bn = model.features.bn1
    assert type(bn) is nn.BatchNorm2d and bn.training
    before = bn.running_mean.clone()
    model(torch.rand(2, 3, 64, 64))
    assert not torch.equal(bn.running_mean, before)


def test_freeze_batchnorm_keeps_parameter_identity() -> None:
    model = build("resnet18", 2, freeze_bn=False)
    params = [id(p) for p in model.parameters()]
    freeze_batchnorm(model)
    assert [id(p) for p in model.parameters()] == params


def test_max_pool_head() -> None:
    assert isinstance(build("tiny", 2, pool="max").pool, nn.AdaptiveMaxPool2d)
    with pytest.raises(WsiTrainError, match="avg, max"):
        build("tiny", 2, pool="mean")


def test_weights_round_trip(tmp_path) -> None:
    torch.manual_seed(1)
    src = build("resnet18", 4)
    path = tmp_path / "w.pt"
    torch.save(src.state_dict(), path)
    dst = build("resnet18", 4, weights=path)
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(src.eval()(x), dst.eval()(x))
    torch.save({"model": src.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")  # training checkpoint wrapper
    build("resnet18", 4, weights=str(tmp_path / "ckpt.pt"))


@pytest.mark.parametrize("prefixed", [True, False])
def test_a_trunk_file_loads_the_trunk_and_leaves_the_head(tmp_path, prefixed: bool) -> None:
    """Fine-tuning from a trunk pretrained elsewhere: the file holds the trunk's keys alone (a 2-class model's trunk
    into a 3-class attention model); the head stays as built, bit for bit."""
    torch.manual_seed(1)
    src = build("tiny_ln", 2, pool="max")
    trunk = src.features.state_dict()
    path = tmp_path / "trunk.pt"
    torch.save({f"features.{k}": v for k, v in trunk.items()} if prefixed else trunk, path)
    torch.manual_seed(2)
    fresh = build("tiny_ln", 3, pool="attention")
    torch.manual_seed(2)
    dst = build("tiny_ln", 3, pool="attention", weights=path)
    for k, v in dst.state_dict().items():
        if k.startswith("features."):
            assert torch.equal(v, trunk[k.removeprefix("features.")]), k
        else:
            assert torch.equal(v, fresh.state_dict()[k]), k
    assert not torch.equal(fresh.features.conv1.weight, dst.features.conv1.weight)  # the load changed something
    assert load_weights(build("tiny_ln", 2), path) == "trunk"
    torch.save(src.state_dict(), tmp_path / "all.pt")
    assert load_weights(build("tiny_ln", 2, pool="max"), tmp_path / "all.pt") == "model"


def test_a_trunk_file_of_another_trunk_names_the_trunk(tmp_path) -> None:
    path = tmp_path / "trunk.pt"
    state = build("tiny_ln", 2).features.state_dict()
    state["conv1.weight"] = torch.zeros(4, 3, 3, 3)  # the same keys, another width
    torch.save(state, path)
    with pytest.raises(WsiTrainError) as info:
        build("tiny_ln", 2, weights=path)
    msg = str(info.value)
    assert "trunk of model 'tiny_ln'" in msg and "conv1.weight (4, 3, 3, 3) vs (8, 3, 3, 3)" in msg
    partial = build("tiny_ln", 2).features.state_dict()
    partial.pop("ln4.bias")  # not the whole trunk: a plain mismatch of the model, every missing key named
    torch.save(partial, path)
    with pytest.raises(WsiTrainError, match="does not match the model 'tiny_ln': missing keys"):
        build("tiny_ln", 2, weights=path)


def test_missing_weights_file_names_it(tmp_path) -> None:
    path = tmp_path / "nope.pt"
    with pytest.raises(WsiTrainError, match="nope.pt"):
        build("tiny", 2, weights=path)


def test_wrong_keys_name_file_and_keys(tmp_path) -> None:
    path = tmp_path / "vgg.pt"
    torch.save(build("tiny", 2).state_dict(), path)
    with pytest.raises(WsiTrainError) as info:
        build("resnet18", 2, weights=path)
    msg = str(info.value)
    assert "vgg.pt" in msg and "missing keys" in msg and "features.conv1.weight" in msg
    assert "unexpected keys" in msg


def test_wrong_num_classes_is_a_shape_mismatch(tmp_path) -> None:
    path = tmp_path / "tiny5.pt"
    torch.save(build("tiny", 5).state_dict(), path)
    with pytest.raises(WsiTrainError, match="classifier.weight"):
        build("tiny", 2, weights=path)


def test_non_state_dict_file(tmp_path) -> None:
    path = tmp_path / "junk.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(WsiTrainError, match="junk.pt"):
        build("tiny", 2, weights=path)


def test_unknown_name_lists_choices() -> None:
    with pytest.raises(WsiTrainError) as info:
        build("vgg11", 2)
    assert "vgg11" in str(info.value) and all(n in str(info.value) for n in MODEL_NAMES)


def test_bad_num_classes() -> None:
    with pytest.raises(WsiTrainError, match="num_classes"):
        build("tiny", 0)


def test_meta_device_build_allocates_nothing() -> None:
    with torch.device("meta"):
        model = build("vgg16", 2)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


class _LeafNormTracer(torch.fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, InputNormalization) or super().is_leaf_module(m, qualname)


class _LeafNormBNTracer(_LeafNormTracer):
    """What an engine that knows BatchNorm does: every BatchNorm2d (frozen or not) stays one call_module node."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, nn.BatchNorm2d) or super().is_leaf_module(m, qualname)


@pytest.mark.parametrize("tracer", [_LeafNormTracer, _LeafNormBNTracer])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_fx_traceable(models: dict[str, nn.Module], name: str, tracer: type[torch.fx.Tracer]) -> None:
    model = models[name]
    graph = tracer().trace(model)
    gm = torch.fx.GraphModule(model, graph)
    call_modules = [n.target for n in graph.nodes if n.op == "call_module"]
    assert call_modules[0] == "normalize" and call_modules[-1] == "classifier"
    if tracer is _LeafNormBNTracer and name != "tiny_ln":  # tiny_ln's LayerNorm2d is traced through, as ConvNeXt's
        assert not any(n.op == "get_attr" for n in graph.nodes)
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
