"""A trunk pretrained elsewhere, for the learning benchmark: patch labels on a disjoint synthetic lesion cohort.

Users fine-tune trunks pretrained elsewhere (ImageNet, or self-supervised on pathology); this machine downloads no
weights, so this script makes a stand-in. It writes a ``wsitrain synth --lesions small`` cohort with another seed
than the benchmark's (``--cohort-seed``, default 1; the benchmark's cohort is seed 0: no slide is shared), cuts a
``--patch`` px patch of level 0 around every lesion (label 1) and every look-alike (label 0) from lesions.json, and
``--tissue`` random tissue patches per slide away from both (label 0), then trains the model's trunk with a global
average pool and a linear layer on them (AdamW, flips and rot90), a quarter of the slides held out. It saves the
trunk alone, ``torch.save(model.features.state_dict())``, which ``model.weights`` loads into any head:

    python benchmarks/pretrain_patches.py --out .cache/wsitrain/tiny_ln_patches.pt
    python benchmarks/pretrain_patches.py --objective contrastive --out .cache/wsitrain/tiny_ln_simclr.pt
    python benchmarks/bench_learning.py ... --model tiny_ln --set model.weights=.cache/wsitrain/tiny_ln_simclr.pt

This is a stronger start than ImageNet gives: the trunk has been told what a lesion and a look-alike look like (on
other slides). ``--objective contrastive`` is the fairer stand-in, a trunk pretrained *without labels*, as the
self-supervised pathology trunks are: ``--crops`` random tissue patches per slide, wherever they fall (lesions.json
is not read for training), two augmented views of each (flips, rot90, a shift, brightness and colour), SimCLR's
contrastive loss (NT-Xent) on a small projection of the trunk's average-pooled features. Lesions enter only as the
share of random tissue crops that happen to touch one. Its report says how well the frozen trunk's features tell
the structures apart (a logistic regression on the pooled features of the training slides' structure patches,
scored on the held-out slides'): the labels are read for that report only. Every figure it prints is *measured*.

A patch encoder (a ViT: ``--model timm/...``, ``python:<module>:<function>``, or a CNN with ``--model-patch``) is
pretrained the same way at its own patch size: the views are ``--model-patch`` px windows of ``--patch`` px crops, one
embedding each, and the file holds its trunk (``encoder.*`` keys), which ``model.weights`` loads with the same
``model.patch``:

    python benchmarks/pretrain_patches.py --objective contrastive --model python:benchmarks.small_vit:small_vit \
        --model-patch 32 --patch 40 --out .cache/wsitrain/small_vit_simclr.pt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from wsitrain.models import build
from wsitrain.report.localisation import LESION
from wsitrain.slides.readers import read_whole
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.slides.synth.lesions import SIDECAR
from wsitrain.slides.tissue.detect import block_tissue
from wsitrain.train.class_balance import class_weights

PAGE = "docs/benchmarks/bench_learning/pretrained.md"  # where this script's figures are documented (named in --help)


def crop(rgb: np.ndarray, cy: int, cx: int, patch: int) -> np.ndarray:
    """The ``patch`` px square centred at (cy, cx), moved inside the image: (patch, patch, 3)."""
    h, w = rgb.shape[:2]
    y0 = int(np.clip(cy - patch // 2, 0, h - patch))
    x0 = int(np.clip(cx - patch // 2, 0, w - patch))
    return rgb[y0 : y0 + patch, x0 : x0 + patch]


def slide_patches(rgb: np.ndarray, boxes: list[dict], patch: int, tissue: int, rng: np.random.Generator
                  ) -> tuple[list[np.ndarray], list[int]]:  # fmt: skip
    """One slide's patches and labels: every structure's box (lesion 1, look-alike 0) and random tissue (0)."""
    xs, ys = [], []
    for b in boxes:
        xs.append(crop(rgb, (b["y0"] + b["y1"]) // 2, (b["x0"] + b["x1"]) // 2, patch))
        ys.append(int(b["kind"] == LESION))
    step = 16
    away = block_tissue(rgb, step).copy()
    for b in boxes:  # no tissue patch overlaps a structure
        away[max(0, (b["y0"] - patch) // step) : (b["y1"] + patch) // step + 1,
             max(0, (b["x0"] - patch) // step) : (b["x1"] + patch) // step + 1] = False  # fmt: skip
    cells = np.argwhere(away)
    for i in rng.choice(len(cells), size=min(tissue, len(cells)), replace=False) if len(cells) else []:
        cy, cx = cells[i] * step + step // 2
        xs.append(crop(rgb, int(cy), int(cx), patch))
        ys.append(0)
    return xs, ys


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A random flip and rot90 of a (B, 3, p, p) batch (the same for the batch)."""
    k = int(torch.randint(4, (1,), generator=g))
    if int(torch.randint(2, (1,), generator=g)):
        x = x.flip(-1)
    return torch.rot90(x, k, (-2, -1))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> str:
    """Patch accuracy on the lesions and on the rest (look-alikes and tissue), apart: the lesions are the rarer."""
    model.eval()
    with torch.no_grad():
        p = torch.cat([model(x[i : i + 64]).argmax(1) for i in range(0, len(x), 64)])
    model.train()
    hit = p == y
    return f"lesions {float(hit[y == 1].float().mean()):.2f}, the rest {float(hit[y == 0].float().mean()):.2f}"


