"""benchmarks/bench_learning.py's offline paths: ``--rescore`` (the pointing game split by look-alikes, from a run's
heatmaps) and the bad input of ``--rescore`` / ``--rerun-baseline`` (exit 2, one message naming the file or seed)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks" / "bench_learning"  # the committed benchmark tables
LESION = {"kind": "lesion", "x0": 64, "y0": 32, "x1": 96, "y1": 64}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_script("bench_learning")


def recorded(tmp_path: Path) -> tuple[Path, Path]:
    """A recorded benchmark (the committed setup and one whole-slide attention row) whose run folder holds the
    heatmaps of two positive slides: one peaks on its look-alike, one without a look-alike peaks on its lesion."""
    rows = [json.loads(x) for x in (DOCS / "default.jsonl").read_text().splitlines() if x.strip()]
    setup = next(r for r in rows if r["kind"] == "setup")
    run = next(r for r in rows if r.get("input") == "whole slide" and r["pool"] == "attention")
    cohort, run_dir, out = tmp_path / "cohort", tmp_path / "run", tmp_path / "out"
    maps = run_dir / "heatmaps"
    for d in (cohort, maps, out):
        d.mkdir(parents=True)
    on_lookalike = np.full((1, 4, 5), 0.01)
    on_lookalike[0, 0, 0] = 0.9  # cell (0, 0): centre (16, 16) level-0 px, in the look-alike's box
    on_lesion = np.full((1, 4, 5), 0.01)
    on_lesion[0, 1, 2] = 0.8  # centre (80, 48): in the lesion's box
    np.save(maps / "a.attention.npy", on_lookalike)
    np.save(maps / "c.attention.npy", on_lesion)
    rec = {"stride": 16, "box": [0, 0, 160, 128], "downsample": 2.0}
    (maps / "heatmaps.json").write_text(json.dumps({"classes": ["negative", "positive"], "slides": [
        {**rec, "slide": "a.tiff", "attention": "a.attention.npy"},
        {**rec, "slide": "c.tiff", "attention": "c.attention.npy"}]}))  # fmt: skip
    lookalike = {**LESION, "kind": "distractor", "x0": 0, "x1": 32, "y0": 0, "y1": 32}
    (cohort / "lesions.json").write_text(json.dumps({"slides": {
        "a.tiff": {"label": "positive", "boxes": [LESION, lookalike]},
        "c.tiff": {"label": "positive", "boxes": [LESION]}}}))  # fmt: skip
    old = {k: v for k, v in run.items() if not k.startswith("pointing_with") and k != "n_with_lookalike"}
    lines = [{**setup, "cohort": str(cohort)}, {**old, "run_dir": str(run_dir), "seed": 0}]
    (out / "bench_learning.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out, run_dir


def test_rescore_splits_the_pointing_game_by_lookalikes(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, _ = recorded(tmp_path)
    monkeypatch.setattr(bench, "example_crops", lambda cohort: None)  # the plot's illustration reads real slides
    assert bench.main(["--out", str(out), "--rescore"]) == 0
    row = [json.loads(x) for x in (out / "bench_learning.jsonl").read_text().splitlines()][1]
    assert row["pointing_game"] == 0.5 and row["n_positive"] == 2 and row["n_with_lookalike"] == 1
    assert row["pointing_with_lookalike"] == 0.0 and row["pointing_without_lookalike"] == 1.0
    assert "| 0.50 (0/1 / 1/1) |" in (out / "bench_learning.md").read_text()


def test_rescore_scores_max_pooling_where_it_decided(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A max-pooling row: the CAM's peak and the deciding cell (heatmaps.json's ``decisive``) are both scored, and
    the table shows both."""
    out, run_dir = recorded(tmp_path)
    maps = run_dir / "heatmaps"
    index = json.loads((maps / "heatmaps.json").read_text())
    for rec, cell in zip(index["slides"], ([[0, 0], [1, 2]], [[1, 2], [0, 0]]), strict=True):
        cam = np.zeros((2, 4, 5))
        cam[1, 0, 0] = 3.0  # both positive CAMs peak at (0, 0): the look-alike of a, tissue of c
        np.save(maps / f"{rec['slide']}.cam.npy", cam)
        rec.update(attention=None, cam=f"{rec['slide']}.cam.npy", decisive=cell)  # a decided in its lesion, c not
    (maps / "heatmaps.json").write_text(json.dumps(index))
    lines = [json.loads(x) for x in (out / "bench_learning.jsonl").read_text().splitlines()]
    lines[1]["pool"] = "max"
    (out / "bench_learning.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    monkeypatch.setattr(bench, "example_crops", lambda cohort: None)
    assert bench.main(["--out", str(out), "--rescore"]) == 0
    row = [json.loads(x) for x in (out / "bench_learning.jsonl").read_text().splitlines()][1]
    assert row["pointing_game"] == 0.0 and row["pointing_decisive"] == 0.5
    assert "| CAM 0.00, deciding cell 0.50 (0/1 / 0/1) |" in (out / "bench_learning.md").read_text()


def test_offline_paths_refuse_bad_input(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nothing"
    assert bench.main(["--out", str(missing), "--rescore"]) == 2
    assert str(missing / "bench_learning.jsonl") in capsys.readouterr().err
    out, _ = recorded(tmp_path)
    assert bench.main(["--out", str(out), "--rerun-baseline", "7"]) == 2
    err = capsys.readouterr().err
    assert "--rerun-baseline 7" in err and "run with --baseline" in err  # the record has no baseline at all


def test_a_head_s_map_is_chosen_by_the_pool_it_builds_not_by_its_name(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A named head scores its attention map when its overrides build an attention pool, whatever it is called."""
    monkeypatch.setitem(bench.HEADS, "clam_w01", ["model.pool=gated_attention", "model.attention.instance_loss=0.1"])
    assert [bench.map_key(p) for p in ("attention", "gated_attention", "attention_mil_w01", "clam_w01")] == [
        "attention"] * 4  # fmt: skip
    assert [bench.map_key(p) for p in ("max", "avg", "topk")] == ["cam"] * 3



def test_the_table_names_the_machine_the_model_and_the_overrides(bench: ModuleType) -> None:
    """A run on a GPU with another trunk and ``--set`` overrides says so in the setup line; the committed CPU tables
    (no such keys) still read as before."""
    rows = [json.loads(x) for x in (DOCS / "h200_resnet18.jsonl").read_text().splitlines()]
    setup = {**rows[0], "overrides": ["model.freeze_bn=false"]}
    text = bench.markdown([setup, *rows[1:]])
    assert "Measured on one NVIDIA H200 (16-core host)" in text
    assert "Model `resnet18` (random initial weights, `model.freeze_bn=false`)" in text
    text = bench.markdown([{**setup, "overrides": ["model.weights=trunk.pt"]}, *rows[1:]])
    assert "Model `resnet18` (initial weights from a file, `model.weights=trunk.pt`)" in text
    cpu = [json.loads(x) for x in (DOCS / "default.jsonl").read_text().splitlines() if x.strip()]
    text = bench.markdown(cpu)
    assert "Measured on a 2-core CPU (no GPU)" in text and "Model `tiny` (random initial weights)" in text


def test_a_run_whose_maps_fail_keeps_its_metrics(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:  # fmt: skip
    """predict --heatmaps failing after a fit: the row keeps the fit's metrics and says why it has no pointing."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"val_roc_auc": 0.75}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "val", "accuracy": 0.5, "loss": 0.7}) + "\n")
    labels = tmp_path / "labels.csv"
    labels.write_text("slide,label,split\na.svs,positive,train\nb.svs,negative,val\n")
    seen: list[list[str]] = []
    monkeypatch.setattr(bench, "load_config", lambda path, overrides: seen.append(overrides) or overrides)
    monkeypatch.setattr("wsitrain.train.fit.run_fit", lambda cfg, console, quiet: run_dir)

    def broken(*a: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(bench, "localise", broken)
    row = bench.run_one({"a": 1}, tmp_path, labels, 3, "max", False, ("model.freeze_bn=false",))
    assert row["roc_auc"] == 0.75 and row["accuracy"] == 0.5 and row["pointing_game"] is None
    assert row["localise_error"] == "RuntimeError: CUDA error: an illegal memory access"
    assert "model.freeze_bn=false" in seen[0] and "model.pool=max" in seen[0]  # --set reaches the run's config


def test_the_baseline_freezes_the_runs_own_weights(bench: ModuleType, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``--set model.weights=FILE`` (a trunk pretrained elsewhere) reaches the frozen-feature baseline too: it embeds
    the patches with that trunk, not a random one."""
    import argparse
    import csv

    import torch

    from wsitrain.models import build
    from wsitrain.slides.synth import write_synthetic_dataset
    from wsitrain.train import frozen_mil

    labels = write_synthetic_dataset(tmp_path / "cohort", n=4, size=512, seed=1, lesions="small")
    rows = list(csv.DictReader(labels.open()))
    split = tmp_path / "labels.csv"
    split.write_text("slide,label,split\n" + "".join(f"{r['slide']},{r['label']},{'train' if i % 2 else 'val'}\n"
                                                    for i, r in enumerate(rows)))  # fmt: skip
    torch.manual_seed(5)
    trunk = build("tiny_ln", 2).features.state_dict()
    weights = tmp_path / "trunk.pt"
    torch.save(trunk, weights)
    built: list[torch.nn.Module] = []
    real = frozen_mil.build_frozen_mil
    monkeypatch.setattr(frozen_mil, "build_frozen_mil", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    args = argparse.Namespace(patch=64, baseline_epochs=1, lr=1e-3, set=[f"model.weights={weights}"])
    base = {"model": {"name": "tiny_ln"}, "data": {"slides_dir": str(tmp_path / "cohort")}}
    row = bench.run_baseline(base, split, 0, 5.0, args, tmp_path / "run")
    assert row["roc_auc"] is not None and len(built) == 1
    for k, v in built[0].features.state_dict().items():
        assert torch.equal(v, trunk[k]), k


# Two runs of 4 units, the second with each unit in a process of its own: 28 s alone on 4 slides (2 trained, 2 held
# out), 38 s on 8 (measured 2026-12-02; 52 s in CI): the children's start dominates. CI runs it.
@pytest.mark.heavy
def test_jobs_run_each_unit_in_a_child_and_give_the_one_process_results(bench: ModuleType, tmp_path: Path) -> None:
    """Reference vs variant: ``--jobs 2`` runs each (seed, input, head) in its own process and the baselines after
    their seed's end-to-end runs, yet every metric equals the one-process run's, rows in the same order."""
    common = ["--n", "4", "--size", "512", "--train", "2", "--epochs", "1", "--pools", "max", "--seeds", "0,1",
              "--no-thumbnail", "--baseline", "--baseline-epochs", "1",
              "--cohort", str(tmp_path / "cohort")]  # fmt: skip
    assert bench.main([*common, "--out", str(tmp_path / "one"), "--work", str(tmp_path / "w1")]) == 0
    assert bench.main([*common, "--out", str(tmp_path / "two"), "--work", str(tmp_path / "w2"), "--jobs", "2"]) == 0

    def runs(out: str) -> list[dict]:
        lines = (tmp_path / out / "bench_learning.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == "run"]

    one, two = runs("one"), runs("two")
    assert [(r["seed"], r["input"]) for r in one] == [(0, "whole slide"), (0, "frozen features"),
                                                      (1, "whole slide"), (1, "frozen features")]  # fmt: skip
    assert [(r["seed"], r["input"]) for r in two] == [(r["seed"], r["input"]) for r in one]
    for a, b in zip(one, two, strict=True):
        for key in ("roc_auc", "accuracy", "val_loss", "pointing_game", "lesion_mass"):
            assert a.get(key) == b.get(key), (a["seed"], a["input"], key)
    logs = sorted(p.name for p in (tmp_path / "w2" / "logs").glob("*.log"))
    assert logs == ["seed0-baseline-attention.log", "seed0-whole-max.log", "seed1-baseline-attention.log",
                    "seed1-whole-max.log"] and not (tmp_path / "w1" / "logs").exists()  # fmt: skip


def test_a_failed_child_names_its_log(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A ``--jobs`` child that fails is an error naming its log, not a missing row; ``--jobs 0`` is exit 2."""
    assert bench.main(["--out", str(tmp_path / "o"), "--jobs", "0"]) == 2
    assert "--jobs 0: give 1" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"seed3-whole-max run failed \(exit 2\): see .*seed3-whole-max\.log"):
        bench.run_in_child(bench.Unit(3, bench.WHOLE, "max"), ["--out", str(tmp_path / "o"), "--pools", "nope"],
                           tmp_path)  # fmt: skip
    assert "not available" in (tmp_path / "logs" / "seed3-whole-max.log").read_text()
