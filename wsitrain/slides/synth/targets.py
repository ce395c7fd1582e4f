"""Synthetic cohorts for regression, survival and multi-label tasks, whose targets depend on what the slides show.

Each patient has a hidden grade g in [0, 1]; its slides carry about 16 * g clusters of large dark nuclei (the same
texture the classification demo uses). Regression's ``score`` is 10 * g plus a little noise; survival draws a
log-normal time that shortens with g (20 exp(-3 g), 25% noise), censored by an independent uniform follow-up;
multi-label gives each patient independent 0/1 labels, each shown by clusters of its own colour. A model that
learns to see the clusters therefore learns the targets, which is what the tests and the demo check.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from wsitrain.errors import SlideError
from wsitrain.slides.synth import MANIFEST, _as_wh, _make_out_dir, _Scene, cached_dataset, write_synthetic_slide

TARGET_TASKS = ("regression", "survival", "multilabel")
# multilabel: one nucleus colour per label (purple, brown, teal), all far from the pink tissue and pale nuclei
LABEL_COLOURS = {"purple": (75, 35, 125), "brown": (135, 75, 25), "teal": (25, 105, 115)}
# regression and survival: cluster nuclei from pale to dark purple with the grade
PALE, DARK = (170, 120, 185), (60, 25, 115)
_VERSION = 2


def _add_clusters(scene: _Scene, rng: np.random.Generator, n: int, colour: tuple[int, int, int]) -> None:
    """``n`` clusters of 15-30 large nuclei of ``colour`` inside the tissue (as positive slides have)."""
    r = max(2.5, min(scene.w, scene.h) / 200)
    for cx, cy in scene._inside(rng, n) if n > 0 else []:
        for _ in range(int(rng.integers(15, 30))):
            x, y = cx + rng.normal(0, 2.5 * r), cy + rng.normal(0, 2.5 * r)
            if scene._is_tissue(x, y):
                col = np.array(colour) + rng.integers(-15, 15, size=3)
                scene.nuclei.append((x, y, r * rng.uniform(0.8, 1.2), col))


def write_task_dataset(
    out_dir: str | Path,
    task: str,
    *,
    n: int = 24,
    size: int = 1024,
    seed: int = 0,
    slides_per_patient: int = 1,
    test_fraction: float = 0.0,
    val_fraction: float = 0.25,
) -> Path:
    """Write ``out_dir/slide_000.svs ...`` and ``labels.csv`` for ``task``; return the CSV path.

    Columns: slide, patient, then the task's (regression: score; survival: time, event; multilabel: purple,
    brown, teal), and split when ``test_fraction`` > 0: test for the last ``test_fraction`` of the patients, val for
    the ``val_fraction`` before them, train for the rest (a CSV's split column decides every row, so val is written
    too). A folder holding the same dataset already (its manifest and files) is reused.
    """
    if task not in TARGET_TASKS:
        raise SlideError(f"synth: task {task!r} has no generator", hint=f"choose one of {', '.join(TARGET_TASKS)}")
    if n < 2:
        raise SlideError(f"synth: n={n} must be at least 2", hint="e.g. --n 24")
    if slides_per_patient < 1:
        raise SlideError(f"synth: slides_per_patient={slides_per_patient} must be at least 1", hint="e.g. 2")
    out = Path(out_dir)
    params = {"version": _VERSION, "task": task, "n": n, "size": size, "seed": seed,
              "slides_per_patient": slides_per_patient, "test_fraction": test_fraction,
              "val_fraction": val_fraction}  # fmt: skip
    csv_path = out / "labels.csv"
    names = [f"slide_{i:03d}.svs" for i in range(n)]
    if cached_dataset(out, params, names) is not None:
        return csv_path
    _make_out_dir(out)
    rng = np.random.default_rng([seed, 7])
    n_patients = -(-n // slides_per_patient)
    grade = rng.uniform(0, 1, size=n_patients)
    labels = rng.integers(0, 2, size=(n_patients, len(LABEL_COLOURS)))
    # log-normal times, 20 * exp(-3 g) with 25% noise: the grade orders them (a perfect model's c-index is
    # about 0.93 on 16 patients), and about 15% are censored by a follow-up independent of the slide
    event_time = 20.0 * np.exp(-3.0 * grade + rng.normal(0, 0.25, size=n_patients))
    follow_up = rng.uniform(3.0, 30.0, size=n_patients)
    score = 10.0 * grade + rng.normal(0, 0.3, size=n_patients)
    n_test = int(round(n_patients * test_fraction))
    n_val = int(round((n_patients - n_test) * val_fraction)) if n_test else 0
    w, h = _as_wh(size)
    rows = []
    for i, name in enumerate(names):
        p = i // slides_per_patient
        slide_rng = np.random.default_rng([seed, 11, i])
        scene = _Scene(w, h, False, seed * 100_003 + i)
        if task == "multilabel":
            for j, colour in enumerate(LABEL_COLOURS.values()):
                _add_clusters(scene, slide_rng, 6 * int(labels[p, j]), colour)
        else:
            # the grade shows twice: more clusters, and darker nuclei in them (pale purple at 0, dark at 1), so
            # both average pooling (how many) and max pooling (how dark) can read it
            shade = tuple(int(round(v)) for v in np.array(PALE) + grade[p] * (np.array(DARK) - np.array(PALE)))
            _add_clusters(scene, slide_rng, 2 + int(round(14 * grade[p])), shade)
        write_synthetic_slide(out / name, size=size, scene=scene)
        row: dict[str, str] = {"slide": name, "patient": f"P{p:03d}"}
        if task == "regression":
            row["score"] = f"{score[p]:.4f}"
        elif task == "survival":
            row["time"] = f"{min(event_time[p], follow_up[p]):.4f}"
            row["event"] = str(int(event_time[p] <= follow_up[p]))
        else:
            row.update({c: str(int(labels[p, j])) for j, c in enumerate(LABEL_COLOURS)})
        if n_test:
            first_test, first_val = n_patients - n_test, n_patients - n_test - n_val
            row["split"] = "test" if p >= first_test else "val" if p >= first_val else "train"
        rows.append(row)
    with csv_path.open("w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    (out / MANIFEST).write_text(json.dumps({"params": params, "slides": names}, indent=1))
    return csv_path
