"""The FedTOPS selection rule (paper Algorithm 1 with the tolerances of App. "Selection rule").

Pure: scalars in, one multiplier out. Feasible means every client's predictive change stays
within the trust budget, ``max_i K_i(a) <= trust_budget + feasibility_tol``. If a = 1 (FedAvg) is
feasible it is the incumbent, replaced, scanning the feasible candidates in their given order,
only by one whose teacher score is lower by more than ``score_tol``. If a = 1 is infeasible, the
feasible candidate with the smallest teacher score wins (the first in order on ties). If nothing
is feasible the server holds: 0.0, θ_{t+1} = θ_t.

:func:`select_round` is the whole server decision of one round on the clients' score replies:
the weighted Ĵ, the rule, and the cap at 1 when a client that trained returned no valid scores.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedopd.core.strategies import robust_tolerance

HOLD = 0.0


def vetoes(change_scores: Sequence[Sequence[float]], trust_budget: float, num_candidates: int, feasibility_tol: float = 1e-8) -> list[list[bool]]:
    """vetoes[i][j]: client i's K_i(candidates[j]) exceeds trust_budget + tol (NaN, inf: a veto)."""
    limit = trust_budget + feasibility_tol
    return [[not row[j] <= limit for j in range(num_candidates)] for row in change_scores]


def feasible_indices(
    change_scores: Sequence[Sequence[float]], trust_budget: float, num_candidates: int, feasibility_tol: float = 1e-8, max_vetoes: int = 0
) -> list[int]:
    """Indices j with K_i(candidates[j]) <= trust_budget + tol for every client i but at most
    ``max_vetoes`` of them (0: every client, the paper's rule; NaN: a veto)."""
    v = vetoes(change_scores, trust_budget, num_candidates, feasibility_tol)
    return [j for j in range(num_candidates) if sum(row[j] for row in v) <= max_vetoes]


def select_multiplier(
    candidates: Sequence[float],
    teacher_scores: Sequence[float],
    change_scores: Sequence[Sequence[float]],
    trust_budget: float,
    *,
    score_tol: float = 1e-9,
    feasibility_tol: float = 1e-8,
    max_vetoes: int = 0,
) -> float:
    """The multiplier a_t for this round; 0.0 means hold.

    candidates: floats in their fixed order. teacher_scores[j] = Ĵ(candidates[j]).
    change_scores[i][j] = K̂_i(candidates[j]) for client i (at least one client).
    """
    n = len(candidates)
    if n == 0:
        raise ValueError("select_multiplier: no candidates")
    if len(teacher_scores) != n:
        raise ValueError(f"select_multiplier: {len(teacher_scores)} teacher scores for {n} candidates")
    if not change_scores:
        raise ValueError("select_multiplier: no client change scores")
    for i, row in enumerate(change_scores):
        if len(row) != n:
            raise ValueError(f"select_multiplier: client {i} has {len(row)} change scores for {n} candidates")

    feasible = feasible_indices(change_scores, trust_budget, n, feasibility_tol, max_vetoes)
    if not feasible:
        return HOLD

    scores = [math.inf if math.isnan(x) else float(x) for x in teacher_scores]  # NaN never wins
    fedavg = [j for j in feasible if candidates[j] == 1.0]
    best = fedavg[0] if fedavg else feasible[0]
    for j in feasible:
        if scores[j] < scores[best] - score_tol:
            best = j
    return float(candidates[best])


# ---------------------------------------------------------------------------------------------
# One round's selection (paper §2 step 5): Ĵ, feasibility, the rule, and the cap at 1
# ---------------------------------------------------------------------------------------------

FALLBACK = 1.0  # a when no client scored: FedAvg's step
UNSCORED_CAP = 1.0  # the most a client whose trust constraint is unknown may be moved: FedAvg's step


