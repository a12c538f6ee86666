"""The held-out oracle of FedTOPS's selection (eval/oracle.py): its pure pieces, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eval.oracle import allowed_candidates, main, oracle_choice, recover_increment, sign_test, summarize


def test_the_increment_is_recovered_from_two_saved_adapters_and_the_multiplier():
    # θ_{t+1} = θ_t + 2 Δ with Δ = (0.25, -1): (1.5 - 1) / 2 = 0.25, (-2 - 0) / 2 = -1
    theta = {"a": np.array([1.0], np.float32), "b": np.array([0.0], np.float32)}
    nxt = {"a": np.array([1.5], np.float32), "b": np.array([-2.0], np.float32)}
    delta = recover_increment(theta, nxt, 2.0)
    assert delta["a"].tolist() == [0.25] and delta["b"].tolist() == [-1.0]
    with pytest.raises(ValueError, match="held round"):
        recover_increment(theta, nxt, 0.0)


def test_the_oracle_takes_the_most_accurate_candidate_and_the_smaller_on_a_tie():
    candidates = [0.5, 1.0, 2.0, 3.0]
    assert oracle_choice(candidates, [0.5, 0.7, 0.6, 0.1]) == 1.0
    assert oracle_choice(candidates, [0.5, 0.7, 0.7, 0.1]) == 1.0  # tie: the smaller a
    assert oracle_choice(candidates, [0.5, 0.7, 0.6, 0.1], [True, False, True, True]) == 2.0
    assert oracle_choice(candidates, [0.5, 0.7, 0.6, 0.1], [False] * 4) is None


def test_the_sign_test_is_the_exact_two_sided_binomial():
    # 5 against 0: 2 × (1/2)^5 = 0.0625; 3 against 1: 2 × (1 + 4) / 16 = 0.625; ties only: 1
    assert sign_test(5, 0) == pytest.approx(0.0625, rel=1e-15)
    assert sign_test(3, 1) == pytest.approx(0.625, rel=1e-15)
    assert sign_test(2, 2) == 1.0 and sign_test(0, 0) == 1.0


def test_the_summary_counts_choices_against_the_oracle_and_the_accuracy_they_lost():
    cands = [0.5, 1.0, 2.0]
    rounds = [
        {"selected": 2.0, "oracle": 1.0, "candidates": cands, "accuracy": [0.4, 0.6, 0.5]},  # more; lost 10 pp
        {"selected": 1.0, "oracle": 1.0, "candidates": cands, "accuracy": [0.4, 0.6, 0.5]},  # same; 0
        {"selected": 0.5, "oracle": 2.0, "candidates": cands, "accuracy": [0.3, 0.4, 0.6]},  # less; 30 pp
        {"selected": 1.0, "oracle": None, "candidates": cands, "accuracy": [0.3, 0.4, 0.6]},  # no oracle: left out
    ]
    s = summarize(rounds)
    assert (s["rounds"], s["more"], s["same"], s["less"]) == (3, 1, 1, 1)
    assert s["mean_log2_ratio"] == pytest.approx((1 + 0 - 2) / 3, rel=1e-12)  # log2 2, log2 1, log2 1/4
    assert s["mean_accuracy_lost_pp"] == pytest.approx((10 + 0 + 30) / 3, rel=1e-12)
    assert s["sign_test_p"] == 1.0
    assert math.isclose(summarize(rounds[:1])["sign_test_p"], 1.0)  # one of one: 2 × 1/2


def test_a_score_recorded_as_null_makes_its_candidate_infeasible_not_a_crash():
    # δ = 0.05: candidate 1 has a null K̂ (non-finite on the client), candidate 2 a K̂ of 0.2.
    assert allowed_candidates([[0.01, None, 0.2], [0.02, 0.03, 0.04]], 0.05, 3) == [True, False, False]


def test_a_selected_a_outside_the_candidates_is_compared_by_its_own_grade():
    # A capped round: a = 1.0 is not a candidate; graded apart at 0.45, the oracle's 2.0 at 0.6: 15 pp lost.
    rounds = [{"selected": 1.0, "oracle": 2.0, "candidates": [0.5, 2.0], "accuracy": [0.4, 0.6], "selected_accuracy": 0.45}]
    s = summarize(rounds)
    assert (s["more"], s["less"]) == (0, 1) and s["mean_accuracy_lost_pp"] == pytest.approx(15.0, rel=1e-12)


def test_the_command_refuses_what_is_not_a_run_folder_and_a_partition_count_below_1(tmp_path, capsys):
    assert main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "not run folders (no rounds.jsonl)" in capsys.readouterr().err
    (tmp_path / "rounds.jsonl").write_text("")
    assert main([str(tmp_path), "--out", str(tmp_path / "out"), "--num-partitions", "0"]) == 2
    assert "--num-partitions = 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
