"""`wsitrain report RUN_DIR`: one self-contained report.html (images inlined as data URIs; no network needed).

Sections: summary, curves and validation figures, validation slides (table and heatmaps), the engine's plan,
per-tile timing and memory, config and library versions. A part whose inputs the run folder lacks says what is
missing and how to get it, instead of being left out silently.
"""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

import yaml

from wsitrain.errors import WsiTrainError
from wsitrain.report.figures import plan_memory_figure, tile_histograms
from wsitrain.report.runlog import VALIDATION, plans, read_json, step_peaks, tile_times
from wsitrain.train.plateau import FLAT_SPREAD
from wsitrain.units import format_bytes
from wsitrain.write_errors import named_write_errors

REPORT = "report.html"
HEATMAP_DIR = "heatmaps"

_CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0 auto;max-width:1400px;padding:1em 2em;
color:#222;background:#fff}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:2px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1.05em;margin-bottom:.3em}
table{border-collapse:collapse;font-size:.88em;margin:.5em 0}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.wrong td{background:#fde8e8}
img.fig{max-width:100%;height:auto;border:1px solid #eee}
pre{background:#f7f7f7;border:1px solid #e3e3e3;padding:.6em;font-size:.82em;overflow:auto;max-height:32em}
.note{color:#8a5a00;background:#fff7e0;border-left:4px solid #f0b400;padding:.4em .8em;margin:.5em 0;font-size:.9em}
.muted{color:#777;font-size:.88em}
.row{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}
.maps{display:flex;flex-wrap:wrap;gap:.8em}
.maps details{border:1px solid #ddd;border-radius:4px;padding:.3em;background:#fafafa}
.maps details summary{cursor:zoom-in;list-style:none;font-size:.85em}
.maps details summary::-webkit-details-marker{display:none}
.maps details img{width:300px;height:auto;display:block}
.maps details[open]{flex-basis:100%}
.maps details[open] summary{cursor:zoom-out}
.maps details[open] img{width:100%;max-width:1800px}
.bar{display:inline-block;height:.7em;background:#4a7fd0;vertical-align:middle;margin-right:.3em}
"""


def data_uri(png: bytes | Path) -> str:
    raw = png.read_bytes() if isinstance(png, Path) else png
    return "data:image/png;base64," + base64.b64encode(raw).decode("ascii")


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _img(png: bytes | Path, alt: str, cls: str = "fig") -> str:
    return f'<img class="{cls}" alt="{_e(alt)}" src="{data_uri(png)}">'


def _note(text: str) -> str:
    return f'<div class="note">{_e(text)}</div>'


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.4g}"
    return "–" if v is None else str(v)


def _kv_table(d: dict[str, Any], byte_keys: tuple[str, ...] = ()) -> str:
    rows = []
    for k, v in d.items():
        shown = format_bytes(int(v)) if k in byte_keys and isinstance(v, (int, float)) and v else _fmt(v)
        rows.append(f"<tr><th>{_e(k)}</th><td>{_e(shown)}</td></tr>")
    return "<table>" + "".join(rows) + "</table>"


def write_report(run_dir: Path, heatmaps: bool = True, console: Any = None) -> Path:
    """Write ``run_dir/report.html`` and return its path. ``heatmaps``: compute validation heatmaps when the run
    folder has none yet (needs a checkpoint and validation.json with slide paths)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise WsiTrainError(f"{run_dir}: no such run folder", hint="pass a folder under runs/ written by wsitrain fit")
    if not (run_dir / "config.yaml").is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise WsiTrainError(
            f"{run_dir}: not a run folder (no config.yaml or metrics.jsonl in it)",
            hint="pass a folder under runs/ written by wsitrain fit",
        )
    maps_note = None
    if heatmaps and not (run_dir / HEATMAP_DIR / "heatmaps.json").is_file():
        from wsitrain.report.run_maps import validation_heatmaps

        maps_note = validation_heatmaps(run_dir, run_dir / HEATMAP_DIR, console)
    body = [
        _header(run_dir),
        _curves(run_dir),
        _task(run_dir),
        _validation(run_dir, maps_note),
        _tissue(run_dir),
        _plans(run_dir),
        _tiles(run_dir),
        _config(run_dir),
    ]
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>wsitrain report: {_e(run_dir.name)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    out = run_dir / REPORT
    with named_write_errors(out, "the report", then=f"run `wsitrain report {run_dir}` again"):
        out.write_text(page, encoding="utf-8")
    return out


def _header(run_dir: Path) -> str:
    s = read_json(run_dir / "summary.json") or {}
    v = read_json(run_dir / "versions.json") or {}
    cfg = _config_dict(run_dir)
    model = (cfg.get("model") or {}).get("name", "?")
    pool = (cfg.get("model") or {}).get("pool", "?")
    head = (
        f"<h1>wsitrain run {_e(run_dir.name)}</h1><p class=\"muted\">{_e(run_dir.resolve())} · model {_e(model)} "
        f"({_e(pool)} pool) · device {_e(v.get('device', '?'))} · wsitrain {_e(v.get('wsitrain', '?'))}</p>"
    )
    if not s:
        return head + _note("summary.json is missing: the run did not finish (or is still running).")
    keys = ("epochs", "optimizer_steps", "val_loss", "val_accuracy", "val_balanced_accuracy", "val_roc_auc",
            "best_val_loss", "mean_slide_s", "mean_forward_s", "mean_backward_s", "peak_bytes", "wall_s",
            "balance", "rank_wait_share")  # the last two: several ranks only
    # a task's metrics and the held-out test figures, where the run has them (test_ keys: marked as test)
    keys += tuple(k for k in s if k not in keys and (k == "task" or k.startswith(("val_", "best_val_", "test_"))))
    shown = {(f"{k} (held-out test)" if k.startswith("test_") else k): s.get(k) for k in keys if k in s}
    spread = s.get("val_output_spread")
    flat = (_note(f"val_output_spread {spread:.4f} is below {FLAT_SPREAD}: the model gave every validation slide "
                  "about the same output, so it had not left the plateau of near-constant outputs and its ROC AUC "
                  "ranks tiny differences (docs/research/plateau.md)")
            if isinstance(spread, float) and spread < FLAT_SPREAD else "")  # fmt: skip
    return head + "<h2>Summary</h2>" + flat + _kv_table(shown, ("peak_bytes",))


def _curves(run_dir: Path) -> str:
    out = ["<h2>Training curves</h2>"]
    curves = run_dir / "curves.png"
    if not curves.is_file() and (run_dir / "metrics.jsonl").is_file():
        from wsitrain.report.curves import write_curves

        write_curves(run_dir)
    out.append(_img(curves, "training curves") if curves.is_file() else _note("no metrics.jsonl: nothing to plot"))
    figs = [p for p in (run_dir / "roc.png", run_dir / "confusion.png") if p.is_file()]
    if figs:
        out.append("<h3>Validation set (last validation)</h3><div class=\"row\">"
                   + "".join(_img(p, p.stem) for p in figs) + "</div>")
    else:
        out.append(_note("no roc.png / confusion.png: the run has no validation slides, or validated before "
                         "this version wrote them"))
    return "\n".join(out)


def _task(run_dir: Path) -> str:
    """The task's validation and held-out test metrics and pictures (nothing for a classification run without
    test rows, so its page is as before)."""
    from wsitrain.report.task_figures import SETS, write_task_figures

    s = read_json(run_dir / "summary.json") or {}
    found = [(name, what) for name, what in SETS if (run_dir / name).is_file()]
    if not found:
        return ""
    out = ["<h2>Task results</h2>"]
    write_task_figures(run_dir)  # redrawn from the rows, so an old run's page gets them too
    for name, what in found:
        data = read_json(run_dir / name) or {}
        metrics = data.get("metrics") or {}
        mark = " <b>(held-out test: evaluated once, with best.pt)</b>" if what == "test" else " (last validation)"
        out.append(f"<h3>{_e(what.capitalize())}{mark}</h3>")
        out.append(_kv_table({k: v for k, v in metrics.items() if k != "seconds"}))
        if any(k.startswith("patient_") for k in metrics):
            out.append(_note("patient_* figures: each patient's slide outputs averaged, then the metric over "
                             "patients"))
        png = run_dir / f"{data.get('task')}_{what}.png"
        if png.is_file():
            out.append(_img(png, f"{what} {data.get('task')}"))
    if s.get("task"):
        out.append(_note(f"task {s['task']}; best.pt chosen by the validation metric in best_val_*"))
    return "\n".join(out)


def _decided_on_tissue(val: dict[str, Any], maps: dict[str, Any] | None) -> list[dict[str, bool] | None] | None:
    """Per validation slide, a max-pooling head's record of which classes were decided on the tissue: validation's
    own (fit records it), else the heatmaps' (the report's maps, for runs that predate the record); None when
    neither has one (not a max-pooling head)."""
    slides = val["slides"]
    if any("decided_on_tissue" in r for r in slides):
        return [r.get("decided_on_tissue") for r in slides]
    if not maps or not any(m.get("decisive_on_tissue") is not None for m in maps.get("slides", [])):
        return None
    classes = maps.get("classes", val["classes"])
    by_path = {m.get("path"): m.get("decisive_on_tissue") for m in maps["slides"]}
    out: list[dict[str, bool] | None] = []
    for r in slides:
        rec = by_path.get(r.get("path"))
        out.append(None if rec is None else dict(zip(classes, rec, strict=True)))
    return out


def _tissue_cell(where: list[dict[str, bool] | None] | None, i: int, classes: list[str]) -> str:
    if where is None:
        return ""
    rec = where[i]
    if rec is None:
        return '<td class="muted">no tissue mask</td>'
    return "<td>" + ", ".join(f"{_e(c)} {'yes' if rec.get(c) else '<b>no</b>'}" for c in classes) + "</td>"


def _tissue_summary(where: list[dict[str, bool] | None], classes: list[str]) -> str:
    known = [r for r in where if r is not None]
    parts = ", ".join(f"{_e(c)} {sum(bool(r.get(c)) for r in known)} of {len(known)}" for c in classes)
    return (f"<p>Max pooling decided on the tissue (the deciding map cell inside the slide's tissue mask): {parts} "
            "slides. A score decided off the tissue reads the background or the image border, not evidence "
            "(model.mask_pool keeps the pool on the tissue).</p>")


def _validation(run_dir: Path, maps_note: str | None) -> str:
    out = ["<h2>Validation slides</h2>"]
    val = read_json(run_dir / VALIDATION)
    maps = read_json(run_dir / HEATMAP_DIR / "heatmaps.json")
    if val is None:
        out.append(_note(f"no {VALIDATION}: per-slide validation probabilities were not recorded by this run"))
    else:
        classes = val["classes"]
        head = "".join(f"<th>p({_e(c)})</th>" for c in classes)
        where = _decided_on_tissue(val, maps)
        if where is not None:
            head += "<th>decided on tissue</th>"
        rows = []
        for i, r in enumerate(val["slides"]):
            cells = "".join(
                f'<td class="num"><span class="bar" style="width:{60 * r["probs"][c]:.1f}px"></span>'
                f'{r["probs"][c]:.3f}</td>' for c in classes
            )
            ok = r["label"] == r["predicted"]
            rows.append(f'<tr class="{"" if ok else "wrong"}"><td>{_e(r["slide"])}</td><td>{_e(r["label"])}</td>'
                        f'<td>{_e(r["predicted"])}</td>{cells}' + _tissue_cell(where, i, classes) +
                        f'<td>{"yes" if ok else "no"}</td></tr>')  # fmt: skip
        n_ok = sum(r["label"] == r["predicted"] for r in val["slides"])
        out.append(f"<p>{n_ok} of {len(val['slides'])} correct (rows in red are wrong).</p>"
                   f"<table><tr><th>slide</th><th>label</th><th>predicted</th>{head}<th>correct</th></tr>"
                   + "".join(rows) + "</table>")
        if where is not None:
            out.append(_tissue_summary(where, classes))
    out.append("<h3>Heatmaps (click a picture to enlarge it, click again to shrink it)</h3>")
    if maps_note:
        out.append(_note(maps_note))
    if maps and maps.get("slides"):
        out.append("<p class=\"muted\">Class activation maps: the classifier's weights applied to the last feature "
                   "map at every position (logit units; red for, blue against the class), over the slide's "
                   "thumbnail, tissue outlined in green. A max-pooling head's circle marks the position whose "
                   "features decided the score.</p>")
        items = []
        for r in maps["slides"]:
            png = run_dir / HEATMAP_DIR / r["png"]
            if not png.is_file():
                continue
            p = max(r["probs"].values())
            label = f" · label {_e(r['label'])}" if r.get("label") else ""
            items.append(f"<details><summary>{_img(png, r['slide'], 'map')}<b>{_e(r['slide'])}</b>: "
                         f"{_e(r['predicted'])} ({p:.3f}){label}</summary></details>")
        out.append('<div class="maps">' + "".join(items) + "</div>")
    elif not maps_note:
        out.append(_note("no heatmaps: run `wsitrain report RUN_DIR` with heatmaps on, or "
                         "`wsitrain predict ... --heatmaps RUN_DIR/heatmaps`"))
    return "\n".join(out)


def _tissue(run_dir: Path) -> str:
    from wsitrain.report.tissue_pieces import tissue_section

    return tissue_section((read_json(run_dir / "data.json") or {}).get("tissue"), _config_dict(run_dir), data_uri)


def _plans(run_dir: Path) -> str:
    out = ["<h2>Engine plan</h2>"]
    rows = plans(run_dir)
    if not rows:
        return out[0] + _note("no plans.jsonl: the engine's plan was not recorded")
    for r in rows:
        p = r["plan"]
        shape = "×".join(str(s) for s in p.get("input_shape", []))
        out.append(f"<h3>input {_e(shape)} (first seen on slide {_e(r.get('slide', '?'))})</h3>")
        facts = {
            "model": p.get("model"), "dtype": p.get("dtype"), "device": p.get("device"),
            "fits": p.get("fits"), "budget": format_bytes(p.get("budget_bytes") or 0),
            "estimated peak": format_bytes(p.get("estimated_peak_bytes") or 0),
            "plain PyTorch peak": format_bytes(p.get("baseline_peak_bytes") or 0),
            f"best checkpoint_sequential ({p.get('checkpoint_segments')} segments)":
                format_bytes(p.get("checkpoint_peak_bytes") or 0),
            "extra compute vs plain": f"{100 * float(p.get('overhead') or 0):+.1f}%",
            "predicted step time vs plain": f"{float(p.get('slowdown') or 1.0):.2f}x",
            "recomputed tiles per step": p.get("recomputed_tiles"),
            "input on host": p.get("input_on_host"),
        }
        seg_rows = []
        for s in p.get("segments", []):
            layers = s.get("layers") or []
            span = layers[0] if len(layers) == 1 else f"{layers[0]} … {layers[-1]}" if layers else ""
            tiled = s.get("mode") == "tiled"
            seg_rows.append(
                f"<tr><td>{s['index']}</td><td>{_e(span)} ({len(layers)})</td><td>{_e(s['mode'])}</td>"
                f"<td>{'×'.join(map(str, s['tile_grid'])) if tiled else '–'}</td>"
                f"<td>{'×'.join(map(str, s['tile_shape'])) if tiled else '–'}</td>"
                f"<td>{'/'.join(map(str, s['halo'])) if tiled else '–'}</td>"
                f"<td class=\"num\">{_e(format_bytes(s['checkpoint_bytes']))} ({_e(s['checkpoint_location'])})</td>"
                f"<td class=\"num\">{_e(format_bytes(s['tile_activation_bytes']))}</td>"
                f"<td class=\"num\">{_e(format_bytes(s['peak_bytes']))}</td>"
                f"<td class=\"num\">{float(s['flops']) / 1e9:.2f}</td></tr>"
            )
        out.append('<div class="row"><div>' + _kv_table(facts) + "</div><div>"
                   + _img(plan_memory_figure(p), "memory by part") + "</div></div>")
        out.append("<table><tr><th>segment</th><th>layers</th><th>mode</th><th>tile grid</th><th>tile incl. halo"
                   "</th><th>halo</th><th>checkpoint</th><th>tile working set</th><th>peak</th><th>GFLOP</th></tr>"
                   + "".join(seg_rows) + "</table>")
        for n in p.get("notes") or []:
            out.append(f'<p class="muted">note: {_e(n)}</p>')
    return "\n".join(out)


def _tiles(run_dir: Path) -> str:
    out = ["<h2>Per-tile timing and memory</h2>"]
    cfg = _config_dict(run_dir)
    mode = (cfg.get("log") or {}).get("tiles", "?")
    t = tile_times(run_dir)
    if t is None:
        return out[0] + _note(f"no tiles.jsonl (log.tiles: {mode}): set log.tiles: all to record every tile")
    device = (read_json(run_dir / "versions.json") or {}).get("device", "")
    if not t.per_tile:
        out.append(_note(f"log.tiles: {mode} records one summary per step, not every tile: the histograms show "
                         "per-step mean tile times and per-step peaks. Set log.tiles: all for per-tile ones."))
    if not any(t.bytes.values()):
        t.bytes = {"step": step_peaks(run_dir)}
        out.append(_note("the tiles carry no memory (per-tile peaks are measured only with the engine's "
                         "tile_peaks=True): the memory histogram shows each training step's peak from metrics.jsonl"))
    if "cpu" in str(device).lower():
        out.append(_note("on CPU a tile's memory is the process's peak resident set so far (it only grows), "
                         "not the tile's own use; on CUDA it is the allocator's peak during the tile"))
    out.append(_img(tile_histograms(t, str(device)), "tile histograms"))
    return "\n".join(out)


def _config_dict(run_dir: Path) -> dict[str, Any]:
    p = run_dir / "config.yaml"
    if not p.is_file():
        return {}
    with open(p) as f:
        return yaml.safe_load(f) or {}


def _config(run_dir: Path) -> str:
    out = ["<h2>Config</h2>"]
    p = run_dir / "config.yaml"
    out.append(f"<pre>{_e(p.read_text())}</pre>" if p.is_file() else _note("config.yaml is missing"))
    out.append("<h2>Library versions</h2>")
    v = read_json(run_dir / "versions.json")
    out.append(_kv_table(v) if v else _note("versions.json is missing"))
    return "\n".join(out)
