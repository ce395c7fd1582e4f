"""The tissue warning names the slides whose doubts are unusual for the cohort (slides.tissue.cohort), not every
slide with a speck; the rest stay in the tissue table, marked apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from wsitrain.preflight import PreflightReport, SlideShape, tissue_warnings
from wsitrain.slides.tissue.cohort import MIN_COHORT, unusual_doubts
from wsitrain.slides.tissue.summary import DARKER_WHY

THRESHOLD = 0.001  # data.tissue.min_fragment_mm2 (mm²)


def record(*areas: float, darker: bool = False) -> dict[str, Any]:
    """A tissue record whose doubts are dropped 'small' pieces of ``areas`` mm² (the first one darker)."""
    doubts = [{"kind": "small", "area_mm2": a, "box": [0, 0, 1, 1],
               "why": f"{a:.4f} mm² is more than a tenth of the threshold" + (f" and {DARKER_WHY}" if darker and not i
                                                                              else "")}
              for i, a in enumerate(areas)]  # fmt: skip
    return {"kept": {"count": 1, "area_mm2": 1.0}, "doubts": doubts, "mpp_assumed": False, "mpp": 0.5,
            "min_fragment_mm2": THRESHOLD,
            "dropped": {"count": len(areas), "area_mm2": sum(areas), "by_reason": {"small": len(areas)},
                        "largest": doubts[0] if doubts else None, "pieces": doubts}}  # fmt: skip


def specks(n: int, seed: int = 0) -> dict[str, dict[str, Any]]:
    """``n`` slides, each with specks of 1.1-2.5 tenths of the threshold, as on nearly every real slide."""
    rng = np.random.default_rng(seed)
    return {f"s{i:02d}.svs": record(*rng.uniform(0.11, 0.25, size=2) * THRESHOLD) for i in range(n)}


def test_specks_on_every_slide_are_not_unusual() -> None:
    assert unusual_doubts(specks(40)) == {}


def test_a_large_piece_is_unusual_among_specks() -> None:
    cohort = specks(40)
    cohort["lesion.svs"] = record(0.8 * THRESHOLD, 0.15 * THRESHOLD)
    found = unusual_doubts(cohort)
    assert list(found) == ["lesion.svs"] and "0.0008 mm²" in found["lesion.svs"]


def test_a_darker_piece_is_unusual_where_dark_pieces_are_rare() -> None:
    cohort = specks(40)
    cohort["s03.svs"] = record(0.15 * THRESHOLD, darker=True)
    assert list(unusual_doubts(cohort)) == ["s03.svs"]
    dark_everywhere = {n: record(0.15 * THRESHOLD, darker=True) for n in cohort}  # then darkness is typical
    assert unusual_doubts(dark_everywhere) == {}


def test_rare_doubts_and_small_cohorts_are_all_named() -> None:
    clean = {f"c{i}.svs": record() for i in range(20)}
    assert list(unusual_doubts({**clean, **specks(3)})) == ["s00.svs", "s01.svs", "s02.svs"]  # 3 of 23 slides
    small = specks(MIN_COHORT - 1)
    assert set(unusual_doubts(small)) == set(small)  # nothing to compare with


def shapes(records: dict[str, dict[str, Any]]) -> list[SlideShape]:
    return [SlideShape(n, Path(n), 0, 0.5, (64, 64), (64, 64), None, r) for n, r in records.items()]


def test_the_warning_names_the_unusual_slide_and_counts_the_rest() -> None:
    cohort = specks(40)
    assert tissue_warnings(shapes(cohort)) == []  # a warning that would fire on every slide does not fire
    cohort["lesion.svs"] = record(0.8 * THRESHOLD)
    (line,) = tissue_warnings(shapes(cohort))
    assert line.startswith("tissue: on 1 slide, a dropped piece may be tissue") and "unusual for this cohort" in line
    assert "lesion.svs (a dropped piece of 0.0008 mm²" in line and "s00.svs" not in line
    assert "40 other slides have doubts typical of this cohort, listed in the tissue table" in line
    report = PreflightReport("cpu", 2**20, False, slides=shapes(cohort))
    table = report.tissue_table()
    assert table is not None
    cells = list(table.columns[-1].cells)
    assert cells[0] == "[yellow]1 unusual[/]" and cells[1] == "2"  # the unusual slide first, the rest counted
    assert list(table.columns[0].cells)[0] == "lesion.svs"


def test_one_reason_for_all_is_said_once() -> None:
    (line,) = tissue_warnings(shapes(specks(3)))
    assert "unusual for this cohort: s00.svs, s01.svs, s02.svs (too few slides, 3, to tell what is usual);" in line
