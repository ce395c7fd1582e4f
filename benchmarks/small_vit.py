"""The benchmark's stand-in for a pathology foundation model: a small ViT on 32 px patches.

``model.name: python:benchmarks.small_vit:small_vit`` (from the repository root, with ``model.patch: 32``): timm's
VisionTransformer with 16 px tokens (4 per patch and a class token), width 64, 4 blocks of 4 heads, MLP ratio 2:
0.18 M parameters. Why 16 px tokens: forward and backward over every 32 px patch of a 1024 x 896 px slide took 0.7 s
on one CPU thread against 2.0 s with 8 px tokens (16 per patch; measured, plain autograd, torch 2.14.1), which keeps
the benchmark's twelve runs within the hour on a 2-core CPU. UNI or Virchow2 have the same structure (patch
embedding, class token, blocks, final norm) at ViT-L / ViT-H width; ``benchmarks/bench_foundation.py`` pretrains
this one without labels (``benchmarks/pretrain_patches.py --objective contrastive``) to stand in for them.
"""

from __future__ import annotations

from torch import nn

PATCH = 32  # px at the benchmark's 2.5 um/px: 80 um, 0.4 of a lesion's 200 um


def small_vit() -> nn.Module:
    """(B, 3, 32, 32) -> (B, 64): the class token after the final norm."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(img_size=PATCH, patch_size=16, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0,
                             num_classes=0)  # fmt: skip
