"""Why whole slides: a learning benchmark. Small lesions that only full resolution shows, against a thumbnail.

    python benchmarks/bench_learning.py --out docs/benchmarks                # the documented run (~30-40 min, 2 CPUs)
    python benchmarks/bench_learning.py --out /tmp/bl --quick            # a smoke run: 16 slides of 1024 px, 1 seed
    python benchmarks/bench_learning.py --out docs/benchmarks --pools avg,max,attention
    python benchmarks/bench_learning.py --out docs/benchmarks --plot-only    # the table and plot from the JSONL
    python benchmarks/pretrain_patches.py --objective contrastive --out trunk.pt   # a trunk pretrained without labels
    python benchmarks/bench_learning.py --out D --jobs 2 --baseline --model tiny_ln --set model.weights=trunk.pt ...

``--jobs N`` runs N of the benchmark's runs at once, each in a process of its own with ``--threads`` threads (its
log in ``--work``/logs): on a 2-core CPU, ``--jobs 2 --threads 1`` does in about half the time what one process
does, with the same figures (a run's results depend on its seed only; its wall time on its share of the CPU).

The cohort is ``wsitrain synth --lesions small`` (``--n`` slides of ``--size`` px at 2.5 um/px, half positive,
written once into ``--cohort``): positive slides carry one to three lesions of 200 um (atypical nuclei, well under
1% of the tissue), every slide carries look-alike distractors whose thumbnail is the same as a lesion's, so nothing
at thumbnail scale separates the classes.

For each seed, the slides are split, stratified by label, into ``--train`` training slides and the rest held out
(the CSV's ``split`` column: ``train`` / ``val``; the held-out slides are never used to choose anything: the AUC
reported is the last epoch's, not the best). Then the *same product run* trains the ``tiny`` built-in model
(``--model``: another, from random weights; ``--device cuda``: on a GPU), through ``wsitrain fit``'s Python API
(``run_fit``) with the config below and the seed's ``seed``, on two inputs:

- **whole slide**: level 0 (every pixel, 2.5 um/px), cropped to the tissue, once per ``--pools`` entry
  (``model.pool``: ``avg``, ``max``, and ``attention`` where this wsitrain has it);
- **thumbnail**: ``data.mpp`` = 4 x 2.5 = 10 um/px, pyramid level 2: the 512 px thumbnail of a 2048 px slide,
  cropped to the tissue, with the same pools.

Reported per (input, pool): held-out ROC AUC over the seeds (mean, std, each seed), and each run's wall time.
Every figure is *measured* on the machine that runs the script (nproc, torch version and thread count are in every
row). Writes ``bench_learning.jsonl``, ``bench_learning.md`` and ``bench_learning.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from wsitrain.config import load_config
from wsitrain.slides.readers import read_whole
from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.slides.synth.lesions import BLOCK, LESION_MPP, read_sidecar

THUMB_MPP = LESION_MPP * BLOCK  # pyramid level 2: 512 px for a 2048 px slide


# Benchmark heads beyond plain ``model.pool`` values: name -> the config overrides that build it.
# ``attention_per_class`` is CLAM-MB (one attention branch per class); its maps are scored on the positive class's
# branch, the evidence for a lesion, where one branch for all classes also attends to what argues for "negative".
# ``attention_mil`` is CLAM-MB with the MIL instance loss on the positive branch's scores at its defaults
# (model.attention.instance_loss, docs/research/plateau.md sections 10-11; the map's outer ring left out, border_cells'
# default with the loss), ``attention_mil_w01`` the same at a fifth of the weight; ``attention_mil_pos1`` pushes only a
# positive slide's highest cell up, ``attention_mil_top1`` also only a negative slide's highest down;
# ``attention_mil_stream`` is ``attention_mil`` whose positive branch's 16 highest scores add to the positive logit
# (model.attention.instance_stream) and whose scores read the trunk's map standardised over the slide (norm: slide);
# ``attention_mil_w01_stream`` the same at weight 0.1, ``attention_mil_stream_cell`` that with each cell standardised
# over its channels instead (norm: cell), ``attention_mil_stream_only`` weight 0.1 and the stream without a norm
# (docs/research/plateau.md section 12). ``*_map_norm``: the head reads the trunk's map standardised over the slide
# (model.map_norm: slide, docs/research/plateau.md section 13).
PER_CLASS = ["model.pool=attention", "model.attention.branches=per_class"]
MIL = [*PER_CLASS, "model.attention.instance_loss=0.5"]
POS1 = [*MIL, "model.attention.instance_positive_cells=1"]
W01 = [*PER_CLASS, "model.attention.instance_loss=0.1"]
STREAM = [*W01, "model.attention.instance_stream=true"]
HEADS = {"attention_per_class": PER_CLASS, "attention_mil": MIL, "attention_mil_w01": W01, "attention_mil_pos1": POS1,
         "attention_mil_top1": [*POS1, "model.attention.instance_cells=1"],
         "attention_mil_stream": [*MIL, "model.attention.instance_stream=true", "model.attention.norm=slide"],
         "attention_mil_w01_stream": [*STREAM, "model.attention.norm=slide"],
         "attention_mil_stream_cell": [*STREAM, "model.attention.norm=cell"],
         "attention_mil_stream_only": STREAM,
         "max_map_norm": ["model.pool=max", "model.map_norm=slide"],
         "attention_map_norm": ["model.pool=attention", "model.map_norm=slide"],
         "attention_mil_w01_map_norm": [*W01, "model.map_norm=slide"]}  # fmt: skip

PAGE = "docs/benchmarks/learning.md and docs/benchmarks/bench_learning/"  # named in --help


def available_pools() -> list[str]:
    """``model.pool`` values this wsitrain accepts, and the benchmark's named heads (``HEADS``)."""
    from wsitrain.models import zoo

    return list(zoo.POOLS) + list(HEADS)


