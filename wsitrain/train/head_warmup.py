"""``train.head_warmup``: train the head alone on the initial trunk's patch features before end-to-end training.

Why (docs/plateau.md, issue 32, *measured*): an attention head starts uniform, so it pools like an average and a lesion
that is 0.6% of a whole slide's map gets 0.6% of the gradient; end to end, the tiny model on whole 1024 px slides did
not leave the near-constant-output plateau in 112 optimizer steps. The frozen-feature baseline's head, trained for
thousands of cheap steps on a random trunk's patch vectors, did. Warming the head up that way first (the same
module, then end to end from there) gives the trunk's first steps a head that already scores some positions above
others.

How: each training slide is read once (as the first epoch reads it), cut into ``patch`` px patches, and each patch
goes through the model's own ``normalize`` + ``features`` without autograd (``frozen_mil.patch_features``): a bag of
(N, C) vectors per slide. The head (every module after ``features``) then makes ``steps`` AdamW steps on those bags,
one bag per step, laid out as a (1, C, N, 1) map, so it is the very module end-to-end training runs on the trunk's
map; the trunk is untouched and the end-to-end optimizer starts afresh afterwards. Cost: one forward of the trunk per
training slide plus the head's steps on small bags (seconds). The bags hold N x C floats per slide, in host memory.

Kept only when it learnt: its last epoch's mean loss must be ``MIN_GAIN`` below the loss of a constant output at the
training set's class prior, else the head is put back as it was. Why (*measured*, docs/plateau.md section 6): on
seed 1 the warm-up's loss stayed at chance (0.6925 against 0.6931) while its classifier weights grew 5x fitting noise,
and end to end that head drove the trunk's ReLUs off (active features 35% -> 16% in 20 steps): a flat run.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.train.frozen_mil import patch_features

TRUNK = "features"  # the trunk's name in every wsitrain model (wsitrain.models.zoo); the head is what follows it
# nats below the prior's loss the warm-up's last epoch must reach to be kept: the warm-ups that shortened the plateau
# ended 0.013-0.091 below ln 2, the one that flattened its run 0.0006 below (measured, docs/plateau.md section 6)
MIN_GAIN = 0.01


@dataclass
class WarmupResult:
    """What the warm-up did: steps, the mean loss of its first and last epoch over the bags, wall seconds."""

    steps: int = 0
    slides: int = 0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    wall_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    prior_loss: float = float("nan")  # a constant output at the training set's class prior
    kept: bool = False  # False: it did not learn (MIN_GAIN), and the head was put back as it was

    def summary(self) -> str:
        what = "kept" if self.kept else f"not kept: not {MIN_GAIN} below the prior's loss {self.prior_loss:.3f}"
        return (f"head warm-up: {self.steps} head-only steps on {self.slides} slides' patch features, "
                f"loss {self.first_loss:.3f} -> {self.last_loss:.3f}, {self.wall_s:.1f} s; {what}")  # fmt: skip


def prior_loss(labels: list[int]) -> float:
    """Cross-entropy of the best constant output: the entropy of the labels' class frequencies."""
    p = np.bincount(labels) / len(labels)
    return float(-(p[p > 0] * np.log(p[p > 0])).sum())


def head_modules(model: nn.Sequential) -> list[nn.Module]:
    """The modules after the trunk (``features``), in order: attention (if any), pool, flatten, classifier."""
    names = [n for n, _ in model.named_children()]
    if TRUNK not in names:
        raise ValueError(f"train.head_warmup needs a wsitrain model (normalize -> features -> head); got {names}")
    return [m for n, m in list(model.named_children())[names.index(TRUNK) + 1 :]]


def bag_logits(head: list[nn.Module], bag: torch.Tensor) -> torch.Tensor:
    """(N, C) patch vectors of one slide -> (1, outputs) through the head, the bag laid out as a (1, C, N, 1) map."""
    x = bag.t()[None, :, :, None]
    for m in head:
        x = m(x)
    return x


def warm_up_head(model: nn.Sequential, images: Iterable[torch.Tensor], labels: list[int], *, steps: int, patch: int,
                 lr: float, seed: int) -> WarmupResult:  # fmt: skip
    """Train ``model``'s head for ``steps`` AdamW steps at ``lr`` on patch bags of ``images`` ((1, 3, H, W) uint8 or
    float in [0, 1], one per label); the trunk's parameters are not changed."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    bags = []
    for image in images:
        x = image.to(device)
        x = x.float() / 255 if x.dtype == torch.uint8 else x.float()
        bags.append(patch_features(model, x, patch))  # (N, C)
    head = head_modules(model)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in head]
    params = [p for m in head for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    rng = np.random.default_rng(seed)
    result = WarmupResult(slides=len(bags))
    for m in head:
        m.train()
    epoch_losses: list[float] = []
    while result.steps < steps:
        for i in rng.permutation(len(bags)).tolist():
            if result.steps == steps:
                break
            loss = F.cross_entropy(bag_logits(head, bags[i]).float(), torch.tensor([labels[i]], device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            result.steps += 1
            epoch_losses.append(float(loss.detach()))
        result.losses.append(float(np.mean(epoch_losses)))
        epoch_losses = []
    for p in params:
        p.grad = None
    model.train(was_training)
    result.first_loss, result.last_loss = result.losses[0], result.losses[-1]
    result.prior_loss = prior_loss(labels)
    result.kept = result.last_loss < result.prior_loss - MIN_GAIN
    if not result.kept:
        for m, state in zip(head, before, strict=True):
            m.load_state_dict(state)
    result.wall_s = time.perf_counter() - t0
    return result
