"""Does fine-tuning a foundation model on the slide label pay? A small ViT pretrained without labels, four ways.

    python benchmarks/bench_foundation.py --out docs/benchmarks --jobs 2  # the documented run (2 cores)
    python benchmarks/bench_foundation.py --out /tmp/bf --quick         # a smoke run: 16 slides, 1 seed
    python benchmarks/bench_foundation.py --out docs/benchmarks --write-only  # rewrite the page from the JSONL

The encoder stands in for UNI / Virchow2 / H-optimus-0 (no weights are downloaded here): ``benchmarks/small_vit.py``
(a timm VisionTransformer on 32 px patches, 16 px tokens, width 64, 4 blocks), pretrained *without labels* by
``benchmarks/pretrain_patches.py --objective contrastive`` (SimCLR: two augmented 32 px views of random 40 px tissue
crops, NT-Xent) on a disjoint cohort (``wsitrain synth --lesions small``, cohort seed 1; the benchmark's is seed 0,
no slide shared). Its file is the trunk's state dict, loaded with ``model.weights``.

On the learning benchmark's cohort and protocol (benchmarks/bench_learning.py: ``--n`` slides of ``--size`` px at
2.5 um/px, lesions of 200 um on half of them and look-alikes on all; per seed a stratified split into ``--train``
training slides and the rest held out; the held-out AUC of the last epoch; flips and rot90), four runs per seed with
the model ``python:benchmarks.small_vit:small_vit`` at ``model.patch: 32`` and an attention-MIL head:

- **frozen features**: the encoder frozen whole, every 32 px patch of each slide embedded once per augmentation (the
  8 flips and quarter turns) into the frozen-feature cache (wsitrain.train.feature_cache), the model's own
  attention head trained on the cached bags (wsitrain.train.frozen_mil) within the seed's mean end-to-end wall time;
  the cache is shared by the seeds (the same encoder), so only the first seed pays for the features;
- **end-to-end, all blocks**: ``wsitrain fit`` over every patch of every slide, exact (the SFT engine's patch trunk);
- **end-to-end, last two blocks**: ``model.freeze: {last_blocks: 2}`` (stem and blocks 0-1 fixed, forward only);
- **LoRA**: ``model.lora: {rank: 4, alpha: 8, targets: [qkv, proj]}`` (the encoder's own weights fixed);
- **LP-FT**: all blocks end to end after ``train.head_warmup`` (the head trained alone on the frozen encoder's patch
  embeddings first, as linear-probe-then-fine-tune recipes do).

Reported per row: held-out ROC AUC (mean, std, each seed), accuracy, held-out loss against the chance loss, pointing
game (the share of held-out positive slides whose highest attention patch lies in a lesion), wall time per run; and
the CNN whole-slide rows of docs/benchmarks/bench_learning/pretrained_fresh (tiny_ln pretrained on the same kind of
disjoint cohort, seeds 67-69) beside them. Every figure is *measured* on the machine that runs it. Writes
``foundation-models.{jsonl,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import importlib.util
import io
import json
import multiprocessing
import statistics
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL = "python:benchmarks.small_vit:small_vit"
PATCH = 32
FROZEN, ALL, LAST2, LORA = "frozen features", "end-to-end, all blocks", "end-to-end, last two blocks", "LoRA"
LPFT = "end-to-end, all blocks, head first (LP-FT)"
# row -> the config overrides of its end-to-end run (FROZEN is not a fit: wsitrain.train.frozen_mil). LP-FT (linear
# probe, then fine-tune; Kumar et al. 2022): the head is trained alone on the frozen encoder's patch embeddings first
# (train.head_warmup, as many head steps as the frozen row's head gets at most), then everything end to end, so the
# encoder is fine-tuned from a head that already points at what its features carry.
RUNS: dict[str, list[str]] = {
    ALL: [],
    LAST2: ["model.freeze={last_blocks: 2}"],
    LORA: ["model.lora={rank: 4, alpha: 8, targets: [qkv, proj]}"],
    LPFT: [f"train.head_warmup={{steps: 2000, patch: {PATCH}}}"],
}
ORDER = (FROZEN, ALL, LAST2, LORA, LPFT)
KEYS = {"frozen": FROZEN, "all": ALL, "last2": LAST2, "lora": LORA, "lpft": LPFT}  # --rows
# the scripts it runs in its own process: the learning benchmark (cohort, split, fit) and the pretraining
BENCH_LEARNING = Path(__file__).with_name("bench_learning.py")
PRETRAIN = Path(__file__).with_name("pretrain_patches.py")


def bench_learning() -> Any:
    """benchmarks/bench_learning.py as a module: its cohort, split, fit run and
    localisation are this benchmark's too."""
    path = BENCH_LEARNING
    if path.is_file():
        spec = importlib.util.spec_from_file_location("bench_learning", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_learning"] = module
        spec.loader.exec_module(module)
        return module
    raise SystemExit(f"error: {path} is missing")


def pretrain(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The encoder's file: pretrained without labels by benchmarks/pretrain_patches.py (in this process), unless
    ``--encoder`` names one."""
    if args.encoder is not None:
        return args.encoder, {"encoder": str(args.encoder), "pretrained_here": False}
    out = args.work / "small_vit_simclr.pt"
    spec = importlib.util.spec_from_file_location("pretrain_patches", PRETRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = ["--objective", "contrastive", "--model", MODEL, "--model-patch", str(PATCH), "--patch", "40",
            "--n", str(args.pretrain_n), "--crops", "64", "--batch", "128", "--epochs", str(args.pretrain_epochs),
            "--lr", "1e-3", "--threads", str(args.threads), "--cohort", str(args.work / "pretrain"),
            "--out", str(out)]  # fmt: skip
    t0 = time.perf_counter()
    log = io.StringIO()
    with redirect_stdout(log):
        code = module.main(argv)
    if code:
        raise SystemExit(f"error: pretraining failed ({code}):\n{log.getvalue()}")
    lines = log.getvalue().splitlines()
    probe = [ln for ln in lines if "linear probe" in ln]
    probe = [ln.split("held-out linear probe: ", 1)[-1] for ln in probe]
    return out, {"encoder": str(out), "pretrained_here": True, "pretrain_argv": " ".join(argv),
                 "pretrain_s": round(time.perf_counter() - t0, 1), "probe_before": probe[0] if probe else None,
                 "probe_after": probe[-1] if probe else None,
                 "contrastive_loss": [ln for ln in lines if ln.startswith("epoch")][-1:]}  # fmt: skip


def base_config(bl: Any, labels: Path, cohort: Path, runs: Path, encoder: Path,
                args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """bench_learning's fit config with the ViT at model.patch 32, its pretrained weights, and an attention head."""
    ns = argparse.Namespace(model=MODEL, device=args.device, epochs=args.epochs, lr=args.lr, schedule="constant",
                            warmup=0, patch=PATCH)  # fmt: skip
    cfg = bl.base_config(labels, cohort, runs, ns)
    cfg["model"].update({"patch": PATCH, "weights": str(encoder), "pool": "attention"})
    return cfg


def run_fit_row(row: str, seed: int, labels: str, cohort: str, encoder: str, args: argparse.Namespace) -> dict:
    """One end-to-end row's fit (a process of its own under ``--jobs``)."""
    torch.set_num_threads(args.threads)
    bl = bench_learning()
    work = args.work / row.replace(" ", "_").replace(",", "")
    (work / "runs").mkdir(parents=True, exist_ok=True)
    base = base_config(bl, Path(labels), Path(cohort), work / "runs", Path(encoder), args)
    result = bl.run_one(base, work, Path(labels), seed, "attention", False, extra=tuple(RUNS[row]))
    return {**result, "row": row}


def run_frozen_row(seed: int, labels: str, cohort: str, encoder: str, budget_s: float,
                   args: argparse.Namespace) -> dict:  # fmt: skip
    """The frozen-feature row: cached bags (8 augmentations per slide), the attention head trained on them."""
    from wsitrain.report.localisation import inside_mask, score_map
    from wsitrain.slides.synth.lesions import read_sidecar
    from wsitrain.train import frozen_mil as FM
    from wsitrain.train.feature_cache import FeatureCache

    torch.set_num_threads(args.threads)
    bl = bench_learning()
    rows = list(csv.DictReader(Path(labels).open()))
    side = read_sidecar(Path(cohort))["slides"]
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = FM.build_frozen_mil(MODEL, 2, pool="attention", weights=encoder, patch=PATCH)
    cache = FeatureCache(args.work / "feature_cache", model, PATCH)
    views: dict[str, list[torch.Tensor]] = {}
    grids: dict[str, tuple[int, int]] = {}
    for r in rows:
        path = Path(cohort) / r["slide"]
        image: list[torch.Tensor] = []

        def read(path: Path = path, image: list[torch.Tensor] = image) -> torch.Tensor:
            if not image:
                image.append(bl.read_level0(path))
            return image[0]

        n_aug = args.augmentations if r["split"] == "train" else 1
        views[r["slide"]] = [cache.bag(r["slide"], k, read) for k in range(n_aug)]
        grids[r["slide"]] = (args.size // PATCH, args.size // PATCH)  # the cohort's slides are square
    feature_s = time.perf_counter() - t0
    train = [r for r in rows if r["split"] == "train"]
    held = [r for r in rows if r["split"] != "train"]
    fit = FM.train_head(model, [views[r["slide"]] for r in train], [int(r["label"] == "positive") for r in train],
                        epochs=args.head_epochs, lr=args.lr, seed=seed,
                        budget_s=max(0.0, budget_s - feature_s))  # fmt: skip
    wall = time.perf_counter() - t0
    probs = FM.predict_bags(model, [views[r["slide"]][0] for r in held])[:, 1].tolist()
    ys = [int(r["label"] == "positive") for r in held]
    pred = [int(p > 0.5) for p in probs]
    loss = float(np.mean([-np.log(max(p if y else 1 - p, 1e-12)) for p, y in zip(probs, ys, strict=True)]))
    points = []
    for r in held:
        if r["label"] == "positive":
            wts = FM.attention_weights(model, views[r["slide"]][0]).numpy()
            grid = grids[r["slide"]]
            boxes = [b for b in side[r["slide"]]["boxes"] if b["kind"] == "lesion"]
            points.append(score_map(wts.reshape(grid), inside_mask(grid, PATCH, (0.0, 0.0), 1.0, boxes)).pointing)
    return {
        "kind": "run", "row": FROZEN, "seed": seed, "roc_auc": bl.auc(ys, probs),
        "accuracy": float(np.mean([q == y for q, y in zip(pred, ys, strict=True)])), "val_loss": loss,
        "chance_loss": bl.chance_loss(Path(labels)), "pointing_game": float(np.mean(points)) if points else None,
        "head_epochs": fit.epochs, "first_train_loss": fit.train_loss[0], "last_train_loss": fit.train_loss[-1],
        "feature_s": round(feature_s, 1), "cache_computed": cache.computed, "cache_hits": cache.hits,
        "augmentations": args.augmentations, "budget_s": round(budget_s, 1), "wall_s": round(wall, 1),
    }  # fmt: skip


# ---- reporting ------------------------------------------------------------------------------------------------------
# the CNN rows beside them: bench_learning runs on the same cohort and protocol (tiny_ln, 48 slides, 12 epochs,
# lr 3e-4): its trunk pretrained on patch labels (pretrained_fresh, seeds 67-69) and without labels (contrastive,
# SimCLR as here, seeds 61-63)
CNN_RUNS = {"pretrained_fresh": "labels", "contrastive": "SimCLR"}
CNN_ROWS = {("whole slide", "max"), ("whole slide", "attention"), ("frozen features", "attention")}


def cnn_rows() -> list[dict[str, Any]]:
    """The CNN rows of docs' bench_learning runs (CNN_RUNS), where they are in this checkout."""
    rows: list[dict[str, Any]] = []
    for name, how in CNN_RUNS.items():
        for folder in (ROOT / "docs" / "bench_learning", ROOT / "docs" / "benchmarks" / "bench_learning"):
            path = folder / f"{name}.jsonl"
            if path.is_file():
                runs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
                rows += [{**r, "row": f"CNN tiny_ln ({how}-pretrained): {r['input']}, {r['pool']}"} for r in runs
                         if r.get("kind") == "run" and (r["input"], r["pool"]) in CNN_ROWS]  # fmt: skip
                break
    return rows


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.mean(vals) if vals else None


def _fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| row | held-out ROC AUC (mean ± sample std) | per seed | accuracy (mean) | "
           "held-out loss / chance (mean) | pointing game (mean) | wall per run (mean) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    names = [n for n in ORDER if any(r["row"] == n for r in rows)]
    names += list(dict.fromkeys(r["row"] for r in rows if r["row"] not in ORDER))
    for name in names:
        rs = sorted((r for r in rows if r["row"] == name), key=lambda r: r["seed"])
        aucs = [r["roc_auc"] for r in rs]
        sd = statistics.stdev(aucs) if len(aucs) > 1 else 0.0  # the sample std, as bench_learning's tables
        out.append(f"| {name} | {statistics.mean(aucs):.3f} ± {sd:.3f} | {', '.join(f'{a:.2f}' for a in aucs)} | "
                   f"{_fmt(_mean(rs, 'accuracy'))} | {_fmt(_mean(rs, 'val_loss'))} / {_fmt(_mean(rs, 'chance_loss'))} "
                   f"| {_fmt(_mean(rs, 'pointing_game'))} | {_fmt(_mean(rs, 'wall_s'), 0)} s |")  # fmt: skip
    return out


def markdown(setup: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    m = setup["machine"]
    lines = [
        "# Does fine-tuning a foundation model pay? (measured)",
        "",
        f"Measured on {m['nproc']} CPU cores ({m['cpu']}, no GPU), {setup['threads']} intra-op thread(s) per run, "
        f"torch {m['torch']}, {m['date']}; `python benchmarks/bench_foundation.py {setup['argv']}` "
        f"(total wall time {setup.get('total_wall_s', 0) / 60:.1f} min).",
        "",
        f"Cohort: `wsitrain synth --lesions small`, {setup['n']} slides of {setup['size']} px at 2.5 um/px (seed 0), "
        f"half positive; per seed {setup['n_train']} training slides, the rest held out (stratified). Model "
        f"`{MODEL}` (a ViT: 32 px patches of 16 px tokens, width 64, 4 blocks; 0.18 M parameters) at `model.patch: "
        f"{PATCH}`, attention-MIL head, {setup['epochs']} epochs, AdamW lr {setup['lr']:g}, constant schedule, flips "
        "and rot90; held-out AUC of the last epoch.",
        "",
        "Encoder: " + (f"pretrained here without labels, {setup.get('pretrain_s', '?')} s: `python "
                       f"benchmarks/pretrain_patches.py {setup.get('pretrain_argv', '')}` (SimCLR on random tissue "
                       "crops of a disjoint cohort, cohort seed 1; no label read for training). Its held-out linear "
                       f"probe before: {setup.get('probe_before')}; after: {setup.get('probe_after')}."
                       if setup.get("pretrained_here") else f"the file {setup['encoder']}."),
        "",
        *table(rows),
        "",
        f"Seeds: {', '.join(map(str, setup['seeds']))}. *Frozen features*: the encoder frozen whole, each slide's "
        f"patches embedded once per augmentation ({setup['augmentations']} of the 8 flips and quarter turns for "
        "training slides, the slide itself for held-out ones) into the frozen-feature cache and read back from disk "
        "by later seeds; the head trained on the bags within the seed's mean end-to-end wall time. *Last two "
        "blocks*: `model.freeze: {last_blocks: 2}`. *LoRA*: `model.lora: {rank: 4, alpha: 8, targets: [qkv, "
        f"proj]}}`. *LP-FT*: `train.head_warmup: {{steps: 2000, patch: {PATCH}}}`, then all blocks. "
        "*Chance loss*: always answering the training set's class shares. *Pointing game*: the share of "
        "held-out positive slides whose highest attention patch lies in a lesion box.",
    ]
    if len(setup["seeds"]) < 3 or setup["n"] < 48 or setup["epochs"] < 12:
        lines += ["", f"**A reduced run** ({len(setup['seeds'])} seed(s), {setup['n']} slides, {setup['epochs']} "
                  "epochs): the protocol's full run is `python benchmarks/bench_foundation.py --out docs/benchmarks "
                  "--jobs 2` (48 slides, seeds 67-69, 12 epochs)."]  # fmt: skip
    cnn = [r for r in rows if r["row"].startswith("CNN")]
    if cnn:
        lines += ["", "The CNN rows are the learning benchmark's (benchmarks/bench_learning.py, measured 2026-11-29 "
                  "on this kind of machine, the same cohort and protocol: 48 slides of 1024 px, 12 epochs, lr 3e-4) "
                  "with the tiny_ln trunk (4 convolutions with a LayerNorm, 32 channels) pretrained on a disjoint "
                  "cohort by `benchmarks/pretrain_patches.py`: on patch labels "
                  "(docs/benchmarks/bench_learning/pretrained_fresh, seeds 67-69) and without labels, SimCLR as the "
                  "ViT here (docs/benchmarks/bench_learning/contrastive, seeds 61-63). Their *frozen features* row "
                  "embeds 64 px patches without the cache's augmentations."]
    if setup.get("notes"):  # what the figures show, added to the recorded setup row by whoever read them
        lines += ["", "## What it shows", "", *[f"{n}\n" for n in setup["notes"]]]
    return "\n".join(lines).rstrip() + "\n"


def write(setup: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "foundation-models.jsonl").open("w") as f:
        for r in [setup, *rows]:
            f.write(json.dumps(r) + "\n")
    (out / "foundation-models.md").write_text(markdown(setup, rows + cnn_rows()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for foundation-models.{jsonl,md}")
    ap.add_argument("--cohort", type=Path, default=Path(".cache/wsitrain/lesions"), help="the benchmark's slides")
    ap.add_argument("--work", type=Path, default=Path(".cache/wsitrain/bench_foundation"), help="runs, cache")
    ap.add_argument("--encoder", type=Path, default=None, help="a pretrained encoder file (default: pretrain one)")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--train", type=int, default=24)
    ap.add_argument("--seeds", default="67,68,69")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--rows", default=",".join(KEYS), help=f"comma-separated rows to run, of {', '.join(KEYS)}")
    ap.add_argument("--augmentations", type=int, default=8, help="frozen features: cached views per training slide")
    ap.add_argument("--head-epochs", type=int, default=2000, help="frozen features: head epochs at most")
    ap.add_argument("--pretrain-n", type=int, default=32, help="slides of the pretraining cohort")
    ap.add_argument("--pretrain-epochs", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each in a process of its own")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="16 slides, 8 train, 1 seed, 2 epochs, short pretraining")
    ap.add_argument("--write-only", action="store_true", help="rewrite the page from --out's JSONL")
    args = ap.parse_args(argv)
    recorded = args.out / "foundation-models.jsonl"
    if args.write_only:
        if not recorded.is_file():
            print(f"error: {recorded} does not exist: run the benchmark first", file=sys.stderr)
            return 2
        setup, *rows = [json.loads(x) for x in recorded.read_text().splitlines() if x.strip()]
        write(setup, rows, args.out)
        return 0
    if args.quick:
        args.n, args.train, args.seeds, args.epochs = 16, 8, "0", 2
        args.pretrain_n, args.pretrain_epochs, args.augmentations = 8, 3, 2
    if unknown := [r for r in args.rows.split(",") if r not in KEYS]:
        print(f"error: --rows {','.join(unknown)}: choose from {', '.join(KEYS)}", file=sys.stderr)
        return 2
    chosen = [KEYS[r] for r in args.rows.split(",")]
    if args.encoder is not None and not args.encoder.is_file():
        print(f"error: --encoder {args.encoder}: no such file", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if str(ROOT) not in sys.path:  # model.name python:benchmarks.small_vit:small_vit is found from the repository root
        sys.path.insert(0, str(ROOT))
    args.work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    bl = bench_learning()
    from wsitrain.slides.synth import write_synthetic_dataset

    cohort = args.cohort / f"n{args.n}-s{args.size}"
    labels_csv = write_synthetic_dataset(cohort, n=args.n, size=args.size, seed=0, lesions="small")
    encoder, about = pretrain(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    setup = {"kind": "setup", "n": args.n, "size": args.size, "n_train": args.train, "seeds": seeds,
             "epochs": args.epochs, "lr": args.lr, "threads": args.threads, "augmentations": args.augmentations,
             "machine": bl.machine(), "argv": " ".join(sys.argv[1:] if argv is None else argv), **about}  # fmt: skip
    print(f"encoder {encoder} ready ({time.perf_counter() - t_start:.0f} s)", flush=True)
    splits = {s: str(bl.split_csv(cohort, labels_csv, s, args.train, args.work)) for s in seeds}
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        rows.sort(key=lambda r: (ORDER.index(r["row"]), r["seed"]))
        setup["total_wall_s"] = round(time.perf_counter() - t_start, 1)
        write(setup, rows, args.out)  # after every run: a cut-off benchmark keeps what it measured
        print(f"seed {row['seed']} {row['row']:28s} AUC {row['roc_auc']:.3f} acc {row['accuracy']:.2f} "
              f"({row['wall_s']} s)", flush=True)  # fmt: skip

    units = [(row, s) for row in ORDER[1:] if row in chosen for s in seeds]
    ctx = multiprocessing.get_context("spawn")  # torch's threads and fork do not mix
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        futures = [pool.submit(run_fit_row, row, s, splits[s], str(cohort), str(encoder), args) for row, s in units]
        for f in concurrent.futures.as_completed(futures):
            record(f.result())
    if FROZEN in chosen:  # last: each seed's budget is its end-to-end runs' mean wall time
        for s in seeds:
            walls = [r["wall_s"] for r in rows if r["seed"] == s] or [60.0]
            record(run_frozen_row(s, splits[s], str(cohort), str(encoder), statistics.mean(walls), args))
    setup["total_wall_s"] = round(time.perf_counter() - t_start, 1)
    write(setup, rows, args.out)
    print((args.out / "foundation-models.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