def head_overrides(pool: str) -> list[str]:
    """The config overrides that build the benchmark's ``pool``: a named head of ``HEADS`` or a ``model.pool``."""
    return HEADS.get(pool, [f"model.pool={pool}"])


def map_key(pool: str) -> str:
    """Which of a run's heatmaps its localisation is scored on: the attention map for a head whose ``model.pool`` is
    an attention pool, else the positive class's CAM (read from the head's overrides, not its name)."""
    from wsitrain.models.heads import ATTENTION_POOLS

    return "attention" if pool_of(pool) in ATTENTION_POOLS else "cam"


def pool_of(pool: str) -> str:
    """The ``model.pool`` a benchmark head builds (read from its overrides, not its name)."""
    return next((o.split("=", 1)[1] for o in head_overrides(pool) if o.startswith("model.pool=")), pool)


def base_config(labels: Path, cohort: Path, runs: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The fit config both inputs share; the input and pool are overrides (see ``run_one``)."""
    cfg: dict[str, Any] = {
        "seed": 0,
        "data": {
            "labels": str(labels),
            "slides_dir": str(cohort),
            "region": "tissue",
            "read_threads": 1,
            "augment": {"flips": True, "rot90": True},
        },
        "model": {"name": args.model, "pool": "max"},
        # Large enough that the tiny model runs plain at 2048 px (no tiling: the fastest on a CPU); the engine
        # still plans every slide.
        "engine": {"memory_budget": "6GiB", "device": args.device},
        "train": {
            "epochs": args.epochs,
            "optimizer": "adamw",
            "lr": args.lr,
            "schedule": args.schedule,
            "val_every": args.epochs,  # held-out slides are read once, after the last epoch
        },
        "log": {"dir": str(runs), "tiles": "off"},
    }
    if args.warmup:  # the head's warm-up on the initial trunk's patch features (docs/research/plateau.md section 6)
        cfg["train"]["head_warmup"] = {"steps": args.warmup, "patch": args.patch}
    return cfg


def split_csv(cohort: Path, labels_csv: Path, seed: int, n_train: int, out: Path) -> Path:
    """The cohort's labels with a seeded, label-stratified split: ``n_train`` slides train, the rest ``val``."""
    with labels_csv.open() as f:
        rows = list(csv.DictReader(f))
    rng = np.random.default_rng(1000 + seed)
    train: set[str] = set()
    for label in sorted({r["label"] for r in rows}):
        names = sorted(r["slide"] for r in rows if r["label"] == label)
        take = round(n_train * len(names) / len(rows))
        train.update(rng.permutation(names)[:take].tolist())
    path = out / f"labels_seed{seed}.csv"
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # then renamed: a parallel run never reads half a file
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["slide", "label", "split"])
        w.writeheader()
        for r in rows:
            w.writerow({"slide": r["slide"], "label": r["label"], "split": "train" if r["slide"] in train else "val"})
    tmp.replace(path)
    return path


