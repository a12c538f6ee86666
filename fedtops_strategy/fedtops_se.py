"""The lr study's FedTOPS variants (docs/sandbox.md), off by default: ``fedtops-se`` keeps the
smaller multiplier unless a larger one is clearly better; ``fedtops-heldout-cache`` scores on
rollouts of prompts the clients did not train on.

``fedtops-se``:

A variant of the lr 3e-3 study (docs/sandbox.md, "Why FedTOPS trails FedAvg at the large learning
rate"), off by default. The score query also asks each client for the standard error of its
Ĵ_i(a) over its cached positions (``teacher-score-se``). After the paper's rule selects a_sel, the
feasible candidates up to a_sel are walked from the smallest up: the walk moves to a larger
candidate a' only when Ĵ(a') is below the current one's by more than SE(a'), the standard error of
Ĵ(a') across clients, √(Σ w_i² se_i(a')²) / Σ w_i with the Ĵ weights. A hold, a fallback and the
cap stay as the paper's rule left them. A client whose reply has no valid standard errors counts
as infinitely uncertain: the walk stays at the smallest feasible candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedtops_strategy.fedtops import FedTOPS
from fedtops_strategy.replies import SCORE_SE
from fedtops_strategy.selection import feasible_indices

SE_KEY = SCORE_SE


def combined_se(errors: Sequence[Sequence[float]], weights: Sequence[float]) -> list[float]:
    """The standard error of the weighted mean Ĵ per candidate: √(Σ w_i² se_i²) / Σ w_i (inf when
    a term overflows: a product, unlike ``**``, gives inf instead of raising)."""
    total = sum(weights)
    return [math.sqrt(sum((w * row[j]) * (w * row[j]) for w, row in zip(weights, errors))) / total for j in range(len(errors[0]))]


def smallest_clear_step(candidates: Sequence[float], teacher: Sequence[float], se: Sequence[float], feasible: Sequence[int], ceiling: float) -> float:
    """The walk over the feasible candidates a <= ``ceiling`` in increasing a: move from the current
    a to a' only if Ĵ(a') < Ĵ(a) − SE(a'). Returns the last a reached."""
    order = sorted((j for j in feasible if candidates[j] <= ceiling), key=lambda j: candidates[j])
    if not order:
        return ceiling
    current = order[0]
    for j in order[1:]:
        if teacher[j] < teacher[current] - se[j]:
            current = j
    return candidates[current]


class FedTOPSStandardError(FedTOPS):
    """FedTOPS with the standard-error walk (module docstring)."""

    strategy_name = "fedtops-se"
    score_config = {"score-se": True}

    def refine(self, selection, fields: dict, scores, train) -> tuple[float, dict]:
        a = selection.multiplier
        if a == 0.0 or selection.fallback or not fields.get("scored-node-ids"):
            return a, {}
        errors = {s.node_id: s.se for s in scores.replies}  # checked at the boundary (replies.parse_score): None when invalid
        scored = fields["scored-node-ids"]
        rows = [errors.get(n) or [math.inf] * len(self.candidates) for n in scored]
        se = combined_se(rows, [scores.weights[n] for n in scored])
        change = [[math.inf if v is None else v for v in row] for row in fields["change_scores"]]
        feasible = feasible_indices(change, self.trust_budget, len(self.candidates), self.feasibility_tol, self.max_vetoes)
        teacher = [math.inf if v is None else v for v in fields["teacher_scores"]]
        refined = smallest_clear_step(self.candidates, teacher, se, feasible, a)
        return refined, {"teacher-score-se": [v if math.isfinite(v) else None for v in se], "paper-multiplier": a}


class FedTOPSHeldoutCache(FedTOPS):
    """``fedtops-heldout-cache``: the paper's rule, scored on a held-out scoring cache: each client
    builds it from one rollout each of ``cache.rollouts`` prompts it does not train on this round,
    generated at θ_t (the lr study's third variant; off by default)."""

    strategy_name = "fedtops-heldout-cache"
    scoring_cache = "untrained"
