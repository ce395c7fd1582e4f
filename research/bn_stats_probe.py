"""Would ``model.bn_stats: slide`` change a run's predictions? Score its validation slides both ways.

For a finished run trained with ``model.freeze_bn: false`` (BatchNorm on each slide's statistics while training), the
run's last checkpoint predicts every validation slide twice on the same read (level 0, whole, plain PyTorch): - with the
running averages (``model.bn_stats: running``, PyTorch's eval mode); - with each slide's own statistics
(``model.bn_stats: slide``). It prints ROC AUC and accuracy of the positive class for both. The learning benchmark's
figures in docs/research/plateau.md section 14 were measured with it:

    python research/bn_stats_probe.py RUN_DIR [RUN_DIR ...]

The read has no tissue mask or crop, so its figures differ a little from the run's own validation; both columns
share the read, so their difference is the statistics'. Small slides only (the benchmark's 1024 px).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from wsitrain.config import load_config
from wsitrain.models.slide_bn import SLIDE
from wsitrain.slides.readers import read_whole
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.engine import build_model
from wsitrain.train.metrics import binary_roc_auc


def read_level0(path: Path) -> torch.Tensor:
    """A slide's level 0, whole, as (1, 3, H, W) uint8, as fit streams it (the model scales it to [0, 1])."""
    return torch.from_numpy(read_whole(path)).permute(2, 0, 1)[None]


def probe(run: Path) -> dict[str, dict[str, float]]:
    """The run's validation slides scored with running averages and with each slide's own statistics."""
    cfg = load_config(run / "config.yaml")
    if cfg.model.freeze_bn:
        raise SystemExit(f"error: {run}: model.freeze_bn is true, so BatchNorm uses the same statistics both ways")
    val = json.loads((run / "validation.json").read_text())
    classes = [str(c) for c in val["classes"]]
    positive = "positive" if "positive" in classes else classes[-1]
    model = build_model(cfg.model.model_copy(update={"weights": None}), len(classes), classes)
    model.load_state_dict(load_checkpoint(run / "last.pt")["model"])
    images = [read_level0(Path(s["path"])) for s in val["slides"]]
    labels = [s["label"] == positive for s in val["slides"]]
    out = {}
    for mode in ("running", SLIDE):
        model.eval()
        for m in model.modules():  # slide: batch statistics in eval mode, the running ones left untouched
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None and mode == SLIDE:
                m.train()
                m.momentum = 0.0
        with torch.no_grad():
            p = [torch.softmax(model(x).float(), 1)[0, classes.index(positive)].item() for x in images]
        acc = float(np.mean([(q > 0.5) == y for q, y in zip(p, labels, strict=True)]))
        out[mode] = {"roc_auc": binary_roc_auc(np.array(labels), np.array(p)), "accuracy": acc}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders of `wsitrain fit` (config.yaml, last.pt)")
    args = ap.parse_args(argv)
    for run in args.runs:
        if not (run / "last.pt").is_file() or not (run / "validation.json").is_file():
            print(f"error: {run} is not a finished run folder (no last.pt or validation.json)", file=sys.stderr)
            return 2
    for run in args.runs:
        r = probe(run)
        print(f"{run}: running averages AUC {r['running']['roc_auc']:.3f} accuracy {r['running']['accuracy']:.2f}; "
              f"each slide's own AUC {r[SLIDE]['roc_auc']:.3f} accuracy {r[SLIDE]['accuracy']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
