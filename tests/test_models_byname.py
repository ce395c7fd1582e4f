"""Models by name: torchvision/<name> and timm/<name> split at their last global pooling, ImageNet weights read
from the libraries' own caches (pre-filled here with random tensors; the network is blocked), run checkpoints
as weights, and the one model-name vocabulary."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn
from typer.testing import CliRunner

from wsitrain.errors import ConfigError, WsiTrainError
from wsitrain.models import BUILTIN_NAMES, build, is_frozen_bn, resolve_model_name
from wsitrain.models.split import split_classifier
from wsitrain.sft import plan

timm = pytest.importorskip("timm", reason="timm is an optional extra; the `test` extra installs it")

X64 = (1, 3, 64, 64)  # small images keep every family fast; all of them reach a >= 1 x 1 map at stride 32


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach the network fails at once, as on an offline cluster node."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network disabled in wsitrain tests")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads these at import time; the environment above is for anything imported later.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    yield cache


def random_state(net: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v.clone()
        for k, v in net.state_dict().items()
    }


# ---- names --------------------------------------------------------------------------------------------------
def test_builtin_and_library_names_resolve() -> None:
    assert resolve_model_name("vgg16").stride == 32 and resolve_model_name("vgg16").is_builtin
    tv = resolve_model_name("torchvision/efficientnet_b0")
    assert (tv.source, tv.arch) == ("torchvision", "efficientnet_b0")
    tm = resolve_model_name("timm/resnet18.a1_in1k")
    assert (tm.source, tm.arch) == ("timm", "resnet18.a1_in1k")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("vgg61", "is not a valid choice; choose one of tiny, tiny_bn, tiny_ln, vgg16"),
        ("torchvision/resnet19", "not a torchvision classification model (did you mean resnet18"),
        ("torchvision/vit_b_17", "not a torchvision classification model (did you mean vit_b_16"),
        ("timm/hf-hub:MahmoodLab", "does not name a hub repository as <org>/<name>"),
        ("python:my_pkg", "write it as python:<module>:<function>"),
        ("python:no_such_package_here.mod:build", "module 'no_such_package_here.mod' cannot be found"),
        ("timm/not_a_model", "is not a timm model"),
        ("torchvision/", "names no model"),
        ("", "is not a model name"),
    ],
)
def test_unknown_names_say_why_and_list_choices(name: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_model_name(name, key="model.name")
    err = info.value
    assert err.exit_code == 2 and str(err).startswith(f"model.name: {name!r}") and says in str(err)
    assert err.problems == [err.message]  # a config loader can collect it with its other problems
    if name == "vgg61":
        assert all(n in str(err) for n in BUILTIN_NAMES)
        assert "torchvision/<name>" in str(err) and "timm/<name>" in str(err) and "vgg16" in (err.hint or "")
    with pytest.raises(WsiTrainError):
        build(name, 2)


def test_registry_is_torch_free() -> None:
    import subprocess
    import sys

    code = "import sys, wsitrain.models; wsitrain.models.resolve_model_name('vgg16'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- the split ----------------------------------------------------------------------------------------------
def _library(name: str) -> nn.Module:
    source, arch = name.split("/")
    torch.manual_seed(0)
    if source == "timm":
        return timm.create_model(arch).eval()
    return torchvision.models.get_model(arch, weights=None).eval()


@pytest.fixture(scope="module")
def libraries() -> dict[str, nn.Module]:
    names = [
        "torchvision/resnet18",
        "torchvision/efficientnet_b0",
        "torchvision/convnext_tiny",
        "torchvision/densenet121",
        "torchvision/mobilenet_v3_small",
        "torchvision/squeezenet1_1",
        "timm/resnet18",
        "timm/mobilenetv3_small_100",
    ]
    return {n: _library(n) for n in names}


def _logits_layer(net: nn.Module, name: str) -> nn.Module:
    path = {
        "torchvision/resnet18": "fc",
        "torchvision/efficientnet_b0": "classifier.1",
        "torchvision/convnext_tiny": "classifier.2",
        "torchvision/densenet121": "classifier",
        "torchvision/mobilenet_v3_small": "classifier.3",
        "timm/resnet18": "fc",
        "timm/mobilenetv3_small_100": "classifier",
    }[name]
    return net.get_submodule(path)


@pytest.mark.parametrize(
    "name",
    [
        "torchvision/resnet18",
        "torchvision/efficientnet_b0",
        "torchvision/convnext_tiny",
        "torchvision/densenet121",
        "torchvision/mobilenet_v3_small",
        "timm/resnet18",
        "timm/mobilenetv3_small_100",
    ],
)
def test_split_computes_what_the_library_computes(libraries: dict[str, nn.Module], name: str) -> None:
    """Trunk -> global average pool -> kept head layers -> the library's own last Linear equals the library model."""
    net = libraries[name]
    parts = split_classifier(net, name, num_classes=5)
    assert parts.stride == 32
    last = parts.classifier[-1] if isinstance(parts.classifier, nn.Sequential) else parts.classifier
    assert isinstance(last, nn.Linear) and last.out_features == 5
    library_logits = _logits_layer(net, name)
    with torch.no_grad():
        last.weight = nn.Parameter(library_logits.weight.detach().clone())
        last.bias = nn.Parameter(library_logits.bias.detach().clone())
    chain = nn.Sequential(parts.features, nn.AdaptiveAvgPool2d(1), nn.Flatten(1), parts.classifier).eval()
    x = torch.rand(X64)
    with torch.no_grad():
        torch.testing.assert_close(chain(x), net(x))


