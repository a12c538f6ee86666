"""Evaluation metrics (paper App. "Evaluation"): all percentages, rounding only when reported.

``correct`` is a (problems × samples) 0/1 array: c_jm = 1 when sample m of problem j is correct.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import comb

import numpy as np


def _matrix(correct) -> np.ndarray:
    c = np.asarray(correct, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"expected a non-empty (problems x samples) array, got shape {c.shape}")
    if not np.all((c == 0) | (c == 1)):
        raise ValueError("correctness values must be 0 or 1")
    return c


def avg_at_k(correct) -> float:
    """Avg@k = 100/(k n) Σ_j Σ_m c_jm: the mean correctness of all sampled responses."""
    return float(100.0 * _matrix(correct).mean())


def pass_at_k(correct, k: int | None = None) -> float:
    """Pass@k in percent; with k = samples (the default) the share of problems solved at least once.

    For k < samples, the unbiased estimator 1 − C(n − c, k)/C(n, k) averaged over problems.
    """
    c = _matrix(correct)
    n = c.shape[1]
    k = n if k is None else k
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    hits = c.sum(axis=1).astype(int)
    per_problem = [1.0 - comb(n - h, k) / comb(n, k) for h in hits]
    return float(100.0 * np.mean(per_problem))


def cap_hit_rate(capped) -> float:
    """Percentage of responses that reached the generation length limit."""
    c = np.asarray(capped, dtype=np.float64)
    if c.size == 0:
        raise ValueError("cap_hit_rate of no responses")
    return float(100.0 * c.mean())


def macro_average(per_benchmark: Mapping[str, float]) -> float:
    """Equal-weight mean over benchmarks (not weighted by problem count); round afterwards."""
    if not per_benchmark:
        raise ValueError("macro_average of no benchmarks")
    return float(np.mean(list(per_benchmark.values())))


def local_mean(client_scores: Sequence[float]) -> float:
    """'Local mean': the mean of the scores of independently trained client models."""
    if len(client_scores) == 0:
        raise ValueError("local_mean of no client models")
    return float(np.mean(client_scores))
