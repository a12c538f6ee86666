"""The selection rule (paper Algorithm 1 with tolerances)."""

import math

import pytest

from fedtops_strategy.selection import select_multiplier

CANDIDATES = [0.5, 1.0, 2.0, 3.0, 5.0, 10.0]


def _k(*rows):
    return [list(r) for r in rows]


def test_picks_the_feasible_candidate_with_the_lowest_teacher_score():
    j = [0.30, 0.28, 0.25, 0.22, 0.24, 0.40]
    k = _k([0.001, 0.002, 0.01, 0.02, 0.04, 0.2])
    assert select_multiplier(CANDIDATES, j, k, 0.05) == 3.0


def test_fedavg_stays_unless_strictly_better_by_more_than_the_score_tolerance():
    k = _k([0.0] * 6)
    assert select_multiplier(CANDIDATES, [0.5, 0.3, 0.3, 0.4, 0.5, 0.6], k, 0.05) == 1.0  # tie keeps a = 1
    assert select_multiplier(CANDIDATES, [0.5, 0.3, 0.3 - 5e-10, 0.4, 0.5, 0.6], k, 0.05) == 1.0  # within 1e-9
    assert select_multiplier(CANDIDATES, [0.5, 0.3, 0.3 - 2e-9, 0.4, 0.5, 0.6], k, 0.05) == 2.0


def test_the_incumbent_moves_as_the_scan_proceeds():
    k = _k([0.0] * 6)
    # 2 beats 1, then 5 beats 2; 3 is better than 1 but not than 2.
    assert select_multiplier(CANDIDATES, [0.9, 0.5, 0.3, 0.4, 0.2, 0.2], k, 0.05) == 5.0


def test_feasibility_uses_every_clients_change_score_and_its_tolerance():
    j = [0.5, 0.4, 0.3, 0.2, 0.1, 0.05]
    k = _k([0.0, 0.01, 0.02, 0.03, 0.04, 0.05 + 5e-9], [0.0, 0.01, 0.02, 0.06, 0.01, 0.01])
    # 3 is infeasible for client 1 only; 10 is within the 1e-8 feasibility tolerance for both.
    assert select_multiplier(CANDIDATES, j, k, 0.05) == 10.0
    k[1][5] = 0.05 + 2e-8
    assert select_multiplier(CANDIDATES, j, k, 0.05) == 5.0


def test_a_small_average_change_cannot_hide_one_clients_large_change():
    j = [0.5, 0.4, 0.1, 0.3, 0.3, 0.3]
    k = _k([0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.12, 0.0, 0.0, 0.0])
    assert select_multiplier(CANDIDATES, j, k, 0.05) == 3.0


def test_when_fedavg_is_infeasible_the_lowest_score_wins_first_in_order_on_ties():
    j = [0.4, 0.1, 0.3, 0.3, 0.5, 0.6]
    k = _k([0.01, 0.2, 0.01, 0.01, 0.01, 0.2])
    assert select_multiplier(CANDIDATES, j, k, 0.05) == 2.0
    assert select_multiplier(CANDIDATES, [0.3, 0.1, 0.3, 0.2, 0.2, 0.6], k, 0.05) == 3.0


def test_nothing_feasible_means_hold():
    assert select_multiplier(CANDIDATES, [0.1] * 6, _k([1.0] * 6), 0.05) == 0.0
    assert select_multiplier(CANDIDATES, [0.1] * 6, _k([math.nan] * 6), 0.05) == 0.0


def test_infinite_change_is_infeasible_and_nan_teacher_score_never_wins():
    j = [0.5, 0.4, math.nan, 0.3, 0.3, 0.3]
    k = _k([0.0, 0.0, 0.0, math.inf, 0.0, 0.0])
    assert select_multiplier(CANDIDATES, j, k, 0.05) == 5.0


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="5 teacher scores for 6 candidates"):
        select_multiplier(CANDIDATES, [0.1] * 5, _k([0.0] * 6), 0.05)
    with pytest.raises(ValueError, match="client 1 has 2 change scores"):
        select_multiplier(CANDIDATES, [0.1] * 6, _k([0.0] * 6, [0.0] * 2), 0.05)
    with pytest.raises(ValueError, match="no client change scores"):
        select_multiplier(CANDIDATES, [0.1] * 6, [], 0.05)


