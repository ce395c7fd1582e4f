"""Folds for cross-validation: grouped by patient, stratified by label (or event), deterministic from the seed.

A patient's slides share everything (tissue, scanner, outcome), so a patient in two folds would leak validation
into training. Folds are built from patients: each stratum's patients are shuffled with the seed and dealt in turn
to the fold that holds fewest slides of that stratum so far, which keeps each stratum's count per fold within one
patient of an even share (within one slide when every patient has one slide).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from wsitrain.errors import WsiTrainError


def grouped_stratified_folds(
    strata: Sequence[str], groups: Sequence[str], k: int, seed: int
) -> list[int]:
    """The fold (0..k-1) of each row. ``strata``: the row's label (a patient takes its first row's stratum);
    ``groups``: its patient (a row without one is its own group). Raises when there are fewer groups than folds."""
    if len(strata) != len(groups):
        raise ValueError("strata and groups must have one entry per row")
    if k < 2:
        raise WsiTrainError(f"--folds {k}: cross-validation needs at least 2 folds", hint="e.g. --folds 5")
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    if len(members) < k:
        raise WsiTrainError(
            f"--folds {k}: only {len(members)} patients (or slides) outside the test set; each fold needs one",
            hint=f"use --folds {max(2, len(members))} or fewer",
        )
    by_stratum: dict[str, list[str]] = {}
    for g, rows in members.items():
        by_stratum.setdefault(str(strata[rows[0]]), []).append(g)
    rng = np.random.default_rng(seed)
    fold_of = [-1] * len(strata)
    total = np.zeros(k, dtype=np.int64)  # slides per fold over all strata: ties go to the emptiest fold
    for stratum in sorted(by_stratum):
        patients = sorted(by_stratum[stratum])
        rng.shuffle(patients)
        # larger patients first, so the small ones even out the counts (the shuffle breaks ties)
        patients.sort(key=lambda g: -len(members[g]))
        count = np.zeros(k, dtype=np.int64)
        for g in patients:
            # the fold with the fewest of this stratum, then the fewest overall, then the lowest index
            f = int(min(range(k), key=lambda j: (count[j], total[j], j)))
            for i in members[g]:
                fold_of[i] = f
            count[f] += len(members[g])
            total[f] += len(members[g])
    return fold_of


def grouped_holdout(strata: Sequence[str], groups: Sequence[str], fraction: float, seed: int) -> list[bool]:
    """Which rows go to validation when patients are known: one fold of ``round(1 / fraction)`` grouped, stratified
    folds, so about ``fraction`` of the slides and never part of a patient (0.25: one fold of 4; 0.3: one of 3)."""
    if fraction <= 0 or len(set(groups)) < 2:
        return [False] * len(strata)
    k = min(len(set(groups)), max(2, round(1 / fraction)))
    return [f == 0 for f in grouped_stratified_folds(strata, groups, k, seed)]
