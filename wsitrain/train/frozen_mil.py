"""The frozen-feature baseline: the pipeline CLAM and slideflow users run, built from wsitrain's own pieces.

The same model as end-to-end training (``wsitrain.models.zoo.build`` with an attention pool), with its trunk frozen
through ``model.freeze`` (``FreezeSpec(until="features")``). Each slide is cut into ``patch`` x ``patch`` px
patches; the frozen trunk embeds every patch once, without autograd, into one vector (the mean of its feature map);
then only the model's own head (``attention`` -> ``pool`` -> ``flatten`` -> ``classifier``) is trained on the bags of
patch vectors, laid out as a (1, C, N, 1) map so it is the very module end-to-end training runs on the trunk's map.

Patch encoders (``model.patch``, a ViT or foundation model: wsitrain.patch) are frozen the same way; their patch is
their own, so each patch gives one embedding. wsitrain.train.feature_cache keeps the bags on disk, one per slide and
augmentation, so the head can train for many epochs on augmented bags without running the encoder again.

Plain tensors in and out: the caller reads the slides (benchmarks/bench_learning.py ``--baseline``,
benchmarks/bench_foundation.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.models import zoo
from wsitrain.models.freeze import FreezeSpec
from wsitrain.models.heads import ATTENTION, ATTENTION_POOLS

HEAD_PARTS = ("attention", "pool", "flatten", "classifier")  # after the trunk, in the model's order (zoo.build)


def build_frozen_mil(name: str, num_classes: int, pool: str = ATTENTION, weights: str | None = None,
                     patch: int | None = None) -> nn.Sequential:  # fmt: skip
    """The model end-to-end training would build, with everything up to and including the trunk frozen; ``patch``:
    ``model.patch`` (a patch encoder's trunk: wsitrain.patch)."""
    if pool not in ATTENTION_POOLS:
        raise ValueError(f"the frozen-feature baseline trains an attention-MIL head; pool {pool!r} is not one")
    return zoo.build(name, num_classes, weights=weights, pool=pool, freeze=FreezeSpec(until="features"), patch=patch)


def patch_grid(image: torch.Tensor, patch: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """(1, 3, H, W) -> (N, 3, patch, patch) non-overlapping patches in row-major order, and the grid (rows, cols).
    The ragged right and bottom edges (less than a patch) are left out, as patch extractors do."""
    rows, cols = image.shape[2] // patch, image.shape[3] // patch
    if rows == 0 or cols == 0:
        raise ValueError(f"image {tuple(image.shape[2:])} is smaller than one {patch} px patch")
    x = image[0, :, : rows * patch, : cols * patch]  # (3, rows*patch, cols*patch)
    x = x.reshape(3, rows, patch, cols, patch).permute(1, 3, 0, 2, 4)  # (rows, cols, 3, patch, patch)
    return x.reshape(rows * cols, 3, patch, patch), (rows, cols)


@torch.no_grad()
def patch_features(model: nn.Sequential, image: torch.Tensor, patch: int, batch: int = 64) -> torch.Tensor:
    """(1, 3, H, W) float in [0, 1] -> (N, C): each patch through the frozen ``normalize`` + ``features`` once, its
    feature map averaged. No autograd graph is kept (the features are constants to the head)."""
    trunk = nn.Sequential(model.normalize, model.features).eval()
    patches, _ = patch_grid(image, patch)
    out = [trunk(patches[i : i + batch]).mean(dim=(2, 3)) for i in range(0, len(patches), batch)]  # (b, C) each
    return torch.cat(out)


def head_logits(model: nn.Sequential, feats: torch.Tensor) -> torch.Tensor:
    """(N, C) patch vectors of one slide -> (1, classes) logits through the model's own head."""
    x = feats.t()[None, :, :, None]  # (1, C, N, 1): the bag as a one-column feature map
    for part in HEAD_PARTS:
        x = getattr(model, part)(x)
    return x


def attention_weights(model: nn.Sequential, feats: torch.Tensor) -> torch.Tensor:
    """(N, C) -> (N,) the head's attention over the patches (branch 0), summing to 1."""
    with torch.no_grad():
        hs = model.attention(feats.t()[None, :, :, None])  # (1, C + K, N, 1)
        return model.pool.weights(hs)[0, 0, :, 0]


@dataclass
class HeadFit:
    """What ``train_head`` did: epochs run, mean train loss per epoch, wall seconds."""

    epochs: int = 0
    train_loss: list[float] = field(default_factory=list)
    wall_s: float = 0.0


def train_head(model: nn.Sequential, bags: Sequence[torch.Tensor | Sequence[torch.Tensor]], labels: list[int], *,
               epochs: int, lr: float, seed: int, budget_s: float | None = None) -> HeadFit:  # fmt: skip
    """Train the trainable (head) parameters on ``bags`` ((N_i, C) each), one bag per step, AdamW at ``lr``, for
    ``epochs`` epochs or until ``budget_s`` seconds have passed (checked after each epoch). A bag given as several
    views (the slide's augmentations, wsitrain.train.feature_cache) is seen as one of them per step, drawn with the
    seed."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    rng = np.random.default_rng(seed)
    fit = HeadFit()
    t0 = time.perf_counter()
    model.train()
    for _ in range(epochs):
        losses = []
        for i in rng.permutation(len(bags)).tolist():
            views = bags[i]
            bag = views if isinstance(views, torch.Tensor) else views[int(rng.integers(len(views)))]
            loss = F.cross_entropy(head_logits(model, bag), torch.tensor([labels[i]]))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        fit.epochs += 1
        fit.train_loss.append(float(np.mean(losses)))
        if budget_s is not None and time.perf_counter() - t0 >= budget_s:
            break
    fit.wall_s = time.perf_counter() - t0
    model.eval()
    return fit


def predict_bags(model: nn.Sequential, bags: list[torch.Tensor]) -> torch.Tensor:
    """(slides, classes) class probabilities of each bag."""
    with torch.no_grad():
        return torch.cat([torch.softmax(head_logits(model, b).float(), 1) for b in bags])
