"""Where do a benchmark run's lesions rank in its positive attention branch, against the look-alikes?

For a run of the learning benchmark (benchmarks/bench_learning.py: a ``wsitrain synth --lesions small`` cohort, whose
lesions.json boxes every lesion and look-alike) with a per-class attention head, read each slide of one split whole
(level 0, plain PyTorch), take the positive class's attention scores over the map, and compare three kinds of cell:
the lesions', the look-alikes' (on positive and on negative slides) and the plain tissue's. Printed per run:

- the rank of each positive slide's best lesion cell among the plain tissue cells (0: the lesion holds the peak);
- the z-score of the best lesion cell and of the best look-alike cell, against the plain tissue's scores;
- their ratio, lesion over the negatives' look-alikes (below 1: a negative slide's highest cells outscore a positive
  slide's lesion, so the highest cells argue against the label);
- the scores' spread: their standard deviation over the tissue (near 0: flat scores, a uniform attention).

``--init`` scores the model ``wsitrain fit`` built for the run's seed before its first step (the run's config and
seed, no checkpoint); without it, the run's last checkpoint. docs/research/plateau.md section 15 was measured with it:

    python research/lesion_rank_probe.py RUN_DIR [RUN_DIR ...] [--init] [--split train|val] [--json OUT]

The read has no tissue crop or mask (tissue cells are the product's tissue mask of the cells' mean colours), so the
scores are those of the whole image. Small slides only (the benchmark's 1024 px).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wsitrain.config import WsiTrainConfig, load_config
from wsitrain.models.attention import AttentionScores
from wsitrain.models.heads import ATTENTION_POOLS, positive_index
from wsitrain.report.localisation import LESION, inside_mask
from wsitrain.slides.readers import read_whole
from wsitrain.slides.synth.lesions import SIDECAR
from wsitrain.slides.tissue.detect import block_tissue
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.engine import build_model, seed_everything


@dataclass(frozen=True)
class SlideRank:
    """One slide's positive-branch scores, by kind of cell (z: against the plain tissue's mean and std)."""

    slide: str
    label: str
    lesion_rank: int | None  # the best lesion cell's rank among plain tissue cells; None: no lesion cell
    lesion_z: float | None
    lookalike_z: float | None
    spread: float  # std of the scores over the tissue cells


@dataclass(frozen=True)
class RunRank:
    """A run's summary over the split's slides (means; the rank is a median)."""

    run: str
    weights: str  # "init" or "last.pt"
    lesion_rank: float
    lesion_z: float
    lookalike_z_positive: float
    lookalike_z_negative: float
    ratio: float  # lesion_z / lookalike_z_negative
    spread: float
    slides: list[SlideRank]


def cell_tissue(rgb: np.ndarray, shape: tuple[int, int], stride: int) -> np.ndarray:
    """(h, w) bool: the product's tissue mask of each map cell's mean colour, the map's outer ring left out (the
    attention pool with the instance loss leaves it out too, and zero padding sets it apart)."""
    mask = np.zeros(shape, dtype=bool)
    found = block_tissue(rgb, stride)[: shape[0], : shape[1]]
    mask[: found.shape[0], : found.shape[1]] = found
    mask[0, :] = mask[-1, :] = mask[:, 0] = mask[:, -1] = False
    return mask


def _z(values: np.ndarray, plain: np.ndarray) -> float | None:
    return float((values.max() - plain.mean()) / max(plain.std(), 1e-12)) if values.size else None


def slide_rank(slide: str, label: str, scores: np.ndarray, tissue: np.ndarray, lesion: np.ndarray,
               lookalike: np.ndarray) -> SlideRank:  # fmt: skip
    """One slide's figures from its (h, w) scores and cell masks (lesion and look-alike cells count inside tissue)."""
    lesion, lookalike = lesion & tissue, lookalike & tissue
    plain = scores[tissue & ~lesion & ~lookalike]
    rank = int((plain > scores[lesion].max()).sum()) if lesion.any() else None
    return SlideRank(slide, label, rank, _z(scores[lesion], plain), _z(scores[lookalike], plain),
                     float(scores[tissue].std()))  # fmt: skip


def run_classes(run: Path) -> tuple[WsiTrainConfig, list[str], list[dict[str, str]]]:
    """The run's config, classes (validation.json's, else the CSV's sorted labels) and CSV rows."""
    cfg = load_config(run / "config.yaml")
    if cfg.model.pool not in ATTENTION_POOLS or cfg.model.attention.branches != "per_class":
        raise SystemExit(f"error: {run}: the probe reads a per-class attention head (model.pool: attention, "
                         "model.attention.branches: per_class)")  # fmt: skip
    if cfg.data.labels is None or not (Path(cfg.data.slides_dir or "") / SIDECAR).is_file():
        raise SystemExit(f"error: {run}: its slides_dir has no {SIDECAR} (a `wsitrain synth --lesions` cohort)")
    rows = list(csv.DictReader(Path(cfg.data.labels).open()))
    val = run / "validation.json"
    classes = json.loads(val.read_text())["classes"] if val.is_file() else sorted({r["label"] for r in rows})
    return cfg, [str(c) for c in classes], rows


