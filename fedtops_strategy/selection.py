"""The FedTOPS selection rule (paper Algorithm 1 with the tolerances of App. "Selection rule").

Pure: scalars in, one multiplier out. Feasible means every client's predictive change stays
within the trust budget, ``max_i K_i(a) <= delta + feasibility_tol``. If a = 1 (FedAvg) is
feasible it is the incumbent, replaced, scanning the feasible candidates in their given order,
only by one whose teacher score is lower by more than ``score_tol``. If a = 1 is infeasible, the
feasible candidate with the smallest teacher score wins (the first in order on ties). If nothing
is feasible the server holds: 0.0, θ_{t+1} = θ_t.
"""

from __future__ import annotations

import math
from typing import Sequence

HOLD = 0.0


def feasible_indices(
    change_scores: Sequence[Sequence[float]], trust_budget: float, num_candidates: int, feasibility_tol: float = 1e-8
) -> list[int]:
    """Indices j with K_i(candidates[j]) <= trust_budget + tol for every client i (NaN: infeasible)."""
    limit = trust_budget + feasibility_tol
    return [j for j in range(num_candidates) if all(row[j] <= limit for row in change_scores)]


def select_multiplier(
    candidates: Sequence[float],
    teacher_scores: Sequence[float],
    change_scores: Sequence[Sequence[float]],
    trust_budget: float,
    *,
    score_tol: float = 1e-9,
    feasibility_tol: float = 1e-8,
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

    feasible = feasible_indices(change_scores, trust_budget, n, feasibility_tol)
    if not feasible:
        return HOLD

    scores = [math.inf if math.isnan(x) else float(x) for x in teacher_scores]  # NaN never wins
    fedavg = [j for j in feasible if candidates[j] == 1.0]
    best = fedavg[0] if fedavg else feasible[0]
    for j in feasible:
        if scores[j] < scores[best] - score_tol:
            best = j
    return float(candidates[best])