def tissue_crops(rgb: np.ndarray, n: int, patch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``n`` random ``patch`` px squares centred on tissue (16 px cells of the tissue mask), wherever they fall."""
    step = 16
    cells = np.argwhere(block_tissue(rgb, step))
    if not len(cells):
        return []
    picks = cells[rng.choice(len(cells), size=n, replace=len(cells) < n)] * step + step // 2
    return [crop(rgb, int(cy), int(cx), patch) for cy, cx in picks]


def views(x: torch.Tensor, out: int, g: torch.Generator) -> torch.Tensor:
    """One augmented view of each patch of a uint8 (B, 3, p, p) batch: float (B, 3, out, out) in [0, 1].

    Per patch: a random ``out`` px window (a shift of up to ``p - out`` px), a flip, a rot90, brightness (x0.8-1.2)
    and a colour shift (+-0.05 per channel), the stain and scanner variation a pathology trunk should not encode.
    """
    b, _, p, _ = x.shape
    oy, ox = (torch.randint(p - out + 1, (2, b), generator=g)).tolist()
    v = torch.stack([x[i, :, oy[i] : oy[i] + out, ox[i] : ox[i] + out] for i in range(b)]).float() / 255
    flip = torch.rand(b, generator=g) < 0.5
    v = torch.where(flip[:, None, None, None], v.flip(-1), v)
    k = torch.randint(4, (b,), generator=g)
    v = torch.stack([torch.rot90(v[i], int(k[i]), (-2, -1)) for i in range(b)])
    scale = 0.8 + 0.4 * torch.rand(b, 1, 1, 1, generator=g)
    shift = 0.1 * torch.rand(b, 3, 1, 1, generator=g) - 0.05
    return (v * scale + shift).clamp(0, 1)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's loss on two views' projections (B, D): each view must pick its partner among the other 2B - 1."""
    z = F.normalize(torch.cat([z1, z2]), dim=1)  # (2B, D)
    sim = z @ z.T / temperature
    sim.fill_diagonal_(float("-inf"))
    b = len(z1)
    partner = torch.cat([torch.arange(b, 2 * b), torch.arange(b)])
    return F.cross_entropy(sim, partner)


def pooled(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The trunk's average-pooled features of a uint8 (B, 3, p, p) batch, without gradients: (B, C)."""
    model.eval()
    with torch.no_grad():
        f = torch.cat([model.features(model.normalize(x[i : i + 64])).mean((-2, -1)) for i in range(0, len(x), 64)])
    model.train()
    return f


def balanced(y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy weights of the two classes, n / (2 n_k) (wsitrain.train.class_balance's); 1 for an absent one."""
    w = class_weights(y.tolist())
    return torch.tensor([w.get(c, 1.0) for c in range(2)])


def logistic(f: torch.Tensor, y: torch.Tensor) -> torch.nn.Linear:
    """A class-weighted, lightly L2-regularised logistic regression of labels ``y`` on standardised features (N, C)."""
    lin = torch.nn.Linear(f.shape[1], 2)
    opt = torch.optim.LBFGS(lin.parameters(), max_iter=200)
    weight = balanced(y)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(lin(f), y, weight=weight) + 1e-3 * lin.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    return lin


KINDS = ("tissue", "lesions", "look-alikes")  # a probe patch's kind: its index here


def probe(model: torch.nn.Module, folds: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """How well the frozen trunk's pooled features tell lesions from the rest: for each fold of slides (patches,
    kinds: indices into ``KINDS``), a logistic regression of lesion vs the rest on the other folds' patches, scored on
    the fold's; every patch is scored once, held out, and the hits are counted per kind."""
    feats = [pooled(model, x) for x, _ in folds]
    hit, kinds = [], []
    with torch.random.fork_rng():  # the regressions' initial weights: the training after a probe draws as without
        torch.manual_seed(0)
        for k, (fv, (_, kv)) in enumerate(zip(feats, folds, strict=True)):
            f = torch.cat([f for j, f in enumerate(feats) if j != k])
            mu, sd = f.mean(0), f.std(0) + 1e-6
            lin = logistic((f - mu) / sd, torch.cat([(kd == 1).long() for j, (_, kd) in enumerate(folds) if j != k]))
            with torch.no_grad():
                hit.append(lin((fv - mu) / sd).argmax(1) == (kv == 1).long())
            kinds.append(kv)
    h, kd = torch.cat(hit), torch.cat(kinds)
    counts = ", ".join(f"{name} {int(h[kd == i].sum())}/{int((kd == i).sum())}" for i, name in enumerate(KINDS)
                       if (kd == i).any())  # fmt: skip
    f = torch.cat(feats)
    les, look = f[kd == KINDS.index("lesions")], f[kd == KINDS.index("look-alikes")]
    if not len(les) or not len(look):
        return counts
    apart, auc = separation(les, look), best_auc(les, look)
    return f"{counts}; lesion vs look-alike: {apart:.2f} sd apart, best channel AUC {auc:.2f}"


def separation(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two groups of raw features (N, C) lie along the line joining their means, in their pooled
    within-group standard deviations along it: what a head that has not yet learnt which channels matter sees,
    where a linear probe (which weighs the channels to fit) sees the best direction."""
    d = a.mean(0) - b.mean(0)
    d = d / d.norm().clamp(min=1e-12)
    pa, pb = a @ d, b @ d
    within = torch.cat([pa - pa.mean(), pb - pb.mean()]).std()
    return float((pa.mean() - pb.mean()) / within.clamp(min=1e-12))


def best_auc(a: torch.Tensor, b: torch.Tensor) -> float:
    """The best single channel's ROC AUC between two groups (N, C), either way round."""
    best = 0.0
    for c in range(a.shape[1]):
        greater = (a[:, c, None] > b[None, :, c]).float().mean() + 0.5 * (a[:, c, None] == b[None, :, c]).float().mean()
        best = max(best, float(greater), 1 - float(greater))
    return best


def train_labels(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, xv: torch.Tensor, yv: torch.Tensor,
                 args: argparse.Namespace) -> None:  # fmt: skip
    """The trunk and a linear layer on its average pool, trained on the patch labels."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    weight = balanced(y)  # lesions are the rarer class
    g = torch.Generator().manual_seed(args.seed)
    model.train()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x), generator=g)
        losses = []
        for i in range(0, len(x), 16):
            idx = order[i : i + 16]
            loss = F.cross_entropy(model(augment(x[idx], g)), y[idx], weight=weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if epoch == 1 or epoch % 10 == 0 or epoch == args.epochs:
            print(f"epoch {epoch}: loss {np.mean(losses):.3f}, patch accuracy train {accuracy(model, x, y)}; "
                  f"held out {accuracy(model, xv, yv)}", flush=True)  # fmt: skip


def train_contrastive(model: torch.nn.Module, crops: torch.Tensor, args: argparse.Namespace) -> None:
    """The trunk and a projection (C -> 2C -> C) on its average pool, trained with NT-Xent on two views per crop."""
    c = model.features(model.normalize(crops[:1])).shape[1]
    head = torch.nn.Sequential(torch.nn.Linear(c, 2 * c), torch.nn.ReLU(), torch.nn.Linear(2 * c, c))
    params = [*model.features.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    # views are shifted windows of 5/6 of the crop; a patch encoder's are its own patch size (one embedding each)
    out = args.model_patch or args.patch - args.patch // 6

    def project(v: torch.Tensor) -> torch.Tensor:
        return head(model.features(model.normalize(v)).mean((-2, -1)))

    model.train()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(crops), generator=g)
        losses = []
        for i in range(0, len(crops) - args.batch + 1, args.batch):
            x = crops[order[i : i + args.batch]]
            loss = nt_xent(project(views(x, out, g)), project(views(x, out, g)), args.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if epoch == 1 or epoch % 10 == 0 or epoch == args.epochs:
            print(f"epoch {epoch}: contrastive loss {np.mean(losses):.3f} (chance {np.log(2 * args.batch - 1):.3f})",
                  flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, help="the trunk's state dict (.pt)")
    ap.add_argument("--probe", default=None, metavar="TRUNK",
                    help="train nothing: print the linear probe of a trunk file (or 'random': --seed's random trunk)")
    ap.add_argument("--cohort", type=Path, default=Path(".cache/wsitrain/pretrain_lesions"), help="its slides")
    ap.add_argument("--cohort-seed", type=int, default=1, help="the cohort's seed (the benchmark's is 0)")
    ap.add_argument("--n", type=int, default=32, help="slides in the cohort")
    ap.add_argument("--size", type=int, default=1024, help="slide edge, px")
    ap.add_argument("--model", default="tiny_ln", help="model.name whose trunk is trained")
    ap.add_argument("--patch", type=int, default=96, help="patch edge, px (a structure's box is 88 px)")
    ap.add_argument("--model-patch", type=int, default=None,
                    help="model.patch of a patch encoder (a ViT): its views are this size, inside --patch px crops")
    ap.add_argument("--tissue", type=int, default=4, help="random tissue patches per slide")
    ap.add_argument("--objective", choices=("labels", "contrastive"), default="labels",
                    help="labels: lesion vs the rest; contrastive: SimCLR on random tissue crops, no labels")
    ap.add_argument("--crops", type=int, default=64, help="contrastive: random tissue crops per slide")
    ap.add_argument("--batch", type=int, default=128, help="contrastive: crops per step (2 views each)")
    ap.add_argument("--temperature", type=float, default=0.2, help="contrastive: NT-Xent temperature")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="weights and order")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.probe is None):
        print("error: give --out (train a trunk) or --probe TRUNK (probe one), not both", file=sys.stderr)
        return 2
    if args.probe not in (None, "random") and not Path(args.probe).is_file():
        print(f"error: --probe {args.probe}: no such file (a trunk's state dict, or 'random')", file=sys.stderr)
        return 2
    if args.model_patch is not None and not 0 < args.model_patch < args.patch:
        print(f"error: --model-patch {args.model_patch} must be below --patch {args.patch} (views are shifted windows "
              "of the crops)", file=sys.stderr)  # fmt: skip
        return 2
    if args.cohort_seed == 0:
        print("error: --cohort-seed 0 is the learning benchmark's cohort: pretrain on another", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    cohort = args.cohort / f"n{args.n}-s{args.size}-seed{args.cohort_seed}"
    labels = write_synthetic_dataset(cohort, n=args.n, size=args.size, seed=args.cohort_seed, lesions="small")
    truth = json.loads((cohort / SIDECAR).read_text())["slides"]
    rng = np.random.default_rng(args.seed)
    names = sorted(truth)
    held = set(names[::4])  # a quarter of the slides, for the held-out patch accuracy
    patches: dict[str, tuple[list[np.ndarray], list[int]]] = {}
    unlabelled: list[np.ndarray] = []
    for name in names:
        rgb = read_whole(labels.parent / name)
        patches[name] = slide_patches(rgb, truth[name]["boxes"], args.patch, args.tissue, rng)
        if args.objective == "contrastive":  # no labels are read for these: every slide gives crops
            unlabelled.extend(tissue_crops(rgb, args.crops, args.patch, rng))

    def nchw(xs: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous()

    def stack(group: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return nchw([x for n in group for x in patches[n][0]]), torch.tensor([y for n in group for y in patches[n][1]])

    def kinds(name: str) -> list[int]:  # slide_patches' order: the structures' boxes, then tissue
        boxes = truth[name]["boxes"]
        return [KINDS.index("lesions" if b["kind"] == LESION else "look-alikes") for b in boxes] + [
            KINDS.index("tissue")] * (len(patches[name][1]) - len(boxes))  # fmt: skip

    folds = [(stack(g)[0], torch.tensor([k for n in g for k in kinds(n)])) for g in (names[i::4] for i in range(4))]
    torch.manual_seed(args.seed)
    model = build(args.model, 2, pool="avg", weights=args.probe if args.probe not in (None, "random") else None,
                  patch=args.model_patch)  # fmt: skip
    if args.probe is not None:
        print(f"{args.probe}: the {args.model} trunk's features, held-out linear probe: {probe(model, folds)}")
        return 0
    (x, y), (xv, yv) = stack([n for n in names if n not in held]), stack(sorted(held))
    if args.objective == "labels":
        train_labels(model, x, y, xv, yv, args)
        what = (f"{len(x)} training patches ({int(y.sum())} lesions) from {len(names) - len(held)} slides, "
                f"{len(xv)} held-out patches ({int(yv.sum())} lesions) from {len(held)}")  # fmt: skip
    else:
        if len(unlabelled) < args.batch:
            print(f"error: {len(unlabelled)} tissue crops, fewer than --batch {args.batch}: lower --batch or raise "
                  f"--crops or --n", file=sys.stderr)  # fmt: skip
            return 2
        print(f"before: the random trunk's features, held-out linear probe: {probe(model, folds)}", flush=True)
        train_contrastive(model, nchw(unlabelled), args)
        print(f"after: the trunk's features, held-out linear probe: {probe(model, folds)}")
        what = f"{len(unlabelled)} unlabelled tissue crops from {len(names)} slides"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.features.state_dict(), args.out)
    print(f"{args.out}: the {args.model} trunk ({args.objective}), {what}; "
          f"{time.perf_counter() - t0:.0f} s (measured)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
