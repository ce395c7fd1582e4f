"""Task metrics in numpy only (no scipy, no lifelines): concordance, Kaplan-Meier, log-rank, R^2, correlations,
per-label AUC.

Every function takes plain arrays and returns floats (nan where a metric is undefined, e.g. no comparable pairs),
so the same code serves validation, test, per-patient and cross-validation summaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from wsitrain.train.metrics import _average_ranks, binary_roc_auc


def concordance_index(time: np.ndarray, event: np.ndarray, risk: np.ndarray) -> float:
    """Harrell's C: over comparable pairs (the shorter time is an event), the share where the shorter-lived one has
    the higher risk; tied risks count one half. Pairs with equal times are comparable when exactly one is an event
    (the event is the shorter), as in Harrell's definition and lifelines; two events at one time are not compared.
    nan when no pair is comparable.
    """
    t = np.asarray(time, dtype=np.float64)
    e = np.asarray(event).astype(bool)
    r = np.asarray(risk, dtype=np.float64)
    concordant = 0.0
    comparable = 0
    for i in np.flatnonzero(e):
        # j outlived i: a later time, or the same time but censored (still alive at i's event)
        later = (t > t[i]) | ((t == t[i]) & ~e)
        later[i] = False
        n = int(later.sum())
        if n == 0:
            continue
        comparable += n
        concordant += float(np.sum(r[later] < r[i])) + 0.5 * float(np.sum(r[later] == r[i]))
    return concordant / comparable if comparable else math.nan


@dataclass(frozen=True)
class KaplanMeier:
    """The Kaplan-Meier estimate as a step function: ``survival[k]`` holds from ``times[k]`` on (times[0] = 0)."""

    times: np.ndarray
    survival: np.ndarray
    at_risk: np.ndarray  # at risk just before each time (times[0]: everyone)


def kaplan_meier(time: np.ndarray, event: np.ndarray) -> KaplanMeier:
    """S(t) = prod over event times u <= t of (1 - d_u / n_u); censored at u count as at risk at u."""
    t = np.asarray(time, dtype=np.float64)
    e = np.asarray(event).astype(bool)
    times, surv, risk = [0.0], [1.0], [len(t)]
    s = 1.0
    for u in np.unique(t[e]):
        n = int(np.sum(t >= u))
        d = int(np.sum((t == u) & e))
        s *= 1.0 - d / n
        times.append(float(u))
        surv.append(s)
        risk.append(n)
    return KaplanMeier(np.array(times), np.array(surv), np.array(risk))


def logrank_test(time: np.ndarray, event: np.ndarray, group: np.ndarray) -> tuple[float, float]:
    """(chi-square statistic, p-value) of the two-group log-rank test (1 degree of freedom).

    At each event time u: O - E for group 1 sums d1 - d * n1 / n and its variance sums
    d * (n1 / n) * (1 - n1 / n) * (n - d) / (n - 1) (hypergeometric, exact for ties). The chi-square(1) tail is
    erfc(sqrt(x / 2)), so no scipy is needed. (nan, nan) when a group is empty or nothing happened.
    """
    t = np.asarray(time, dtype=np.float64)
    e = np.asarray(event).astype(bool)
    g = np.asarray(group).astype(bool)
    if g.all() or not g.any():
        return math.nan, math.nan
    o_minus_e, var = 0.0, 0.0
    for u in np.unique(t[e]):
        at = t >= u
        n, n1 = int(at.sum()), int((at & g).sum())
        d = int(np.sum((t == u) & e))
        d1 = int(np.sum((t == u) & e & g))
        o_minus_e += d1 - d * n1 / n
        if n > 1:
            var += d * (n1 / n) * (1 - n1 / n) * (n - d) / (n - 1)
    if var <= 0:
        return math.nan, math.nan
    chi2 = o_minus_e**2 / var
    return float(chi2), float(math.erfc(math.sqrt(chi2 / 2.0)))


def r2_score(y: np.ndarray, pred: np.ndarray) -> float:
    """1 - residual sum of squares / total sum of squares (can be negative); nan for fewer than two values or a
    constant target."""
    y, p = np.asarray(y, dtype=np.float64), np.asarray(pred, dtype=np.float64)
    if y.size < 2:
        return math.nan
    total = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - p) ** 2)) / total if total > 0 else math.nan


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r; nan when either side is constant or has fewer than two values."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2:
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    den = math.sqrt(float(np.sum(dx * dx)) * float(np.sum(dy * dy)))
    return float(np.sum(dx * dy)) / den if den > 0 else math.nan


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho: Pearson's r of the ranks, ties sharing their mean rank."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2:
        return math.nan
    return pearson(_average_ranks(x), _average_ranks(y))


def label_aucs(targets: np.ndarray, scores: np.ndarray) -> list[float]:
    """ROC AUC of each label column (nan where a label has one value only among these slides)."""
    y, s = np.asarray(targets), np.asarray(scores, dtype=np.float64)
    return [binary_roc_auc(y[:, j] > 0.5, s[:, j]) for j in range(y.shape[1])]


def macro_auc(aucs: list[float]) -> float:
    """The mean of the defined per-label AUCs; nan when none is defined."""
    defined = [a for a in aucs if not math.isnan(a)]
    return float(np.mean(defined)) if defined else math.nan