def run_one(base: dict[str, Any], work: Path, labels: Path, seed: int, pool: str, thumbnail: bool,
            extra: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """One ``wsitrain fit`` run (``extra``: more config overrides); its held-out metrics from the run folder's
    summary.json."""
    from rich.console import Console

    from wsitrain.train.fit import run_fit

    cfg_path = work / "base.yaml"
    cfg_path.write_text(yaml.safe_dump(base))
    name = f"{'thumb' if thumbnail else 'whole'}-{pool}-seed{seed}"
    overrides = [f"seed={seed}", *head_overrides(pool), *extra, f"data.labels={labels}", f"name={name}"]
    if thumbnail:
        overrides.append(f"data.mpp={THUMB_MPP}")
    cfg = load_config(cfg_path, overrides)
    t0 = time.perf_counter()
    with open(os.devnull, "w") as sink:
        run_dir = run_fit(cfg, console=Console(file=sink), quiet=True)
    wall = time.perf_counter() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [m for m in metrics if m.get("kind") == "val"]
    last = val[-1] if val else {}
    sizes = [m.get("shape") for m in metrics if m.get("kind") == "train"]
    t1 = time.perf_counter()
    where, failed = None, None
    if not thumbnail:
        try:  # a run's metrics are measured even where its maps cannot be made; the row says why
            where = localise(cfg, run_dir, labels, pool)
        except Exception as e:  # noqa: BLE001 (any failure of predict --heatmaps)
            failed = f"{type(e).__name__}: {e}"
    return {
        "kind": "run",
        "input": "thumbnail" if thumbnail else "whole slide",
        "mpp": THUMB_MPP if thumbnail else LESION_MPP,
        "pool": pool,
        "seed": seed,
        "roc_auc": _num(summary.get("val_roc_auc", last.get("roc_auc"))),
        "accuracy": _num(last.get("accuracy")),
        "balanced_accuracy": _num(last.get("balanced_accuracy")),
        "val_loss": _num(last.get("loss")),
        "chance_loss": chance_loss(labels),
        "pointing_game": None if where is None else _num(where["pointing_game"]),
        "pointing_decisive": None if where is None else _num(where.get("pointing_decisive")),
        "lesion_mass": None if where is None else _num(where["lesion_mass"]),
        **lookalike_split(where),
        "localise_s": None if where is None else round(time.perf_counter() - t1, 1),
        "localise_error": failed,
        "first_train_loss": _num(summary.get("first_epoch_train_loss")),
        "last_train_loss": _num(summary.get("last_epoch_train_loss")),
        "mean_slide_s": _num(summary.get("mean_slide_s")),
        "wall_s": round(wall, 1),
        "example_input": sizes[0] if sizes else None,
        "run_dir": str(run_dir),
    }


def read_level0(path: Path) -> torch.Tensor:
    """A slide's level 0, whole, as (1, 3, H, W) float in [0, 1] (the benchmark's slides are small)."""
    return torch.from_numpy(read_whole(path)).permute(2, 0, 1)[None].float() / 255


def run_baseline(base: dict[str, Any], labels: Path, seed: int, budget_s: float, args: argparse.Namespace,
                 run_dir: Path) -> dict[str, Any]:  # fmt: skip
    """The frozen-feature baseline (wsitrain.train.frozen_mil): the same model (``--model``, with ``--set
    model.weights``' weights when given) and seed as the end-to-end runs, its trunk frozen, every ``--patch`` px
    patch of level 0 embedded once, and the model's own attention head trained on the bags (one slide per step, the
    same lr) for up to ``--baseline-epochs`` epochs or until the wall-time budget (the seed's mean end-to-end
    whole-slide fit) is spent, feature extraction included."""
    from wsitrain.report.localisation import inside_mask, score_map
    from wsitrain.train import frozen_mil as FM

    rows = list(csv.DictReader(labels.open()))
    slides_dir = Path(base["data"]["slides_dir"])
    side = read_sidecar(slides_dir)["slides"]
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    # the same backbone as the end-to-end runs: a ``--set model.weights=...`` trunk too, not a random one
    weights = next((o.split("=", 1)[1] for o in args.set if o.startswith("model.weights=")), None)
    model = FM.build_frozen_mil(base["model"]["name"], 2, pool="attention", weights=weights)
    bags: dict[str, torch.Tensor] = {}
    grids: dict[str, tuple[int, int]] = {}
    for r in rows:
        image = read_level0(slides_dir / r["slide"])  # (1, 3, H, W)
        grids[r["slide"]] = (image.shape[2] // args.patch, image.shape[3] // args.patch)
        bags[r["slide"]] = FM.patch_features(model, image, args.patch)  # (rows * cols, C)
    feature_s = time.perf_counter() - t0
    train = [r for r in rows if r["split"] == "train"]
    held = [r for r in rows if r["split"] != "train"]
    labels_train = [int(r["label"] == "positive") for r in train]
    fit = FM.train_head(model, [bags[r["slide"]] for r in train], labels_train, epochs=args.baseline_epochs,
                        lr=args.lr, seed=seed, budget_s=max(0.0, budget_s - feature_s))  # fmt: skip
    wall = time.perf_counter() - t0
    probs = FM.predict_bags(model, [bags[r["slide"]] for r in held])[:, 1].tolist()
    ys = [int(r["label"] == "positive") for r in held]
    pred = [int(p > 0.5) for p in probs]
    loss = float(np.mean([-np.log(max(p if y else 1 - p, 1e-12)) for p, y in zip(probs, ys, strict=True)]))
    recall = [np.mean([q == y for q, y2 in zip(pred, ys, strict=True) if y2 == y]) for y in (0, 1)]
    points, masses = [], []
    for r in held:
        if r["label"] != "positive":
            continue
        w = FM.attention_weights(model, bags[r["slide"]]).numpy()
        rows_cols = grids[r["slide"]]
        inside = inside_mask(rows_cols, args.patch, (0.0, 0.0), 1.0, [b for b in side[r["slide"]]["boxes"]
                                                                    if b["kind"] == "lesion"])  # fmt: skip
        score = score_map(w.reshape(rows_cols), inside)
        points.append(score.pointing)
        masses.append(score.mass)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "validation.json").write_text(json.dumps({"slides": [
        {"slide": r["slide"], "label": r["label"], "probs": {"negative": 1 - p, "positive": p}}
        for r, p in zip(held, probs, strict=True)]}))  # fmt: skip
    return {
        "kind": "run", "input": "frozen features", "mpp": LESION_MPP, "pool": "attention", "seed": seed,
        "roc_auc": _num(auc(ys, probs)), "accuracy": float(np.mean([q == y for q, y in zip(pred, ys, strict=True)])),
        "balanced_accuracy": float(np.mean(recall)), "val_loss": loss, "chance_loss": chance_loss(labels),
        "pointing_game": float(np.mean(points)) if points else None,
        "lesion_mass": float(np.mean(masses)) if masses else None,
        "first_train_loss": fit.train_loss[0], "last_train_loss": fit.train_loss[-1], "head_epochs": fit.epochs,
        "feature_s": round(feature_s, 1), "budget_s": round(budget_s, 1), "patch": args.patch,
        "wall_s": round(wall, 1), "run_dir": str(run_dir),
    }  # fmt: skip


def auc(ys: list[int], ps: list[float]) -> float:
    """ROC AUC by pairwise comparison (ties count half); nan with one class only."""
    pos = [p for p, y in zip(ps, ys, strict=True) if y]
    neg = [p for p, y in zip(ps, ys, strict=True) if not y]
    if not pos or not neg:
        return float("nan")
    return sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))


def chance_loss(labels: Path) -> float:
    """The held-out cross-entropy of always predicting the training set's class shares (ln 2 when balanced): a run
    whose held-out loss is not below it has learned nothing it can show on held-out slides."""
    rows = list(csv.DictReader(labels.open()))
    train = [r["label"] for r in rows if r["split"] == "train"]
    held = [r["label"] for r in rows if r["split"] != "train"]
    share = {c: train.count(c) / len(train) for c in set(train)}
    return float(-np.mean([np.log(share.get(c, 1e-12)) for c in held]))