def test_fedavg_is_the_incumbent_even_when_an_earlier_candidate_ties_with_it():
    # 0.5 comes first in the scan and ties with a = 1 exactly: a = 1 stays (Algorithm 1).
    assert select_multiplier(CANDIDATES, [0.3, 0.3, 0.4, 0.4, 0.4, 0.4], _k([0.0] * 6), 0.05) == 1.0
    # ... and a candidate before 1 replaces it only when better by more than the tolerance.
    assert select_multiplier(CANDIDATES, [0.3 - 2e-9, 0.3, 0.4, 0.4, 0.4, 0.4], _k([0.0] * 6), 0.05) == 0.5


def test_feasibility_is_per_client_not_on_the_average_change():
    # Candidate 10: mean change 0.04 <= 0.05, but client 0's 0.07 > 0.05: infeasible.
    j = [0.5, 0.4, 0.3, 0.3, 0.3, 0.1]
    k = _k([0.0, 0.0, 0.0, 0.0, 0.0, 0.07], [0.0, 0.0, 0.0, 0.0, 0.0, 0.01])
    assert select_multiplier(CANDIDATES, j, k, 0.05) == 2.0


def test_hold_returns_exactly_zero_when_only_a_tolerance_beyond_the_budget():
    k = _k([0.05 + 2e-8] * 6)
    assert select_multiplier(CANDIDATES, [0.1] * 6, k, 0.05) == 0.0


def test_a_single_candidate_is_a_valid_candidate_set():
    assert select_multiplier([1.0], [0.2], _k([0.01]), 0.05) == 1.0
    assert select_multiplier([3.0], [0.2], _k([0.01]), 0.05) == 3.0
    with pytest.raises(ValueError, match="no candidates"):
        select_multiplier([], [], _k([]), 0.05)


def test_a_change_equal_to_the_budget_is_feasible_and_the_tolerance_is_the_callers():
    assert select_multiplier([1.0, 2.0], [0.3, 0.2], _k([0.0, 0.05]), 0.05, feasibility_tol=0.0) == 2.0
    # 5e-9 over the budget: feasible with the default 1e-8 tolerance, not with tolerance 0.
    assert select_multiplier([1.0, 2.0], [0.3, 0.2], _k([0.0, 0.05 + 5e-9]), 0.05) == 2.0
    assert select_multiplier([1.0, 2.0], [0.3, 0.2], _k([0.0, 0.05 + 5e-9]), 0.05, feasibility_tol=0.0) == 1.0


def test_feasible_indices_default_tolerance_is_1e_8():
    from fedtops_strategy.selection import feasible_indices

    assert feasible_indices([[0.05 + 5e-9]], 0.05, 1) == [0]
    assert feasible_indices([[0.05 + 2e-8]], 0.05, 1) == []


def test_a_score_lower_by_exactly_the_tolerance_is_still_a_tie():
    j = [0.9, 0.5, 0.5 - 1e-9, 0.9, 0.9, 0.9]
    assert select_multiplier(CANDIDATES, j, _k([0.0] * 6), 0.05) == 1.0
    assert select_multiplier(CANDIDATES, j, _k([0.0] * 6), 0.05, score_tol=0.0) == 2.0


def test_when_fedavg_is_infeasible_the_first_feasible_candidate_wins_a_tie_for_the_minimum():
    k = _k([0.0, 0.2, 0.0, 0.0, 0.0, 0.0])  # a = 1 infeasible
    assert select_multiplier(CANDIDATES, [0.2, 0.1, 0.2, 0.3, 0.3, 0.3], k, 0.05) == 0.5


def test_a_nan_teacher_score_for_fedavg_loses_to_any_finite_score():
    j = [0.5, math.nan, 0.4, 0.6, 0.7, 0.8]
    assert select_multiplier(CANDIDATES, j, _k([0.0] * 6), 0.05) == 2.0


# One round's decision: select_round (weighted Ĵ, the rule, the cap at 1, the fallback).


def test_teacher_score_is_the_num_examples_weighted_mean_over_the_clients_that_scored():
    from fedtops_strategy.selection import weighted_teacher_scores

    # Weights 1 and 3: Ĵ = (1·0.4 + 3·0.2) / 4 = 0.25 and (1·0.5 + 3·0.25) / 4 = 0.3125 (exact in binary).
    assert weighted_teacher_scores([[0.4, 0.5], [0.2, 0.25]], [1, 3]) == [0.25, 0.3125]


