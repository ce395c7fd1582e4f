"""Task metrics, the survival loss and the cross-validation folds against references computed by hand on fixed data.

Each expected value is worked out in the comment next to it (no scipy or lifelines needed to check them).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from wsitrain.errors import WsiTrainError
from wsitrain.tasks import metrics as M
from wsitrain.tasks.splits import grouped_stratified_folds
from wsitrain.tasks.survival import bin_index, risk_score, survival_nll, time_bins


def test_concordance_index_counts_ties_as_harrell() -> None:
    t = np.array([2, 4, 4, 6, 8])
    e = np.array([1, 1, 0, 1, 0])
    risk = np.array([0.9, 0.5, 0.5, 0.7, 0.1])
    # event at 2: outlived by all 4 others, lower risk each time -> 4 of 4.
    # event at 4: outlived by 6, 8 and the censored 4 (alive at the event): tie 0.5, 0.7 discordant, 0.1 -> 1.5 of 3.
    # event at 6: outlived by 8 -> 1 of 1. Censored rows start no pair. C = 6.5 / 8.
    assert M.concordance_index(t, e, risk) == pytest.approx(6.5 / 8)
    assert M.concordance_index(t, e, -risk) == pytest.approx(1.5 / 8)  # ties stay one half
    assert math.isnan(M.concordance_index(t, np.zeros(5), risk))  # no event: nothing comparable


def test_concordance_index_perfect_and_reversed() -> None:
    t = np.array([5.0, 1.0, 3.0, 2.0])
    e = np.ones(4)
    assert M.concordance_index(t, e, -t) == 1.0
    assert M.concordance_index(t, e, t) == 0.0
    # two events at one time are not compared: only the 5 pairs of different times count
    assert M.concordance_index(np.array([1, 1, 2]), np.ones(3), np.array([2, 1, 0])) == 1.0


def test_kaplan_meier_by_hand() -> None:
    km = M.kaplan_meier(np.array([1, 2, 2, 3, 4]), np.array([1, 1, 0, 1, 0]))
    # t=1: 5 at risk, 1 event -> 4/5; t=2: 4 at risk (the censored 2 included), 1 event -> 0.8*3/4 = 0.6;
    # t=3: 2 at risk, 1 event -> 0.3. The censored 4 adds no step.
    np.testing.assert_allclose(km.times, [0, 1, 2, 3])
    np.testing.assert_allclose(km.survival, [1.0, 0.8, 0.6, 0.3])
    np.testing.assert_array_equal(km.at_risk, [5, 5, 4, 2])


def test_logrank_by_hand() -> None:
    t = np.array([1, 3, 5, 2, 4, 6])
    e = np.array([1, 1, 0, 1, 1, 1])
    g = np.array([1, 1, 1, 0, 0, 0])
    # event times 1, 2, 3, 4, 6 with (n, n1, d, d1):
    #   1: (6, 3, 1, 1) O-E +1/2,  V 1/4;   2: (5, 2, 1, 0) O-E -2/5, V 6/25;   3: (4, 2, 1, 1) O-E +1/2, V 1/4;
    #   4: (3, 1, 1, 0) O-E -1/3,  V 2/9;   6: (1, 0, 1, 0) O-E 0, V 0 (one at risk).
    o_e = 0.5 - 0.4 + 0.5 - 1 / 3
    var = 0.25 + 0.24 + 0.25 + 2 / 9
    chi2, p = M.logrank_test(t, e, g)
    assert chi2 == pytest.approx(o_e**2 / var)
    assert p == pytest.approx(math.erfc(math.sqrt(chi2 / 2)))
    assert 0.78 < p < 0.79  # chi2 0.0739 on 1 degree of freedom
    chi2_swapped, p_swapped = M.logrank_test(t, e, 1 - g)
    assert chi2_swapped == pytest.approx(chi2) and p_swapped == pytest.approx(p)


def test_logrank_tied_events_use_the_hypergeometric_variance() -> None:
    t = np.array([1, 1, 2, 1, 2, 3])
    e = np.ones(6)
    g = np.array([1, 1, 1, 0, 0, 0])
    # t=1: n=6, n1=3, d=3, d1=2: O-E = 2 - 1.5 = 0.5; V = 3 * .5 * .5 * 3/5 = 0.45
    # t=2: n=3, n1=1, d=2, d1=1: O-E = 1 - 2/3 = 1/3; V = 2 * (1/3) * (2/3) * 1/2 = 2/9
    # t=3: n=1: V 0, O-E 0
    chi2, _ = M.logrank_test(t, e, g)
    assert chi2 == pytest.approx((0.5 + 1 / 3) ** 2 / (0.45 + 2 / 9))
    assert all(math.isnan(v) for v in M.logrank_test(t, e, np.ones(6)))


def test_regression_metrics_by_hand() -> None:
    y, p = np.array([1.0, 2, 3, 4]), np.array([1.0, 2, 3, 5])
    assert M.r2_score(y, p) == pytest.approx(1 - 1 / 5)  # residual 1, total 5
    assert M.pearson(y, p) == pytest.approx(6.5 / math.sqrt(5 * 8.75))
    assert M.spearman(y, p) == pytest.approx(1.0)
    # ties share ranks: x ranks (1, 2.5, 2.5, 4), y ranks (1, 3, 2, 4) -> 4.5 / sqrt(4.5 * 5)
    assert M.spearman(np.array([1, 2, 2, 3]), np.array([1, 3, 2, 4])) == pytest.approx(4.5 / math.sqrt(22.5))
    assert M.r2_score(y, np.full(4, 2.5)) == pytest.approx(0.0)
    assert math.isnan(M.r2_score(np.ones(3), np.ones(3))) and math.isnan(M.pearson(np.ones(3), y[:3]))


def test_label_aucs_and_macro() -> None:
    y = np.array([[1, 0], [0, 0], [1, 1], [0, 1]])
    s = np.array([[0.9, 0.2], [0.1, 0.8], [0.4, 0.7], [0.6, 0.6]])
    # label 0: positives 0.9, 0.4 against negatives 0.1, 0.6 -> 3 of 4 pairs; label 1: 0.7, 0.6 against 0.2, 0.8
    # -> 2 of 4. Macro: 0.625.
    aucs = M.label_aucs(y, s)
    assert aucs == pytest.approx([0.75, 0.5])
    assert M.macro_auc(aucs) == pytest.approx(0.625)
    assert M.macro_auc([0.8, math.nan]) == pytest.approx(0.8)  # a label with one value is left out


def test_survival_nll_by_hand() -> None:
    # hazards 0.25, 0.5, 0.75 in three bins (logits log(1/3), 0, log 3)
    logits = torch.log(torch.tensor([[1 / 3, 1.0, 3.0]] * 3))
    bins = torch.tensor([2, 1, 0])
    events = torch.tensor([1.0, 0.0, 1.0])
    event_in_2 = -(math.log(0.75) + math.log(0.5) + math.log(0.75))  # survived bins 0, 1; event in 2
    censored_in_1 = -(math.log(0.75) + math.log(0.5))  # survived bins 0 and 1 (censored at bin 1's end)
    event_in_0 = -math.log(0.25)
    loss = survival_nll(logits, bins, events)
    assert float(loss) == pytest.approx((event_in_2 + censored_in_1 + event_in_0) / 3, rel=1e-6)
    # risk: 3 minus the sum of S = (0.75, 0.375, 0.09375)
    assert float(risk_score(logits[:1])[0]) == pytest.approx(3 - (0.75 + 0.375 + 0.09375), rel=1e-6)


def test_survival_nll_gradient_pushes_hazard_toward_the_event_bin() -> None:
    logits = torch.zeros(1, 3, requires_grad=True)
    survival_nll(logits, torch.tensor([1]), torch.tensor([1.0])).backward()
    g = logits.grad[0]
    assert g[0] > 0 and g[1] < 0 and g[2] == 0  # lower hazard before the event, higher in its bin, none after


def test_time_bins_from_event_quantiles() -> None:
    t = np.array([1, 2, 3, 4, 5, 6, 7, 8, 100, 200])
    e = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0, 0])  # censored times do not move the cuts
    cuts = time_bins(t, e, 4)
    assert cuts == pytest.approx([2.75, 4.5, 6.25])  # numpy's linear quantiles of 1..8
    np.testing.assert_array_equal(bin_index(np.array([0, 2.75, 3, 100]), cuts), [0, 1, 1, 3])
    assert time_bins(np.array([5, 5, 5, 5]), np.ones(4), 4) == [5.0]  # tied quantiles merge


def _folds_case() -> tuple[list[str], list[str]]:
    rng = np.random.default_rng(7)
    strata, groups = [], []
    for p in range(30):
        n_slides = int(rng.integers(1, 4))
        label = "pos" if p % 3 == 0 else "neg"
        for _ in range(n_slides):
            strata.append(label)
            groups.append(f"P{p}")
    return strata, groups


def test_folds_never_divide_a_patient_and_are_deterministic() -> None:
    strata, groups = _folds_case()
    folds = grouped_stratified_folds(strata, groups, 4, seed=1)
    by_patient: dict[str, set[int]] = {}
    for g, f in zip(groups, folds, strict=True):
        by_patient.setdefault(g, set()).add(f)
    assert all(len(fs) == 1 for fs in by_patient.values())
    assert set(folds) == {0, 1, 2, 3}
    assert grouped_stratified_folds(strata, groups, 4, seed=1) == folds
    assert grouped_stratified_folds(strata, groups, 4, seed=2) != folds


def test_folds_stratify_within_one_sample_when_patients_have_one_slide() -> None:
    strata = ["a"] * 10 + ["b"] * 7 + ["c"] * 3
    groups = [f"s{i}" for i in range(20)]
    for seed in range(5):
        folds = grouped_stratified_folds(strata, groups, 3, seed=seed)
        for s in "abc":
            counts = Counter(f for f, x in zip(folds, strata, strict=True) if x == s)
            per_fold = [counts.get(k, 0) for k in range(3)]
            assert max(per_fold) - min(per_fold) <= 1, (seed, s, per_fold)
        sizes = Counter(folds)
        assert max(sizes.values()) - min(sizes.values()) <= 1


def test_folds_need_a_patient_per_fold() -> None:
    with pytest.raises(WsiTrainError, match="only 2 patients"):
        grouped_stratified_folds(["a", "b", "a"], ["p", "q", "p"], 3, seed=0)
