"""What makes the near-constant-output plateau: a small, cheap probe (docs/research/plateau.md).

    python research/plateau_probe.py --out /tmp/probe.jsonl --variants torch_init,he_init --pools max,attention

Trains wsitrain's ``tiny`` model (``wsitrain.models.zoo.build``, the same layers ``fit`` trains) with plain autograd
(no SFT engine, no data loader: the slides are small enough to hold whole) on a ``synth --lesions small`` cohort,
one slide per step, AdamW, and logs per epoch: the mean train loss, the spread (std) of p(positive) over the training
slides as seen in training, the held-out loss, AUC and spread, and for attention pools the attention mass on the
lesion boxes of held-out positives and the pointing game (hits on positives with a look-alike, and without). Each
variant changes one thing against ``torch_init`` (PyTorch's default layer init, what ``tiny`` has) so the plateau's
length can be compared variant by variant. Every figure it prints is *measured* on the machine that runs it.
``--device cuda`` trains the same runs on a GPU; ``--save DIR`` keeps each run's weights and ``--rescore FILE`` reads
one back: per structure kind on the held-out slides, the attention score and the classifier's per-cell evidence
(``structure_scores``; attention runs also log them at their end).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wsitrain.models import zoo
from wsitrain.models.attention import AttentionPool, BranchClassifier, feature_mask
from wsitrain.models.heads import AttentionSpec
from wsitrain.sft.ops.topk_pool import MaskedTopKMean
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.slides.synth.lesions import LESION_MODES, read_sidecar
from wsitrain.slides.tissue.detect import tissue_mask

# The plateau ends at the first epoch whose mean training loss is <= 0.6 (chance is ln 2 = 0.693; on the plateau it
# stays 0.68-0.72, measured, docs/research/plateau.md). Not the spread of p: a large init starts with a spread it has
# not learnt.
PLATEAU_LOSS = 0.6
VARIANTS = (
    "torch_init",
    "he_init",
    "he_zero_head",
    "lr3e-3",
    "zero_head",
    "balanced_sampling",
    "accumulate2",
    "accumulate4",
    "head_lr10x",
    "topk4",
    "topk16",
    "topk64",
    "inst_aux",
    "score_mil",
    "head_warmup",
    "head_warmup_patch",
    "null_slot",
    "null_slot_low",
    "positive_attention",
    "evidence_attention",
    "evidence_attention_t01",
    "he_evidence_attention",
    "evidence_max",
    "evidence_standardised",
    "he_evidence_max",
    "evidence_max_lr3e-3",
    "max_then_evidence",
    "he_max_then_evidence",
    "max_plus_instance",
    "he_max_plus_instance",
    "max_plus_evidence",
    "he_max_plus_evidence",
    "he_max_plus_instance_loss",
    "max_plus_instance_loss",
    "he_max_to_evidence",
    "he_topk_evidence",
    "attention_nonneg",
    "max_nonneg",
    "he_max_nonneg",
    "max_nonneg_lr3e-3",
    "score_mil_negk",
    "score_mil_negk_t4",
    "mb_torch_init",
    "mb_score_mil_negk",
    "mb_score_mil_negk_bias",
    "mb_score_mil_lme",
    "mb_score_mil_negk_sum",
    "mb_score_mil",
    "mb_score_mil_posk16",
    "score_mil_lme",
    "he_max_refit_evidence",
    "max_refit_evidence",
)
# he_max_to_evidence: the slide logit moves from per-channel max pooling to the max-instance head, linearly over these
# 0-based epochs, mix 0 at the first and 1 from the second on (the classifier shared), instead of switching at once
# (max_then_evidence fell back at the switch)
RAMP_EPOCHS = (3, 9)
# he_topk_evidence: the slide's logit difference is the mean of its k most positive cells' (a lesion is ~25 cells)
TOPK_EVIDENCE = 16
# max_then_evidence: epochs of per-channel max pooling (which leaves the plateau first, section 6) before the
# max-instance head takes over, with the trunk and classifier it reached
SWITCH_EPOCH = 6
# inst_aux: CLAM's bag / instance weighting (bag loss 0.7, instance loss 0.3) and the instance positions per slide
INST_WEIGHT, INST_K = 0.3, 8
# score_mil: the attention scores read as instance logits as well, their maximum pushed towards the slide's label (max-
# pooling MIL on the scores: a softmax ignores the scores' level, so this only adds what a level means); its weight
SCORE_MIL_WEIGHT = 0.5
# score_mil_negk: the same, but a negative slide's k highest scores are all pushed below 0 (every cell of a negative
# slide is negative, the MIL assumption): 64 cells are about two of its 1-3 look-alikes (boxes of 88 px, 6 x 6 cells
# at tiny's stride 16)
SCORE_NEG_K = 64
# _sum: a negative slide's k cells each weigh as much as a positive slide's top cell (their BCEs summed, not averaged:
# mb_score_mil_negk's seed 1 kept its top cell on the image edge, every slide's, pushed up on positives 64 times harder
# per cell than down on negatives); posk16: a positive slide's 16 highest cells pushed up, averaged
MIL_POSITIVE_K = 16
# score_mil_negk_t4: the same, the softmax over 4 x the scores, so scores the BCE leaves a few logits apart (lesion
# above 0, tissue and look-alikes below) still concentrate the pooled feature on the lesion (score_mil_negk's
# attention pointed at the lesions from epoch 5 on seed 0 but held 1-7% of its mass there, measured)
SCORE_SHARPNESS = 4.0
# mb_*: one attention branch per class (CLAM-MB, model.attention.branches: per_class). The probe's maps (pointing, mass,
# structure scores) and mb_score_mil_negk's instance loss read the positive class's branch: the negative class's branch
# stays free to find the look-alikes (the fast way off the plateau, section 9), the positive one is asked to rank the
# lesions first. _bias: the instance logits are the scores plus a learnt bias (the attention layers have none, a softmax
# being shift-invariant), so the loss can lower every cell's logit at once without saturating the tanh layer
# (mb_score_mil_negk, seed 1: every score driven to about -3.3, lesions and look-alikes alike, and no way back)
# he_max_refit_evidence: at SWITCH_EPOCH the classifier is first fitted as the max-instance head on the frozen trunk's
# training maps (head-only AdamW steps, one slide each), so the hand-over starts from a head that fits the cells
# (max_then_evidence fell back at the switch: train loss 0.36-0.62 -> 0.75-0.89, H200, docs/research/plateau.md section
# 9)
REFIT_STEPS = 500
# the evidence heads' softmax temperature: 0 is a hard maximum (max-instance MIL), < 0 standardises the scores over
# the map and sharpens them by its absolute value (docs/research/plateau.md section 9)
EVIDENCE_TEMPERATURE = {
    "evidence_attention": 1.0,
    "he_evidence_attention": 1.0,
    "evidence_attention_t01": 0.1,
    "evidence_max": 0.0,
    "he_evidence_max": 0.0,
    "evidence_max_lr3e-3": 0.0,
    "evidence_standardised": -4.0,
}
# head_warmup: head-only AdamW steps on the frozen initial trunk's maps before end-to-end training (the frozen-feature
# baseline's head made 5,816 in its budget, docs/research/plateau.md section 5)
WARMUP_STEPS = 2000


def load_cohort(cohort: Path, n: int, size: int, crop: int | None = None, lesions: str = "small"
                ) -> tuple[list[torch.Tensor], list[int], list[str], dict[str, Any]]:  # fmt: skip
    """The cohort's level-0 images; with ``crop``, a ``crop`` px window around each slide's first structure (a
    lesion on positives, a look-alike distractor on negatives: no shortcut), its boxes moved into the window."""
    import openslide

    labels_csv = write_synthetic_dataset(cohort, n=n, size=size, seed=0, lesions=lesions)
    side = read_sidecar(cohort)["slides"]
    rows = list(csv.DictReader(labels_csv.open()))
    images, ys, names = [], [], []
    for r in rows:
        s = openslide.OpenSlide(str(cohort / r["slide"]))
        rgb = np.asarray(s.read_region((0, 0), 0, s.dimensions).convert("RGB"))
        if crop is not None:
            rgb = _crop(rgb, crop, side[r["slide"]])
        images.append(torch.from_numpy(rgb.copy()).permute(2, 0, 1)[None])  # (1, 3, H, W) uint8
        ys.append(int(r["label"] == "positive"))
        names.append(r["slide"])
    return images, ys, names, side


def _crop(rgb: np.ndarray, crop: int, entry: dict[str, Any]) -> np.ndarray:
    first = sorted(entry["boxes"], key=lambda b: b["kind"] != "lesion")[0]
    cx, cy = (first["x0"] + first["x1"]) // 2, (first["y0"] + first["y1"]) // 2
    x0 = int(np.clip(cx - crop // 2, 0, rgb.shape[1] - crop))
    y0 = int(np.clip(cy - crop // 2, 0, rgb.shape[0] - crop))
    entry["boxes"] = [{**b, "x0": b["x0"] - x0, "x1": b["x1"] - x0, "y0": b["y0"] - y0, "y1": b["y1"] - y0}
                      for b in entry["boxes"]]  # fmt: skip
    return rgb[y0 : y0 + crop, x0 : x0 + crop]


def he_init(trunk: nn.Module) -> None:
    """He (fan-in, ReLU) init for every convolution, zero biases: the trunk's output keeps the input's scale."""
    for m in trunk.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            nn.init.zeros_(m.bias)


def cell_evidence(weight: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """A two-class classifier's evidence for class 1 at each cell, ``(w_1 - w_0) . h``: (B, C, H, W) -> (B, 1, H, W)."""
    return torch.einsum("c,bchw->bhw", weight[1] - weight[0], feats)[:, None]