def test_the_weighted_mean_divides_once_after_summing_as_the_saved_runs_did():
    from fedtops_strategy.selection import weighted_teacher_scores

    # Σ w_i Ĵ_i / Σ w_i, not Σ (w_i / Σ w) Ĵ_i (Flower's aggregate_metricrecords): they differ in
    # the last bit here, and the golden runs pin the first.
    j = [[0.762], [0.002], [0.445]]
    assert weighted_teacher_scores(j, [570, 570, 570]) == [0.403]
    assert sum(570 / 1710 * x for [x] in j) == 0.40299999999999997


def test_a_round_where_every_client_that_trained_scored_takes_the_rules_choice():
    from fedtops_strategy.selection import select_round

    j = [[0.5, 0.4, 0.3, 0.2, 0.1, 0.0]] * 2
    s = select_round(CANDIDATES, j, _k([0.0] * 6, [0.0] * 6), [1, 1], 0.05, all_scored=True)
    assert (s.multiplier, s.selected, s.cap, s.fallback, s.num_feasible) == (10.0, 10.0, None, False, 6)
    assert s.teacher_scores == [0.5, 0.4, 0.3, 0.2, 0.1, 0.0]


def test_a_client_that_trained_without_scores_caps_the_multiplier_at_one():
    from fedtops_strategy.selection import select_round

    j = [[0.5, 0.4, 0.3, 0.2, 0.1, 0.0]]
    s = select_round(CANDIDATES, j, _k([0.0] * 6), [1], 0.05, all_scored=False)
    assert (s.multiplier, s.selected, s.cap, s.capped) == (1.0, 10.0, 1.0, True)


@pytest.mark.parametrize("k, selected", [([1.0] * 6, 0.0), ([0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.5)])
def test_the_cap_leaves_a_hold_and_a_half_step_as_they_are(k, selected):
    from fedtops_strategy.selection import select_round

    s = select_round(CANDIDATES, [[0.5, 0.4, 0.3, 0.2, 0.1, 0.0]], _k(k), [1], 0.05, all_scored=False)
    assert (s.multiplier, s.selected, s.cap, s.capped) == (selected, selected, 1.0, False)


def test_no_client_scored_falls_back_to_fedavg_without_a_cap():
    from fedtops_strategy.selection import select_round

    s = select_round(CANDIDATES, [], [], [], 0.05, all_scored=False)
    assert (s.multiplier, s.selected, s.cap, s.fallback, s.teacher_scores, s.num_feasible) == (1.0, 1.0, None, True, None, 0)


def test_select_round_uses_the_weighted_scores_and_its_tolerances():
    from fedtops_strategy.selection import select_round

    # Unweighted, a = 2 would win (0.30 vs 0.325 for a = 3); with weights 1 and 3, a = 3 (0.2875).
    j = [[0.5, 0.5, 0.3, 0.4, 0.9, 0.9], [0.5, 0.5, 0.3, 0.25, 0.9, 0.9]]
    assert select_round(CANDIDATES, j, _k([0.0] * 6, [0.0] * 6), [1, 3], 0.05, all_scored=True).multiplier == 3.0
    k = _k([0.0, 0.0, 0.05 + 5e-9, 0.06, 0.06, 0.06])
    strict = select_round(CANDIDATES, [[0.5, 0.4, 0.3, 0.2, 0.1, 0.0]], k, [1], 0.05, all_scored=True, feasibility_tol=0.0)
    assert (strict.multiplier, strict.num_feasible) == (1.0, 2)


def test_an_infinite_trust_budget_makes_every_finite_candidate_feasible_and_the_lowest_score_wins():
    # K = 1e6 would be infeasible at any finite δ; at δ = inf a = 10 (lowest Ĵ) wins over FedAvg
    change = [[0.0, 0.1, 1e6], [0.0, 0.2, 5e5]]
    assert select_multiplier([0.5, 1.0, 10.0], [0.3, 0.2, 0.1], change, math.inf) == 10.0
    assert select_multiplier([0.5, 1.0, 10.0], [0.3, 0.2, 0.1], change, 1.0) == 1.0
    # a NaN change score is still infeasible: never a "no constraint" candidate
    assert select_multiplier([1.0, 10.0], [0.2, 0.1], [[0.0, math.nan]], math.inf) == 1.0