def weighted_teacher_scores(client_teacher_scores: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """Ĵ(a_j) = Σ_i w_i Ĵ_i(a_j) / Σ_i w_i over the clients that scored (w_i: their ``num-examples``).

    In float64, summed over clients then divided once (Flower's ``aggregate_metricrecords``
    divides the weights first, which rounds differently in the last bit).
    """
    w = np.asarray(weights, dtype=np.float64)
    j = np.asarray(client_teacher_scores, dtype=np.float64)
    return ((w[:, None] * j).sum(0) / w.sum()).tolist()


def robust_teacher_scores(
    client_teacher_scores: Sequence[Sequence[float]], how: str, trim_fraction: float = 0.2, planned: int | None = None
) -> list[float]:
    """Ĵ(a_j) across clients, unweighted: ``median``, or ``trimmed-mean`` (f = ⌊β planned⌋ values
    cut at each end whatever the round holds, Flower's ``trim_mean``; ``planned`` None: the rows
    there are). A client's inf at a candidate is one value among the others."""
    from flwr.serverapp.strategy.fedtrimmedavg import trim_mean

    j = np.asarray(client_teacher_scores, dtype=np.float64)
    if how == "median":
        return np.median(j, axis=0).tolist()
    if how == "trimmed-mean":
        f, _ = robust_tolerance(how, planned or len(j), trim_fraction)
        with np.errstate(invalid="ignore"):  # inf among the kept values gives inf; inf - inf is not formed
            return np.asarray(trim_mean(j, (f + 0.25) / len(j)), dtype=np.float64).tolist()  # ⌊(f + ¼)/n · n⌋ = f, and < ½
    raise ValueError(f"strategy.score-aggregate = {how!r}; allowed: 'mean', 'median', 'trimmed-mean'")


def aggregate_teacher_scores(
    client_teacher_scores: Sequence[Sequence[float]],
    weights: Sequence[float],
    how: str = "mean",
    trim_fraction: float = 0.2,
    planned: int | None = None,
) -> list[float]:
    """Ĵ per candidate: the paper's weighted mean (``mean``), or a robust statistic across clients."""
    if how == "mean":
        return weighted_teacher_scores(client_teacher_scores, weights)
    return robust_teacher_scores(client_teacher_scores, how, trim_fraction, planned)


@dataclass(frozen=True)
class Selection:
    """What the server decided in one round, with what the round record keeps of it."""

    multiplier: float  # a_t, applied: θ_{t+1} = θ_t + a_t Δ_t (0.0: hold)
    selected: float  # the rule's choice before the cap (FALLBACK when no client scored)
    teacher_scores: list[float] | None  # Ĵ(a) per candidate; None when no client scored
    num_feasible: int
    cap: float | None  # UNSCORED_CAP when a client that trained did not score, or too few rows for a robust Ĵ; else None
    fallback: bool  # no client scored: a = FALLBACK
    too_few_rows: str | None = None  # why a robust Ĵ could not keep its breakdown point (then a is capped at 1)

    @property
    def capped(self) -> bool:
        return self.multiplier < self.selected


def select_round(
    candidates: Sequence[float],
    client_teacher_scores: Sequence[Sequence[float]],
    change_scores: Sequence[Sequence[float]],
    weights: Sequence[float],
    trust_budget: float,
    *,
    all_scored: bool,
    score_tol: float = 1e-9,
    feasibility_tol: float = 1e-8,
    max_vetoes: int = 0,
    score_aggregate: str = "mean",
    trim_fraction: float = 0.2,
    planned: int | None = None,
) -> Selection:
    """The round's multiplier from the valid score replies (row i of each list: client i).

    ``all_scored``: every client whose update is in Δ_t is among them. If not, its K̂ is unknown
    and a_t is capped at 1; if no client scored at all, a_t = 1 (a fallback, not a cap).
    ``max_vetoes``, ``score_aggregate``: :func:`feasible_indices`, :func:`aggregate_teacher_scores`
    (defaults: the paper's rule). ``planned``: the score rows a round has when every asked client
    answers; a robust Ĵ keeps the tolerance it has at that size, and a round with fewer rows than
    that needs caps a at 1 (:func:`robust_scores_problem`). A capped round applies the best
    feasible candidate at most the cap, or holds.
    """
    if not client_teacher_scores:
        return Selection(FALLBACK, FALLBACK, None, 0, None, fallback=True)
    teacher_scores = aggregate_teacher_scores(client_teacher_scores, weights, score_aggregate, trim_fraction, planned)
    too_few = robust_scores_problem(score_aggregate, len(client_teacher_scores), trim_fraction, planned)
    selected = select_multiplier(
        candidates, teacher_scores, change_scores, trust_budget, score_tol=score_tol, feasibility_tol=feasibility_tol, max_vetoes=max_vetoes
    )
    num_feasible = len(feasible_indices(change_scores, trust_budget, len(candidates), feasibility_tol, max_vetoes))
    cap = None if all_scored and too_few is None else UNSCORED_CAP
    multiplier = selected
    if cap is not None and selected > cap:  # the best feasible candidate at most the cap (none: hold), never an infeasible one
        allowed = [j for j, a in enumerate(candidates) if a <= cap]
        multiplier = 0.0
        if allowed:
            multiplier = select_multiplier(
                [candidates[j] for j in allowed],
                [teacher_scores[j] for j in allowed],
                [[row[j] for j in allowed] for row in change_scores],
                trust_budget,
                score_tol=score_tol,
                feasibility_tol=feasibility_tol,
                max_vetoes=max_vetoes,
            )
    return Selection(multiplier, selected, teacher_scores, num_feasible, cap, fallback=False, too_few_rows=too_few)


def robust_scores_problem(how: str, rows: int, trim_fraction: float, planned: int | None = None) -> str | None:
    """Why ``how`` (``strategy.score-aggregate``) of ``rows`` score rows cannot keep the
    tolerance it was set up for with ``planned`` rows per round
    (:func:`fedopd.core.strategies.robust_tolerance`; None: the rows there are), or None. The
    paper's mean makes no such claim."""
    if how == "mean":
        return None
    if how == "median" and rows < 3:
        return f"the median of {rows} score row(s) is their mean"
    f, needed = robust_tolerance(how, planned or rows, trim_fraction)
    if how == "trimmed-mean" and f == 0:
        return f"the trimmed mean of {rows} score rows cuts none (strategy.trim-fraction = {trim_fraction:g})"
    if rows < needed:
        return f"{rows} score rows, fewer than the {needed} that the {how} needs to tolerate the {f} colluding row(s) it was set up for ({planned} per round)"
    return None
