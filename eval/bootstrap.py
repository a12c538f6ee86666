"""Paired bootstrap intervals for differences between two methods' held-out grades.

Every function takes 0/1 grades of the same problems for both methods (the sandbox evaluates
every run on the same held-out problems) and returns the mean difference B − A in percentage
points with its 95 % percentile interval. Each draw uses the same indices for both methods
(paired); a problem's samples stay together.

* :func:`paired_bootstrap`: one model pair, problems resampled (the paper's "Paired evaluation").
* :func:`seed_bootstrap`: several training seeds, the seeds resampled: the interval covers the
  spread of training runs, not of problems.
* :func:`problem_bootstrap`: several training seeds, the problems resampled (the same problems
  for every seed in a draw): the interval covers the choice of problems with the seeds fixed.
"""

from __future__ import annotations

import numpy as np


def _interval(diffs: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap_mean(values: np.ndarray, draws: int, seed: int = 0) -> tuple[float, float, float]:
    """The mean of ``values`` and the 95 % percentile interval of the means of ``draws`` resamples
    (with replacement, the size of ``values``)."""
    values = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(draws, len(values)))
    return (float(values.mean()), *_interval(values[idx].mean(axis=1)))


def paired_bootstrap(a: np.ndarray, b: np.ndarray, draws: int, seed: int = 0) -> tuple[float, float, float]:
    """Mean-score difference b − a (percent) and its 95 % percentile interval.

    ``a`` and ``b`` are (questions × samples) 0/1 arrays of the same questions; each draw
    resamples question indices with replacement, keeping a question's samples together and using
    the same indices for both models.
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    if a.shape[0] != b.shape[0]:
        raise ValueError("paired_bootstrap: both models must be graded on the same questions")
    per_a, per_b = a.mean(axis=1), b.mean(axis=1)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per_a), size=(draws, len(per_a)))
    diffs = 100.0 * (per_b[idx].mean(axis=1) - per_a[idx].mean(axis=1))
    return (100.0 * float(per_b.mean() - per_a.mean()), *_interval(diffs))


def _per_seed_problem(grades: np.ndarray) -> np.ndarray:
    """(seeds, problems) mean grade of each problem's samples, from (seeds, problems[, samples])."""
    g = np.asarray(grades, dtype=float)
    if g.ndim == 2:
        return g
    if g.ndim == 3:
        return g.mean(axis=2)
    raise ValueError(f"grades must be (seeds, problems) or (seeds, problems, samples), got shape {g.shape}")


def _check_pair(a: np.ndarray, b: np.ndarray) -> None:
    if a.shape != b.shape:
        raise ValueError(f"both methods need grades of the same seeds and problems: {a.shape} vs {b.shape}")


def seed_bootstrap(a: np.ndarray, b: np.ndarray, draws: int, seed: int = 0) -> tuple[float, float, float]:
    """b − a (pp) over seeds × problems and its 95 % interval with the *seeds* resampled (paired:
    seed s of a with seed s of b). ``a``, ``b``: (seeds, problems[, samples]) 0/1 grades."""
    a, b = _per_seed_problem(a), _per_seed_problem(b)
    _check_pair(a, b)
    return bootstrap_mean(100.0 * (b.mean(axis=1) - a.mean(axis=1)), draws, seed)  # per seed


def problem_bootstrap(a: np.ndarray, b: np.ndarray, draws: int, seed: int = 0) -> tuple[float, float, float]:
    """b − a (pp) over seeds × problems and its 95 % interval with the *problems* resampled, the
    same problem indices for every seed and both methods in a draw. ``a``, ``b``: (seeds,
    problems[, samples]) 0/1 grades."""
    a, b = _per_seed_problem(a), _per_seed_problem(b)
    _check_pair(a, b)
    return bootstrap_mean(100.0 * (b - a).mean(axis=0), draws, seed)  # the seeds' mean difference on each problem


# Two-sided 5 % test with 80 % power: z_{0.975} + z_{0.8}.
DETECTABLE_Z = 1.959963984540054 + 0.8416212335729143


def detectable_difference(sd: float, n: int) -> float:
    """The smallest true mean difference a two-sided 5 % test on ``n`` paired replicates detects
    with 80 % power, for replicate differences with standard deviation ``sd`` (normal
    approximation): (z_0.975 + z_0.8) · sd / √n."""
    if n < 1 or sd < 0:
        raise ValueError("detectable_difference: n >= 1 and sd >= 0")
    return DETECTABLE_Z * sd / np.sqrt(n)
