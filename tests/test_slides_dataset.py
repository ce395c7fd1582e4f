"""Labels CSV validation, reproducible splits, the slide dataset and the prefetching loader."""

from __future__ import annotations

import pickle
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from wsitrain.errors import SlideError
from wsitrain.slides.augment import AugmentConfig
from wsitrain.slides.dataset import PrefetchLoader, SlideDataset, SlideRecord, load_labels, split_records
from wsitrain.slides.readers import open_slide
from wsitrain.slides.synth import write_synthetic_dataset

BROKEN = Path(__file__).resolve().parents[2] / "shared" / "slides" / "broken.svs"


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_dataset(tmp_path_factory.mktemp("ds"), n=6, size=256, seed=2)


def test_load_labels_from_synthetic_dataset(synth: Path) -> None:
    records, classes = load_labels(synth, synth.parent)
    assert classes == ["negative", "positive"] and len(records) == 6
    assert sum(r.label for r in records) == 3
    assert all(r.path.is_file() and r.label_name == classes[r.label] for r in records)


def test_slides_given_by_id_and_split_column(synth: Path, tmp_path: Path) -> None:
    csv = tmp_path / "labels.csv"
    csv.write_text("Slide,Label,Split\nslide_000,a,train\nslide_001,b,train\nslide_002,a,val\nslide_003,b,test\n")
    records, classes = load_labels(csv, synth.parent)
    assert classes == ["a", "b"] and records[0].path.name == "slide_000.svs"
    train, val = split_records(records, 0.5, seed=0)
    assert [r.slide_id for r in train] == ["slide_000", "slide_001"] and [r.slide_id for r in val] == ["slide_002"]


def test_every_problem_reported_at_once(synth: Path, tmp_path: Path) -> None:
    lines = ["slide,label", "slide_000.svs,a", "nope.svs,b", "slide_000.svs,a", "slide_001.svs,", "junk.svs,a"]
    (tmp_path / "junk.svs").write_bytes(b"not a slide at all")
    shutil.copy(synth.parent / "slide_001.svs", tmp_path / "slide_001.svs")
    shutil.copy(synth.parent / "slide_000.svs", tmp_path / "slide_000.svs")
    csv = tmp_path / "labels.csv"
    csv.write_text("\n".join(lines) + "\n")
    with pytest.raises(SlideError) as e:
        load_labels(csv, tmp_path)
    msg = e.value.message
    assert "4 problems" in msg
    assert "line 3: nope.svs: no such slide" in msg
    assert "line 4: slide_000.svs: listed twice (also line 2)" in msg
    assert "line 5: slide_001.svs: empty label" in msg
    assert "line 6: junk.svs: unreadable" in msg and "junk.svs" in msg


@pytest.mark.skipif(not BROKEN.exists(), reason=f"{BROKEN} not found (real test slides live beside the checkout)")
def test_broken_shared_slide_is_named(tmp_path: Path) -> None:
    csv = tmp_path / "labels.csv"
    csv.write_text(f"slide,label\n{BROKEN},x\n")
    with pytest.raises(SlideError, match="line 2: .*broken.svs: unreadable"):
        load_labels(csv)


def test_missing_columns_and_files(tmp_path: Path) -> None:
    csv = tmp_path / "l.csv"
    csv.write_text("name,label\na,b\n")
    with pytest.raises(SlideError, match="missing column slide"):
        load_labels(csv, tmp_path)
    with pytest.raises(SlideError, match="labels file not found"):
        load_labels(tmp_path / "none.csv", tmp_path)
    with pytest.raises(SlideError, match="slide folder not found"):
        load_labels(csv, tmp_path / "nowhere")


def _records(n_pos: int, n_neg: int) -> list[SlideRecord]:
    return [SlideRecord(f"s{i}", Path(f"s{i}.svs"), int(i < n_pos), "x") for i in range(n_pos + n_neg)]


def test_split_is_reproducible_and_stratified() -> None:
    recs = _records(8, 12)
    t1, v1 = split_records(recs, 0.25, seed=3)
    t2, v2 = split_records(recs, 0.25, seed=3)
    assert [r.slide_id for r in v1] == [r.slide_id for r in v2]
    assert sum(r.label for r in v1) == 2 and len(v1) == 5 and len(t1) + len(v1) == 20
    assert {r.slide_id for r in t1}.isdisjoint(r.slide_id for r in v1)
    _t3, v3 = split_records(recs, 0.25, seed=4)
    assert [r.slide_id for r in v3] != [r.slide_id for r in v1]
    t, v = split_records(_records(2, 2), 0.1, seed=0)
    assert len(v) == 2 and len(t) == 2  # at least one of each class in val when a class has two slides
    with pytest.raises(SlideError, match="val_fraction"):
        split_records(recs, 1.0)


def test_dataset_reads_augments_and_pickles(synth: Path) -> None:
    records, _ = load_labels(synth, synth.parent)
    ds = SlideDataset(records, {"mpp": 1.0, "pad_multiple": 32}, AugmentConfig(color_jitter="hsv"), seed=1)
    img, label, rec, res = ds[0]
    assert img.dtype == torch.uint8 and img.shape == (3, 128, 128) and label == rec.label and res.scale == 0.5
    again = ds[0][0]
    assert torch.equal(img, again)  # same epoch and seed: same augmentation
    ds.set_epoch(1)
    assert not torch.equal(img, ds[0][0])
    clone = pickle.loads(pickle.dumps(ds))
    clone.set_epoch(0)
    assert torch.equal(clone[0][0], img)
    reader = open_slide(records[0].path)
    _ = reader.info
    copy = pickle.loads(pickle.dumps(reader))  # handle dropped; reopened lazily on first use
    assert copy.read_region(0, 0, 0, 8, 8).shape == (8, 8, 3)


class _SlowDataset:
    """Records which items were requested and when, so the test can see reading happen ahead of use."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.started: list[int] = []
        self.event = threading.Event()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.started.append(i)
        self.event.set()
        if i == self.fail_at:
            raise SlideError(f"item {i} failed")
        return i * 10


def test_prefetch_order_lookahead_and_errors() -> None:
    ds = _SlowDataset(5)
    loader = PrefetchLoader(ds, order=[3, 1, 4, 0])
    it = iter(loader)
    assert next(it) == 30
    deadline = time.monotonic() + 10
    while len(ds.started) < 2 and time.monotonic() < deadline:  # the next slide is read while we "train"
        time.sleep(0.01)
    assert ds.started[:2] == [3, 1]
    assert list(it) == [10, 40, 0] and len(loader) == 4
    with pytest.raises(SlideError, match="item 2 failed"):
        list(PrefetchLoader(_SlowDataset(4, fail_at=2)))
    # Leaving early stops the worker instead of leaking it.
    for x in PrefetchLoader(_SlowDataset(100)):
        if x == 20:
            break
    assert not any(t.name == "wsitrain-prefetch" and t.is_alive() for t in threading.enumerate())


def test_labels_differing_only_in_case_or_spaces_are_refused(synth: Path, tmp_path: Path) -> None:
    csv = tmp_path / "labels.csv"
    csv.write_text("slide,label\nslide_000,positive\nslide_001,Positive\nslide_002,negative\n"
                   "slide_003,\" negative\"\n")  # fmt: skip
    with pytest.raises(SlideError) as err:
        load_labels(csv, synth.parent)
    msg = err.value.message
    assert "'positive' (line 2) and 'Positive' (line 3) differ only in case or spaces" in msg
    assert "'negative' (line 4) and ' negative' (line 5)" in msg and str(csv) in msg