def test_split_places_the_cut_at_the_last_global_pooling(libraries: dict[str, nn.Module]) -> None:
    eff = split_classifier(libraries["torchvision/efficientnet_b0"], "eff", 3)
    assert eff.features is libraries["torchvision/efficientnet_b0"].features  # the library's modules, not copies
    # EfficientNet's squeeze-excitation pools sit inside the trunk: the split is after all of them.
    assert sum(isinstance(m, nn.AdaptiveAvgPool2d) for m in eff.features.modules()) == 16
    assert [type(m) for m in eff.classifier] == [nn.Dropout, nn.Linear] and eff.channels == 1280

    cnx = split_classifier(libraries["torchvision/convnext_tiny"], "cnx", 3)
    # ConvNeXt normalizes the pooled (B, C, 1, 1) map before flattening: its own LayerNorm2d gets that map back.
    assert [type(m).__name__ for m in cnx.classifier] == ["Unflatten", "LayerNorm2d", "Flatten", "Linear"]
    assert cnx.classifier[1] is libraries["torchvision/convnext_tiny"].classifier[0]

    dense = split_classifier(libraries["torchvision/densenet121"], "dense", 3)
    assert list(dict(dense.features.named_children()))[-2:] == ["norm5", "relu"]  # forward's F.relu as a module
    assert isinstance(dense.features.relu, nn.ReLU)

    squeeze = split_classifier(libraries["torchvision/squeezenet1_1"], "squeeze", 3)
    # SqueezeNet classifies with a 1x1 conv before its pooling: that conv is cut off, its dropout joins the head.
    assert squeeze.channels == 512 and squeeze.stride == 16
    assert [type(m) for m in squeeze.classifier] == [nn.Dropout, nn.Linear]

    mnv3 = split_classifier(libraries["timm/mobilenetv3_small_100"], "mnv3", 3)
    # timm applies a 1x1 conv and an activation to the pooled map, then flattens: kept, in that order.
    assert [k for k, _ in mnv3.classifier.named_children()] == [
        "unflatten",
        "conv_head",
        "act2",
        "flatten",
        "classifier",
    ]
    assert mnv3.classifier.conv_head is libraries["timm/mobilenetv3_small_100"].conv_head


def test_vgg_fixed_size_pool_drops_its_classifier() -> None:
    with torch.device("meta"):  # VGG's 120M-parameter classifier: shapes are all this test needs
        parts = split_classifier(torchvision.models.vgg11(), "vgg11", 4)
    assert isinstance(parts.classifier, nn.Linear) and parts.classifier.in_features == 512 and parts.stride == 32
    assert parts.dropped == ("classifier",)


