"""Patch encoders by name (wsitrain.patch.encoders): every name form, the Hugging Face cache read offline, local
weights, and the errors (exit 2) that say what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.fake_hub import REVISION, TINY_MEAN, TINY_STD, TINY_VIT_ARGS, write_timm_repo
from wsitrain.errors import ConfigError, WsiTrainError
from wsitrain.models.normalize import IMAGENET_MEAN
from wsitrain.models.registry import resolve_model_name
from wsitrain.patch.encoders import block_paths, build_encoder, load_encoder_weights

REPO = "tiny-org/tiny-vit"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A hub cache folder holding one tiny ViT repository (random weights) and a Virchow-style one (token output)."""
    cache = tmp_path_factory.mktemp("hf") / "hub"
    state = write_timm_repo(cache, REPO)
    write_timm_repo(cache, "tiny-org/tokens", model_args={**TINY_VIT_ARGS, "global_pool": ""}, seed=1)
    return cache, state


@pytest.fixture
def offline(hub: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_CACHE at the fake cache and HF_HUB_OFFLINE=1, as on a machine without network."""
    cache, _ = hub
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


# ---- names --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "source", "patch_only"),
    [
        ("timm/vit_small_patch16_224", "timm", True),
        ("timm/vit_small_patch16_224.augreg_in21k", "timm", True),
        ("timm/resnet18", "timm", False),
        ("torchvision/vit_b_16", "torchvision", True),
        ("torchvision/resnet18", "torchvision", False),
        ("timm/hf-hub:MahmoodLab/UNI", "hf-hub", True),
        ("timm/hf-hub:paige-ai/Virchow2@main", "hf-hub", True),
        ("python:tests.fake_hub:write_timm_repo", "python", True),
        ("resnet18", "builtin", False),
    ],
)
def test_name_forms_resolve(name: str, source: str, patch_only: bool) -> None:
    spec = resolve_model_name(name)
    assert (spec.source, spec.patch_only) == (source, patch_only)


def test_hub_and_python_names_resolve_without_torch() -> None:
    """Config validation stays torch-free for the new forms: nothing is imported to check them."""
    code = ("import sys, wsitrain.models as m; m.resolve_model_name('timm/hf-hub:MahmoodLab/UNI'); "
            "m.resolve_model_name('python:json.decoder:JSONDecoder'); print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_bad_names_exit_2() -> None:
    for name, says in [("timm/hf-hub:/x", "does not name a hub repository"),
                       ("python:a.b", "write it as python:<module>:<function>"),
                       ("python:1bad:f", "is not <dotted.module>:<function>")]:  # fmt: skip
        with pytest.raises(ConfigError, match="model.name") as info:
            resolve_model_name(name)
        assert info.value.exit_code == 2 and says in str(info.value)


# ---- library encoders ---------------------------------------------------------------------------------------
def test_timm_vit_at_a_given_patch_size() -> None:
    net, info = build_encoder("timm/vit_tiny_patch16_224", weights=None, pretrained=False, patch=32)
    assert (info.patch, info.dim) == (32, 192)
    assert info.blocks == tuple(f"blocks.{i}" for i in range(12))
    assert (info.mean, info.std) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))  # timm's cfg of its augreg weights
    assert net(torch.rand(2, 3, 32, 32)).shape == (2, 192)


def test_torchvision_vit_without_its_head() -> None:
    net, info = build_encoder("torchvision/vit_b_16", weights=None, pretrained=False, patch=32)
    assert (info.patch, info.dim, len(info.blocks)) == (32, 768, 12)
    assert info.blocks[0] == "encoder.layers.encoder_layer_0"
    assert net(torch.rand(2, 3, 32, 32)).shape == (2, 768)


def test_cnn_as_patch_encoder_needs_a_patch_size() -> None:
    net, info = build_encoder("tiny", weights=None, pretrained=False, patch=32)
    assert (info.patch, info.dim) == (32, 32) and net(torch.rand(2, 3, 32, 32)).shape == (2, 32)
    assert [b.rsplit(".", 1)[-1] for b in info.blocks] == ["conv1", "conv2", "conv3", "conv4"]
    with pytest.raises(WsiTrainError, match="is a CNN: as a patch encoder it needs model.patch") as err:
        build_encoder("tiny", weights=None, pretrained=False)
    assert err.value.exit_code == 2


def test_block_paths_of_a_plain_module() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten())
    assert block_paths(net) == ("0", "2")


# ---- the Hugging Face cache ---------------------------------------------------------------------------------
def test_hub_model_loads_from_the_cache_offline(offline: Path, hub: tuple[Path, dict[str, torch.Tensor]]) -> None:
    _, state = hub
    net, info = build_encoder(f"timm/hf-hub:{REPO}", weights=None, pretrained=True)
    assert (info.patch, info.dim, info.blocks) == (32, 48, ("blocks.0", "blocks.1"))
    assert (info.mean, info.std) == (TINY_MEAN, TINY_STD)  # the encoder's own normalisation, from pretrained_cfg
    loaded = net.state_dict()
    assert set(loaded) == set(state)
    for k, v in state.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    assert net(torch.rand(2, 3, 32, 32)).shape == (2, 48)


def test_hub_revision_and_patch_size(offline: Path, hub: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """A pinned revision reads that snapshot; another patch size resamples the position embedding (timm's filter)."""
    _, state = hub
    net, info = build_encoder(f"timm/hf-hub:{REPO}@{REVISION}", weights=None, pretrained=True, patch=48)
    assert info.patch == 48 and net.pos_embed.shape[1] == 1 + (48 // 8) ** 2
    torch.testing.assert_close(net.blocks[1].mlp.fc2.weight, state["blocks.1.mlp.fc2.weight"], rtol=0, atol=0)
    assert net(torch.rand(1, 3, 48, 48)).shape == (1, 48)


def test_hub_token_output_pools_the_class_token(offline: Path) -> None:
    net, info = build_encoder("timm/hf-hub:tiny-org/tokens", weights=None, pretrained=True)
    x = torch.rand(2, 3, 32, 32)
    tokens = net.forward_features(x)  # (2, 1 + 16, 48)
    torch.testing.assert_close(net(x), tokens[:, 0])
    assert info.dim == 48


def test_hub_model_not_in_the_cache_says_where_and_how(offline: Path) -> None:
    with pytest.raises(WsiTrainError) as err:
        build_encoder("timm/hf-hub:MahmoodLab/UNI", weights=None, pretrained=True)
    text = f"{err.value} {err.value.hint}"
    assert err.value.exit_code == 2
    assert str(offline / "models--MahmoodLab--UNI") in text and "never downloads" in text
    assert "huggingface-cli download MahmoodLab/UNI" in text and "HF_HOME" in text


def test_hub_cache_from_hf_home(hub: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:
    cache, _ = hub
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, info = build_encoder(f"timm/hf-hub:{REPO}", weights=None, pretrained=True)
    assert info.dim == 48


# ---- local weights, user modules ----------------------------------------------------------------------------
def test_local_weights_through_the_safe_loader(offline: Path, tmp_path: Path) -> None:
    src, _ = build_encoder(f"timm/hf-hub:{REPO}", weights=None, pretrained=True)
    torch.manual_seed(5)
    for p in src.parameters():
        nn.init.normal_(p)
    file = tmp_path / "enc.pt"
    torch.save({f"features.encoder.{k}": v for k, v in src.state_dict().items()}, file)  # a patch model's keys
    net, _ = build_encoder(f"timm/hf-hub:{REPO}", weights=file, pretrained=False)
    for k, v in src.state_dict().items():
        torch.testing.assert_close(net.state_dict()[k], v, rtol=0, atol=0)
    torch.save({"blocks.0.norm1.weight": torch.ones(48)}, file)
    with pytest.raises(WsiTrainError, match="does not hold this encoder's weights: missing keys"):
        load_encoder_weights(net, file)


def test_user_module_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_encoders.py").write_text(
        "import torch\n"
        "from torch import nn\n"
        "def small():\n"
        "    return nn.Sequential(nn.Conv2d(3, 6, 4, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())\n"
        "def with_cfg():\n"
        "    m = small()\n"
        "    m.pretrained_cfg = {'mean': (0.5, 0.5, 0.5), 'std': (0.1, 0.2, 0.3), 'input_size': (3, 16, 16)}\n"
        "    return m\n"
        "def not_a_module():\n"
        "    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    net, info = build_encoder("python:my_encoders:small", weights=None, pretrained=False, patch=24)
    assert (info.patch, info.dim, info.mean) == (24, 6, tuple(IMAGENET_MEAN))
    _, info = build_encoder("python:my_encoders:with_cfg", weights=None, pretrained=False)
    assert (info.patch, info.dim, info.std) == (16, 6, (0.1, 0.2, 0.3))
    with pytest.raises(WsiTrainError, match="model.patch is required"):
        build_encoder("python:my_encoders:small", weights=None, pretrained=False)
    with pytest.raises(WsiTrainError, match="returned int, not a module"):
        build_encoder("python:my_encoders:not_a_module", weights=None, pretrained=False, patch=16)
    with pytest.raises(WsiTrainError, match="has no attribute 'missing'"):
        build_encoder("python:my_encoders:missing", weights=None, pretrained=False, patch=16)


def test_the_hub_encoders_normalisation_reaches_the_model(offline: Path) -> None:
    """The run's input normalisation (the model's first layer, fed uint8 patches) is the encoder's own."""
    from wsitrain.models.zoo import build

    model = build(f"timm/hf-hub:{REPO}", 2, pool="attention")
    torch.testing.assert_close(model.normalize.mean, torch.tensor(TINY_MEAN))
    torch.testing.assert_close(model.normalize.std, torch.tensor(TINY_STD))
    assert model.stride == 32 and model.features.encoder.pos_embed.shape[1] == 1 + 16