def linear_of(classifier: nn.Module) -> nn.Module:
    """The Linear whose ``weight`` (2, C) scores the features: the classifier, or the one CLAM-MB's head wraps."""
    return classifier.classifier if isinstance(classifier, BranchClassifier) else classifier


def top_cells(e: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Weights (B, 1, H, W) that put 1/k on each of the k largest cells of ``e`` (B, 1, H, W), 0 elsewhere."""
    f = e.flatten(2)
    return torch.zeros_like(f).scatter_(2, f.topk(k, 2).indices, 1.0 / k).view_as(e)


class NullSlotPool(AttentionPool):
    """Attention with one more place to look: a learnt "nothing here" slot, score ``b + log n`` (n: the map's
    positions, so its share does not shrink with the slide) and value ``v`` (C,), beside the map's positions."""

    def __init__(self, channels: int, init_score: float) -> None:
        super().__init__(1)
        self.null_score = nn.Parameter(torch.tensor(float(init_score)))
        self.null_value = nn.Parameter(torch.zeros(channels))

    def _all_scores(self, hs: torch.Tensor) -> torch.Tensor:
        s = hs[:, -1:].flatten(2)  # (B, 1, N)
        null = (self.null_score + math.log(s.shape[-1])).expand(s.shape[0], 1, 1)
        return torch.softmax(torch.cat([s, null], -1), -1)  # (B, 1, N + 1)

    def weights(self, hs: torch.Tensor) -> torch.Tensor:
        return self._all_scores(hs)[..., :-1].view_as(hs[:, -1:])  # (B, 1, H, W): the map's share

    def forward(self, hs: torch.Tensor) -> torch.Tensor:
        a = self._all_scores(hs)  # (B, 1, N + 1)
        z = torch.einsum("bkn,bcn->bkc", a[..., :-1], hs[:, :-1].flatten(2))
        return z + a[..., -1:] * self.null_value  # (B, 1, C)


class SharpAttentionPool(AttentionPool):
    """ABMIL with the softmax over ``sharpness`` times the scores (the scores themselves stay what the layers give)."""

    def __init__(self, sharpness: float) -> None:
        super().__init__(1)
        self.sharpness = sharpness

    def weights(self, hs: torch.Tensor) -> torch.Tensor:
        return super().weights(torch.cat([hs[:, :-1], self.sharpness * hs[:, -1:]], 1))


class EvidencePool(AttentionPool):
    """Attention whose score is the classifier's own evidence for the positive class at each position
    (``(w_1 - w_0) . h_p``): the softmax then weights the positions the classifier finds most positive, a smooth
    maximum of the per-position logits, so only positive evidence can raise a slide's score."""

    def __init__(self, classifier: nn.Module, temperature: float = 1.0) -> None:
        super().__init__(1)
        self._classifier = (classifier,)  # not a submodule: the model holds it already
        self.temperature = temperature

    def weights(self, hs: torch.Tensor) -> torch.Tensor:
        s = cell_evidence(self._classifier[0].weight, hs[:, :-1])  # (B, 1, H, W)
        if self.temperature == 0:  # a hard maximum: all weight on the most positive position
            return top_cells(s)
        if self.temperature < 0:  # scores standardised over the map, then sharpened by -temperature
            f = s.flatten(2)
            return torch.softmax(-self.temperature * (f - f.mean(-1, keepdim=True)) / (f.std(-1, keepdim=True) + 1e-6),
                                 -1).view_as(s)  # fmt: skip
        return torch.softmax(s.flatten(2) / self.temperature, -1).view_as(s)


class ChannelMaxPool(AttentionPool):
    """Max pooling of each feature channel on the attention model's map (its score channel unused), so a run can
    start as max pooling and hand the same trunk and classifier to another pool; its ``weights`` (for the probe's
    logs) are the hard maximum of the classifier's per-cell evidence."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__(1)
        self._classifier = (classifier,)  # not a submodule: the model holds it already

    def weights(self, hs: torch.Tensor) -> torch.Tensor:
        return top_cells(cell_evidence(self._classifier[0].weight, hs[:, :-1]))

    def forward(self, hs: torch.Tensor) -> torch.Tensor:
        return hs[:, :-1].amax((2, 3))[:, None]  # (B, 1, C)


class MaxPlusInstancePool(AttentionPool):
    """Per-channel max pooling and a max-instance head side by side: (B, C + K, H, W) -> (B, 1, C + 1), the channels'
    maxima and the highest per-cell instance logit ``e_p``, which ``MixedClassifier`` adds to the positive class.
    ``e_p`` is its own 1x1 layer on the features (``tied=False``) or the classifier's evidence ``(w_1 - w_0) . h_p``
    (``tied=True``); ``weights`` (the map the probe's pointing game reads) is the hard maximum of ``e``."""

    def __init__(self, channels: int, classifier: nn.Linear, tied: bool) -> None:
        super().__init__(1)
        self.instance = None if tied else nn.Conv2d(channels, 1, 1)
        self._classifier = (classifier,)  # not a submodule: the model holds it already

    def _instance(self, hs: torch.Tensor) -> torch.Tensor:
        h = hs[:, :-1]  # (B, C, H, W)
        return self.instance(h) if self.instance is not None else cell_evidence(self._classifier[0].weight, h)

    def weights(self, hs: torch.Tensor) -> torch.Tensor:
        return top_cells(self._instance(hs))

    def forward(self, hs: torch.Tensor) -> torch.Tensor:
        top = self._instance(hs).amax((2, 3))  # (B, 1)
        return torch.cat([hs[:, :-1].amax((2, 3)), top], 1)[:, None]  # (B, 1, C + 1)


class MixedClassifier(nn.Module):
    """(B, C + 1) -> (B, 2): the classifier on the C pooled maxima, plus the top instance logit on class 1."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        logits = self.linear(z[:, :-1])
        return logits + torch.cat([torch.zeros_like(z[:, -1:]), z[:, -1:]], 1)


class MaxToEvidencePool(AttentionPool):
    """(B, C + K, H, W) -> (B, 1, C + 1): the channels' maxima and the classifier's top cell evidence (or the mean of
    its ``k`` top cells), mixed by ``RampClassifier``: ``(1 - mix)`` max pooling's logits plus ``mix`` times the
    max-instance head's. ``weights``: the hard maximum (or the top ``k``, evenly) of the evidence."""

    def __init__(self, classifier: nn.Linear, k: int = 1) -> None:
        super().__init__(1)
        self._classifier = (classifier,)
        self.k = k

    def weights(self, hs: torch.Tensor) -> torch.Tensor:
        return top_cells(cell_evidence(self._classifier[0].weight, hs[:, :-1]), self.k)

    def forward(self, hs: torch.Tensor) -> torch.Tensor:
        e = cell_evidence(self._classifier[0].weight, hs[:, :-1]).flatten(1)  # (B, N)
        top = e.topk(self.k, 1).values.mean(1, keepdim=True)  # (B, 1)
        return torch.cat([hs[:, :-1].amax((2, 3)), top], 1)[:, None]  # (B, 1, C + 1)


class RampClassifier(nn.Module):
    """(B, C + 1) -> (B, 2): ``(1 - mix) * linear(maxima) + mix * (b + [0, top evidence])``."""

    def __init__(self, linear: nn.Linear, mix: float) -> None:
        super().__init__()
        self.linear, self.mix = linear, mix

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        pooled = self.linear(z[:, :-1])
        instance = self.linear.bias + torch.cat([torch.zeros_like(z[:, -1:]), z[:, -1:]], 1)
        return (1 - self.mix) * pooled + self.mix * instance


class NonNegativeClassifier(nn.Module):
    """Two classes, where only evidence *for* class 1 exists: logits ``[0, |v| . z + b]`` (the MIL standard assumption:
    a feature can raise the positive class, none can vouch for the negative one, so a look-alike cannot be the
    negatives' evidence). ``v`` starts as the built Linear's ``w_1 - w_0``, ``b`` as ``b_1 - b_0``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.v = nn.Parameter((linear.weight[1] - linear.weight[0]).detach().clone())
        self.b = nn.Parameter((linear.bias[1] - linear.bias[0]).detach().clone())

    @property
    def weight(self) -> torch.Tensor:
        """(2, C), as a Linear's: class 0's row is zero."""
        return torch.stack([torch.zeros_like(self.v), self.v.abs()])

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        pos = z @ self.v.abs() + self.b  # (B,)
        return torch.stack([torch.zeros_like(pos), pos], 1)


def make_model(pool: str, variant: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    attention = AttentionSpec(per_class=True) if variant.startswith("mb_") else None
    model = zoo.build("tiny", 2, pool=pool, attention=attention)  # tiny's layers keep PyTorch's default init
    if variant.endswith(("_bias", "_lme")):
        model.instance_bias = nn.Parameter(torch.zeros(()))  # an attribute, not a layer: the model's forward skips it
    if variant.startswith("he_"):
        he_init(model.features)
    if variant in ("zero_head", "he_zero_head"):
        nn.init.zeros_(model.classifier.weight)
        nn.init.zeros_(model.classifier.bias)
    if variant.startswith("topk"):  # the global pool replaced by the top-k mean (model.pool: topk, model.topk)
        if pool in zoo.ATTENTION_POOLS:
            raise SystemExit(f"--variants {variant} replaces a max or avg pool, not {pool}")
        model.pool = MaskedTopKMean(int(variant[len("topk") :]))
    if "_nonneg" in variant:
        model.classifier = NonNegativeClassifier(model.classifier)
        if "max_nonneg" in variant:  # per-channel max pooling on the attention model's map; pointing: its top cell
            model.pool = ChannelMaxPool(model.classifier)
    if variant in ("he_max_to_evidence", "he_topk_evidence"):
        linear = model.classifier
        model.pool = MaxToEvidencePool(linear, TOPK_EVIDENCE if variant == "he_topk_evidence" else 1)
        model.classifier = RampClassifier(linear, 1.0 if variant == "he_topk_evidence" else 0.0)
    if "max_plus_" in variant:
        linear = model.classifier
        model.pool = MaxPlusInstancePool(model.attention.out_channels, linear, tied="evidence" in variant)
        model.classifier = MixedClassifier(linear)
    if variant.endswith(("max_then_evidence", "max_refit_evidence")):
        model.pool = ChannelMaxPool(model.classifier)
    if variant in EVIDENCE_TEMPERATURE:
        model.pool = EvidencePool(model.classifier, EVIDENCE_TEMPERATURE[variant])
    if variant == "score_mil_negk_t4":
        model.pool = SharpAttentionPool(SCORE_SHARPNESS)
    if variant.startswith("null_slot"):  # at init the slot holds half (null_slot) or a tenth (_low) of the mass
        model.pool = NullSlotPool(model.attention.out_channels, 0.0 if variant == "null_slot" else -math.log(9))
    return model


def warm_up_head(model: nn.Module, images: list[torch.Tensor], ys: list[int], train: list[int], lr: float,
                 rng: np.random.Generator, steps: int = WARMUP_STEPS) -> dict[str, float]:  # fmt: skip
    """Train only the head (everything after ``features``) on the initial trunk's maps of the training slides, one
    slide and a random quarter turn per step; the trunk is untouched. Returns its loss and wall time."""
    t0 = time.perf_counter()
    with torch.no_grad():
        maps = [model[:2](images[i].float() / 255) for i in train]  # (1, C, h, w) each
    head = model[2:]
    opt = torch.optim.AdamW(head.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        j = int(rng.integers(len(train)))
        logits = head(torch.rot90(maps[j], int(rng.integers(4)), (2, 3)))
        loss = F.cross_entropy(logits, torch.tensor([ys[train[j]]], device=logits.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"warmup_steps": steps, "warmup_last100_loss": round(float(np.mean(losses[-100:])), 4),
            "warmup_wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def warm_up_head_on_patches(model: nn.Module, images: list[torch.Tensor], ys: list[int], train: list[int], lr: float,
                            seed: int, steps: int = WARMUP_STEPS, patch: int = 64) -> dict[str, float]:  # fmt: skip
    """The same, on bags of ``patch`` px patch vectors (the frozen-feature baseline's features: each patch through the
    initial trunk alone, its map averaged): ``train.head_warmup`` itself (wsitrain.train.head_warmup)."""
    from wsitrain.train.head_warmup import warm_up_head as fit_warm_up

    res = fit_warm_up(model, [images[i] for i in train], [ys[i] for i in train], steps=steps, patch=patch, lr=lr,
                      seed=seed)  # fmt: skip
    return {"warmup_steps": res.steps, "warmup_last_epoch_loss": round(res.last_loss, 4), "warmup_kept": res.kept,
            "warmup_wall_s": round(res.wall_s, 1)}  # fmt: skip


def forward_with_instances(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slide's logits (1, 2) and its per-position logit map (1, 2, h, w): the classifier on each position's
    features (attention: the attended features ``h``), as the CAM path computes it."""
    trunk_end = 3 if "attention" in model._modules else 2
    f = model[:trunk_end](x)  # (1, C [+ K], h, w)
    h = f[:, : -model.pool.branches] if trunk_end == 3 else f
    w, b = model.classifier.weight, model.classifier.bias
    cam = torch.einsum("kc,bchw->bkhw", w, h) + b[None, :, None, None]  # (1, 2, h, w)
    return model[trunk_end:](f), cam


def instance_loss(cam: torch.Tensor, y: int, k: int = INST_K) -> torch.Tensor:
    """CLAM-style instance loss on the per-position logit map: a positive slide's k highest positions (by the positive
    class's margin) pushed to positive and its k lowest to negative; a negative slide's k highest to negative."""
    margin = (cam[0, 1] - cam[0, 0]).flatten()  # (h * w,)
    top = margin.topk(k).values
    if not y:
        return F.binary_cross_entropy_with_logits(top, torch.zeros_like(top))
    bottom = (-margin).topk(k).values.neg()
    z = torch.cat([top, bottom])
    return F.binary_cross_entropy_with_logits(z, torch.cat([torch.ones_like(top), torch.zeros_like(bottom)]))


def masked_scores(model: nn.Module, hs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The last attention branch's scores (1, N), -inf where its pool's mask leaves a cell out; how many it keeps."""
    s = hs[:, -1:]  # (1, 1, h, w)
    mask = model.pool.mask_at(s.shape[-2], s.shape[-1])
    if mask is None:
        return s.flatten(1), s[0, 0].numel()
    return s.masked_fill(~mask, float("-inf")).flatten(1), int(mask.sum())


def score_mil_loss(model: nn.Module, x: torch.Tensor, y: int, neg_k: int = 1, pos_k: int = 1, neg_sum: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The slide's logits (1, 2) and the max-instance loss of its attention scores: BCE(max_p s_p, y); on a negative
    slide, the mean BCE of its ``neg_k`` highest scores against 0."""
    hs = model[:3](x)  # normalize, features, attention: (1, C + 1, h, w)
    s, keep = masked_scores(model, hs)  # (1, N), the cells the pool attends to
    top = s.topk(min(pos_k if y else neg_k, keep), 1).values  # (1, k): the highest scores on the map
    if hasattr(model, "instance_bias"):
        top = top + model.instance_bias
    reduction = "sum" if neg_sum and not y else "mean"
    return model[3:](hs), F.binary_cross_entropy_with_logits(top, torch.full_like(top, float(y)), reduction=reduction)


def score_lme_loss(model: nn.Module, x: torch.Tensor, y: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slide's logits (1, 2) and BCE(log-mean-exp of the (positive class's) attention scores + a learnt bias, y):
    a smooth maximum whose gradient on each cell is that cell's attention weight, so the online softmax the engine
    fuses already holds it (``m + log(d / n)``)."""
    hs = model[:3](x)  # normalize, features, attention: (1, C + K, h, w)
    s, keep = masked_scores(model, hs)  # (1, N), the cells the pool attends to
    lme = torch.logsumexp(s, 1) - math.log(keep) + model.instance_bias  # (1,)
    return model[3:](hs), F.binary_cross_entropy_with_logits(lme, torch.full_like(lme, float(y)))


def refit_max_instance(model: nn.Module, images: list[torch.Tensor], ys: list[int], train: list[int], lr: float,
                       rng: np.random.Generator, steps: int = REFIT_STEPS) -> dict[str, float]:  # fmt: skip
    """Fit the classifier alone as the max-instance head (slide logit difference = its most positive cell's) on the
    frozen trunk's maps of the training slides, one slide and a random quarter turn per step."""
    with torch.no_grad():
        maps = [model[:3](images[i].float() / 255) for i in train]  # (1, C + 1, h, w) each
    pool = EvidencePool(model.classifier, 0.0)
    opt = torch.optim.AdamW(model.classifier.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        j = int(rng.integers(len(train)))
        hs = torch.rot90(maps[j], int(rng.integers(4)), (2, 3))
        logits = model.classifier(pool(hs).flatten(1))
        loss = F.cross_entropy(logits, torch.tensor([ys[train[j]]], device=logits.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"refit_first100_loss": round(float(np.mean(losses[:100])), 4),
            "refit_last100_loss": round(float(np.mean(losses[-100:])), 4)}  # fmt: skip


def pointing(model: nn.Module, x: torch.Tensor, boxes: list[dict[str, Any]]) -> bool:
    """Whether the highest attention cell lies in a lesion box (the pointing game, as the benchmark scores it)."""
    hs = model[:3](x)
    a = model.pool.weights(hs)[0, -1]  # (h, w): the positive class's branch with one per class
    r, c = divmod(int(a.flatten().argmax()), a.shape[1])
    s = model.stride
    return any(b["kind"] == "lesion" and b["y0"] // s <= r < -(-b["y1"] // s) and b["x0"] // s <= c < -(-b["x1"] // s)
               for b in boxes)  # fmt: skip


def structure_scores(model: nn.Module, x: torch.Tensor, boxes: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per structure kind, each box's highest attention score (before the softmax) and highest positive-class
    evidence ``(w_1 - w_0) . h`` of the classifier on a cell's features, and the same two at the 99th percentile
    of the cells outside every box ("background"): what the attention and the classifier each rank first."""
    hs = model[:3](x)  # (1, C + 1, h, w)
    score, feats = hs[0, -1], hs[0, : -model.pool.branches]  # (h, w): the positive class's branch; (C, h, w)
    evidence = cell_evidence(linear_of(model.classifier).weight, feats[None])[0, 0]  # (h, w)
    s = model.stride
    outside = torch.ones_like(score, dtype=torch.bool)
    out: dict[str, list[float]] = {}
    for b in boxes:
        cells = (slice(b["y0"] // s, -(-b["y1"] // s)), slice(b["x0"] // s, -(-b["x1"] // s)))
        outside[cells] = False
        kind = "lesion" if b["kind"] == "lesion" else "look-alike"
        out.setdefault(f"{kind} score", []).append(float(score[cells].max()))
        out.setdefault(f"{kind} evidence", []).append(float(evidence[cells].max()))
    out["background score p99"] = [float(torch.quantile(score[outside], 0.99))]
    out["background evidence p99"] = [float(torch.quantile(evidence[outside], 0.99))]
    return out


def auc(y: list[int], p: list[float]) -> float:
    pos = [q for q, t in zip(p, y, strict=True) if t]
    neg = [q for q, t in zip(p, y, strict=True) if not t]
    wins = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def lesion_mass(model: nn.Module, x: torch.Tensor, boxes: list[dict[str, Any]]) -> float:
    hs = model[:3](x)  # normalize, features, attention: (1, C + 1, h, w)
    a = model.pool.weights(hs)[0, -1]  # (h, w), sums to 1: the positive class's branch with one per class
    stride = model.stride
    on = torch.zeros_like(a, dtype=torch.bool)
    for b in boxes:
        if b["kind"] == "lesion":
            on[b["y0"] // stride : -(-b["y1"] // stride), b["x0"] // stride : -(-b["x1"] // stride)] = True
    return float(a[on].sum())


def trunk_stats(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """How much of the trunk's output depends on the input at init: std over positions vs the mean level."""
    with torch.no_grad():
        f = model.features(model.normalize(x.float() / 255))  # (1, C, h, w)
    model.zero_grad()
    F.cross_entropy(model(x.float() / 255), torch.tensor([1], device=x.device)).backward()
    g_first = float(model.features.conv1.weight.grad.norm() / model.features.conv1.weight.norm())
    head = next(model.classifier.parameters())  # the Linear's weight (or the head's first parameter)
    g_head = float(head.grad.norm() / max(float(head.norm()), 1e-12))
    model.zero_grad()
    return {
        "feature_mean": float(f.mean()),
        "feature_std_over_positions": float(f.std(dim=(2, 3)).mean()),
        "conv1_relative_grad": g_first,
        "classifier_relative_grad": g_head,
    }


def train_split(ys: list[int], n_train: int, rng: np.random.Generator) -> list[int]:
    """The training slides, stratified (the rest are held out)."""
    idx_pos = [i for i, y in enumerate(ys) if y]
    idx_neg = [i for i, y in enumerate(ys) if not y]
    return sorted(rng.permutation(idx_pos)[: n_train // 2].tolist() + rng.permutation(idx_neg)[
        : n_train - n_train // 2].tolist())  # fmt: skip


def rescore(path: Path, variant: str, pool: str, seed: int, args: argparse.Namespace, data: tuple) -> dict[str, Any]:
    """A saved run's structure scores on its held-out slides, per kind: the median and the range over the boxes."""
    images, ys, names, side, _ = data
    train = train_split(ys, args.train, np.random.default_rng(seed))
    model = make_model(pool, variant, seed).to(images[0].device)
    model.load_state_dict(torch.load(path, weights_only=True, map_location=images[0].device))
    return {"model": str(path), "variant": variant, "seed": seed,
            "structures": held_out_structures(model, [i for i in range(len(ys)) if i not in train], data)}


def held_out_structures(model: nn.Module, held: list[int], data: tuple) -> dict[str, dict[str, float]]:
    """``structure_scores`` over the held-out slides, per key: the median and the range over the boxes."""
    images, _, names, side, masks = data
    model.eval()
    found: dict[str, list[float]] = {}
    with torch.no_grad():
        for i in held:
            set_mask(model, masks, i)
            for key, values in structure_scores(model, images[i].float() / 255, side[names[i]]["boxes"]).items():
                found.setdefault(key, []).extend(values)
    return {k: {"median": round(float(np.median(v)), 3), "min": round(min(v), 3), "max": round(max(v), 3), "n": len(v)}
            for k, v in sorted(found.items())}  # fmt: skip


def tissue_map_masks(images: list[torch.Tensor], stride: int, border: int = 0) -> list[torch.Tensor]:
    """Each slide's tissue at the map's cells, (1, 1, h, w) bool: wsitrain's own detection on the whole image
    (fragments of any size), a cell kept when any of its pixels is tissue, as ``fit`` masks the attention pool
    (``data.mask_background``, on by default): no cell off the tissue, such as the image corner, can be attended.
    ``border``: the map's outer ring this many cells deep is left out too (where the convolutions' zero padding
    shows: the same on every slide)."""
    out = []
    for x in images:  # (1, 3, H, W) uint8
        tissue, _ = tissue_mask(x[0].permute(1, 2, 0).cpu().numpy())
        hw = (x.shape[2] // stride, x.shape[3] // stride)
        m = feature_mask(torch.from_numpy(tissue), hw, stride)
        if border:
            ring = torch.ones_like(m)
            ring[..., border:-border, border:-border] = False
            m = m & ~ring
        out.append(m.to(x.device))
    return out


def set_mask(model: nn.Module, masks: list[torch.Tensor] | None, i: int, quarter_turns: int = 0) -> None:
    """Slide ``i``'s tissue mask (turned as its image) on the attention pool for the next forward and backward, as
    ``pool.masked()`` sets it; nothing without ``--tissue-mask``."""
    if masks is not None:
        model.pool.mask = torch.rot90(masks[i], quarter_turns, (2, 3))


def run(variant: str, pool: str, seed: int, args: argparse.Namespace, data: tuple) -> dict[str, Any]:
    images, ys, names, side, masks = data
    rng = np.random.default_rng(seed)
    train = train_split(ys, args.train, rng)
    if variant == "balanced_sampling":  # imbalance on purpose: drop one positive, then sample classes equally
        train = train[1:] if ys[train[0]] else train
    held = [i for i in range(len(ys)) if i not in train]
    model = make_model(pool, variant, seed).to(images[0].device)
    stats = trunk_stats(model, images[train[0]])
    if variant == "head_warmup":
        stats.update(warm_up_head(model, images, ys, train, args.lr, rng))
    if variant == "head_warmup_patch":  # as train.head_warmup does it: wsitrain.train.frozen_mil's bags of patches
        stats.update(warm_up_head_on_patches(model, images, ys, train, args.lr, seed))
    if variant.startswith("head_warmup"):
        print(variant, pool, seed, json.dumps(stats), flush=True)
    lr = 3e-3 if variant.endswith("lr3e-3") else args.lr
    if variant == "head_lr10x":  # train.backbone_lr_scale 0.1 at lr 10x: the head 10x faster, the trunk as before
        from wsitrain.train.optim import parameter_groups

        opt = torch.optim.AdamW(parameter_groups(model, 10 * lr, 0.1))
    else:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    out: dict[str, Any] = {"variant": variant, "pool": pool, "seed": seed, "lr": lr, "tissue_mask": masks is not None,
                           "border_cells": args.border_cells if masks is not None else 0,
                           **stats, "epochs": []}  # fmt: skip
    # the variants that add a loss of their own call backward themselves
    own_backward = variant == "inst_aux" or "score_mil" in variant or variant.endswith("plus_instance_loss")
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        if variant.endswith(("max_then_evidence", "max_refit_evidence")) and epoch == SWITCH_EPOCH:
            if variant.endswith("max_refit_evidence"):
                fit = refit_max_instance(model, images, ys, train, lr, rng)
                out.update(fit)
                print(variant, pool, seed, json.dumps(fit), flush=True)
            model.pool = EvidencePool(model.classifier, 0.0)
        if variant == "he_max_to_evidence":
            model.classifier.mix = min(1.0, max(0.0, (epoch - RAMP_EPOCHS[0]) / (RAMP_EPOCHS[1] - RAMP_EPOCHS[0])))
        model.train()
        order = rng.permutation(train).tolist()
        if variant == "balanced_sampling":
            pos = [i for i in train if ys[i]]
            neg = [i for i in train if not ys[i]]
            order = rng.choice(pos, len(train) // 2).tolist() + rng.choice(neg, len(train) - len(train) // 2).tolist()
            rng.shuffle(order)
        losses, ps = [], []
        accumulate = int(variant[len("accumulate") :]) if variant.startswith("accumulate") else 1
        for k, i in enumerate(order):
            q = int(rng.integers(4))
            x = torch.rot90(images[i].float() / 255, q, (2, 3))
            set_mask(model, masks, i, q)
            if variant == "inst_aux":
                logits, cam = forward_with_instances(model, x)
                loss = F.cross_entropy(logits, torch.tensor([ys[i]], device=x.device))
                aux = instance_loss(cam, ys[i])
                ((1 - INST_WEIGHT) * loss + INST_WEIGHT * aux).backward()  # the logged loss stays the bag's
            elif variant.endswith("score_mil_lme"):
                logits, aux = score_lme_loss(model, x, ys[i])
                loss = F.cross_entropy(logits, torch.tensor([ys[i]], device=x.device))
                (loss + SCORE_MIL_WEIGHT * aux).backward()
            elif "score_mil" in variant:
                neg_k = SCORE_NEG_K if "neg" in variant or "posk" in variant else 1
                logits, aux = score_mil_loss(model, x, ys[i], neg_k, MIL_POSITIVE_K if "posk" in variant else 1,
                                             variant.endswith("_sum"))  # fmt: skip
                loss = F.cross_entropy(logits, torch.tensor([ys[i]], device=x.device))
                (loss + SCORE_MIL_WEIGHT * aux).backward()
            elif variant.endswith("max_plus_instance_loss"):  # the instance branch also answers alone
                flat = model[3:5](model[:3](x))  # pool, flatten: (1, C + 1)
                logits = model.classifier(flat)
                loss = F.cross_entropy(logits, torch.tensor([ys[i]], device=x.device))
                alone = torch.cat([torch.zeros_like(flat[:, -1:]), flat[:, -1:]], 1)
                (loss + F.cross_entropy(alone, torch.tensor([ys[i]], device=x.device))).backward()
            elif variant == "positive_attention":  # the scores learn from positive slides only (the witnesses)
                hs = model[:3](x)  # normalize, features, attention: (1, C + 1, h, w)
                if not ys[i]:
                    hs = torch.cat([hs[:, :-1], hs[:, -1:].detach()], 1)
                logits = model[3:](hs)
                loss = F.cross_entropy(logits, torch.tensor([ys[i]], device=x.device))
            else:
                logits = model(x)
                loss = F.cross_entropy(logits, torch.tensor([ys[i]], device=x.device))
            if not own_backward:
                (loss / accumulate).backward()  # as train.accumulate: the mean gradient of ``accumulate`` slides a step
            if (k + 1) % accumulate == 0 or k + 1 == len(order):
                opt.step()
                opt.zero_grad()
            losses.append(float(loss.detach()))
            ps.append(float(torch.softmax(logits.detach(), 1)[0, 1]))
        model.eval()
        with torch.no_grad():
            hp = []
            for i in held:
                set_mask(model, masks, i)
                hp.append(float(torch.softmax(model(images[i].float() / 255), 1)[0, 1]))
            hy = [ys[i] for i in held]
            hl = float(np.mean([-np.log(max(p if y else 1 - p, 1e-12)) for p, y in zip(hp, hy, strict=True)]))
            mass, hits = None, None
            if pool in zoo.ATTENTION_POOLS:
                masses = []
                for i in (i for i in held if ys[i]):
                    set_mask(model, masks, i)
                    masses.append(lesion_mass(model, images[i].float() / 255, side[names[i]]["boxes"]))
                mass = float(np.mean(masses))
                # pointing hits on held-out positives that carry a look-alike too / that do not
                split = {True: [0, 0], False: [0, 0]}
                for i in (i for i in held if ys[i]):
                    boxes = side[names[i]]["boxes"]
                    cell = split[any(b["kind"] != "lesion" for b in boxes)]
                    set_mask(model, masks, i)
                    cell[0] += pointing(model, images[i].float() / 255, boxes)
                    cell[1] += 1
                hits = {"with_lookalike": split[True], "without": split[False]}
        # "steps": slides seen (one optimizer step per slide unless accumulating)
        row = {"epoch": epoch + 1, "steps": (epoch + 1) * len(order), "train_loss": round(float(np.mean(losses)), 4),
               "train_p_spread": round(float(np.std(ps)), 4), "held_loss": round(hl, 4),
               "held_auc": round(auc(hy, hp), 3), "held_acc": round(float(np.mean([(p > 0.5) == y for p, y in
                                                                                   zip(hp, hy, strict=True)])), 3),
               "held_p_spread": round(float(np.std(hp)), 4), "lesion_mass": None if mass is None else round(mass, 4),
               "pointing": hits, "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
        out["epochs"].append(row)
        print(variant, pool, seed, json.dumps(row), flush=True)
    out["plateau_steps"] = plateau_steps(out["epochs"])
    if pool in zoo.ATTENTION_POOLS:
        out["structures"] = held_out_structures(model, held, data)
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), args.save / f"{variant}-{pool}-seed{seed}.pt")
    return out


def plateau_steps(epochs: list[dict[str, Any]], loss: float = PLATEAU_LOSS) -> int | None:
    """Optimizer steps until the end of the first epoch whose mean training loss is <= ``loss`` (None: the run never
    left the plateau)."""
    return next((e["steps"] for e in epochs if e["train_loss"] <= loss), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSONL, one line per (variant, pool, seed)")
    ap.add_argument("--cohort", type=Path, default=Path(".cache/wsitrain/lesions/n16-s1024"))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--train", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--pools", default="max,attention")
    ap.add_argument("--variants", default="torch_init,he_init")
    ap.add_argument("--crop", type=int, default=None, help="a window around each slide's first structure, px")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lesions", choices=[m for m in LESION_MODES if m != "none"], default="small",
                    help="the cohort's kind (wsitrain synth --lesions)")
    ap.add_argument("--device", default="cpu", help="where the runs train (cpu; cuda trains the same runs faster)")
    ap.add_argument("--tissue-mask", action="store_true",
                    help="attention pools attend to each slide's tissue only, as fit does (data.mask_background)")
    ap.add_argument("--border-cells", type=int, default=0,
                    help="with --tissue-mask: also leave the map's outer ring this many cells deep out")
    ap.add_argument("--save", type=Path, default=None, help="folder for each run's final state_dict")
    ap.add_argument("--rescore", type=Path, default=None,
                    help="no training: a --save'd state_dict of the one --variants/--pools/--seeds run, its held-out "
                         "slides' attention scores and classifier evidence per structure kind")  # fmt: skip
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        print(f"error: unknown --variants {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    images, ys, names, side = load_cohort(args.cohort, args.n, args.size, args.crop, args.lesions)
    stride = zoo.build("tiny", 2).stride
    masks = tissue_map_masks(images, stride, args.border_cells) if args.tissue_mask else None
    data = ([x.to(args.device) for x in images], ys, names, side, masks)
    if args.rescore is not None:
        found = rescore(args.rescore, args.variants, args.pools, int(args.seeds), args, data)
        print(json.dumps(found, indent=1))
        with args.out.open("a") as f:
            f.write(json.dumps(found) + "\n")
        return 0
    with args.out.open("a") as f:
        for seed in (int(s) for s in args.seeds.split(",")):
            for pool in args.pools.split(","):
                for variant in args.variants.split(","):
                    f.write(json.dumps(run(variant, pool, seed, args, data)) + "\n")
                    f.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
