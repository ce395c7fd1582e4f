"""Patch encoders through the SFT engine: exact against plain autograd on the whole bag.

A ``PatchTrunk`` (an encoder on every patch of a non-overlapping grid) is tiled in whole patches: the forward sweep
keeps no activations, the head runs forward and backward on the embedding map, and each chunk of patches is
recomputed and back-propagated. Float64, against the same model run plain: the output, every parameter gradient and
the input gradient, for timm ViTs of several shapes (with and without a class token, with register tokens), a CNN
encoder, batch 2, a ragged slide whose last rows and columns do not fill a patch (not encoded, as a strided
convolution drops them), a tissue mask, every head, several chunk sizes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from wsitrain.models.heads import AttentionSpec
from wsitrain.models.zoo import patch_model
from wsitrain.sft import SFT

timm = pytest.importorskip("timm", reason="the ViT encoders are timm's")

P = 32  # the encoders' input patch
SHAPE = (2, 3, 5 * P + 7, 3 * P + 11)  # a 5 x 3 grid of patches, 7 rows and 11 columns past the last whole patch


def vit(depth: int = 2, class_token: bool = True, reg_tokens: int = 0, dim: int = 48) -> tuple[nn.Module, int]:
    """A random timm ViT on 32 px patches (8 px tokens): (N, 3, 32, 32) -> (N, dim)."""
    enc = timm.create_model(
        "vit_small_patch16_224", pretrained=False, num_classes=0, img_size=P, patch_size=8, depth=depth,
        embed_dim=dim, num_heads=2, class_token=class_token, reg_tokens=reg_tokens,
        global_pool="token" if class_token else "avg",
    )  # fmt: skip
    return enc, dim


def cnn() -> tuple[nn.Module, int]:
    """A small CNN as a patch encoder (the classic patch + MIL pipeline's)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 12, 3, stride=2, padding=1),
        nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(1),
    ), 12  # fmt: skip


def tissue() -> torch.Tensor:
    """(2, 1, 5, 3): different tissue per sample, whole chunks outside it."""
    m = torch.zeros(2, 1, 5, 3, dtype=torch.bool)
    m[0, :, 1:4, 0:2] = True
    m[1, :, 4, 2] = True  # one patch in a corner
    return m


HEADS = {
    "avg": {"pool": "avg"},
    "max": {"pool": "max"},
    "topk": {"pool": "topk", "topk": 3},
    "attention": {"pool": "attention"},
    "gated": {"pool": "gated_attention", "attention": AttentionSpec(hidden=6)},
    "clam_mb": {"pool": "gated_attention", "attention": AttentionSpec(per_class=True, instance_k=2, dim=10)},
}


def step(model: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    """Output, parameter gradients and input gradient of one step with the tissue mask set on the pool."""
    inner = model.model if isinstance(model, SFT) else model
    inner.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    with inner.pool.masked(mask):
        y = model(xr)
    y = y[0] if isinstance(y, tuple) else y
    (y * torch.arange(1.0, 1.0 + y.shape[-1], dtype=y.dtype)).square().sum().backward()
    return y.detach(), [p.grad for p in inner.parameters()], xr.grad


def assert_same_output_and_grads(model: nn.Module, got: tuple, ref: tuple) -> None:
    """``step``'s output and every parameter gradient of ``model`` equal (None where the reference has none)."""
    torch.testing.assert_close(got[0], ref[0])
    names = [n for n, _ in model.named_parameters()]
    for n, a, b in zip(names, got[1], ref[1], strict=True):
        assert (a is None) == (b is None), n
        if a is not None:
            torch.testing.assert_close(a, b, msg=lambda m, n=n: f"{n}: {m}")


def compare(model: nn.Module, mask: torch.Tensor | None, tile: int, shape: tuple[int, ...] = SHAPE) -> SFT:
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64)
    twin = copy.deepcopy(model)
    ref = step(model, x, mask)
    sft = SFT(twin, tile_size=tile, memory_budget="1GiB")
    got = step(sft, x, mask)
    assert_same_output_and_grads(model, got, ref)
    torch.testing.assert_close(got[2], ref[2])
    seg = sft.plan_for(tuple(x.shape), input_dtype=torch.float64).segments[-1]
    assert seg.mode == "tiled" and seg.n_tiles > 1, "the patch grid must really be tiled"
    return sft


