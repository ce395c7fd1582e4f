"""Slide-level classification metrics: accuracy, balanced accuracy, ROC AUC and the outputs' spread (numpy only)."""

from __future__ import annotations

import math

import numpy as np


def accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    """Fraction of slides whose predicted class equals the label; nan for no slides."""
    labels, predicted = np.asarray(labels), np.asarray(predicted)
    if labels.size == 0:
        return math.nan
    return float(np.mean(labels == predicted))


def balanced_accuracy(labels: np.ndarray, predicted: np.ndarray) -> float:
    """Mean per-class recall over the classes present in ``labels`` (robust to class imbalance)."""
    labels, predicted = np.asarray(labels), np.asarray(predicted)
    if labels.size == 0:
        return math.nan
    recalls = [float(np.mean(predicted[labels == c] == c)) for c in np.unique(labels)]
    return float(np.mean(recalls))


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties sharing their mean rank (what the Mann-Whitney U statistic needs)."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(len(x), dtype=np.float64)
    # Boundaries of runs of equal values in sorted order.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1]
    ends = np.r_[starts[1:], len(x)]
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + 1 + e) / 2.0  # mean of ranks s+1..e
    return ranks


def binary_roc_auc(is_positive: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve = P(score of a random positive > a random negative), ties count half.

    nan when only one class is present, since the AUC is undefined then.
    """
    y = np.asarray(is_positive).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ranks = _average_ranks(s)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def roc_auc(labels: np.ndarray, probs: np.ndarray) -> float:
    """ROC AUC from class probabilities (N, C): binary uses class 1; more classes average one-vs-rest.

    Classes absent from ``labels`` are left out of the average; nan if fewer than two classes are present.
    """
    labels = np.asarray(labels)
    probs = np.asarray(probs, dtype=np.float64)
    if labels.size == 0:
        return math.nan
    if probs.ndim == 1 or probs.shape[1] == 1:
        return binary_roc_auc(labels == 1, probs.reshape(-1))
    if probs.shape[1] == 2:
        return binary_roc_auc(labels == 1, probs[:, 1])
    aucs = [binary_roc_auc(labels == c, probs[:, c]) for c in range(probs.shape[1])]
    aucs = [a for a in aucs if not math.isnan(a)]
    return float(np.mean(aucs)) if aucs else math.nan


def output_spread(probs: np.ndarray) -> float:
    """How much the model's answer varies between slides: the largest standard deviation over the slides of one
    class's probability (N, C) (two classes: that of p(class 1)); near 0, every slide gets about the same output.
    nan for fewer than two slides."""
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[0] < 2:
        return math.nan
    return float(probs.std(axis=0).max())


def classification_metrics(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """accuracy, balanced_accuracy, roc_auc and output_spread for labels (N,) and class probabilities (N, C)."""
    labels = np.asarray(labels)
    probs = np.asarray(probs, dtype=np.float64)
    predicted = probs.argmax(axis=1) if probs.size else np.zeros(0, dtype=int)
    return {
        "accuracy": accuracy(labels, predicted),
        "balanced_accuracy": balanced_accuracy(labels, predicted),
        "roc_auc": roc_auc(labels, probs),
        "output_spread": output_spread(probs),
    }
