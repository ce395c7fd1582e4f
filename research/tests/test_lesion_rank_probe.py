"""research/lesion_rank_probe.py: where a lesion cohort's lesions and look-alikes rank in a run's positive attention
branch, at initialisation (the weights fit built for the run's seed) and trained; bad input is exit 2 or names the
folder."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from script_module import load_script
from tiny_runs import finished_run

from wsitrain.slides.synth import write_synthetic_dataset
from wsitrain.train.checkpoint import load_checkpoint


def test_slide_figures_from_hand_made_maps() -> None:
    probe = load_script("lesion_rank_probe", "research")
    tissue = np.ones((4, 4), bool)
    scores = np.zeros((4, 4))
    scores[0, 0] = 5.0  # a look-alike above the lesion
    scores[1, 1] = 3.0  # the lesion's best cell
    scores[2, 2] = 4.0  # plain tissue above the lesion too
    lesion = np.zeros((4, 4), bool)
    lesion[1, 1] = lesion[1, 2] = True
    look = np.zeros((4, 4), bool)
    look[0, 0] = True
    s = probe.slide_rank("a", "positive", scores, tissue, lesion, look)
    plain = np.delete(scores.ravel(), [0, 5, 6])  # the 13 plain tissue cells
    assert s.lesion_rank == 1  # only the plain cell at 4.0 is above it; the look-alike is not plain tissue
    assert s.lesion_z == pytest.approx((3.0 - plain.mean()) / plain.std())
    assert s.lookalike_z == pytest.approx((5.0 - plain.mean()) / plain.std())
    assert s.spread == pytest.approx(scores.std())
    none = probe.slide_rank("b", "negative", scores, tissue, np.zeros_like(lesion), look)
    assert none.lesion_rank is None and none.lesion_z is None
    outside = probe.slide_rank("c", "positive", scores, ~lesion, lesion, look)  # lesion cells off the tissue
    assert outside.lesion_rank is None
    run = probe.summarise("r", "init", [s, none], "positive")
    assert run.lesion_rank == 1 and run.lookalike_z_negative == pytest.approx(none.lookalike_z)
    assert run.ratio == pytest.approx(s.lesion_z / none.lookalike_z)


def lesion_run(tmp: Path) -> Path:
    """A one-epoch fit of CLAM-MB on four 512 px lesion slides at an lr of 1e-12: its last.pt is its initial weights
    to within round-off, so the probe's rebuilt initial model can be checked against it."""
    cohort = tmp / "cohort"
    labels = write_synthetic_dataset(cohort, n=4, size=512, seed=1, lesions="small")
    rows = list(csv.DictReader(labels.open()))
    seen: set[str] = set()
    for r in rows:  # one slide of each class trains, the other is held out
        r["split"] = "val" if r["label"] in seen else "train"
        seen.add(r["label"])
    split = tmp / "labels.csv"
    with split.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["slide", "label", "split"])
        w.writeheader()
        w.writerows(rows)
    cfg = tmp / "cfg.yaml"
    cfg.write_text(
        f"name: exp\nseed: 3\ndata: {{labels: {split}, slides_dir: {cohort}, region: whole}}\n"
        "model: {name: tiny_ln, pool: attention, attention: {branches: per_class, instance_loss: 0.1}}\n"
        "engine: {memory_budget: 1GiB, device: cpu}\n"
        "train: {epochs: 1, optimizer: sgd, lr: 1.0e-12, momentum: 0.0}\n"
        f"log: {{dir: {tmp / 'runs'}, tiles: 'off'}}\n"
    )
    return finished_run(cfg)


def test_a_run_is_probed_at_init_and_trained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    probe = load_script("lesion_rank_probe", "research")
    run = lesion_run(tmp_path)
    trained = load_checkpoint(run / "last.pt")["model"]
    init = probe.run_model(run, init=True).state_dict()
    assert trained.keys() == init.keys()
    for k, v in init.items():  # the seed's initial weights, not another draw (those differ by ~0.1)
        torch.testing.assert_close(trained[k], v, rtol=0, atol=1e-9, msg=k)
    torch.manual_seed(4)  # another global state before: the probe seeds as fit did
    other = probe.run_model(run, init=True)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), init.values(), strict=True))
    r = probe.rank_run(run, init=True, split="train")
    assert sorted(s.label for s in r.slides) == ["negative", "positive"]  # one per class
    pos = next(s for s in r.slides if s.label == "positive")
    assert pos.lesion_rank is not None and pos.lesion_z is not None and r.spread > 0
    out = tmp_path / "ranks.json"
    assert probe.main([str(run), "--split", "val", "--json", str(out)]) == 0
    assert "(last.pt, val): lesion rank" in capsys.readouterr().out
    assert out.is_file()


def test_bad_input_names_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    probe = load_script("lesion_rank_probe", "research")
    assert probe.main([str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run folder (config.yaml, last.pt missing)" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text(
        f"data: {{synthetic: {{n: 4, size: 128, cache_dir: {tmp_path}}}}}\nmodel: {{name: tiny, pool: max}}\n"
    )
    with pytest.raises(SystemExit, match="per-class attention head"):
        probe.rank_run(tmp_path, init=True)
