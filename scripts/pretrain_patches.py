"""A trunk pretrained elsewhere, for the learning benchmark: patch labels on a disjoint synthetic lesion cohort.

Users fine-tune trunks pretrained elsewhere (ImageNet, or self-supervised on pathology); this machine downloads no
weights, so this script makes a stand-in. It writes a ``wsitrain synth --lesions small`` cohort with another seed
than the benchmark's (``--cohort-seed``, default 1; the benchmark's cohort is seed 0: no slide is shared), cuts a
``--patch`` px patch of level 0 around every lesion (label 1) and every look-alike (label 0) from lesions.json, and
``--tissue`` random tissue patches per slide away from both (label 0), then trains the model's trunk with a global
average pool and a linear layer on them (AdamW, flips and rot90), a quarter of the slides held out. It saves the
trunk alone, ``torch.save(model.features.state_dict())``, which ``model.weights`` loads into any head:

    python scripts/pretrain_patches.py --out .cache/wsitrain/tiny_ln_patches.pt
    python scripts/bench_learning.py ... --model tiny_ln --set model.weights=.cache/wsitrain/tiny_ln_patches.pt

This is a stronger start than ImageNet gives: the trunk has been told what a lesion and a look-alike look like (on
other slides). Every figure it prints is *measured*.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the trunk's state dict (.pt)")
    ap.add_argument("--cohort", type=Path, default=Path(".cache/wsitrain/pretrain_lesions"), help="its slides")
    ap.add_argument("--cohort-seed", type=int, default=1, help="the cohort's seed (the benchmark's is 0)")
    ap.add_argument("--n", type=int, default=32, help="slides in the cohort")
    ap.add_argument("--size", type=int, default=1024, help="slide edge, px")
    ap.add_argument("--model", default="tiny_ln", help="model.name whose trunk is trained")
    ap.add_argument("--patch", type=int, default=96, help="patch edge, px (a structure's box is 88 px)")
    ap.add_argument("--tissue", type=int, default=4, help="random tissue patches per slide")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0, help="weights and order")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args(argv)
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
    parts: dict[bool, tuple[list[np.ndarray], list[int]]] = {True: ([], []), False: ([], [])}
    for name in names:
        xs, ys = slide_patches(read_whole(labels.parent / name), truth[name]["boxes"], args.patch, args.tissue, rng)
        parts[name in held][0].extend(xs)
        parts[name in held][1].extend(ys)

    def tensors(held_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = parts[held_out]
        return torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous(), torch.tensor(ys)

    (x, y), (xv, yv) = tensors(False), tensors(True)
    torch.manual_seed(args.seed)
    model = build(args.model, 2, pool="avg")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    weight = len(y) / (2 * torch.bincount(y, minlength=2).clamp(min=1).float())  # lesions are the rarer class
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.features.state_dict(), args.out)
    print(f"{args.out}: the {args.model} trunk, {len(x)} training patches ({int(y.sum())} lesions) from "
          f"{len(names) - len(held)} slides, {len(xv)} held out ({int(yv.sum())} lesions) from {len(held)}; "
          f"{time.perf_counter() - t0:.0f} s (measured)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
