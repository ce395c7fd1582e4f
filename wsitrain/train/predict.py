"""`wsitrain predict`: slide-level class probabilities from a fit checkpoint, through the same engine (no backward)."""

from __future__ import annotations

import contextlib
import csv
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console

from wsitrain.config import WsiTrainConfig, config_to_dict, diff_configs
from wsitrain.errors import SlideError, WsiTrainError
from wsitrain.gpus import run_budget
from wsitrain.memory import tune_owned_process
from wsitrain.models import build
from wsitrain.models.freeze import FreezeSpec
from wsitrain.models.heads import DEFAULT_TOPK, NO_NORM, AttentionSpec
from wsitrain.models.slide_bn import RUNNING
from wsitrain.patch.lora import LoraSpec, add_lora
from wsitrain.report.decision import DecisionWatch
from wsitrain.report.heatmap_files import HeatmapWriter
from wsitrain.slides.readers import open_slide
from wsitrain.slides.stream import ReadResult
from wsitrain.slides.suffixes import SLIDE_SUFFIXES, is_slide_name
from wsitrain.slides.tile_source import slide_read
from wsitrain.tasks.objective import Objective, per_patient
from wsitrain.train.attention_mask import tissue_masked
from wsitrain.train.checkpoint import load_checkpoint
from wsitrain.train.data import masking_note, read_kwargs
from wsitrain.train.engine import resolve_device, wrap_engine
from wsitrain.train.loop import Evaluator
from wsitrain.write_errors import named_write_errors

# data.* keys that change how a slide is read: predicting with other values reads slides differently from training.
_READ_KEYS = ("level", "mpp", "magnification", "fallback_mpp", "region", "size", "mask_background")


def list_slides(slides: Path) -> list[Path]:
    """The slide files to predict: ``slides`` itself if it is a file, else the slide files in the folder (sorted)."""
    slides = Path(slides)
    if slides.is_file():
        return [slides]
    if not slides.is_dir():
        raise SlideError(f"--slides {slides}: no such file or folder", hint="pass a folder of slides or one slide file")
    found = sorted(p for p in slides.iterdir() if p.is_file() and is_slide_name(p))
    if not found:
        raise SlideError(
            f"--slides {slides}: no slide files in it (looked for {', '.join(SLIDE_SUFFIXES)})",
            hint="pass the folder that holds the slides",
        )
    return found


def _check_readable(paths: list[Path]) -> None:
    """Open every slide first, so a bad file fails the command before any prediction is spent."""
    problems = []
    for p in paths:
        try:
            open_slide(p).close()
        except SlideError as e:
            problems.append(e.message)
    if problems:
        raise SlideError(
            f"{len(problems)} of {len(paths)} slides cannot be read:\n" + "\n".join(f"  - {m}" for m in problems),
            hint="remove or re-export these files, or point --slides at a folder without them",
        )


def _check_out(out: Path) -> None:
    """--out must name a file in an existing folder: refused before any slide is read."""
    if out.is_dir():
        raise WsiTrainError(f"--out {out}: is a folder; --out names the CSV file to write",
                            hint=f"e.g. --out {out / 'predictions.csv'}")  # fmt: skip
    parent = out.parent
    if not parent.exists():
        raise WsiTrainError(f"--out {out}: folder {parent} does not exist", hint="create it or choose another path")
    if not parent.is_dir():
        raise WsiTrainError(f"--out {out}: {parent} is a file, not a folder", hint="choose a path in a folder")


def _check_model(cfg: WsiTrainConfig, trained: dict[str, Any], checkpoint: Path) -> None:
    """The config's model must be the checkpoint's: silently following either would predict with a surprise."""
    trained_name = (trained.get("model") or {}).get("name")
    if trained_name is not None and trained_name != cfg.model.name:
        raise WsiTrainError(
            f"checkpoint {checkpoint} holds a {trained_name} model but the config's model.name is {cfg.model.name}",
            hint=f"predict with the config the run was trained with (its config.yaml), or set "
            f"--set model.name={trained_name}",
        )


