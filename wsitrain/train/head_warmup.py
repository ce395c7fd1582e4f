"""``train.head_warmup``: train the head alone on the initial trunk's patch features before end-to-end training.

Why (docs/research/plateau.md, issue 32, *measured*): an attention head starts uniform, so it pools like an average and
a lesion that is 0.6% of a whole slide's map gets 0.6% of the gradient; end to end, the tiny model on whole 1024 px
slides did not leave the near-constant-output plateau in 112 optimizer steps. The frozen-feature baseline's head,
trained for thousands of cheap steps on a random trunk's patch vectors, did. Warming the head up that way first (the
same module, then end to end from there) gives the trunk's first steps a head that already scores some positions above
others.

How: each training slide is read once (as the first epoch reads it), cut into ``patch`` px patches, and each patch
goes through the model's own ``normalize`` + ``features`` without autograd (``frozen_mil.patch_features``): a bag of
(N, C) vectors per slide. The head (every module after ``features``) then makes ``steps`` AdamW steps on those bags,
one bag per step, laid out as a (1, C, N, 1) map, so it is the very module end-to-end training runs on the trunk's
map; the trunk is untouched and the end-to-end optimizer starts afresh afterwards. Cost: one forward of the trunk per
training slide plus the head's steps on small bags (seconds).

Memory: the slide stays where it was read (host memory); one row of patches at a time is cut from it and sent to the
device in batches of ``BATCH`` patches, so the device holds a batch of patches and its trunk activations, never the
slide. The bags stay in host memory, N x C float32 per slide (``bag_bytes``); each step moves one bag to the device.
``fit`` refuses, before anything is written, a warm-up whose bags would not fit ``engine.host_memory`` (ResNet-50's
2,048 channels at 64 px patches: 20 GB for one 100,000 px slide), naming the smallest ``patch`` that fits.

Kept only when it learnt: its last epoch's mean loss must be ``MIN_GAIN`` below the loss of a constant output at the
training set's class prior, else the head is put back as it was. Why (*measured*, docs/research/plateau.md section 6):
on seed 1 the warm-up's loss stayed at chance (0.6925 against 0.6931) while its classifier weights grew 5x fitting
noise, and end to end that head drove the trunk's ReLUs off (active features 35% -> 16% in 20 steps): a flat run.

Stopped on held-out bags (``hold_out``): a share of the training slides, per class, only scores the warm-up. After each
pass over the other bags the held-out bags' mean loss is taken; the head kept is the one with the lowest, the warm-up
ends after ``patience`` passes without a new lowest (or at ``steps``), and the keep rule reads the held-out loss against
a constant output at the fitted bags' class prior. Why (*measured*, docs/research/plateau.md section 16): 48,000 steps
on all 24 bags freed seeds 61-63, but on seed 64 the warm-up overfitted them (loss 0.86 -> 0.00) and that overconfident
head began end-to-end training at a loss of 1.9-2.7.

Laid out as the slide's map (``layout: map``): each patch's trunk map is kept cell by cell, not averaged, and put where
it lies in the slide's map (``host_cell_map``), so the head warms up on a (1, C, H / stride, W / stride) map pooled
under the same tissue mask and border rule as end to end; only the context across patch borders differs. Why
(*measured*, docs/research/plateau.md section 17): with ``hold_out`` on seed 64 the patch-vector head was right on its
held-out training bags too (loss 0.0005), yet end to end began at a loss of 3.1: the head had learnt averages of 16
cells over tissue and background alike, and met single cells over tissue only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.models.freeze import TRUNK  # the head is what follows it
from wsitrain.sft.ops.pool_mask import MaskSource
from wsitrain.train.attention_mask import masked_pool
from wsitrain.train.frozen_mil import patch_grid

# nats below the prior's loss the warm-up's last epoch must reach to be kept: the warm-ups that shortened the plateau
# ended 0.013-0.091 below ln 2, the one that flattened its run 0.0006 below (measured, docs/research/plateau.md section
# 6)
MIN_GAIN = 0.01
BATCH = 64  # patches per trunk forward on the device (frozen_mil's batch)
PATCHES, MAP = "patches", "map"  # train.head_warmup.layout: a vector per patch, or the slide's map cell by cell
LAYOUTS = (PATCHES, MAP)


def bag_bytes(shape: tuple[int, int], patch: int, channels: int, cell: int | None = None) -> int:
    """Host bytes of one slide's bag: its whole patches (ragged edges left out) x ``channels`` float32; with ``cell``
    (``layout: map``, the model's stride), its map's (H / cell) x (W / cell) cells instead, plus their 1-byte mask."""
    if cell is not None:
        return (shape[0] // cell) * (shape[1] // cell) * (channels * 4 + 1)
    return (shape[0] // patch) * (shape[1] // patch) * channels * 4


def bags_over_budget(
    shapes: list[tuple[int, int]], patch: int, channels: int, stride: int, host_budget: int, layout: str = PATCHES
) -> tuple[int, int | None] | None:
    """None when the bags of slides read at ``shapes`` fit ``host_budget``; else (their bytes, the smallest patch, a
    multiple of ``stride``, whose bags fit; None when none up to the largest read does, or with ``layout: map``, whose
    bags do not depend on the patch)."""
    cell = stride if layout == MAP else None
    need = sum(bag_bytes(s, patch, channels, cell) for s in shapes)
    if need <= host_budget:
        return None
    if cell is not None:
        return need, None
    p = -(-patch // stride) * stride
    while p < max(max(s) for s in shapes):
        p += stride
        if sum(bag_bytes(s, p, channels) for s in shapes) <= host_budget:
            return need, p
    return need, None


def trunk_channels(model: nn.Sequential, patch: int) -> int:
    """The trunk's output channels: one zero patch through it (no autograd)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        was = model.training
        model.eval()
        c = int(model.features(model.normalize(torch.zeros(1, 3, patch, patch, device=device))).shape[1])
        model.train(was)
    return c


@torch.no_grad()
def _trunk_maps(model: nn.Sequential, image: torch.Tensor, patch: int,
                device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:  # fmt: skip
    """(patch row, its first patch column, (b, C, h, w) trunk maps on the host) for every whole ``patch`` px patch of
    ``image`` ((1, 3, H, W) uint8 or float in [0, 1], anywhere), row-major: each row of patches is cut from ``image``
    where it lies and goes to ``device`` ``BATCH`` patches at a time (uint8 as float in [0, 1]; a float slide keeps
    its dtype), so neither the slide nor its float copy is ever made on the device."""
    if image.shape[2] // patch == 0 or image.shape[3] // patch == 0:
        raise ValueError(f"image {tuple(image.shape[2:])} is smaller than one {patch} px patch")
    trunk = nn.Sequential(model.normalize, model.features).eval()
    for r in range(image.shape[2] // patch):
        strip = image[:, :, r * patch : (r + 1) * patch, :]  # (1, 3, patch, W): one row of patches
        patches, _ = patch_grid(strip, patch)  # (cols, 3, patch, patch), a copy of the strip only
        for i in range(0, len(patches), BATCH):
            x = patches[i : i + BATCH].to(device)
            yield r, i, trunk(x.float() / 255 if x.dtype == torch.uint8 else x).cpu()


def host_patch_features(model: nn.Sequential, image: torch.Tensor, patch: int, device: torch.device) -> torch.Tensor:
    """(1, 3, H, W) uint8 or float in [0, 1], anywhere -> (N, C) float32 on the host, in ``patch_grid``'s row-major
    order: each whole patch's trunk map averaged (``_trunk_maps``)."""
    return torch.cat([y.mean(dim=(2, 3)).float() for _, _, y in _trunk_maps(model, image, patch, device)])


def host_cell_map(model: nn.Sequential, image: torch.Tensor, patch: int, device: torch.device,
                  tissue: MaskSource | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(1, 3, H, W) uint8 or float in [0, 1], anywhere -> ((1, C, H / s, W / s) float, (1, 1, H / s, W / s) bool)
    on the host, s the model's stride: every whole ``patch`` px patch goes through the trunk alone (``_trunk_maps``)
    and its (patch / s)^2 cells are put where they lie in the slide's map. The mask holds the cells that a whole patch
    covered and that ``tissue`` (``ReadResult.map_mask``: the mask end-to-end training pools under) keeps."""
    stride = int(model.stride)
    if patch % stride:
        raise ValueError(f"patch {patch} px is not a multiple of the model's stride ({stride} px)")
    k = patch // stride
    h, w = image.shape[2] // stride, image.shape[3] // stride
    out: torch.Tensor | None = None
    for r, c0, y in _trunk_maps(model, image, patch, device):  # y: (b, C, k, k)
        if tuple(y.shape[2:]) != (k, k):
            raise ValueError(f"a {patch} px patch gives a {tuple(y.shape[2:])} map, not {k} x {k} cells")
        if out is None:
            out = torch.zeros(1, y.shape[1], h, w, dtype=y.dtype)
        for j, cells in enumerate(y):
            c = c0 + j
            out[0, :, r * k : (r + 1) * k, c * k : (c + 1) * k] = cells
    assert out is not None
    mask = torch.zeros(1, 1, h, w, dtype=torch.bool)
    mask[..., : (image.shape[2] // patch) * k, : (image.shape[3] // patch) * k] = True
    keep = tissue(h, w) if callable(tissue) else tissue
    if keep is not None:
        mask &= keep.to(torch.bool).cpu()
    return out, mask


@dataclass
class WarmupResult:
    """What the warm-up did: steps, the mean loss of its first and last epoch over the bags, wall seconds."""

    steps: int = 0
    slides: int = 0
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    wall_s: float = 0.0
    losses: list[float] = field(default_factory=list)
    prior_loss: float = float("nan")  # a constant output at the class prior, on the bags the keep rule reads
    kept: bool = False  # False: it did not learn (MIN_GAIN), and the head was put back as it was
    held_out: int = 0  # slides whose bags only scored the warm-up (hold_out)
    held_out_losses: list[float] = field(default_factory=list)  # their mean loss after each pass
    best_step: int = 0  # the step of the head kept (hold_out: its lowest held-out loss; else the last)

    @property
    def held_out_loss(self) -> float:
        """The lowest held-out loss (nan without ``hold_out``)."""
        return min(self.held_out_losses) if self.held_out_losses else float("nan")

    def summary(self) -> str:
        read = "held-out loss" if self.held_out else "loss"
        what = "kept" if self.kept else f"not kept: not {MIN_GAIN} below the prior's {read} {self.prior_loss:.3f}"
        held = (f"; lowest held-out loss {self.held_out_loss:.3f} ({self.held_out} slides) at step {self.best_step}"
                if self.held_out else "")  # fmt: skip
        return (f"head warm-up: {self.steps} head-only steps on {self.slides - self.held_out} slides' patch features, "
                f"loss {self.first_loss:.3f} -> {self.last_loss:.3f}{held}, {self.wall_s:.1f} s; {what}")  # fmt: skip


def prior_loss(labels: list[int], scored: list[int] | None = None) -> float:
    """Cross-entropy on ``scored`` (default: ``labels`` themselves, where it is their entropy: the best constant
    output's loss) of the constant output at ``labels``' class frequencies."""
    scored = labels if scored is None else scored
    p = np.bincount(labels, minlength=max(scored) + 1) / len(labels)
    return float(-np.log(p[scored]).mean())


def split_held_out(labels: list[int], share: float, seed: int) -> tuple[list[int], list[int]]:
    """(fitted, held-out) slide indices: ``round(share * n)`` of each class's ``n`` slides held out (at least one),
    drawn with ``seed``; raises ValueError when a class would be left with none on either side."""
    rng = np.random.default_rng(seed)
    fit: list[int] = []
    held: list[int] = []
    for c in sorted(set(labels)):
        idx = [i for i, y in enumerate(labels) if y == c]
        k = max(1, round(share * len(idx)))
        if k >= len(idx):
            raise ValueError(f"class {c} has {len(idx)} training slide{'s' * (len(idx) != 1)}: holding out "
                             f"{share:g} of them leaves none to fit")  # fmt: skip
        perm = rng.permutation(idx).tolist()
        held += perm[:k]
        fit += perm[k:]
    return sorted(fit), sorted(held)


def head_modules(model: nn.Sequential) -> list[nn.Module]:
    """The modules after the trunk (``features``), in order: attention (if any), pool, flatten, classifier."""
    names = [n for n, _ in model.named_children()]
    if TRUNK not in names:
        raise ValueError(f"train.head_warmup needs a wsitrain model (normalize -> features -> head); got {names}")
    return [m for n, m in list(model.named_children())[names.index(TRUNK) + 1 :]]


@dataclass(frozen=True)
class Bag:
    """One training slide's warm-up input on the host: (N, C) patch vectors (``layout: patches``), or a (1, C, h, w)
    map of cells with the (1, 1, h, w) mask the head pools under (``layout: map``)."""

    x: torch.Tensor
    mask: torch.Tensor | None = None


def bag_logits(head: list[nn.Module], bag: Bag) -> torch.Tensor:
    """One slide's bag -> (1, outputs) through the head: (N, C) patch vectors laid out as a (1, C, N, 1) map, or a
    map pooled under its mask (where the head's pool is maskable, as end to end)."""
    x = bag.x.t()[None, :, :, None] if bag.x.dim() == 2 else bag.x
    block: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if bag.mask is not None and (pool := masked_pool(nn.ModuleList(head))) is not None:
        block = pool.masked(bag.mask.to(x.device))
    with block:
        for m in head:
            x = m(x)
    return x


def _on(bag: Bag, device: torch.device) -> Bag:
    return Bag(bag.x.to(device), None if bag.mask is None else bag.mask.to(device))


def _mean_loss(head: list[nn.Module], bags: list[Bag], labels: list[int], device: torch.device) -> float:
    """The head's mean cross-entropy over ``bags`` in eval mode (no autograd), one bag on the device at a time."""
    was = [m.training for m in head]
    for m in head:
        m.eval()
    with torch.no_grad():
        losses = [float(F.cross_entropy(bag_logits(head, _on(b, device)).float(), torch.tensor([y], device=device)))
                  for b, y in zip(bags, labels, strict=True)]  # fmt: skip
    for m, w in zip(head, was, strict=True):
        m.train(w)
    return float(np.mean(losses))


def warm_up_head(model: nn.Sequential, images: Iterable[torch.Tensor | tuple[torch.Tensor, MaskSource | None]],
                 labels: list[int], *, steps: int, patch: int, lr: float, seed: int, hold_out: float = 0.0,
                 patience: int = 200, layout: str = PATCHES) -> WarmupResult:  # fmt: skip
    """Train ``model``'s head for up to ``steps`` AdamW steps at ``lr`` on bags of ``images`` ((1, 3, H, W) uint8 or
    float in [0, 1], one per label, each alone or with the tissue mask end-to-end training pools it under): a vector
    per patch, or with ``layout: map`` the slide's map cell by cell (``host_cell_map``). The trunk's parameters are
    not changed. With ``hold_out``, that share of each class's slides only scores it: the head kept is the one with
    their lowest mean loss, and training stops after ``patience`` passes without a new lowest."""
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    bags: list[Bag] = []  # on the host
    for item in images:
        image, tissue = item if isinstance(item, tuple) else (item, None)
        if layout == MAP:
            bags.append(Bag(*host_cell_map(model, image, patch, device, tissue)))  # (1, C, h, w), (1, 1, h, w)
        else:
            bags.append(Bag(host_patch_features(model, image, patch, device)))  # (N, C)
    fit, held = split_held_out(labels, hold_out, seed) if hold_out > 0 else (list(range(len(bags))), [])
    head = head_modules(model)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in head]
    best = before
    params = [p for m in head for p in m.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    rng = np.random.default_rng(seed)
    result = WarmupResult(slides=len(bags), held_out=len(held))
    for m in head:
        m.train()
    epoch_losses: list[float] = []
    since_best = 0
    while result.steps < steps and since_best < patience:
        for i in rng.permutation(fit).tolist():
            if result.steps == steps:
                break
            bag = _on(bags[i], device)  # one bag on the device at a time
            loss = F.cross_entropy(bag_logits(head, bag).float(), torch.tensor([labels[i]], device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            result.steps += 1
            epoch_losses.append(float(loss.detach()))
        result.losses.append(float(np.mean(epoch_losses)))
        epoch_losses = []
        if held:
            result.held_out_losses.append(_mean_loss(head, [bags[i] for i in held], [labels[i] for i in held], device))
            if result.held_out_losses[-1] == result.held_out_loss:  # a new lowest: this head is the one kept
                best = [{k: v.clone() for k, v in m.state_dict().items()} for m in head]
                result.best_step, since_best = result.steps, 0
            else:
                since_best += 1
    for p in params:
        p.grad = None
    model.train(was_training)
    result.first_loss, result.last_loss = result.losses[0], result.losses[-1]
    if held:
        result.prior_loss = prior_loss([labels[i] for i in fit], [labels[i] for i in held])
        result.kept = result.held_out_loss < result.prior_loss - MIN_GAIN
        keep = best if result.kept else before
    else:
        result.best_step = result.steps
        result.prior_loss = prior_loss(labels)
        result.kept = result.last_loss < result.prior_loss - MIN_GAIN
        keep = None if result.kept else before
    if keep is not None:
        for m, state in zip(head, keep, strict=True):
            m.load_state_dict(state)
    result.wall_s = time.perf_counter() - t0
    return result