def localise(cfg: Any, run_dir: Path, labels: Path, pool: str) -> dict[str, float]:
    """Pointing game and map mass on the lesions (wsitrain.report.localisation) of the held-out positive slides:
    ``predict --heatmaps`` with the last checkpoint (as the AUC), attention maps for attention pools, else the CAM."""
    from rich.console import Console

    from wsitrain.train.predict import run_predict

    rows = list(csv.DictReader(labels.open()))
    slides_dir = Path(cfg.data.slides_dir)
    held = run_dir / "held_out_slides"
    held.mkdir(exist_ok=True)
    for r in rows:
        if r["split"] != "train" and not (held / r["slide"]).exists():
            (held / r["slide"]).symlink_to((slides_dir / r["slide"]).resolve())
    maps = run_dir / "heatmaps"
    with open(os.devnull, "w") as sink:
        run_predict(cfg, checkpoint=run_dir / "last.pt", slides=held, out=run_dir / "held_out.csv",
                    console=Console(file=sink), heatmaps=maps, viewer_files=False)  # fmt: skip
    return score_maps(maps, slides_dir / "lesions.json", pool)


def score_maps(maps: Path, lesions: Path, pool: str) -> dict[str, float]:
    """A run's localisation from its heatmaps folder: the attention or CAM map's (``map_key``), and for max pooling
    also its deciding cell's pointing game (``pointing_decisive``: where the max-pooled score was really decided)."""
    from wsitrain.report.localisation import DECISIVE, score_heatmaps

    key = map_key(pool)
    where = score_heatmaps(maps, lesions, key=key)
    if key == "cam" and pool_of(pool) == "max":
        where["pointing_decisive"] = score_heatmaps(maps, lesions, key=DECISIVE)["pointing_game"]
    return where


def lookalike_split(where: dict[str, float] | None) -> dict[str, Any]:
    """The pointing game apart on held-out positives that also carry a look-alike and on those that do not."""
    if where is None or "n_with_lookalike" not in where:
        return {}
    return {"pointing_with_lookalike": _num(where["pointing_game_with_lookalike"]),
            "pointing_without_lookalike": _num(where["pointing_game_without_lookalike"]),
            "n_positive": int(where["n_positive"]), "n_with_lookalike": int(where["n_with_lookalike"])}  # fmt: skip


def rescore(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole-slide rows scored again from their run folders' heatmaps (no prediction): the current localisation
    scores, the look-alike split included, for runs recorded before it existed."""
    setup = next(r for r in rows if r["kind"] == "setup")
    lesions = Path(setup["cohort"]) / "lesions.json"
    out = []
    for r in rows:
        maps = Path(r.get("run_dir") or "") / "heatmaps"
        if r.get("input") == "whole slide" and (maps / "heatmaps.json").exists():
            where = score_maps(maps, lesions, r["pool"])
            r = {**r, "pointing_game": _num(where["pointing_game"]), "lesion_mass": _num(where["lesion_mass"]),
                 "pointing_decisive": _num(where.get("pointing_decisive")), **lookalike_split(where)}  # fmt: skip
        out.append(r)
    return out


def _pointing_cell(rs: list[dict[str, Any]]) -> str:
    """Mean pointing game, and pooled over the seeds' held-out positives: with a look-alike / without one."""
    mean = _mean(rs, "pointing_game")
    decisive = _mean(rs, "pointing_decisive")
    split = [r for r in rs if r.get("n_with_lookalike") is not None]
    if mean == "-" or not split:
        return mean
    if decisive != "-":  # max pooling: the CAM's peak, then the deciding cell
        mean = f"CAM {mean}, deciding cell {decisive}"
    parts = []
    for key, n in (("pointing_with_lookalike", lambda r: r["n_with_lookalike"]),
                   ("pointing_without_lookalike", lambda r: r["n_positive"] - r["n_with_lookalike"])):  # fmt: skip
        hits = sum(r[key] * n(r) for r in split if r.get(key) is not None)
        total = sum(n(r) for r in split if r.get(key) is not None)
        parts.append(f"{round(hits)}/{total}" if total else "-")
    return f"{mean} ({parts[0]} / {parts[1]})"


def _num(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and np.isnan(x)) else float(x)


def machine() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "nproc": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
    }


