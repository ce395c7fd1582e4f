"""Discrete-time survival: time bins from the training set's event times, the censored negative log-likelihood,
and a scalar risk for concordance and Kaplan-Meier groups.

The head has one output per time bin: the logit of the hazard h_k, the probability of the event in bin k given
survival to its start. A slide whose time falls in bin k contributes (as in pycox's logistic-hazard loss)

    event:    -[sum_{j<k} log(1 - h_j) + log h_k]
    censored: -[sum_{j<=k} log(1 - h_j)]        (censoring at the end of the bin: it survived bin k)

This is a per-slide likelihood, unlike Cox's partial likelihood, so it trains one slide at a time as wsitrain does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def time_bins(times: np.ndarray, events: np.ndarray, n_bins: int) -> list[float]:
    """The inner cut points between ``n_bins`` bins at the quantiles of the event times (censored times excluded).

    Bin k holds times in [cuts[k-1], cuts[k]); bin 0 starts at 0 and the last bin is open-ended. Equal quantiles
    (many tied event times) are merged, so fewer bins than asked can result; the caller checks there are events
    enough first.
    """
    t = np.asarray(times, dtype=np.float64)[np.asarray(events).astype(bool)]
    if t.size == 0 or n_bins < 2:
        return []
    qs = np.quantile(t, np.arange(1, n_bins) / n_bins)
    return [float(q) for q in np.unique(qs)]


def bin_index(times: np.ndarray, cuts: list[float]) -> np.ndarray:
    """The bin of each time: the number of cut points at or below it."""
    return np.searchsorted(np.asarray(cuts, dtype=np.float64), np.asarray(times, dtype=np.float64), side="right")


def survival_nll(logits: torch.Tensor, bins: torch.Tensor, events: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood over the batch: logits (N, K) hazards, bins (N,) long, events (N,) 0/1."""
    logits = logits.float()
    k = logits.shape[1]
    steps = torch.arange(k, device=logits.device)[None, :]
    b = bins.long().clamp(max=k - 1)[:, None]
    e = events.float()[:, None]
    # log(1 - h) = logsigmoid(-x), log h = logsigmoid(x): stable for large logits.
    survived = (steps < b).float() + (steps == b).float() * (1.0 - e)
    happened = (steps == b).float() * e
    ll = survived * F.logsigmoid(-logits) + happened * F.logsigmoid(logits)
    return -ll.sum(dim=1).mean()


def survival_curve(logits: torch.Tensor) -> torch.Tensor:
    """S after each bin, (N, K): the running product of 1 - h."""
    return torch.cumprod(torch.sigmoid(-logits.float()), dim=1)


def risk_score(logits: torch.Tensor) -> torch.Tensor:
    """Higher means an earlier event: the number of bins minus the expected bins survived (sum of S), (N,)."""
    s = survival_curve(logits)
    return s.shape[1] - s.sum(dim=1)
