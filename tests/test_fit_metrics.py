"""Metrics against hand-computed values and a brute-force pairwise AUC."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from wsitrain.train.metrics import accuracy, balanced_accuracy, binary_roc_auc, classification_metrics, roc_auc


def _pairwise_auc(y: np.ndarray, s: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_accuracy_and_balanced_accuracy_by_hand() -> None:
    y = np.array([0, 0, 0, 0, 1, 1])
    p = np.array([0, 0, 0, 1, 1, 0])
    assert accuracy(y, p) == pytest.approx(4 / 6)
    # recall class 0 = 3/4, class 1 = 1/2
    assert balanced_accuracy(y, p) == pytest.approx((0.75 + 0.5) / 2)


def test_auc_matches_pairwise_count_with_ties() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        y = rng.integers(0, 2, size=30)
        if y.min() == y.max():
            continue
        s = rng.integers(0, 6, size=30).astype(float)  # many ties
        assert binary_roc_auc(y == 1, s) == pytest.approx(_pairwise_auc(y, s))


def test_auc_extremes_and_undefined() -> None:
    y = np.array([0, 0, 1, 1])
    assert binary_roc_auc(y == 1, np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert binary_roc_auc(y == 1, np.array([0.9, 0.8, 0.2, 0.1])) == 0.0
    assert math.isnan(binary_roc_auc(np.array([True, True]), np.array([0.3, 0.4])))


def test_multiclass_auc_is_mean_one_vs_rest() -> None:
    y = np.array([0, 1, 2, 0, 1, 2])
    probs = np.array([[0.8, 0.1, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7],
                      [0.3, 0.6, 0.1], [0.5, 0.4, 0.1], [0.2, 0.1, 0.7]])
    expected = np.mean([_pairwise_auc((y == c).astype(int), probs[:, c]) for c in range(3)])
    assert roc_auc(y, probs) == pytest.approx(expected)
    m = classification_metrics(y, probs)
    assert m["accuracy"] == pytest.approx(4 / 6)
