"""Tiny patch encoders for end-to-end tests, named ``python:tiny_encoders:<function>`` (tests/ is on sys.path)."""

from __future__ import annotations

from torch import nn


def tiny_vit() -> nn.Module:
    """A random timm ViT on 32 px patches (8 px tokens, depth 1, 24 wide): (N, 3, 32, 32) -> (N, 24)."""
    import timm

    net = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0, img_size=32, patch_size=8,
                            depth=1, embed_dim=24, num_heads=2)  # fmt: skip
    net.pretrained_cfg = {"input_size": (3, 32, 32), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    return net


def tiny_vit_deep() -> nn.Module:
    """``tiny_vit`` with 3 blocks: what ``model.freeze.last_blocks`` has blocks to leave frozen in."""
    import timm

    net = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=0, img_size=32, patch_size=8,
                            depth=3, embed_dim=24, num_heads=2)  # fmt: skip
    net.pretrained_cfg = {"input_size": (3, 32, 32), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    return net
