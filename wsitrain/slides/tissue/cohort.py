"""Which slides' tissue doubts are unusual for their cohort, so that the warning names those and not every slide.

A doubt (``summary.doubts``: a dropped piece that may be tissue) is common: specks a little above a tenth of
``data.tissue.min_fragment_mm2`` are on nearly every slide of a real cohort (issue 54: all 40 slides of a 2048 px
fit raised one), and a warning that always fires is read by nobody. A slide's doubts are unusual when:

- few slides have doubts at all (at most ``RARE_SHARE`` of the cohort): then any doubt stands out;
- its largest doubt is an outlier among the doubtful slides' largest: above Tukey's upper fence (Q3 + 1.5 IQR) of
  their log areas, and above ``OUTLIER_RATIO`` times their median (with a tight spread the fence alone would name
  a speck only a little larger than the rest);
- it has a piece darker than its kept tissue (a dense cluster of nuclei is dark) while such pieces are rare
  (at most ``RARE_SHARE`` of the slides have one).

Below ``MIN_COHORT`` slides with tissue records there is no distribution to compare with: every doubt is unusual.
The rest stay in the tissue table (``validate``), data.json's tissue and the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from wsitrain.slides.tissue.summary import DARKER_WHY

# Fewer slides than this give quartiles of a handful of values: every doubt is then warned, as before.
MIN_COHORT = 8
# Doubts on at most this share of the slides are rare, so each is worth the warning.
RARE_SHARE = 0.25
# Tukey's fence: 1.5 interquartile ranges above the third quartile (of log areas: piece areas are skewed).
FENCE_IQR = 1.5
# An outlier is also at least this many times the doubtful slides' median largest doubt.
OUTLIER_RATIO = 2.0


def unusual_doubts(records: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """For each slide whose doubts are unusual for the cohort (``records``: tissue records by slide), why."""
    doubtful = {name: r["doubts"] for name, r in records.items() if r["doubts"]}
    if not doubtful:
        return {}
    n = len(records)
    if n < MIN_COHORT:
        return {name: f"too few slides, {n}, to tell what is usual" for name in doubtful}
    if len(doubtful) <= RARE_SHARE * n:
        return {name: f"doubts on {len(doubtful)} of {n} slides" for name in doubtful}
    largest = {name: max(d["area_mm2"] for d in ds) for name, ds in doubtful.items()}
    logs = np.log(np.maximum(np.array(list(largest.values())), 1e-12))
    q1, median, q3 = np.percentile(logs, [25, 50, 75])
    fence = max(q3 + FENCE_IQR * (q3 - q1), median + np.log(OUTLIER_RATIO))
    darker = [name for name, ds in doubtful.items() if any(DARKER_WHY in d["why"] for d in ds)]
    out = {}
    for name, area in largest.items():
        why = []
        if np.log(max(area, 1e-12)) > fence:
            why.append(f"a dropped piece of {area:.4g} mm², where the doubtful slides' largest are typically "
                       f"{float(np.exp(median)):.2g} mm²")  # fmt: skip
        if name in darker and len(darker) <= RARE_SHARE * n:
            why.append(f"a dropped piece darker than its tissue, as on {len(darker)} of {n} slides")
        if why:
            out[name] = " and ".join(why)
    return out