def test_googlenet_input_transform_becomes_the_normalization(monkeypatch: pytest.MonkeyPatch) -> None:
    """GoogLeNet with ImageNet weights re-normalizes its input in forward; wsitrain normalizes with 0.5 instead."""
    from wsitrain.models import pretrained

    def googlenet(arch: str, imagenet: bool) -> nn.Module:  # what torchvision builds for weights="DEFAULT"
        return torchvision.models.googlenet(weights=None, transform_input=True, aux_logits=False, init_weights=False)

    monkeypatch.setattr(pretrained, "torchvision_net", googlenet)
    torch.manual_seed(0)
    lib = googlenet("googlenet", True).double().eval()
    model = build("torchvision/googlenet", 1000, weights="imagenet").double().eval()
    assert isinstance(model.features, nn.Sequential)  # no channel slicing left in front of the trunk
    model.features.load_state_dict({k: v for k, v in lib.state_dict().items() if not k.startswith("fc.")})
    model.classifier[-1].load_state_dict(lib.fc.state_dict())
    rgb = torch.rand(1, 3, 96, 96, dtype=torch.float64)
    mean = torch.tensor([0.485, 0.456, 0.406], dtype=torch.float64)[:, None, None]
    std = torch.tensor([0.229, 0.224, 0.225], dtype=torch.float64)[:, None, None]
    with torch.no_grad():
        torch.testing.assert_close(model(rgb), lib((rgb - mean) / std), rtol=0, atol=1e-12)


def test_a_vit_is_a_patch_encoder_and_no_spatial_trunk() -> None:
    """A ViT has no spatial trunk to split (the split refuses it), so the name builds a patch-encoder model."""
    from wsitrain.models.split import split_classifier

    with pytest.raises(WsiTrainError, match="no pooling over height and width"):
        split_classifier(timm.create_model("vit_tiny_patch16_224"), "timm/vit_tiny_patch16_224", 2)
    model = build("timm/vit_tiny_patch16_224", 2)
    assert model.stride == 224 and model.features.patch == 224


# ---- built models -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {n: build(n, 3) for n in ("torchvision/resnet18", "torchvision/efficientnet_b0", "timm/efficientnet_b0")}