def run_predict(
    cfg: WsiTrainConfig,
    *,
    checkpoint: Path,
    slides: Path,
    out: Path,
    console: Console | None = None,
    heatmaps: Path | None = None,
    saliency: bool = False,
    viewer_files: bool = True,
    geojson_cell: int | None = None,
    patients: Path | None = None,
) -> Path:
    """Write ``out`` (CSV: slide, path, one probability column per class, predicted class); return its path.

    A task checkpoint (regression, survival, multilabel) writes its outputs instead: ``pred_<column>``,
    ``prob_<label>`` or ``risk``. ``patients``: a CSV with slide and patient columns; then ``<out>.patients.csv``
    holds each patient's outputs, the mean over its slides. With ``heatmaps``: the maps of every slide there;
    ``viewer_files`` adds NAME.geojson (QuPath detections of ``geojson_cell`` x ``geojson_cell`` map cells; None:
    automatic) and NAME.heatmap.tif (HeatmapWriter)."""
    console = console or Console()
    out = Path(out)
    ckpt = load_checkpoint(Path(checkpoint))
    class_names = [str(c) for c in ckpt.get("class_names") or []]
    trained = ckpt.get("config") or {}
    if not class_names:
        raise WsiTrainError(f"checkpoint {checkpoint} has no class names", hint="use a checkpoint written by fit")
    _check_model(cfg, trained, Path(checkpoint))
    objective = Objective.from_state(ckpt["task"]) if ckpt.get("task") else None
    _check_out(out)
    patient_of = _read_patients(Path(patients)) if patients is not None else None
    paths = list_slides(Path(slides))
    _check_readable(paths)

    # How to read slides comes from cfg; say so when it differs from training.
    read_changed = [k for k in diff_configs(trained.get("data", {}), config_to_dict(cfg)["data"])
                    if k.split(".")[0] in _READ_KEYS]  # fmt: skip
    if trained and read_changed:
        console.print(f"[yellow]note: data.{', data.'.join(read_changed)} differ from the training config; "
                      "predictions read slides differently from training[/yellow]")
    # The architecture is the checkpoint's (what its weights fit); model.name was checked to agree above.
    m = {**config_to_dict(cfg)["model"], **(trained.get("model") or {})}
    n_outputs = objective.n_outputs if objective is not None else len(class_names)
    model = build(m["name"], n_outputs, weights=None, pool=m["pool"], freeze_bn=m["freeze_bn"],
                  attention=AttentionSpec.from_dict(m.get("attention"), class_names), mask_pool=m["mask_pool"],
                  freeze=FreezeSpec.from_dict(m.get("freeze")), topk=m.get("topk", DEFAULT_TOPK),
                  map_norm=m.get("map_norm") or NO_NORM, bn_stats=m.get("bn_stats") or RUNNING,
                  patch=m.get("patch"))  # fmt: skip
    lora = LoraSpec.from_dict(m.get("lora"))
    if lora is not None:  # the adapters are in the checkpoint's state: put them in place first
        add_lora(model, lora, FreezeSpec.from_dict(m.get("freeze")))
    model.load_state_dict(ckpt["model"])
    device = resolve_device(cfg.engine.device)
    budget = run_budget(cfg.engine.memory_budget, device)
    tune_owned_process(device, budget.bytes)  # as fit: the budget is the CUDA allocator's limit too
    engine = wrap_engine(  # no optimizer state to plan for
        model, cfg.engine, device, budget.bytes, optimizer=None, low_precision=cfg.train.precision != "fp32"
    )
    runner = Evaluator(engine, device=device, precision=cfg.train.precision, loss=cfg.train.loss, objective=objective)
    rk = read_kwargs(cfg, model.stride)
    console.print(f"memory budget: {budget.describe()}", markup=False, highlight=False)
    console.print(masking_note(cfg), markup=False, highlight=False)

    maps = (_heatmap_writer(Path(heatmaps), class_names, saliency, runner, objective, viewer_files, geojson_cell)
            if heatmaps else None)
    rows = []
    outputs: list[list[float]] = []
    t0 = time.perf_counter()
    # a max-pooling classifier: per slide and class, was the score decided on the tissue? (columns on_tissue_*)
    watch = DecisionWatch(engine) if objective is None else None
    for i, (p, read) in enumerate(_reads(paths, cfg.data.stream_tiles, rk), 1):
        with tissue_masked(model, read), (watch.slide(read.image, read) if watch else contextlib.nullcontext()):
            res = runner.eval_slide(read.image, None)
        probs = res.probs.tolist()
        outputs.append(probs)
        if objective is not None:
            rows.append([p.name, str(p), *(f"{v:.6f}" for v in probs)])
            console.print(f"[{i}/{len(paths)}] {p.name}: " + ", ".join(f"{h} {v:.4g}" for h, v in
                          zip(_task_header(objective), probs, strict=True)), markup=False, highlight=False)  # fmt: skip
            if maps is not None:
                maps.add(p, read, engine, probabilities=objective.outputs)
            continue
        pred = class_names[int(max(range(len(probs)), key=probs.__getitem__))]
        rows.append([p.name, str(p), *(f"{v:.6f}" for v in probs), pred])
        if watch is not None and watch.active:  # "" where the slide has no tissue mask
            rows[-1] += [str(v).lower() for v in watch.last] if watch.last is not None else [""] * len(class_names)
        console.print(f"[{i}/{len(paths)}] {p.name}: {pred} ({max(probs):.3f}), "
                      f"{tuple(read.image.shape[-2:])} px, read {read.seconds:.2f} s, forward {res.forward_s:.2f} s",
                      markup=False, highlight=False)  # fmt: skip
        if maps is not None:
            maps.add(p, read, engine)
    if maps is not None:
        console.print(f"wrote heatmaps of {len(paths)} slides to {maps.close().parent}", markup=False)
    header = _task_header(objective) if objective is not None else [*(f"prob_{c}" for c in class_names), "predicted"]
    if watch is not None and watch.active:
        header += [f"on_tissue_{c}" for c in class_names]
    with named_write_errors(out, "the predictions"), open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["slide", "path", *header])
        w.writerows(rows)
    if patient_of is not None:
        _write_patients(out, paths, patient_of, outputs, _task_header(objective) if objective is not None
                        else [f"prob_{c}" for c in class_names], console)  # fmt: skip
    secs = time.perf_counter() - t0
    console.print(
        f"wrote {out}: {len(rows)} slides in {secs:.1f} s ({secs / max(1, len(rows)):.2f} s per slide)",
        markup=False, highlight=False,
    )
    return out


