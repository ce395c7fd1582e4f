"""`wsitrain cv CONFIG --folds K`: K fits on patient-grouped, stratified folds; one folder with every fold's run,
a summary of each metric per fold and as mean +/- standard deviation, and a page across folds.

Folds are dealt by ``wsitrain.tasks.splits`` (stratified by the label, or by the event for survival; a patient's
slides stay in one fold; the same seed gives the same folds). Rows marked split=test stay out of every fold: each
fold's fit evaluates them once with its best.pt. Each fold is an ordinary fit of a labels CSV written into
``folds/`` (train and val from the fold, test as given), so its run folder is complete on its own.

A rerun resumes: a fold with summary.json is kept, a fold with last.pt continues from it (`fit --resume`), a fold
killed before its first checkpoint starts again. Under torchrun every rank runs every fold (all ranks train each).
"""

from __future__ import annotations

import csv
import html
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from wsitrain.config import WsiTrainConfig, config_to_dict
from wsitrain.errors import WsiTrainError
from wsitrain.slides.dataset import SlideRecord
from wsitrain.tasks.columns import load_task_records
from wsitrain.tasks.kinds import TEST_SPLITS
from wsitrain.tasks.splits import grouped_stratified_folds
from wsitrain.train import distributed as D
from wsitrain.train.data import resolve_labels
from wsitrain.train.fit import run_fit
from wsitrain.train.runfolder import write_json
from wsitrain.write_errors import named_write_errors

CV_FILE = "cv.json"  # the fold assignment and the config, to recognize the same cross-validation on a rerun
SUMMARY = "cv_summary.json"
PAGE = "cv.html"
# Metrics left out of the summary: counts and timings, not results.
_NOT_METRICS = ("_n", "_n_patients", "_seconds")


def run_cv(cfg: WsiTrainConfig, *, folds: int, name: str | None = None, console: Console | None = None,
           quiet: bool = False) -> Path:  # fmt: skip
    """Run (or resume) the K folds; return the cross-validation folder (log.dir / NAME-cvK)."""
    console = console or Console()
    labels_csv, slides_dir = resolve_labels(cfg)
    records, _ = load_task_records(labels_csv, slides_dir, cfg.task, check_readable=False)  # exit 2 on bad columns
    pool = [r for r in records if r.split not in TEST_SPLITS and r.split != "exclude"]
    test = [r for r in records if r.split in TEST_SPLITS]
    groups = [r.patient if r.patient is not None else f"#line{r.line}" for r in pool]
    fold_of = grouped_stratified_folds([str(r.label) for r in pool], groups, folds, cfg.seed)
    cv_dir = Path(cfg.log.dir) / f"{name or cfg.name or 'cv'}-cv{folds}"
    plan = {"folds": folds, "seed": cfg.seed, "labels": str(labels_csv), "config": config_to_dict(cfg),
            "assignment": {str(r.path): f for r, f in zip(pool, fold_of, strict=True)},
            "test": [str(r.path) for r in test]}  # fmt: skip
    _check_same_plan(cv_dir, plan)

    device = "cuda" if cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and _cuda()) else "cpu"
    info = D.init_distributed(cfg.distributed.backend, device, cfg.distributed.collective_timeout_minutes)
    try:
        if info.is_main:
            cv_dir.mkdir(parents=True, exist_ok=True)
            write_json(cv_dir / CV_FILE, plan)
            for k in range(folds):
                _write_fold_csv(cv_dir / "folds" / f"fold-{k + 1}.csv", labels_csv, pool, fold_of, k, test)
        D.barrier(info)
        summaries: list[dict[str, Any]] = []
        for k in range(folds):
            fold_name = f"fold-{k + 1}"
            run = cv_dir / fold_name
            fold_cfg = _fold_config(cfg, cv_dir, k)
            # rank 0 decides what the fold needs (it writes the folder; every rank follows the same branch)
            D.barrier(info)
            state = D.broadcast_object(_fold_state(run), info)
            if state == "done":
                console.print(f"{fold_name}: finished earlier, kept", markup=False)
            elif state == "resume":
                console.print(f"{fold_name}: resuming from {run / 'last.pt'}", markup=False)
                run_fit(fold_cfg, resume=run, console=console, quiet=quiet)
            else:
                if run.exists() and info.is_main:  # killed before its first checkpoint: nothing to continue from
                    shutil.rmtree(run)
                D.barrier(info)
                console.print(f"{fold_name}: training ({fold_of.count(k)} validation slides)", markup=False)
                run_fit(fold_cfg, console=console, quiet=quiet)
            D.barrier(info)  # rank 0 writes summary.json after the other ranks return from the fit
            if info.is_main:
                summaries.append(json.loads((run / "summary.json").read_text()))
        if info.is_main:
            from wsitrain.report.html import write_report

            for k in range(folds):  # each fold's own page, linked from the page across folds
                write_report(cv_dir / f"fold-{k + 1}", heatmaps=False)
            summary = summarize(summaries)
            write_json(cv_dir / SUMMARY, summary)
            with named_write_errors(cv_dir / PAGE, "the report"):
                (cv_dir / PAGE).write_text(cv_page(cv_dir, summary, cfg), encoding="utf-8")
            console.print(_table(summary))
            console.print(f"cross-validation: {cv_dir / PAGE}", markup=False)
        D.barrier(info)
    finally:
        D.cleanup(info)
    return cv_dir


