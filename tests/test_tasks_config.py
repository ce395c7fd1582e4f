"""The task section of the config and the labels CSV's task columns: every bad value is refused before anything is
written, with one message naming the CSV, the line and the column."""

from __future__ import annotations

from pathlib import Path

import pytest

from wsitrain.config import WsiTrainConfig, load_config
from wsitrain.errors import ConfigError, SlideError
from wsitrain.slides.synth import write_synthetic_slide
from wsitrain.tasks.columns import load_task_records
from wsitrain.train.data import split_fit


def test_task_defaults_to_classification_and_accepts_the_short_form(tmp_path: Path) -> None:
    assert WsiTrainConfig().task.kind == "classification"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task: survival\n")
    assert load_config(cfg).task.kind == "survival"
    assert load_config(cfg, ["task.bins=6"]).task.bins == 6
    cfg.write_text("task:\n  kind: regression\n  columns: [score]\n  loss: huber\n")
    t = load_config(cfg).task
    assert (t.kind, t.columns, t.loss) == ("regression", ["score"], "huber")


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("task: {kind: regression}", "columns is not set"),
        ("task: {kind: survival, columns: [a]}", "columns apply to regression and multilabel"),
        ("task: {kind: ranking}", "'ranking' is not a valid choice"),
        ("task: {kind: survival, bins: 1}", "task.bins: must be >= 2"),
        ("task: {kind: multilabel, columns: [a, a]}", "lists a more than once"),
    ],
)
def test_bad_task_sections_are_config_errors(tmp_path: Path, yaml_text: str, message: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text + "\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(cfg)
    assert err.value.exit_code == 2


@pytest.fixture(scope="module")
def slides(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("slides")
    for i in range(6):
        write_synthetic_slide(d / f"s{i}.svs", size=64, positive=False, seed=i)
    return d


def _csv(d: Path, text: str) -> Path:
    p = d / "labels.csv"
    p.write_text(text)
    return p


def _task(**kw: object) -> WsiTrainConfig:
    return WsiTrainConfig.model_validate({"task": kw})


def test_survival_columns_are_read_into_targets(slides: Path, tmp_path: Path) -> None:
    csv = _csv(tmp_path, "slide,time,event,patient\n" + "".join(f"s{i}.svs,{i + 1},{i % 2},P{i}\n" for i in range(6)))
    records, names = load_task_records(csv, slides, _task(kind="survival", bins=2).task)
    assert names == ["risk"]
    assert [r.target for r in records] == [(i + 1.0, float(i % 2)) for i in range(6)]
    assert [r.label for r in records] == [i % 2 for i in range(6)]  # the event is the stratum
    assert [r.patient for r in records] == [f"P{i}" for i in range(6)]


def test_every_bad_survival_value_is_named_by_line_and_column(slides: Path, tmp_path: Path) -> None:
    csv = _csv(tmp_path, "slide,time,event\ns0.svs,1,1\ns1.svs,,1\ns2.svs,abc,0\ns3.svs,3,2\ns4.svs,-1,1\n"
                         "s5.svs,inf,1\n")  # fmt: skip
    with pytest.raises(SlideError) as err:
        load_task_records(csv, slides, _task(kind="survival", bins=2).task)
    msg = err.value.message
    assert str(csv) in msg and "5 problems" in msg
    for expected in ("line 3, column time: empty", "line 4, column time: 'abc' is not a number",
                     "line 5, column event: event '2' is not 0 or 1", "line 6, column time: time '-1' is negative",
                     "line 7, column time: 'inf' is not a finite number"):  # fmt: skip
        assert expected in msg
    assert err.value.exit_code == 2


def test_missing_columns_too_few_events_and_constant_labels(slides: Path, tmp_path: Path) -> None:
    csv = _csv(tmp_path, "slide,time\ns0.svs,1\n")
    with pytest.raises(SlideError, match="no column event for task survival"):
        load_task_records(csv, slides, _task(kind="survival").task)
    csv = _csv(tmp_path, "slide,time,event\n" + "".join(f"s{i}.svs,{i + 1},{int(i < 3)}\n" for i in range(6)))
    with pytest.raises(SlideError, match="column event: 3 events outside the test rows, fewer than task.bins"):
        load_task_records(csv, slides, _task(kind="survival", bins=4).task)
    csv = _csv(tmp_path, "slide,a,b\n" + "".join(f"s{i}.svs,1,{i % 2}\n" for i in range(6)))
    with pytest.raises(SlideError, match="column a: every row outside the test set has the value 1"):
        load_task_records(csv, slides, _task(kind="multilabel", columns=["a", "b"]).task)
    csv = _csv(tmp_path, "slide,a\ns0.svs,0.5\ns1.svs,1\n")
    with pytest.raises(SlideError, match="line 2, column a: '0.5' is not 0 or 1"):
        load_task_records(csv, slides, _task(kind="multilabel", columns=["a"]).task)


def test_a_patient_has_one_outcome(slides: Path, tmp_path: Path) -> None:
    csv = _csv(tmp_path, "slide,score,patient\ns0.svs,1,A\ns1.svs,2,A\ns2.svs,3,B\n")
    with pytest.raises(SlideError, match="line 3, column score: patient A has 2 here but 1 on line 2"):
        load_task_records(csv, slides, _task(kind="regression", columns=["score"]).task)


def test_classification_is_read_as_before(slides: Path, tmp_path: Path) -> None:
    csv = _csv(tmp_path, "slide,label\ns0.svs,b\ns1.svs,a\n")
    records, names = load_task_records(csv, slides, WsiTrainConfig().task)
    assert names == ["a", "b"] and [r.label for r in records] == [1, 0] and all(r.target == () for r in records)


def test_the_validation_split_never_divides_a_patient(slides: Path, tmp_path: Path) -> None:
    rows = "".join(f"s{i}.svs,{i},P{i // 2}\n" for i in range(6))
    csv = _csv(tmp_path, "slide,score,patient\n" + rows.replace("s1.svs,1", "s1.svs,0").replace("s3.svs,3", "s3.svs,2")
               .replace("s5.svs,5", "s5.svs,4"))  # fmt: skip
    records, _ = load_task_records(csv, slides, _task(kind="regression", columns=["score"]).task)
    for seed in range(4):
        train, val = split_fit(records, 0.3, seed)
        assert val and train
        assert not {r.patient for r in train} & {r.patient for r in val}


def test_synth_task_cli_writes_a_cohort_the_task_reads(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from wsitrain.cli import app

    result = CliRunner().invoke(app, ["synth", str(tmp_path / "d"), "--task", "survival", "--n", "8", "--size", "64",
                                      "--test-fraction", "0.25"])  # fmt: skip
    assert result.exit_code == 0, result.output
    records, _ = load_task_records(tmp_path / "d" / "labels.csv", tmp_path / "d", _task(kind="survival", bins=2).task)
    assert len(records) == 8 and {r.split for r in records} == {"train", "val", "test"}
    assert all(r.patient for r in records) and all(r.target[0] > 0 for r in records)
    bad = CliRunner().invoke(app, ["synth", str(tmp_path / "e"), "--task", "ranking"])
    assert bad.exit_code == 2 and "no generator" in bad.output