def run_model(run: Path, init: bool = False) -> nn.Module:
    """The run's model in eval mode: its last checkpoint, or (``init``) the weights fit built for its seed before
    the first step (fit seeds, then builds: the same draws give the same weights)."""
    cfg, classes, _ = run_classes(run)
    return _model(run, cfg, classes, init)


def _model(run: Path, cfg: WsiTrainConfig, classes: list[str], init: bool) -> nn.Module:
    seed_everything(cfg.seed, False)
    model = build_model(cfg.model.model_copy(update={"weights": None}), len(classes), classes)
    if not init:
        model.load_state_dict(load_checkpoint(run / "last.pt")["model"])
    return model.eval()


def rank_run(run: Path, init: bool = False, split: str = "train") -> RunRank:
    """The run's slides of ``split`` scored on its positive attention branch (``init``: before the first step)."""
    cfg, classes, rows = run_classes(run)
    positive = classes[positive_index(cfg.model.attention.positive_class, classes)]
    model = _model(run, cfg, classes, init)
    scores_module = next(m for m in model.modules() if isinstance(m, AttentionScores))
    branch = classes.index(positive) - len(classes)  # the branch's channel, counted from the end
    captured: dict[str, torch.Tensor] = {}
    scores_module.register_forward_hook(lambda _m, _a, out: captured.__setitem__("s", out[0, branch].detach()))
    cohort = Path(cfg.data.slides_dir or "")
    truth = json.loads((cohort / SIDECAR).read_text())["slides"]
    stride = int(model.stride)
    out = []
    for r in rows:
        if r.get("split", "train") != split:
            continue
        rgb = read_whole(cohort / r["slide"])
        with torch.no_grad():
            model(torch.from_numpy(rgb).permute(2, 0, 1)[None])
        s = captured["s"].double().numpy()  # (h, w)
        boxes = truth[r["slide"]]["boxes"]
        lesion = inside_mask(s.shape, stride, (0, 0), 1.0, [b for b in boxes if b["kind"] == LESION])
        look = inside_mask(s.shape, stride, (0, 0), 1.0, [b for b in boxes if b["kind"] != LESION])
        out.append(slide_rank(r["slide"], r["label"], s, cell_tissue(rgb, s.shape, stride), lesion, look))
    return summarise(str(run), "init" if init else "last.pt", out, positive)


def summarise(run: str, weights: str, slides: list[SlideRank], positive: str) -> RunRank:
    """Means over the slides (the rank's median), by class."""

    def mean(xs: list[float | None]) -> float:
        kept = [x for x in xs if x is not None]
        return statistics.fmean(kept) if kept else float("nan")

    pos = [s for s in slides if s.label == positive]
    neg = [s for s in slides if s.label != positive]
    ranks = [s.lesion_rank for s in pos if s.lesion_rank is not None]
    lesion_z = mean([s.lesion_z for s in pos])
    look_neg = mean([s.lookalike_z for s in neg])
    return RunRank(run, weights, float(statistics.median(ranks)) if ranks else float("nan"), lesion_z,
                   mean([s.lookalike_z for s in pos]), look_neg, lesion_z / look_neg if look_neg else float("nan"),
                   mean([s.spread for s in slides]), slides)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders of the learning benchmark (config.yaml, last.pt)")
    ap.add_argument("--init", action="store_true", help="the model fit built for the run's seed, before any step")
    ap.add_argument("--split", choices=("train", "val"), default="train", help="which slides of the run's CSV")
    ap.add_argument("--json", type=Path, help="also write every slide's figures here")
    args = ap.parse_args(argv)
    for run in args.runs:
        need = ["config.yaml"] + ([] if args.init else ["last.pt"])
        missing = [n for n in need if not (run / n).is_file()]
        if missing:
            print(f"error: {run} is not a run folder ({', '.join(missing)} missing)", file=sys.stderr)
            return 2
    results = []
    for run in args.runs:
        r = rank_run(run, args.init, args.split)
        results.append(r)
        print(f"{run} ({r.weights}, {args.split}): lesion rank {r.lesion_rank:g}, lesion z {r.lesion_z:.2f}, "
              f"look-alike z {r.lookalike_z_positive:.2f} on positives / {r.lookalike_z_negative:.2f} on negatives, "
              f"ratio {r.ratio:.2f}, spread {r.spread:.4f}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
