"""Avg@k, Pass@k, cap-hit and macro averages against hand computation."""

import numpy as np
import pytest

from eval.metrics import avg_at_k, cap_hit_rate, local_mean, macro_average, pass_at_k

# 3 problems x 8 samples: 8, 2 and 0 correct.
CORRECT = np.array([[1] * 8, [1, 0, 0, 1, 0, 0, 0, 0], [0] * 8])


def test_avg_at_8_is_the_mean_correctness_in_percent():
    assert avg_at_k(CORRECT) == pytest.approx(100 * 10 / 24)  # 41.666...


def test_pass_at_8_is_the_share_of_problems_solved_at_least_once():
    assert pass_at_k(CORRECT) == pytest.approx(100 * 2 / 3)


def test_pass_at_k_below_the_sample_count_is_the_unbiased_estimator():
    # problem 2: 1 - C(6,1)/C(8,1) = 2/8; problem 1: 1; problem 3: 0
    assert pass_at_k(CORRECT, k=1) == pytest.approx(100 * (1 + 0.25 + 0) / 3)
    assert pass_at_k(CORRECT, k=1) == pytest.approx(avg_at_k(CORRECT))


def test_cap_hit_rate_and_macro_with_equal_weights_rounding_last():
    assert cap_hit_rate([True, False, False, False]) == 25.0
    per_benchmark = {"math500": 1.006, "aime24": 1.006, "amc23": 1.002}
    assert macro_average(per_benchmark) == pytest.approx(3.014 / 3)
    assert round(macro_average(per_benchmark), 2) == 1.0  # rounding first would give (1.01+1.01+1.00)/3 -> 1.01
    assert macro_average({"a": 10.0, "b": 50.0}) == 30.0  # equal weights, whatever the problem counts
    assert local_mean([30.0, 33.0, 36.0]) == 33.0


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="0 or 1"):
        avg_at_k([[0, 2]])
    with pytest.raises(ValueError, match="non-empty"):
        pass_at_k(np.zeros((0, 8)))
    with pytest.raises(ValueError, match="k must be in"):
        pass_at_k(CORRECT, k=9)
