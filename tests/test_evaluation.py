"""The server's held-out evaluation: which rounds, and how client values are combined."""

import pytest

from server_app.evaluation import aggregate_evaluation, is_evaluation_round


def test_evaluation_rounds_are_zero_every_kth_and_the_last():
    assert [r for r in range(11) if is_evaluation_round(r, 4, 10)] == [0, 4, 8, 10]
    assert [r for r in range(4) if is_evaluation_round(r, 1, 3)] == [0, 1, 2, 3]
    assert not any(is_evaluation_round(r, 0, 10) for r in range(11))


def test_the_aggregate_is_weighted_by_num_examples_and_the_local_mean_is_plain():
    clients = [
        {"node-id": 1, "partition-id": 0, "num-examples": 10, "accuracy": 50.0, "avg@8": 20.0},
        {"node-id": 2, "partition-id": 1, "num-examples": 30, "accuracy": 10.0, "avg@8": 40.0},
    ]
    weighted = aggregate_evaluation(clients, weighted=True)
    assert weighted == {"accuracy": pytest.approx((10 * 50 + 30 * 10) / 40), "avg@8": pytest.approx((10 * 20 + 30 * 40) / 40)}
    assert aggregate_evaluation(clients, weighted=False) == {"accuracy": 30.0, "avg@8": 30.0}