@pytest.mark.parametrize("name", ["torchvision/resnet18", "torchvision/efficientnet_b0", "timm/efficientnet_b0"])
def test_layout_uint8_and_engine_plan(built: dict[str, nn.Module], name: str) -> None:
    model = built[name].eval()
    assert model.name == name and model.stride == 32
    assert list(dict(model.named_children())) == ["normalize", "features", "pool", "flatten", "classifier"]
    x8 = torch.randint(0, 256, X64, dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(model(x8), model(x8.float() / 255))
    assert model(x8).shape == (1, 3)
    p = plan(model, X64, memory_budget="2GiB", device="cpu")
    assert p.fits and p.model_name == name


def test_engine_runs_a_library_model_tiled_and_exact() -> None:
    """torchvision's own ResNet-18 modules, tiled in 64 px tiles, give plain autograd's output and gradients."""
    import copy

    from wsitrain.sft import SFT

    torch.manual_seed(0)
    plain = build("torchvision/resnet18", 3).double().eval()
    tiled = copy.deepcopy(plain)
    x = torch.rand(1, 3, 128, 160, dtype=torch.float64, requires_grad=True)
    x_tiled = x.detach().clone().requires_grad_(True)
    plain(x).sum().backward()
    engine = SFT(tiled, memory_budget="2GiB", tile_size=64)
    y = engine(x_tiled)
    y.sum().backward()
    p = plan(tiled, tuple(x.shape), memory_budget="2GiB", device="cpu", tile_size=64)
    assert any(s["mode"] == "tiled" for s in p.to_dict()["segments"])
    torch.testing.assert_close(y, plain(x))
    torch.testing.assert_close(x_tiled.grad, x.grad)
    for (name, a), b in zip(plain.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_normalization_is_the_libraries_own() -> None:
    from wsitrain.models.zoo import input_normalization

    assert input_normalization(resolve_model_name("torchvision/resnet18")) == (
        (0.485, 0.456, 0.406),
        (0.229, 0.224, 0.225),
    )
    cfg = timm.models.get_pretrained_cfg("inception_v3.tf_in1k")
    assert input_normalization(resolve_model_name("timm/inception_v3.tf_in1k")) == (tuple(cfg.mean), tuple(cfg.std))
    assert tuple(cfg.mean) == (0.5, 0.5, 0.5)  # a model whose normalization is not ImageNet's


@pytest.mark.parametrize("name", ["torchvision/resnet18", "timm/efficientnet_b0"])
def test_freeze_bn_freezes_every_batchnorm_and_keeps_its_forward(name: str) -> None:
    torch.manual_seed(0)
    free = build(name, 2, freeze_bn=False).eval()
    x = torch.rand(X64)
    with torch.no_grad():
        expected = free(x)
    frozen = build(name, 2, freeze_bn=True)
    frozen.load_state_dict(free.state_dict())
    frozen.train()
    bns = [m for m in frozen.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(is_frozen_bn(m) and not m.training and m.weight.requires_grad for m in bns)
    if name.startswith("timm"):  # timm's BatchNormAct2d keeps its activation: the class is subclassed, not replaced
        assert any(type(m).__name__ == "FrozenBatchNormAct2d" for m in bns)
    before = [m.running_mean.clone() for m in bns]
    y = frozen(x)
    torch.testing.assert_close(y, expected)  # frozen BatchNorm in train mode = eval (neither model drops anything)
    y.sum().backward()
    assert all(torch.equal(m.running_mean, b) for m, b in zip(bns, before, strict=True))


def test_meta_device_build_allocates_nothing() -> None:
    # RegNet computes its widths with tensors while building: built on the CPU and moved to meta.
    with torch.device("meta"):
        model = build("torchvision/regnet_y_400mf", 2)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]) and model.stride == 32


# ---- ImageNet weights from the libraries' caches ------------------------------------------------------------
def test_torchvision_imagenet_from_a_filled_cache(torch_home: Path) -> None:
    from wsitrain.models.pretrained import torchvision_cache_file

    path, url = torchvision_cache_file("resnet18")
    assert path.parent == torch_home and path.name == url.rsplit("/", 1)[1]
    written = random_state(torchvision.models.resnet18(), seed=1)
    torch_home.mkdir(parents=True)
    torch.save(written, path)
    # The built-in ResNet-18 reads the same file; a config's model.weights arrives as Path("imagenet").
    for name, weights in (("torchvision/resnet18", "imagenet"), ("resnet18", Path("imagenet"))):
        model = build(name, 3, weights=weights)
        trunk = model.features.state_dict()
        assert trunk.keys() == {k for k in written if not k.startswith("fc.")}
        for k, v in trunk.items():
            assert torch.equal(v, written[k]), k


def test_torchvision_imagenet_missing_names_the_cache_file(torch_home: Path) -> None:
    with pytest.raises(WsiTrainError) as info:
        build("torchvision/resnet18", 3, weights="imagenet")
    msg = str(info.value)
    assert str(torch_home / "resnet18-f37072fd.pth") in msg and "cannot be downloaded" in msg
    assert "download.pytorch.org" in (info.value.hint or "") and "TORCH_HOME" in (info.value.hint or "")
    assert "\x1b" not in msg and info.value.exit_code == 2


def _fill_hf_cache(cache: Path, repo: str, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    folder = cache / f"models--{repo.replace('/', '--')}"
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    save_file(state, str(folder / "snapshots" / commit / "model.safetensors"))


@pytest.mark.parametrize("offline_flag", [True, False], ids=["HF_HUB_OFFLINE", "network-unreachable"])
def test_timm_imagenet_from_a_filled_cache(hf_cache: Path, monkeypatch: pytest.MonkeyPatch, offline_flag: bool) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline_flag)  # without the flag the hub tries, then falls back
    written = random_state(timm.create_model("resnet18"), seed=2)
    _fill_hf_cache(hf_cache, "timm/resnet18.a1_in1k", written)  # resnet18's default pretrained tag
    model = build("timm/resnet18", 3, weights="imagenet")
    for k, v in model.features.state_dict().items():
        assert torch.equal(v, written[k]), k


def test_timm_imagenet_missing_names_the_cache(hf_cache: Path) -> None:
    # HF_HUB_OFFLINE=1 (the fixture): without it huggingface_hub retries an unreachable network for ~45 s first.
    with pytest.raises(WsiTrainError) as info:
        build("timm/resnet18", 3, weights="imagenet")
    msg = str(info.value)
    assert str(hf_cache / "models--timm--resnet18.a1_in1k") in msg and "model.safetensors" in msg
    assert "hf download timm/resnet18.a1_in1k" in (info.value.hint or "")
    assert "\x1b" not in msg


def test_builtin_without_imagenet_weights() -> None:
    with pytest.raises(WsiTrainError, match="'tiny' has no ImageNet weights"):
        build("tiny", 2, weights="imagenet")


# ---- local files and run checkpoints ------------------------------------------------------------------------
def _run_checkpoint(path: Path, model: nn.Module, model_name: str) -> None:
    """A checkpoint as `wsitrain fit` writes it: model, optimizer, scheduler, scaler, numpy RNG state, config."""
    from wsitrain.train.checkpoint import rng_states, save_checkpoint

    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    model(torch.rand(1, 3, 32, 32)).sum().backward()
    opt.step()
    sched.step()
    save_checkpoint(
        path,
        model=model.state_dict(),
        optimizer=opt.state_dict(),
        scheduler=sched.state_dict(),
        scaler=torch.amp.GradScaler("cpu", enabled=False).state_dict(),
        epoch=1,
        next_index=0,
        global_step=1,
        best={"metric": 0.5},
        history=[{"epoch": 0, "loss": 1.0}],
        rng=rng_states(),
        config={"model": {"name": model_name, "pool": "avg"}},
        class_names=["a", "b"],
    )


def test_run_checkpoint_as_weights(tmp_path: Path) -> None:
    torch.manual_seed(3)
    src = build("tiny", 2)
    _run_checkpoint(tmp_path / "best.pt", src, "tiny")
    dst = build("tiny", 2, weights=tmp_path / "best.pt")
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_checkpoint_of_another_model_says_which(tmp_path: Path) -> None:
    _run_checkpoint(tmp_path / "last.pt", build("tiny", 2), "tiny")
    with pytest.raises(WsiTrainError, match="checkpoint of model 'tiny', not 'darknet19'"):
        build("darknet19", 2, weights=tmp_path / "last.pt")


def test_unsafe_file_error_has_no_terminal_codes(tmp_path: Path) -> None:
    path = tmp_path / "pickled.pt"
    torch.save({"model": build("tiny", 2)}, path)  # a pickled module, not a state dict: refused by weights_only
    with pytest.raises(WsiTrainError) as info:
        build("tiny", 2, weights=path)
    assert "pickled.pt" in str(info.value) and "\x1b" not in str(info.value)
    assert "\n" not in info.value.message


def test_shape_mismatch_names_the_parameter(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = build("torchvision/resnet18", 5)
    torch.save(src.state_dict(), tmp_path / "w.pt")
    with pytest.raises(WsiTrainError, match=r"classifier\.weight \(5, 512\) vs \(3, 512\)"):
        build("torchvision/resnet18", 3, weights=tmp_path / "w.pt")


# ---- `wsitrain models` --------------------------------------------------------------------------------------
def test_models_command_lists_builtins_and_naming() -> None:
    from wsitrain.cli import app

    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in BUILTIN_NAMES:
        assert name in result.output
    assert "torchvision/<name>" in result.output and "timm/<name>" in result.output
    assert "efficientnet_b0" in result.output and "timm is installed" in result.output
    assert "14,714,688" in result.output  # VGG-16's trunk, without its 120M-parameter classifier
    assert "Patch encoders" in result.output and "vit_b_16" in result.output and "timm/hf-hub:<org>/<name>" in (
        result.output) and "python:<module>:<function>" in result.output  # fmt: skip


def test_models_command_describes_one(torch_home: Path) -> None:
    from wsitrain.cli import app

    result = CliRunner().invoke(app, ["models", "torchvision/efficientnet_b0"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "4,007,548" in result.output  # EfficientNet-B0's trunk parameters
    assert "efficientnet_b0_rwightman-7f5810bc.pth" in result.output and "not cached" in result.output
    bad = CliRunner().invoke(app, ["models", "vgg61"])
    assert bad.exit_code == 2 and "vgg61" in bad.output