def _fold_state(run: Path) -> str:
    """done: summary.json is there; resume: last.pt is; new: neither (a folder without last.pt is started over)."""
    if (run / "summary.json").is_file():
        return "done"
    return "resume" if (run / "last.pt").is_file() else "new"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_same_plan(cv_dir: Path, plan: dict[str, Any]) -> None:
    """A rerun continues only the same cross-validation: same folds, seed, slides and config."""
    old_file = cv_dir / CV_FILE
    if not old_file.is_file():
        if cv_dir.exists() and any(cv_dir.iterdir()):
            raise WsiTrainError(f"{cv_dir} exists and is not a cross-validation folder (no {CV_FILE})",
                                hint="pass --name with another name, or remove the folder")  # fmt: skip
        return
    old = json.loads(old_file.read_text())
    changed = [k for k in ("folds", "seed", "labels", "assignment", "test", "config") if old.get(k) != plan.get(k)]
    if changed:
        raise WsiTrainError(
            f"{cv_dir} holds another cross-validation (its {', '.join(changed)} differ); its folds cannot be kept",
            hint="pass --name to start a new one beside it, or rerun with its config (cv.json holds it)",
        )


def _write_fold_csv(path: Path, labels_csv: Path, pool: list[SlideRecord], fold_of: list[int], k: int,
                    test: list[SlideRecord]) -> None:  # fmt: skip
    """The labels CSV of fold ``k``: every column of the original, slide as an absolute path, split set."""
    with Path(labels_csv).open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        fields = [c for c in (reader.fieldnames or []) if c.strip().lower() not in ("split", "slide")]
        rows = {line: row for line, row in enumerate(reader, start=2)}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["slide", *fields, "split"])
        for r, fold in [*zip(pool, fold_of, strict=True), *((t, -1) for t in test)]:
            split = "test" if fold == -1 else "val" if fold == k else "train"
            w.writerow([str(Path(r.path).resolve()), *(rows[r.line].get(c, "") for c in fields), split])


def _fold_config(cfg: WsiTrainConfig, cv_dir: Path, k: int) -> WsiTrainConfig:
    d = config_to_dict(cfg)
    d["name"] = f"fold-{k + 1}"
    d["data"].update(synthetic=None, labels=str(cv_dir / "folds" / f"fold-{k + 1}.csv"), slides_dir=None)
    d["log"]["dir"] = str(cv_dir)
    return WsiTrainConfig.model_validate(d)


def summarize(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each validation and test metric per fold, and its mean and standard deviation (n - 1) over the folds."""
    keys: list[str] = []
    for s in summaries:
        keys += [k for k, v in s.items() if k.startswith(("val_", "best_val_", "test_")) and k not in keys
                 and not k.endswith(_NOT_METRICS) and (isinstance(v, (int, float)) or v is None)]  # fmt: skip
    metrics = {}
    for key in keys:
        values = [s.get(key) for s in summaries]
        finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
        metrics[key] = {
            "folds": values,
            "mean": float(np.mean(finite)) if finite else None,
            "std": float(np.std(finite, ddof=1)) if len(finite) > 1 else None,
        }
    return {"n_folds": len(summaries), "task": summaries[0].get("task", "classification") if summaries else None,
            "metrics": metrics,
            "note": "validation figures are each fold's last validation; test figures come from each fold's best.pt "
                    "on the same held-out test rows; per-patient figures average each patient's slide outputs"}


def _pm(m: dict[str, Any]) -> str:
    if m["mean"] is None:
        return "-"
    return f"{m['mean']:.3f} ± {m['std']:.3f}" if m["std"] is not None else f"{m['mean']:.3f}"


def _table(summary: dict[str, Any]) -> Table:
    n = summary["n_folds"]
    t = Table(title=f"cross-validation, {n} folds", title_justify="left")
    t.add_column("metric")
    for k in range(n):
        t.add_column(f"fold {k + 1}", justify="right")
    t.add_column("mean ± sd", justify="right")
    for key, m in summary["metrics"].items():
        t.add_row(key, *(f"{v:.3f}" if isinstance(v, (int, float)) else "-" for v in m["folds"]), _pm(m))
    return t


def cv_page(cv_dir: Path, summary: dict[str, Any], cfg: WsiTrainConfig) -> str:
    """A self-contained page: the metrics table across folds (test rows marked) and links to each fold's run."""
    n = summary["n_folds"]
    head = "".join(f"<th>fold {k + 1}</th>" for k in range(n))
    rows = []
    for key, m in summary["metrics"].items():
        cls = ' class="test"' if key.startswith("test_") else ""
        cells = "".join(f"<td>{v:.4f}</td>" if isinstance(v, (int, float)) else "<td>-</td>" for v in m["folds"])
        label = html.escape(key) + (" <b>(held-out test)</b>" if key.startswith("test_") else "")
        rows.append(f"<tr{cls}><td>{label}</td>{cells}<td><b>{html.escape(_pm(m))}</b></td></tr>")
    links = " · ".join(f'<a href="fold-{k + 1}/report.html">fold {k + 1}</a> (<a href="fold-{k + 1}/summary.json">'
                       "summary</a>)" for k in range(n))  # fmt: skip
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(cv_dir.name)}</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}td:first-child{{text-align:left}}
tr.test{{background:#fff4e0}}p.note{{color:#555}}</style></head><body>
<h1>Cross-validation: {html.escape(cv_dir.name)}</h1>
<p>{n} folds, task {html.escape(str(summary["task"]))}, model {html.escape(cfg.model.name)}, seed {cfg.seed}.
Folds are stratified by {"event" if summary["task"] == "survival" else "label"} and never divide a patient;
rows with split=test are in no fold.</p>
<table><tr><th>metric</th>{head}<th>mean ± sd</th></tr>{"".join(rows)}</table>
<p class="note">{html.escape(summary["note"])}. Standard deviation over folds with n - 1.</p>
<p>Runs: {links}. Each fold's page: <code>wsitrain report {html.escape(str(cv_dir))}/fold-K</code>.</p>
</body></html>
"""