def build(encoder: tuple[nn.Module, int], head: str = "avg") -> nn.Module:
    enc, dim = encoder
    return patch_model("test-encoder", enc, P, dim, 3, **HEADS[head]).double()


@pytest.mark.parametrize(
    "encoder",
    [
        pytest.param(lambda: vit(depth=1), id="vit-depth1-cls"),
        pytest.param(lambda: vit(depth=2, class_token=False), id="vit-depth2-avg"),
        pytest.param(lambda: vit(depth=2, reg_tokens=2, dim=32), id="vit-depth2-registers"),
        pytest.param(cnn, id="cnn"),
    ],
)
@pytest.mark.parametrize("tile", [P, 2 * P, 3 * P], ids=["1-patch", "2-patch", "3-patch"])
def test_encoders_and_chunk_sizes_are_exact(encoder, tile: int) -> None:
    torch.manual_seed(0)
    compare(build(encoder()), tissue(), tile)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("masked", [False, True], ids=["all", "tissue"])
def test_every_head_is_exact(head: str, masked: bool) -> None:
    torch.manual_seed(2)
    compare(build(vit(depth=1), head), tissue() if masked else None, 2 * P)


def test_the_partial_border_patches_are_not_encoded() -> None:
    """Pixels past the last whole patch take no part: the map is 5 x 3, their input gradient is zero, and changing
    them changes nothing (the reader pads a region to whole patches with background, so a slide never has any)."""
    torch.manual_seed(3)
    model = build(vit(depth=1))
    x = torch.randn(*SHAPE, dtype=torch.float64, requires_grad=True)
    fmap = model.features(model.normalize(x))
    assert fmap.shape == (2, 48, 5, 3)
    fmap.square().sum().backward()
    assert x.grad is not None and x.grad[:, :, 5 * P :].abs().max() == 0 and x.grad[:, :, :, 3 * P :].abs().max() == 0
    assert x.grad[:, :, : 5 * P, : 3 * P].abs().max() > 0
    y = x.detach().clone()
    y[:, :, 5 * P :] = 7.0
    torch.testing.assert_close(model.features(model.normalize(y)), fmap.detach(), rtol=0, atol=0)


def test_frozen_leading_blocks_are_exact_and_differentiate_nothing() -> None:
    """Frozen patch embedding and first block (model.freeze): the rest trains exactly; the frozen ones get no
    gradient, tiled or plain."""
    torch.manual_seed(4)
    model = build(vit(depth=2))
    enc = model.features.encoder
    for m in (enc.patch_embed, enc.blocks[0]):
        m.requires_grad_(False)
    enc.cls_token.requires_grad_(False)
    enc.pos_embed.requires_grad_(False)
    compare(model, tissue(), 2 * P)


def test_background_chunks_skip_their_backward() -> None:
    """Chunks wholly outside the tissue get a zero embedding gradient under a masked pool: not recomputed."""
    torch.manual_seed(5)
    sft = compare(build(vit(depth=1), "gated"), tissue(), P)
    assert sft.last_stats.skipped_backward > 0


def test_lora_adapters_are_exact() -> None:
    """LoRA through peft (model.lora: adapters on qkv and the MLP's fc2, base weights frozen): the adapters' gradients,
    the head's and the input's equal plain autograd's, tiled in chunks, with the tissue mask and an attention head."""
    pytest.importorskip("peft", reason="model.lora is peft's")
    from wsitrain.patch.lora import LoraSpec, add_lora

    torch.manual_seed(5)
    model = build(vit(depth=2), "gated")
    assert add_lora(model, LoraSpec(rank=2, alpha=4, targets=("qkv", "fc2"))) == 4  # freezes the encoder's own
    with torch.no_grad():  # adapters away from LoRA's zero start, so every adapter's gradient is non-trivial
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    model = model.double()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trained) and not any(n.startswith("features.encoder.blocks.0.attn.qkv.base")
                                                           for n in trained)  # fmt: skip
    compare(model, tissue(), 2 * P)
