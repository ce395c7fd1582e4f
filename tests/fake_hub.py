"""A Hugging Face hub cache in the hub's own file layout, filled with a tiny timm model's random weights.

``models--<org>--<name>/snapshots/<revision>/{config.json, model.safetensors}`` and ``refs/main`` holding the
revision: what ``huggingface-cli download`` leaves, so wsitrain reads it as it would read UNI or Virchow2. Nothing is
downloaded: the weights are a fresh timm model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the hub's snapshots are named
# the tiny ViT every hub test loads: 32 px, 8 px tokens, 2 blocks of width 48
TINY_VIT_ARGS: dict[str, Any] = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}
TINY_MEAN, TINY_STD = (0.6, 0.5, 0.7), (0.2, 0.25, 0.15)  # not ImageNet's: the tests see the encoder's own


def write_timm_repo(cache: Path, repo: str, *, architecture: str = "vit_tiny_patch16_224",
                    model_args: dict[str, Any] | None = None, seed: int = 0,
                    revision: str = REVISION) -> dict[str, torch.Tensor]:  # fmt: skip
    """Write repository ``repo`` ("org/name") into hub cache folder ``cache``; returns the state dict written."""
    import timm
    from safetensors.torch import save_file

    args = dict(TINY_VIT_ARGS if model_args is None else model_args)
    torch.manual_seed(seed)
    net = timm.create_model(architecture, pretrained=False, num_classes=0, **args)
    state = {k: v.contiguous() for k, v in net.state_dict().items()}
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(revision)
    size = args.get("img_size", 224)
    config = {
        "architecture": architecture,
        "num_classes": 0,
        "model_args": args,
        "pretrained_cfg": {"input_size": [3, size, size], "mean": list(TINY_MEAN), "std": list(TINY_STD),
                           "num_classes": 0, "interpolation": "bicubic"},  # fmt: skip
    }
    (snapshot / "config.json").write_text(json.dumps(config))
    save_file(state, str(snapshot / "model.safetensors"))
    return state


def tiny_vit() -> torch.nn.Module:
    """``python:tests.fake_hub:tiny_vit``: a 2-block ViT of width 24 on 16 px patches (8 px tokens), for fit tests."""
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=0, img_size=16, patch_size=8,
                             depth=2, embed_dim=24, num_heads=2)  # fmt: skip