# ---- reporting ----------------------------------------------------------------------------------------------------
def groups(rows: list[dict[str, Any]]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    runs = [r for r in rows if r["kind"] == "run"]
    keys: list[tuple[str, str]] = []
    for r in runs:
        if (r["input"], r["pool"]) not in keys:
            keys.append((r["input"], r["pool"]))
    order = next((r["pools"] for r in rows if r["kind"] == "setup"), [])
    rank = {"whole slide": 0, "frozen features": 1}
    keys.sort(key=lambda k: (rank.get(k[0], 2), order.index(k[1]) if k[1] in order else len(order), k[1]))
    return [(i, p, [r for r in runs if (r["input"], r["pool"]) == (i, p)]) for i, p in keys]


def prob_spread(row: dict[str, Any]) -> float | None:
    """Std of the held-out slides' positive-class probability: ~0 when a run collapsed to one output for all."""
    try:
        v = json.loads((Path(row["run_dir"]) / "validation.json").read_text())
    except (OSError, KeyError, ValueError):
        return None
    probs = [float(s["probs"].get("positive", 0.0)) for s in v.get("slides", [])]
    return float(np.std(probs)) if probs else None


def _mean(rs: list[dict[str, Any]], key: str) -> str:
    """Mean of a row key over runs that have it ('-' when none: older rows, or thumbnails for localisation)."""
    xs = [r[key] for r in rs if r.get(key) is not None]
    return f"{statistics.mean(xs):.2f}" if xs else "-"


def on_tissue(row: dict[str, Any]) -> dict[str, float] | None:
    """Max pooling: per class, the share of held-out slides whose score was decided on the tissue (validation.json's
    ``decided_on_tissue``, wsitrain/report/decision.py); None for other pools or runs that predate the record."""
    try:
        v = json.loads((Path(row["run_dir"]) / "validation.json").read_text())
    except (OSError, KeyError, ValueError):
        return None
    recs = [s["decided_on_tissue"] for s in v.get("slides", []) if s.get("decided_on_tissue")]
    if not recs:
        return None
    return {c: sum(bool(r[c]) for r in recs) / len(recs) for c in v.get("classes", [])}


def _on_tissue_cell(rs: list[dict[str, Any]]) -> str:
    shares = [x for x in (on_tissue(r) for r in rs) if x is not None]
    if not shares:
        return "-"
    return ", ".join(f"{c} {statistics.mean(s[c] for s in shares):.2f}" for c in shares[0])


def _mean_std(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.3f} ± {sd:.3f}"


def _where(setup: dict[str, Any]) -> str:
    """The machine a table was measured on: the GPU when the runs used one, else the CPU."""
    m = setup["machine"]
    if setup.get("device") == "cuda":
        return f"one {m.get('gpu')} ({m['nproc']}-core host)"
    return f"a {m['nproc']}-core CPU (no GPU)"


def _with(setup: dict[str, Any]) -> str:
    """The runs' extra config overrides (``--set``), as the table's setup line names them."""
    return "".join(f", `{o}`" for o in setup.get("overrides") or [])


def _start(setup: dict[str, Any]) -> str:
    """Where the runs' weights started: random, or the ``--set model.weights`` file (its override names it)."""
    pretrained = any(o.startswith("model.weights=") for o in setup.get("overrides") or [])
    return "initial weights from a file" if pretrained else "random initial weights"


def markdown(rows: list[dict[str, Any]]) -> str:
    head = next(r for r in rows if r["kind"] == "setup")
    m = head["machine"]
    lines = [
        "# Why whole slides: a learning benchmark (measured)",
        "",
        f"Measured on {_where(head)}, {m['torch_threads']} intra-op thread, torch {m['torch']}, "
        f"{m['date']}; `python benchmarks/bench_learning.py {head['argv']}` (total wall time "
        f"{head.get('total_wall_s', 0) / 60:.1f} min).",
        "",
        f"Cohort: `wsitrain synth --lesions small`, {head['n']} slides of {head['size']} px at {LESION_MPP} um/px "
        f"(seed {head['cohort_seed']}), half positive; per seed {head['n_train']} training and "
        f"{head['n'] - head['n_train']} held-out slides (stratified). Lesions: {head['lesion_share']}. "
        f"Model `{head.get('model', 'tiny')}` ({_start(head)}{_with(head)}), {head['epochs']} epochs, AdamW lr "
        f"{head['lr']}, {head.get('schedule', 'cosine')} schedule, "
        "flips and rot90; held-out AUC of the last epoch (no model selection on held-out slides)"
        + (f"; `train.head_warmup` of {head['head_warmup']} head-only steps before each end-to-end run (kept only "
           "when it learnt)." if head.get("head_warmup") else "."),
        "",
        "| input | pool | held-out ROC AUC (mean ± std) | per seed | accuracy (mean) | balanced accuracy (mean) "
        "| held-out loss / chance loss (mean) | spread of p(positive) (mean) "
        "| pointing game (mean; hits on positives with a look-alike / without) "
        "| mass on lesions (mean) | decided on tissue (max pool; mean share per class) | wall per run (mean) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for inp, pool, rs in groups(rows):
        aucs = [r["roc_auc"] for r in rs if r["roc_auc"] is not None]
        accs = [r["accuracy"] for r in rs if r["accuracy"] is not None]
        per = ", ".join(f"{r['roc_auc']:.2f}" if r["roc_auc"] is not None else "nan" for r in rs)
        spreads = [x for x in (prob_spread(r) for r in rs) if x is not None]
        spread = f"{statistics.mean(spreads):.3f}" if spreads else "-"
        what = {"whole slide": f"whole slide ({LESION_MPP} um/px)",
                "frozen features": f"frozen features ({LESION_MPP} um/px, baseline)"}.get(
            inp, f"thumbnail ({THUMB_MPP:g} um/px)")  # fmt: skip
        lines.append(
            f"| {what} | {pool} | {_mean_std(aucs)} | {per} | {statistics.mean(accs) if accs else float('nan'):.2f} "
            f"| {_mean(rs, 'balanced_accuracy')} | {_mean(rs, 'val_loss')} / {_mean(rs, 'chance_loss')} | {spread} "
            f"| {_pointing_cell(rs)} | {_mean(rs, 'lesion_mass')} | {_on_tissue_cell(rs)} "
            f"| {statistics.mean(r['wall_s'] for r in rs):.0f} s |"
        )
    lines += [
        "",
        f"Seeds: {', '.join(str(s) for s in head['seeds'])}. Accuracy thresholds p(positive) at 0.5; *spread* is the "
        "standard deviation of p(positive) over the held-out slides (near 0: the run gives every slide about the "
        "same output, and its AUC ranks tiny differences). *Chance loss*: the held-out cross-entropy of always "
        "answering the training set's class shares. *Pointing game*: the share of held-out positive slides whose "
        "highest attention cell (attention pools) or positive-class CAM cell (avg, max) lies in a lesion box of "
        "lesions.json, and in brackets its hits over the seeds on the positives that also carry a look-alike "
        "(a distractor: the same image as a lesion at thumbnail scale) and on those that do not; for max pooling "
        "also its *deciding cell* (the cell whose channel maxima gave the largest part of the positive logit, where "
        "the score was really decided; the brackets stay the CAM's); "
        "*mass on lesions*: the share of that map's total there (wsitrain.report.localisation); "
        "whole slides only. *Decided on tissue*: per class, the share of held-out slides whose max-pooled score was "
        "decided at a map cell inside the tissue mask (`model.mask_pool`). "
        "Wall time is the fit's (the held-out prediction with heatmaps is timed apart: `localise_s` in the JSONL). "
        "*Frozen features* (``--baseline``): the same model and seed with its trunk frozen, every "
        f"{next((r.get('patch') for r in rows if r.get('input') == 'frozen features'), 64)} px patch of level 0 "
        "embedded once, the model's own attention head trained on the bags within the seed's mean end-to-end wall "
        "time (wsitrain.train.frozen_mil); its pointing game and mass are over the patch grid. "
        + "".join(f"Seed {r['seed']}'s baseline was run again alone (`--rerun-baseline {r['seed']}`) with the budget "
                  "its first run recorded, which had shared the CPU with other work. " for r in rows if r.get("rerun"))
        + "Every figure above is measured.",
    ]
    return "\n".join(lines) + "\n"


def example_crops(cohort: Path) -> list[tuple[str, np.ndarray]] | None:
    """A lesion and a distractor of the cohort at level 0 and on the thumbnail (4x4 block means, shown 4x)."""
    import openslide

    try:
        side = read_sidecar(cohort)["slides"]
    except OSError:
        return None
    picks: dict[str, tuple[str, dict[str, Any]]] = {}
    for name, entry in sorted(side.items()):
        for b in entry["boxes"]:
            picks.setdefault(b["kind"], (name, b))
    if set(picks) != {"lesion", "distractor"}:
        return None
    out = []
    for kind in ("lesion", "distractor"):
        name, b = picks[kind]
        pad = 40
        x0, y0 = max(0, b["x0"] - pad), max(0, b["y0"] - pad)
        w, h = b["x1"] - b["x0"] + 2 * pad, b["y1"] - b["y0"] + 2 * pad
        img = np.asarray(openslide.OpenSlide(str(cohort / name)).read_region((x0, y0), 0, (w, h)).convert("RGB"))
        hb, wb = h // BLOCK * BLOCK, w // BLOCK * BLOCK
        thumb = img[:hb, :wb].reshape(hb // BLOCK, BLOCK, wb // BLOCK, BLOCK, 3).mean(axis=(1, 3)).astype(np.uint8)
        out.append((f"{kind}, level 0 ({LESION_MPP:g} um/px)", img))
        out.append((f"{kind}, thumbnail ({THUMB_MPP:g} um/px)", np.repeat(np.repeat(thumb, BLOCK, 0), BLOCK, 1)))
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    gs = groups(rows)
    if not gs:
        return
    head = next(r for r in rows if r["kind"] == "setup")
    m = head["machine"]
    crops = example_crops(Path(head["cohort"])) if head.get("cohort") else None
    fig = plt.figure(figsize=(max(7, 1.3 * len(gs) + 2) + (4.5 if crops else 0), 5))
    grid = fig.add_gridspec(2, 3 if crops else 1, width_ratios=(2.6, 1, 1) if crops else (1,))
    ax = fig.add_subplot(grid[:, 0])
    for i, (inp, _pool, rs) in enumerate(gs):
        aucs = [r["roc_auc"] for r in rs if r["roc_auc"] is not None]
        colour = {"whole slide": "tab:blue", "frozen features": "tab:green"}.get(inp, "tab:orange")
        if aucs:
            ax.bar(i, statistics.mean(aucs), 0.6, color=colour, alpha=0.6,
                   yerr=statistics.stdev(aucs) if len(aucs) > 1 else 0, capsize=4)  # fmt: skip
            ax.scatter([i] * len(aucs), aucs, color="k", s=14, zorder=3)
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(gs)), [f"{i}\n{p}" for i, p, _ in gs],
                  fontsize=8)  # fmt: skip
    ax.set(ylabel="held-out ROC AUC", ylim=(0, 1.05),
           title=f"whole slide ({head['size']} px) vs {head['size'] // BLOCK} px thumbnail (measured)")  # fmt: skip
    if crops:
        for k, (title, img) in enumerate(crops):
            a = fig.add_subplot(grid[k % 2, 1 + k // 2])
            a.imshow(img, interpolation="nearest")
            a.set_title(title, fontsize=7)
            a.axis("off")
    fig.suptitle(f"measured on {_where(head)}, {m['torch_threads']} thread, torch {m['torch']}, model "
                 f"{head.get('model', 'tiny')}; "
                 f"{len(head['seeds'])} seeds (dots), bars: mean ± std", fontsize=8, y=0.02)  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "bench_learning.jsonl").open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (out / "bench_learning.md").write_text(markdown(rows))
    plot(rows, out / "bench_learning.png")


def rerun_baseline(rows: list[dict[str, Any]], seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``rows`` with ``seed``'s frozen-feature baseline run again on the recorded cohort and split, with the budget
    its row recorded (the seed's mean end-to-end wall time), the benchmark's own settings and ``--threads``."""
    setup = next(r for r in rows if r["kind"] == "setup")
    old = next(r for r in rows if r.get("input") == "frozen features" and r.get("seed") == seed)
    for key in ("n", "size", "epochs", "lr", "schedule"):
        setattr(args, key, setup[key])
    torch.set_num_threads(args.threads)
    cohort = Path(setup["cohort"])
    labels = args.work / f"labels_seed{seed}.csv"
    base = base_config(labels, cohort, args.work / "runs", args)
    row = run_baseline(base, labels, seed, old["budget_s"], args, args.work / "runs" / f"frozen-attention-seed{seed}")
    row.update(torch=torch.__version__, nproc=os.cpu_count(), torch_threads=torch.get_num_threads(), rerun=True)
    print(f"seed {seed} frozen features attention AUC {row['roc_auc']} acc {row['accuracy']} ({row['wall_s']} s, "
          f"{row['head_epochs']} head epochs; was {old['head_epochs']})", flush=True)  # fmt: skip
    return [row if r is old else r for r in rows]


# ---- runs: one per (seed, input, pool), in this process or in --jobs child processes ----------------------------
WHOLE, THUMBNAIL, BASELINE = "whole", "thumbnail", "baseline"


@dataclasses.dataclass(frozen=True)
class Unit:
    """One run of the benchmark: a seed, an input (``WHOLE``, ``THUMBNAIL`` or the frozen-feature ``BASELINE``) and
    a head. ``budget_s``: the baseline's wall-time budget (its seed's mean end-to-end whole-slide wall time)."""

    seed: int
    input: str
    pool: str
    budget_s: float = 0.0

    def key(self) -> str:
        return f"{self.seed}:{self.input}:{self.pool}:{self.budget_s!r}"

    @staticmethod
    def parse(text: str) -> Unit:
        seed, inp, pool, budget = text.split(":")
        return Unit(int(seed), inp, pool, float(budget))


def run_unit(unit: Unit, cohort: Path, labels: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``unit``'s row, run in this process."""
    csv_path = split_csv(cohort, labels, unit.seed, args.train, args.work)
    base = base_config(csv_path, cohort, args.work / "runs", args)
    if unit.input == BASELINE:
        run_dir = args.work / "runs" / f"frozen-attention-seed{unit.seed}"
        row = run_baseline(base, csv_path, unit.seed, unit.budget_s, args, run_dir)
    else:
        row = run_one(base, args.work, csv_path, unit.seed, unit.pool, unit.input == THUMBNAIL, tuple(args.set))
    row.update(torch=torch.__version__, nproc=os.cpu_count(), torch_threads=torch.get_num_threads())
    return row


def run_in_child(unit: Unit, argv: list[str], work: Path) -> dict[str, Any]:
    """``unit``'s row, run by this script in a child process with the benchmark's own arguments (``--jobs``): each
    child has its ``--threads`` intra-op threads, as a run in this process has. Its output goes to
    ``work/logs/``; a failed child is an error naming that log."""
    tag = f"seed{unit.seed}-{unit.input}-{unit.pool}"
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    row_path, log = logs / f"{tag}.json", logs / f"{tag}.log"
    row_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--unit", unit.key(), "--unit-row", str(row_path)]
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0 or not row_path.is_file():
        raise RuntimeError(f"the {tag} run failed (exit {rc}): see {log}")
    return json.loads(row_path.read_text())


def run_units(units: list[Unit], jobs: int, run: Callable[[Unit], dict[str, Any]]
              ) -> Iterator[tuple[Unit, dict[str, Any]]]:  # fmt: skip
    """Each unit with its row as it finishes: one at a time in this process (``jobs`` 1) or ``jobs`` at once."""
    if jobs == 1:
        for u in units:
            yield u, run(u)
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run, u): u for u in units}
        for done in concurrent.futures.as_completed(futures):
            yield futures[done], done.result()


# ---- main -------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=f"{__doc__}\nDocs page: {PAGE}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="folder for bench_learning.{jsonl,md,png}")
    ap.add_argument("--cohort", type=Path, default=Path(".cache/wsitrain/lesions"), help="where the slides go")
    ap.add_argument("--work", type=Path, default=Path(".cache/wsitrain/bench_learning"), help="run folders, CSVs")
    ap.add_argument("--n", type=int, default=64, help="slides in the cohort")
    ap.add_argument("--size", type=int, default=2048, help="slide edge, px (the thumbnail is size / 4)")
    ap.add_argument("--train", type=int, default=32, help="training slides per seed (the rest are held out)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (split, weights, order)")
    ap.add_argument("--pools", default=None, help="comma-separated model.pool values (default: avg,max,attention)")
    ap.add_argument("--epochs", type=int, default=3)
    # 3e-3 (the demo's) collapsed avg and attention pooling to one output for every slide within an epoch here
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--schedule", choices=("cosine", "constant"), default="constant", help="train.schedule")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    ap.add_argument("--model", default="tiny",
                    help="model.name: the trunk (default tiny), from random weights unless --set model.weights=FILE")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="engine.device")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, as `wsitrain fit --set` (e.g. model.freeze_bn=false)")
    ap.add_argument("--no-thumbnail", action="store_true", help="skip the thumbnail baseline")
    ap.add_argument("--baseline", action="store_true",
                    help="also the frozen-feature baseline per seed (frozen trunk, patch features)")  # fmt: skip
    ap.add_argument("--patch", type=int, default=64, help="the baseline's patch edge, px (level 0)")
    ap.add_argument("--baseline-epochs", type=int, default=2000,
                    help="the baseline head's epoch cap; the wall-time budget normally stops it first")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=0,
                    help="train.head_warmup steps before every run (patches of --patch px); 0: none")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="16 slides of 1024 px, 8 train, 1 seed, 2 epochs")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, each in its own process with --threads threads (2 on a 2-core CPU)")
    ap.add_argument("--unit", default=None, help=argparse.SUPPRESS)  # a --jobs child's one run
    ap.add_argument("--unit-row", type=Path, default=None, help=argparse.SUPPRESS)  # where it writes its row
    ap.add_argument("--plot-only", action="store_true", help="rewrite the table and plot from --out's JSONL")
    ap.add_argument("--rescore", action="store_true",
                    help="score the whole-slide runs of --out's JSONL again from their heatmaps, then rewrite")
    ap.add_argument("--rerun-baseline", type=int, default=None, metavar="SEED",
                    help="run SEED's frozen-feature baseline again with the wall-time budget --out's JSONL "
                         "recorded for it, and replace its row (a CPU shared during it: its budget bought less)")
    args = ap.parse_args(argv)
    if args.plot_only or args.rescore or args.rerun_baseline is not None:
        recorded = args.out / "bench_learning.jsonl"
        if not recorded.is_file():
            print(f"error: {recorded} does not exist: run the benchmark with --out {args.out} first", file=sys.stderr)
            return 2
        rows = [json.loads(x) for x in recorded.read_text().splitlines() if x.strip()]
        if args.rescore:
            rows = rescore(rows)
        if args.rerun_baseline is not None:
            seeds = sorted(r["seed"] for r in rows if r.get("input") == "frozen features")
            if args.rerun_baseline not in seeds:
                print(f"error: --rerun-baseline {args.rerun_baseline}: {recorded} has no frozen-feature baseline of "
                      f"that seed (it has: {', '.join(map(str, seeds)) or 'none; run with --baseline'})",
                      file=sys.stderr)  # fmt: skip
                return 2
            rows = rerun_baseline(rows, args.rerun_baseline, args)
        write(rows, args.out)
        return 0
    if args.quick:
        args.n, args.size, args.train, args.seeds, args.epochs = 16, 1024, 8, "0", 2
    default = [p for p in ("avg", "max", "attention") if p in available_pools()]
    pools = args.pools.split(",") if args.pools else default
    unknown = [p for p in pools if p not in available_pools()]
    if unknown:
        print(f"error: --pools {','.join(unknown)} not available in this wsitrain (have: "
              f"{', '.join(available_pools())})", file=sys.stderr)  # fmt: skip
        return 2
    if args.jobs < 1:
        print(f"error: --jobs {args.jobs}: give 1 (one run at a time, in this process) or more", file=sys.stderr)
        return 2
    if not 2 <= args.train <= args.n - 2:
        print(f"error: --train {args.train} must leave at least 2 of --n {args.n} slides on each side", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",")]
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    cohort = args.cohort / f"n{args.n}-s{args.size}"
    labels = write_synthetic_dataset(cohort, n=args.n, size=args.size, seed=0, lesions="small")
    side = read_sidecar(cohort)["slides"]
    shares = [sum(b["area_px"] for b in s["boxes"] if b["kind"] == "lesion") / s["tissue_px"]
              for s in side.values() if s["label"] == "positive"]  # fmt: skip
    setup = {
        "kind": "setup", "n": args.n, "size": args.size, "n_train": args.train, "seeds": seeds, "pools": pools,
        "epochs": args.epochs, "lr": args.lr, "schedule": args.schedule, "cohort_seed": 0, "machine": machine(),
        "head_warmup": args.warmup, "model": args.model, "device": args.device, "overrides": args.set,
        "cohort": str(cohort),
        "argv": " ".join(sys.argv[1:] if argv is None else argv),
        "lesion_share": f"{100 * min(shares):.2f}-{100 * max(shares):.2f}% of the tissue per positive slide",
        "cohort_s": round(time.perf_counter() - t_start, 1),
    }  # fmt: skip
    print(f"cohort {cohort} ready ({setup['cohort_s']} s); lesions {setup['lesion_share']}", flush=True)
    (args.work / "runs").mkdir(parents=True, exist_ok=True)
    if args.unit is not None:  # a --jobs child: its one run, its row to --unit-row
        row = run_unit(Unit.parse(args.unit), cohort, labels, args)
        args.unit_row.write_text(json.dumps(row))
        return 0
    child_argv = list(sys.argv[1:] if argv is None else argv)

    def run(u: Unit) -> dict[str, Any]:
        return run_unit(u, cohort, labels, args) if args.jobs == 1 else run_in_child(u, child_argv, args.work)

    rows: list[dict[str, Any]] = [setup]
    done: dict[tuple[int, str, str], dict[str, Any]] = {}
    inputs = [WHOLE] + ([] if args.no_thumbnail else [THUMBNAIL])
    # per seed: its whole slides, thumbnails, then its baseline
    order = [k for s in seeds for k in [(s, i, p) for i in inputs for p in pools] + [(s, BASELINE, "attention")]]

    def budget(seed: int) -> float:
        """A baseline's wall-time budget: its seed's mean end-to-end whole-slide wall time."""
        return statistics.mean([r["wall_s"] for (s_, i, _), r in done.items() if (s_, i) == (seed, WHOLE)] or [60.0])

    # the whole-slide runs first (the longest), then the thumbnails; the baselines last, as each one's budget is
    # measured by its seed's whole-slide runs
    phases = [lambda: [Unit(seed, inp, pool) for inp in inputs for seed in seeds for pool in pools]]
    if args.baseline:
        phases.append(lambda: [Unit(seed, BASELINE, "attention", budget(seed)) for seed in seeds])
    for phase in phases:
        for unit, row in run_units(phase(), args.jobs, run):
            done[(unit.seed, unit.input, unit.pool)] = row
            rows[1:] = [done[k] for k in order if k in done]  # the table's order, whatever order they finish in
            setup["total_wall_s"] = round(time.perf_counter() - t_start, 1)
            write(rows, args.out)  # after every run: a cut-off benchmark keeps what it measured
            detail = f", {row['head_epochs']} head epochs" if unit.input == BASELINE else ""
            print(f"seed {unit.seed} {row['input']:11s} {row['pool']:9s} AUC {row['roc_auc']} acc {row['accuracy']} "
                  f"({row['wall_s']} s{detail})", flush=True)  # fmt: skip
    setup["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    write(rows, args.out)
    print((args.out / "bench_learning.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