def _reads(paths: list[Path], stream: bool, rk: dict[str, Any]) -> Iterator[tuple[Path, ReadResult]]:
    """Each slide read in turn, closed when the next is asked for. ``stream`` (data.stream_tiles): read tile by tile
    as the engine asks (the prediction, the CAM), never held whole; the outputs are bitwise the whole read's."""
    for p in paths:
        with slide_read(p, stream, **rk) as read:
            yield p, read


def _task_header(objective: Objective) -> list[str]:
    if objective.kind == "survival":
        return ["risk"]
    prefix = "pred" if objective.kind == "regression" else "prob"
    return [f"{prefix}_{n}" for n in objective.names]


def _read_patients(path: Path) -> dict[str, str]:
    """slide (file name or stem) -> patient, from a CSV with slide and patient columns (a labels CSV will do)."""
    if not path.is_file():
        raise WsiTrainError(f"--patients {path}: no such file", hint="pass a CSV with slide and patient columns")
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        fields = {(c or "").strip().lower(): c for c in reader.fieldnames or []}
        if "slide" not in fields or "patient" not in fields:
            raise WsiTrainError(f"--patients {path}: needs columns slide and patient (found: {', '.join(fields)})",
                                hint="the labels CSV with a patient column will do")  # fmt: skip
        out = {}
        for row in reader:
            slide, patient = (row[fields["slide"]] or "").strip(), (row[fields["patient"]] or "").strip()
            if slide and patient:
                out[Path(slide).name] = patient
                out[Path(slide).stem] = patient
    return out


def _write_patients(out: Path, paths: list[Path], patient_of: dict[str, str], outputs: list[list[float]],
                    header: list[str], console: Console) -> None:  # fmt: skip
    """<out>.patients.csv: each patient's outputs averaged over its slides (a slide without a patient stands alone)."""
    import numpy as np

    patients = [patient_of.get(p.name, patient_of.get(p.stem)) for p in paths]
    ids, _, mean = per_patient(patients, np.zeros((len(paths), 1)), np.asarray(outputs))
    counts = {i: sum(1 for q in patients if q == i) for i in ids}
    target = out.with_name(f"{out.stem}.patients.csv")
    with named_write_errors(target, "the per-patient predictions"), open(target, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["patient", "slides", *header])
        for i, row in zip(ids, mean, strict=True):
            w.writerow([i, counts.get(i) or 1, *(f"{v:.6f}" for v in row)])
    console.print(f"wrote {target}: {len(ids)} patients (each the mean of its slides' outputs)", markup=False)


def _heatmap_writer(out: Path, class_names: list[str], saliency: bool, runner: Evaluator,
                    objective: Objective | None, viewer: bool, geojson_k: int | None) -> HeatmapWriter:  # fmt: skip
    """Class activation maps; a task's maps are its outputs' (each regression target or label), and survival's is
    the risk map (report.task_figures.risk_map)."""
    kw: dict[str, Any] = {"viewer": viewer, "geojson_k": geojson_k}
    if objective is None:
        return HeatmapWriter(out, class_names, saliency, runner.autocast, **kw)
    if objective.kind == "survival":
        from wsitrain.report.task_figures import risk_map

        return HeatmapWriter(out, ["risk"], saliency, runner.autocast, transform=risk_map, **kw)
    return HeatmapWriter(out, objective.names, saliency, runner.autocast, **kw)
