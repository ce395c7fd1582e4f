"""build_encoder's other sources: torchvision transformers, CNNs as patch encoders, a ``python:`` entry point's
failures, and a LoRA run's own weights file read back through ``model.weights`` (wsitrain/patch/encoders.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from wsitrain.errors import WsiTrainError
from wsitrain.patch.encoders import build_encoder, file_has_lora
from wsitrain.patch.lora import LoraSpec


def test_a_torchvision_vit_encodes_a_patch_of_any_whole_token_size() -> None:
    # vit_b_16 at 32 px: the same architecture on a 2 x 2 token grid (its position embedding sized for it)
    torch.manual_seed(0)
    net, info = build_encoder("torchvision/vit_b_16", weights=None, pretrained=False, patch=32)
    assert (info.patch, info.dim) == (32, 768)
    assert isinstance(net.heads, nn.Identity) and info.blocks  # the class token's vector, blocks for freezing
    with torch.no_grad():
        out = net(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 768)


def test_a_builtin_cnn_is_a_patch_encoder_and_refuses_weights_it_has_none_of() -> None:
    net, info = build_encoder("tiny", weights=None, pretrained=False, patch=32)
    with torch.no_grad():
        out = net(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, info.dim) and info.patch == 32
    with pytest.raises(WsiTrainError, match="has no ImageNet weights"):
        build_encoder("tiny", weights=None, pretrained=True, patch=32)


def test_a_torchvision_cnn_is_split_at_its_pooling() -> None:
    net, info = build_encoder("torchvision/resnet18", weights=None, pretrained=False, patch=64)
    with torch.no_grad():
        out = net(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 512) and info.dim == 512


def test_a_python_entry_point_that_fails_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "wsitrain_test_entry.py").write_text("def not_a_module():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WsiTrainError, match="returned int, not a module"):
        build_encoder("python:wsitrain_test_entry:not_a_module", weights=None, pretrained=False, patch=32)
    with pytest.raises(WsiTrainError, match="define missing"):
        build_encoder("python:wsitrain_test_entry:missing", weights=None, pretrained=False, patch=32)


def test_a_lora_runs_weights_file_loads_its_adapters(tmp_path: Path) -> None:
    spec = LoraSpec(rank=2, alpha=4, targets=("qkv",))
    torch.manual_seed(0)
    net, _ = build_encoder("python:tiny_encoders:tiny_vit", weights=None, pretrained=False, patch=32, lora=spec)
    with torch.no_grad():  # adapters away from their zero start, so the file's values show
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.add_(0.1)
    path = tmp_path / "encoder.pt"
    torch.save(net.state_dict(), path)
    assert file_has_lora(path) and not file_has_lora(tmp_path / "absent.pt")
    torch.manual_seed(1)  # other random base weights and adapters: the file must replace both
    again, _ = build_encoder("python:tiny_encoders:tiny_vit", weights=path, pretrained=False, patch=32, lora=spec)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(again(x), net(x), rtol=0, atol=0)
    # a plain (base) weights file is the base the adapters start from
    base, _ = build_encoder("python:tiny_encoders:tiny_vit", weights=None, pretrained=False, patch=32)
    plain = tmp_path / "base.pt"
    torch.save(base.state_dict(), plain)
    assert not file_has_lora(plain)
    adapted, _ = build_encoder("python:tiny_encoders:tiny_vit", weights=plain, pretrained=False, patch=32, lora=spec)
    with torch.no_grad():  # LoRA's B starts at zero: the adapted encoder is the base one
        torch.testing.assert_close(adapted(x), base(x), rtol=0, atol=0)
