"""One client cannot decide the round: bounded updates, Flower's robust aggregators, robust scores,
visible holds and deadlines, with hand-made replies through the fake Grid of test_strategies.

Each attack is shown with the defence that stops it and, where the defence is an option, the
damage without it. Expected values are worked out by hand in the comments; every value below is
exact in fp32 unless a tolerance says otherwise (then it is fp32 rounding of a few operations on
values of order 1: relative 1e-6).
"""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from test_strategies import THETA, FakeGrid, _common, _record, _run, message

from fedopd.config import ConfigError, StrategySettings, TimeoutSettings, parse_run_config
from fedtops_strategy import FedTOPS, FixedMultiplier, LoRAFedAvg, make_strategy
from fedtops_strategy.bounds import capped_weights, clip_scales, update_norm
from fedtops_strategy.sampling import NodesNotConnected

pytestmark = pytest.mark.usefixtures("task_identity")

# Two honest clients and node 3, whose factors are θ + 1e6 (an update 1e6 times the others').
HONEST = {1: [np.full((2, 3), 1.0), np.full((3,), 0.0)], 2: [np.full((2, 3), 2.0), np.full((3,), 1.0)]}
HUGE = [np.full((2, 3), 0.5 + 1e6), np.full((3,), -1.0 + 1e6)]
EQUAL = {1: 1, 2: 1, 3: 1}


def _delta_norm(new):
    return math.sqrt(sum(float(np.sum((np.asarray(n, np.float64) - t) ** 2)) for n, t in zip(new, THETA)))


# ---------------------------------------------------------------------------------------------
# Bounded updates (strategy.clip-norm, strategy.max-weight)
# ---------------------------------------------------------------------------------------------


def test_clip_scales_bound_each_norm_by_c_times_the_median():
    # median of (1, 2, 100) is 2; c = 1.5 -> bound 3: only 100 is scaled, to 3/100
    assert clip_scales([1.0, 2.0, 100.0], 1.5) == [1.0, 1.0, 0.03]
    assert clip_scales([1.0, 2.0, 100.0], 0.0) == [1.0, 1.0, 1.0]  # off
    assert clip_scales([0.0, 0.0, 5.0], 2.0) == [1.0, 1.0, 0.0]  # a median of 0 bounds the rest at 0


def test_capped_weights_cut_each_weight_at_c_times_the_median():
    assert capped_weights([16, 16, 10**9], 2.0) == [16.0, 16.0, 32.0]
    assert capped_weights([16, 16, 10**9], 0.0) == [16, 16, 10**9]  # off


def test_update_norm_is_the_l2_norm_over_all_arrays_together():
    # node 1: 6 entries of 0.5 and 3 of 1.0 -> sqrt(1.5 + 3)
    assert update_norm(dict(zip("ab", THETA)), dict(zip("ab", HONEST[1]))) == pytest.approx(math.sqrt(4.5), rel=1e-15)


def test_a_huge_update_decides_fedavg_without_clipping_and_is_bounded_with_it():
    updates = {**HONEST, 3: HUGE}
    # Without: the average moves by ~1e6/3 per entry.
    plain = _run(LoRAFedAvg(**_common(3)), FakeGrid(updates, EQUAL))
    assert _delta_norm(plain) > 9e5

    # With clip-norm 2: norms sqrt(4.5), sqrt(25.5), 3e6; median sqrt(25.5); node 3 is scaled to
    # norm 2 sqrt(25.5), spread evenly over its 9 equal entries: each 2 sqrt(25.5) / 3.
    strategy = LoRAFedAvg(clip_norm=2.0, **_common(3))
    new = _run(strategy, FakeGrid(updates, EQUAL))
    entry = 2 * math.sqrt(25.5) / 3
    np.testing.assert_allclose(new[0], 0.5 + (0.5 + 1.5 + entry) / 3, rtol=1e-6)
    np.testing.assert_allclose(new[1], -1.0 + (1.0 + 2.0 + entry) / 3, rtol=1e-6)
    [b1, b2, b3] = new.records[1]["bounded"]
    assert (b1["scale"], b2["scale"]) == (1.0, 1.0)
    assert b3["node-id"] == 3 and b3["update-norm"] == pytest.approx(3e6, rel=1e-6)
    assert b3["scale"] == pytest.approx(2 * math.sqrt(25.5) / 3e6, rel=1e-6)


def test_an_inflated_weight_decides_the_average_without_a_cap_and_is_cut_with_it():
    updates = {**HONEST, 3: [np.full((2, 3), 3.0), np.full((3,), 2.0)]}  # Δ_3: 2.5 and 3.0
    weights = {1: 1, 2: 1, 3: 100}
    plain = _run(LoRAFedAvg(**_common(3)), FakeGrid(updates, weights))
    # (0.5 + 1.5 + 100 * 2.5) / 102: node 3's update almost alone
    np.testing.assert_allclose(plain[0], 0.5 + 252 / 102, rtol=1e-6)

    strategy = LoRAFedAvg(max_weight=2.0, **_common(3))  # median weight 1 -> cap 2
    new = _run(strategy, FakeGrid(updates, weights))
    np.testing.assert_allclose(new[0], 0.5 + (0.5 + 1.5 + 2 * 2.5) / 4, rtol=1e-6)
    np.testing.assert_allclose(new[1], -1.0 + (1.0 + 2.0 + 2 * 3.0) / 4, rtol=1e-6)
    assert [b["weight"] for b in new.records[1]["bounded"]] == [1.0, 1.0, 2.0]


def test_the_teacher_score_weights_are_the_capped_train_weights():
    updates = {**HONEST, 3: HONEST[2]}
    weights = {1: 1, 2: 1, 3: 100}
    scores = {1: ([0.4] * 6, [0.0] * 6), 2: ([0.4] * 6, [0.0] * 6), 3: ([0.0] * 6, [0.0] * 6)}
    strategy = FedTOPS(max_weight=2.0, **_common(3))
    ran = _run(strategy, FakeGrid(updates, weights, scores))
    # Ĵ = (0.4 + 0.4 + 2 * 0) / 4 = 0.2 (uncapped it would be 0.8 / 102)
    assert ran.records[1]["teacher_scores"] == pytest.approx([0.2] * 6, rel=1e-15)


class ClaimingGrid(FakeGrid):
    """Node 3's score reply claims ``num-examples`` = 1e12 (its train reply said 1; a claim beyond ±1e15 refuses the reply at the boundary)."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        out = []
        for r in replies:
            if r.metadata.message_type == "query.score" and r.metadata.src_node_id == 3:
                m = dict(next(iter(r.content.metric_records.values())).items())
                r = Message(content=RecordDict({"scores": MetricRecord({**m, "num-examples": 1e12})}), metadata=r.metadata)
            out.append(r)
        return out


def test_a_score_replys_own_weight_is_not_used():
    # Before: the weight came from the score reply, and 1e12 made Ĵ node 3's own (0 everywhere but
    # at a = 10, so a = 10 was chosen). Now the train weights (1, 1, 1) give Ĵ = mean of the three.
    updates = {**HONEST, 3: HONEST[2]}
    j3 = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    scores = {1: ([0.3, 0.2, 0.3, 0.3, 0.3, 0.0], [0.0] * 6), 2: ([0.3, 0.2, 0.3, 0.3, 0.3, 0.0], [0.0] * 6), 3: (j3, [0.0] * 6)}
    strategy = FedTOPS(**_common(3))
    ran = _run(strategy, ClaimingGrid(updates, EQUAL, scores))
    record = ran.records[1]
    assert record["teacher_scores"] == pytest.approx([0.2, 0.4 / 3, 0.2, 0.2, 0.2, 1 / 3], rel=1e-12)
    assert record["multiplier"] == 1.0  # 0.133 at a = 1 is the lowest


# ---------------------------------------------------------------------------------------------
# A non-finite adapter holds the round
# ---------------------------------------------------------------------------------------------

OVERFLOWING = [np.full((2, 3), 3.3e38), np.full((3,), 3.3e38)]  # finite in fp32 (max 3.4e38)


def test_a_fixed_step_that_overflows_holds_and_keeps_theta():
    # mean ~1.1e38 is finite; θ + 5 (mean − θ) ~5.5e38 is not: the round holds with θ_t.
    strategy = FixedMultiplier(5.0, **_common(3))
    with np.errstate(over="ignore"):
        new = _run(strategy, FakeGrid({**HONEST, 3: OVERFLOWING}, EQUAL))
    assert all(np.array_equal(n, t) for n, t in zip(new, THETA))
    record = new.records[1]
    assert record["multiplier"] == 0.0 and record["hold-reason"] == "θ_t + 5 Δ_t is not finite"


def test_a_fedtops_candidate_that_overflows_holds_and_keeps_theta():
    # Every candidate is feasible and a = 10 has the lowest Ĵ; θ + 10 Δ overflows.
    scores = {n: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0] * 6) for n in (1, 2, 3)}
    strategy = FedTOPS(**_common(3))
    with np.errstate(over="ignore"):
        new = _run(strategy, FakeGrid({**HONEST, 3: OVERFLOWING}, EQUAL, scores))
    assert all(np.array_equal(n, t) for n, t in zip(new, THETA))
    record = new.records[1]
    assert record["selected-multiplier"] == 10.0 and record["multiplier"] == 0.0
    assert record["hold-reason"] == "θ_t + 10 Δ_t is not finite"


# ---------------------------------------------------------------------------------------------
# Robust scores: Ĵ across clients, vetoes, holds
# ---------------------------------------------------------------------------------------------

HONEST_J = [0.5, 0.4, 0.3, 0.2, 0.1, 0.6]  # lowest at a = 5


@pytest.mark.parametrize("how, selected", [("mean", 10.0), ("median", 5.0), ("trimmed-mean", 5.0)])
def test_a_huge_teacher_score_at_every_candidate_but_the_largest(how, selected):
    # Node 3: Ĵ 700 (a KL a client can report: at most 1074 ln 2, replies.KL_MAX) except at a = 10. With δ = inf the weighted mean picks a = 10 (damage);
    # the median, and a trimmed mean cutting 1 of 3 at each end, are the honest clients' Ĵ: a = 5.
    scores = {1: (HONEST_J, [0.0] * 6), 2: (HONEST_J, [0.0] * 6), 3: ([700.0] * 5 + [0.0], [0.0] * 6)}
    strategy = FedTOPS(trust_budget=math.inf, score_aggregate=how, trim_fraction=0.34, **_common(3))
    ran = _run(strategy, FakeGrid({**HONEST, 3: HONEST[2]}, EQUAL, scores))
    assert ran.records[1]["multiplier"] == selected


def test_a_client_that_vetoes_every_candidate_holds_the_round_and_is_named(caplog):
    scores = {1: (HONEST_J, [0.0] * 6), 2: (HONEST_J, [0.0] * 6), 3: (HONEST_J, [700.0] * 6)}
    strategy = FedTOPS(**_common(3))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        new = _run(strategy, FakeGrid({**HONEST, 3: HONEST[2]}, EQUAL, scores))
    assert all(np.array_equal(n, t) for n, t in zip(new, THETA))
    record = new.records[1]
    assert record["multiplier"] == 0.0 and record["num-feasible"] == 0
    assert record["veto-counts"] == [0, 0, 6] and record["hold-node-ids"] == [3]
    assert "K̂ at a = 1 exceeded δ at node(s) 3" in record["hold-reason"]
    assert any("round 1 holds (a = 0)" in r.getMessage() and "node(s) 3" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_one_veto_allowed_lets_the_others_choose():
    scores = {1: (HONEST_J, [0.0] * 6), 2: (HONEST_J, [0.0] * 6), 3: (HONEST_J, [700.0] * 6)}
    strategy = FedTOPS(max_vetoes=1, **_common(3))
    ran = _run(strategy, FakeGrid({**HONEST, 3: HONEST[2]}, EQUAL, scores))
    record = ran.records[1]
    assert record["multiplier"] == 5.0 and record["num-feasible"] == 6 and record["veto-counts"] == [0, 0, 6]
    assert "hold-reason" not in record


# ---------------------------------------------------------------------------------------------
# Flower's robust aggregators under fedavg, fixed and FedTOPS
# ---------------------------------------------------------------------------------------------


def _aggregating(cls, name, *args, **settings):
    from fedtops_strategy.aggregators import make_aggregator

    return cls(*args, aggregator=make_aggregator(StrategySettings(aggregator=name, **settings)), **_common(3))


@pytest.mark.parametrize(
    "name, settings, expected",
    [
        ("median", {}, (2.0, 1.0)),  # coordinate-wise median of 1, 2, 1e6+0.5 and 0, 1, 1e6-1
        ("trimmed-mean", {"trim_fraction": 0.34}, (2.0, 1.0)),  # cut 1 of 3 at each end: the median
        ("krum", {}, (1.0, 0.0)),  # nodes 1 and 2 tie (distance 9 to each other); the first wins
        ("multikrum", {"num_malicious": 1}, (0.5, -1.0)),  # n = 3 < 2f + 3 = 5: the round holds, θ_t kept
    ],
)
def test_a_robust_aggregator_leaves_the_huge_update_out(name, settings, expected):
    strategy = _aggregating(LoRAFedAvg, name, **settings)
    new = _run(strategy, FakeGrid({**HONEST, 3: HUGE}, EQUAL))
    assert np.array_equal(new[0], np.full((2, 3), expected[0], np.float32))
    assert np.array_equal(new[1], np.full((3,), expected[1], np.float32))
    assert new.records[1].get("aggregation-error") is None  # a diagnostic of the weighted mean only


def test_fixed_under_the_median_moves_a_times_median_minus_theta():
    strategy = _aggregating(FixedMultiplier, "median", 3.0)
    new = _run(strategy, FakeGrid({**HONEST, 3: HUGE}, EQUAL))
    assert np.array_equal(new[0], np.full((2, 3), 0.5 + 3 * 1.5, np.float32))  # median 2: Δ 1.5
    assert np.array_equal(new[1], np.full((3,), -1.0 + 3 * 2.0, np.float32))  # median 1: Δ 2
    assert new.records[1]["multiplier"] == 3.0


def test_fedtops_scores_the_increment_of_the_median():
    scores = {n: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0] * 6) for n in (1, 2, 3)}
    strategy = _aggregating(FedTOPS, "median")
    grid = FakeGrid({**HONEST, 3: HUGE}, EQUAL, scores)
    new = _run(strategy, grid)
    [query, *_] = [m for m in grid.sent if m.metadata.message_type == "query.score"]
    increment = query.content["increment"].to_numpy_ndarrays()
    assert np.array_equal(increment[0], np.full((2, 3), 1.5, np.float32)) and np.array_equal(increment[1], np.full((3,), 2.0, np.float32))
    assert np.array_equal(new[0], np.full((2, 3), 0.5 + 10 * 1.5, np.float32))


def test_the_aggregator_names_are_the_configs():
    from fedopd.config import AGGREGATORS
    from fedtops_strategy.aggregators import AGGREGATORS as BUILT

    assert tuple(BUILT) == AGGREGATORS


# ---------------------------------------------------------------------------------------------
# Deadlines: TTL, skipping silent nodes, waiting for nodes
# ---------------------------------------------------------------------------------------------


def test_each_message_lives_as_long_as_its_phase_waits():
    from server_app.grid import PromptGrid

    class Inner:
        def __init__(self):
            self.pushed = []

        def push_messages(self, messages):
            self.pushed.extend(messages)
            return [None for _ in messages]  # nothing pushed: no reply to wait for

    inner = Inner()
    grid = PromptGrid(inner)
    for phase, timeout in (("train", 3600.0), ("query.score", 600.0), ("evaluate", 42.0)):
        grid.send_and_receive([Message(RecordDict(), dst_node_id=1, message_type=phase)], timeout=timeout)
    assert [(m.metadata.message_type, m.metadata.ttl) for m in inner.pushed] == [("train", 3600.0), ("query.score", 600.0), ("evaluate", 42.0)]


def _sampled(strategy, grid, rounds):
    out = []
    for server_round in range(1, rounds + 1):
        record = _run_round(strategy, grid, server_round)
        out.append((record["sampled-node-ids"], record.get("skipped-node-ids", [])))
    return out


def _run_round(strategy, grid, server_round):
    from flwr.app import ConfigRecord

    from fedtops_strategy.round import play_round

    return play_round(strategy, grid, server_round, _record(THETA), ConfigRecord(), train_timeout=1.0, score_timeout=1.0).to_record()


def test_a_node_that_never_answers_sits_out_after_k_rounds_and_is_asked_again():
    updates = {**HONEST, 3: HONEST[2]}
    lost = {3: ("train", "silent")}
    strategy = LoRAFedAvg(skip_after=2, **_common(3))
    # Rounds 1, 2: asked, no reply; rounds 3, 4: left out; round 5: asked again (and misses again).
    assert _sampled(strategy, FakeGrid(updates, EQUAL, lost=lost), 6) == [
        ([1, 2, 3], []),
        ([1, 2, 3], []),
        ([1, 2], [3]),
        ([1, 2], [3]),
        ([1, 2, 3], []),
        ([1, 2], [3]),
    ]
    # Without skipping (timeout.skip-after = 0), every round waits for it.
    strategy = LoRAFedAvg(**_common(3))
    assert _sampled(strategy, FakeGrid(updates, EQUAL, lost=lost), 4) == [([1, 2, 3], [])] * 4


def _silences(strategy, rounds, silent_on_ask):
    """Drive ``rounds`` rounds in which node 3 answers or not by how many times it has been asked
    (``silent_on_ask(k)`` for its k-th ask, from 1); the rounds in which it was asked and silent."""
    updates, asks, costly = {**HONEST, 3: HONEST[2]}, 0, []
    for server_round in range(1, rounds + 1):
        if 3 in strategy.sitting_out(server_round):
            _run_round(strategy, FakeGrid(updates, EQUAL), server_round)
            continue
        asks += 1
        silent = silent_on_ask(asks)
        _run_round(strategy, FakeGrid(updates, EQUAL, lost={3: ("train", "silent")} if silent else None), server_round)
        costly += [server_round] if silent else []
    return costly


def test_a_node_silent_every_other_round_costs_a_deadline_ever_more_rarely():
    """k = 2: silent in 2 of its last 4 asked rounds sets a node out, consecutive or not, for 2
    rounds, then 4, 8, 16 while its history still holds a silence. By hand: silent at asks 1, 3
    (rounds 1, 3: out 4-5), ask 5 (round 7: out 8-11), ask 7 (round 13: out 14-21), ask 9
    (round 23: out 24-39). Counting consecutive rounds only, it cost every other round: 15 of 30."""
    strategy = LoRAFedAvg(skip_after=2, **_common(3))
    assert _silences(strategy, 30, lambda ask: ask % 2 == 1) == [1, 3, 7, 13, 23]


def test_fewer_than_k_silences_in_2k_rounds_never_set_a_node_out_and_2k_answers_start_afresh():
    # k = 2: silent at asks 1 and 5, three answers between: at most one silence in any 4 asked rounds
    strategy = LoRAFedAvg(skip_after=2, **_common(3))
    assert _silences(strategy, 6, lambda ask: ask in (1, 5)) == [1, 5]
    assert strategy.timeouts[3] == 1 and not any(strategy.sitting_out(t) for t in range(1, 8))
    # set out once (rounds 1, 2 silent: out 3-4), four answers (rounds 5-8) clear its history: the
    # next two silences (rounds 9, 10) set it out for 2 rounds again (11-12), not 4
    strategy = LoRAFedAvg(skip_after=2, **_common(3))
    assert _silences(strategy, 12, lambda ask: ask in (1, 2, 7, 8)) == [1, 2, 9, 10]
    assert strategy.skipped_until[3] == 12


def test_a_skipped_node_is_sampled_when_too_few_others_are_connected():
    strategy = LoRAFedAvg(min_train_nodes=3, min_available_nodes=3, skip_after=1)
    updates = {**HONEST, 3: HONEST[2]}
    _run_round(strategy, FakeGrid(updates, EQUAL, lost={3: ("train", "silent")}), 1)
    assert strategy.sitting_out(2) == {3}
    record = _run_round(strategy, FakeGrid(updates, EQUAL), 2)  # needs 3 nodes: node 3 is asked after all
    assert record["sampled-node-ids"] == [1, 2, 3] and "skipped-node-ids" not in record


def test_waiting_for_nodes_ends_at_the_start_deadline():
    strategy = make_strategy(StrategySettings(name="fedavg"), num_clients=3, timeouts=TimeoutSettings(start=0.5))
    grid = FakeGrid({**HONEST, 3: HONEST[2]}, EQUAL, connected=lambda: [2])
    with pytest.raises(NodesNotConnected, match=r"round 1 waited \d+ s \(timeout.start = 0.5\) for 3 connected node\(s\) and saw 1 \(2\)"):
        _run_round(strategy, grid, 1)


# ---------------------------------------------------------------------------------------------
# The settings: refused where they cannot apply
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"strategy.name": "local", "strategy.aggregator": "median"}, "'strategy.aggregator' = 'median' acts on the average"),
        ({"strategy.name": "centralized", "strategy.clip-norm": 2.0}, "'strategy.clip-norm' = 2.0 acts on the average"),
        ({"strategy.name": "fedavg", "strategy.max-vetoes": 1}, "'strategy.max-vetoes' = 1 acts on FedTOPS's score replies"),
        ({"strategy.num-malicious": 1}, "'strategy.num-malicious' = 1 is used only by Krum"),
        ({"strategy.clip-norm": 0.5}, "'strategy.clip-norm' = 0.5 is invalid"),
        ({"strategy.max-weight": -1}, "'strategy.max-weight' = -1 is invalid"),
        ({"strategy.trim-fraction": 0.5}, "'strategy.trim-fraction' = 0.5 is invalid"),
        ({"strategy.aggregator": "mean"}, "'strategy.aggregator' = 'mean' is invalid"),
        ({"strategy.score-aggregate": "max"}, "'strategy.score-aggregate' = 'max' is invalid"),
    ],
)
def test_robustness_settings_that_cannot_apply_are_refused_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_run_config(settings)


def _score_reply(teacher, change):
    return message(RecordDict({"scores": MetricRecord({"teacher-scores": teacher, "change-scores": change})}), "query.score", src=3, message_id="x")


def test_a_score_reply_without_a_weight_is_valid():
    from fedtops_strategy.fedtops import parse_score_reply

    problem, (j, k) = parse_score_reply(_score_reply([0.1, 0.2], [0.0, math.nan]), 2)
    assert problem is None and j == [0.1, math.inf] and k == [0.0, math.inf]


def test_the_round_line_of_a_held_round_with_a_non_finite_score_says_so():
    from server_app.log_lines import round_summary

    record = {
        "round": 2,
        "strategy": "fedtops",
        "multiplier": 1.0,
        "candidates": [1.0, 2.0],
        "teacher_scores": [None, 0.25],
        "num-feasible": 0,
        "clients": [{"node-id": 1}],
        "hold-reason": "no feasible candidate",
        "skipped-node-ids": [3],
    }
    line = round_summary(record, 4)
    assert "a = 1 | J(a) = - |" in line and line.endswith("(1 skipped) (held: see the WARNING above)")


def test_with_two_clients_the_bounds_are_not_applied_and_the_record_says_why():
    # Two updates: any bar relative to the round is one of them. The lower median would be the
    # smaller norm, so a zero update would scale the other to 0; the mean would let a huge one
    # keep half its norm. The round averages them as they are and says so.
    strategy = LoRAFedAvg(clip_norm=2.0, **_common(2))
    new = _run(strategy, FakeGrid({1: HONEST[1], 2: THETA}, {1: 1, 2: 1}))  # node 2 returns θ_t: a zero update
    record = new.records[1]
    assert record["bounds-skipped"] == "2 update(s): bounds relative to the round need at least 3"
    assert "bounded" not in record
    np.testing.assert_allclose(new[0], 0.5 + 0.5 / 2, rtol=1e-7)  # node 1's Δ 0.5, halved by the mean, not by a bound


def test_with_three_clients_a_zero_update_cannot_lower_the_clipping_bar():
    # Norms sqrt(4.5) (node 1), sqrt(25.5) (node 2), 0 (node 3): the lower median is sqrt(4.5), an
    # honest norm, not node 3's 0. With c = 2 the bar is 2 sqrt(4.5): node 2 is scaled by
    # 2 sqrt(4.5) / sqrt(25.5) = 0.840, node 1 (and the zero update) not at all.
    strategy = LoRAFedAvg(clip_norm=2.0, **_common(3))
    ran = _run(strategy, FakeGrid({**HONEST, 3: THETA}, EQUAL))
    scales = [b["scale"] for b in ran.records[1]["bounded"]]
    assert scales[0] == 1.0 and scales[2] == 1.0
    assert scales[1] == pytest.approx(2 * math.sqrt(4.5) / math.sqrt(25.5), rel=1e-9)


def test_with_four_clients_one_huge_update_cannot_raise_its_own_clipping_bar():
    # Norms sqrt(4.5), sqrt(4.5), sqrt(25.5), 3e6: the lower median is sqrt(4.5) (numpy's median
    # would be (sqrt(4.5) + sqrt(25.5)) / 2); the huge update is scaled to 2 sqrt(4.5).
    strategy = LoRAFedAvg(clip_norm=2.0, **_common(4))
    ran = _run(strategy, FakeGrid({1: HONEST[1], 2: HONEST[2], 3: HONEST[1], 4: HUGE}, {1: 1, 2: 1, 3: 1, 4: 1}))
    b4 = ran.records[1]["bounded"][3]
    assert b4["node-id"] == 4 and b4["scale"] * b4["update-norm"] == pytest.approx(2 * math.sqrt(4.5), rel=1e-9)


def test_bounds_with_fewer_than_three_clients_per_round_are_refused():
    with pytest.raises(ConfigError, match="'strategy.clip-norm' = 2.0 bounds each update by the round's median, which needs at least 3"):
        parse_run_config({"strategy.clip-norm": 2.0, "num-clients": 2})
    with pytest.raises(ConfigError, match="'strategy.max-weight' = 2.0"):
        parse_run_config({"strategy.max-weight": 2.0, "num-clients": 3, "strategy.fraction-train": 0.5})


def test_the_lower_median_is_the_smaller_middle_value():
    from fedtops_strategy.bounds import lower_median

    assert lower_median([3.0]) == 3.0
    assert lower_median([5.0, 1.0]) == 1.0
    assert lower_median([4.0, 1.0, 3.0, 2.0]) == 2.0
    assert lower_median([9.0, 1.0, 5.0]) == 5.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"strategy.aggregator": "trimmed-mean", "num-clients": 3}, "cuts floor(0.2 × 3) = 0 of the 3 clients"),
        ({"strategy.name": "fedtops", "strategy.score-aggregate": "trimmed-mean", "num-clients": 4}, "e.g. 0.25"),
        ({"strategy.aggregator": "trimmed-mean", "num-clients": 2, "strategy.trim-fraction": 0.4}, "'median' instead, or more clients"),
    ],
)
def test_a_trimmed_mean_that_would_cut_nobody_is_refused(overrides, message):
    with pytest.raises(ConfigError, match="strategy.trim-fraction") as err:
        parse_run_config(overrides)
    assert message in str(err.value)


def test_a_trimmed_mean_that_cuts_one_client_at_each_end_is_accepted():
    cfg = parse_run_config({"strategy.aggregator": "trimmed-mean", "num-clients": 3, "strategy.trim-fraction": 0.34})
    assert cfg.strategy.trim_fraction == 0.34


def test_under_local_two_nodes_whose_last_claims_are_one_partition_are_saved_under_their_node_ids():
    from fedtops_strategy import LocalTraining

    updates = {1: HONEST[1], 2: HONEST[2]}
    strategy = LocalTraining(**_common(2))
    claims = {("train", 1): {"partition-id": 0}, ("train", 2): {"partition-id": 1}}
    _run_round(strategy, FakeGrid(updates, {1: 1, 2: 1}, extra=claims), 1)
    assert sorted(strategy.client_adapters()) == [0, 1]
    # Round 2: node 1 stays silent and node 2 claims partition 0, undisputed in that round. Its label
    # becomes 0 while node 1's is still 0: neither folder may be client-0, or one adapter overwrites the other.
    _run_round(strategy, FakeGrid(updates, {1: 1, 2: 1}, extra={("train", 2): {"partition-id": 0}}, lost={1: ("train", "silent")}), 2)
    adapters = strategy.client_adapters()
    assert sorted(adapters) == ["node-1", "node-2"]
    assert np.array_equal(adapters["node-1"]["layer.lora_A.weight"], np.asarray(HONEST[1][0], np.float32))


def test_a_trimmed_mean_that_would_cut_nobody_in_a_round_holds_it_and_says_so(caplog):
    """floor(0.2 x 3) = 0: averaging would be the plain mean, which one update moves at will."""
    from flwr.serverapp.strategy import FedTrimmedAvg

    from fedtops_strategy.averaging import RobustMean, Update

    theta = {"w": np.zeros(2, np.float32)}
    updates = [Update(n, {"w": np.full(2, float(n), np.float32)}, 1) for n in (1, 2, 3)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        held = RobustMean(FedTrimmedAvg(beta=0.2)).average(4, updates, theta)  # floor(0.2 × 3) = 0
        kept = RobustMean(FedTrimmedAvg(beta=0.34)).average(5, updates, theta)  # floor(0.34 × 3) = 1: the middle value
    reason = "3 updates: the trimmed mean (strategy.trim-fraction = 0.2) would cut none: it would be the plain mean"
    assert held.arrays is None and held.hold == reason
    np.testing.assert_array_equal(kept.arrays["w"], [2.0, 2.0])
    assert [r.getMessage() for r in caplog.records if "cut none" in r.getMessage()] == [f"round 4 holds: {reason}"]


@pytest.mark.parametrize(
    "rule, planned, arrived, outcome",
    [
        ("trimmed-mean", 5, 4, 2.5),  # f = ⌊0.2 × 5⌋ = 1 cut at each end of 4: mean of 2 and 3 (the 1e6 is cut)
        ("trimmed-mean", 5, 3, 2.0),  # 3 = 2f + 1: still cut 1 at each end, the middle value
        ("trimmed-mean", 10, 4, None),  # f = 2 needs 5: 4 arrived, hold
        ("median", 5, 4, None),  # f = 2 needs 5 (2 of 4 would be half): hold
        ("median", 6, 5, 3.0),  # f = 2 needs 5: the median of 5
    ],
)
def test_a_robust_aggregator_keeps_the_colluders_it_was_set_up_for_in_a_short_round_or_holds(rule, planned, arrived, outcome):
    """The tolerance f is set by the planned round size (robust_tolerance), not by who arrived:
    the trimmed mean keeps cutting f at each end, and a round with fewer than 2f + 1 updates holds
    (the second colluder review: 2 colluders of 5 plus one honest timeout made the median and a
    trimmed mean of β = 0.4 theirs)."""
    from flwr.serverapp.strategy import FedMedian, FedTrimmedAvg

    from fedtops_strategy.averaging import RobustMean, Update

    theta = {"w": np.zeros(1, np.float32)}
    values = [1.0, 2.0, 3.0, 4.0, 1e6][:arrived] if arrived < 5 else [1.0, 2.0, 3.0, 4.0, 1e6]
    if arrived == 4:
        values = [1.0, 2.0, 3.0, 1e6]
    if arrived == 3:
        values = [1.0, 2.0, 1e6]
    updates = [Update(i, {"w": np.full(1, v, np.float32)}, 1) for i, v in enumerate(values)]
    strategy = FedTrimmedAvg(beta=0.2) if rule == "trimmed-mean" else FedMedian()
    got = RobustMean(strategy, planned).average(1, updates, theta)
    if outcome is None:
        assert got.arrays is None and "which needs at least 5" in got.hold
    else:
        assert got.arrays["w"][0] == pytest.approx(outcome, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Robust aggregators keep their breakdown point, or the run is refused before round 1
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        # Krum (Blanchard et al., 2017) needs n >= 2f + 3: 3 clients tolerate f = 0 only
        (
            {"num-clients": 3, "strategy.aggregator": "krum", "strategy.num-malicious": 1},
            "'strategy.num-malicious' = 1 is invalid: 'krum' tolerates f arbitrary updates of n only when n >= 2f + 3 "
            "(Blanchard et al., 2017), and a round averages 3; allowed: at most 0, or at least 5 clients per round",
        ),
        # Multi-Krum keeps n - f updates: f = 0 keeps them all, the plain mean
        ({"num-clients": 9, "strategy.aggregator": "multikrum"}, "'strategy.num-malicious' = 0 is invalid: 'multikrum' with f = 0 averages all n"),
        # 6 clients tolerate f <= 1 (6 >= 2 + 3, 6 < 4 + 3)
        (
            {"num-clients": 6, "strategy.aggregator": "multikrum", "strategy.num-malicious": 2},
            "and a round averages 6; allowed: at most 1, or at least 7 clients per round",
        ),
        # a fraction of the clients: int(0.5 x 10) = 5 per round, so f = 2 needs 7
        ({"num-clients": 10, "strategy.fraction-train": 0.5, "strategy.aggregator": "krum", "strategy.num-malicious": 2}, "a round averages 5;"),
        (
            {"num-clients": 2, "strategy.aggregator": "median"},
            "'strategy.aggregator' = 'median' is invalid: 'median' of 2 update(s) per round is their mean",
        ),
    ],
)
def test_a_robust_aggregator_that_cannot_keep_its_breakdown_point_is_refused(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_run_config(settings)


@hypothesis_settings(max_examples=120, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(aggregator=st.sampled_from(["median", "krum", "multikrum"]), clients=st.integers(1, 40), malicious=st.integers(0, 20))
def test_an_aggregator_is_accepted_exactly_where_its_breakdown_rule_holds(aggregator, clients, malicious):
    """Median: at least 3 per round; Krum: n >= 2f + 3; Multi-Krum: that and f >= 1 (every client trains)."""
    holds = {"median": clients >= 3, "krum": clients >= 2 * malicious + 3, "multikrum": malicious >= 1 and clients >= 2 * malicious + 3}[aggregator]
    settings = {"num-clients": clients, "strategy.aggregator": aggregator}
    if aggregator != "median":
        settings["strategy.num-malicious"] = malicious
    elif malicious:
        return  # num-malicious is Krum's alone (refused otherwise, tested above)
    try:
        parse_run_config(settings)
        accepted = True
    except ConfigError as err:
        assert "strategy.aggregator" in str(err) or "strategy.num-malicious" in str(err)
        accepted = False
    assert accepted == holds


def test_the_serverapp_checks_the_aggregator_against_the_nodes_connected_when_num_clients_is_0(tmp_path):
    """num-clients = 0 trains the nodes connected at the start: with 3, Krum cannot take f = 1,
    and nothing is written."""
    from conftest import TINY_RUN

    from server_app.inprocess import run_in_process

    config = {**TINY_RUN, "output-dir": str(tmp_path / "runs"), "strategy.aggregator": "krum", "strategy.num-malicious": 1}
    with pytest.raises(ConfigError, match=re.escape("'strategy.num-malicious' = 1 is invalid: 'krum' tolerates")):
        run_in_process(config, num_clients=3)
    assert not (tmp_path / "runs").exists()


def test_the_serverapp_checks_a_trimmed_mean_against_the_nodes_connected_when_num_clients_is_0(tmp_path):
    """floor(0.2 x 3) = 0: the trimmed mean of the 3 connected nodes would cut none."""
    from conftest import TINY_RUN

    from server_app.inprocess import run_in_process

    config = {**TINY_RUN, "output-dir": str(tmp_path / "runs"), "strategy.aggregator": "trimmed-mean"}
    with pytest.raises(ConfigError, match=r"cuts floor\(0.2 × 3\) = 0 .* \(num-clients = 0: the run trains the 3 node\(s\) connected now"):
        run_in_process(config, num_clients=3)
    assert not (tmp_path / "runs").exists()


def test_a_round_with_fewer_updates_than_the_aggregator_needs_holds_and_says_why(caplog):
    """Checked for 3 clients per round; node 3 is silent, so the median would be of 2, their
    mean, which one of them moves at will: the round holds (θ_t kept) and its record says why."""
    strategy = _aggregating(LoRAFedAvg, "median")
    with caplog.at_level(logging.WARNING, logger="flwr"):
        ran = _run(strategy, FakeGrid({**HONEST, 3: HUGE}, EQUAL, lost={3: ("train", "silent")}))
    assert "round 1 holds: 2 updates: 'median' of 2 update(s) is their mean" in caplog.text
    assert ran.records[1]["multiplier"] == 0.0 and ran.records[1]["hold-reason"] == "2 updates: 'median' of 2 update(s) is their mean"
    for got, start in zip(ran, THETA):
        np.testing.assert_array_equal(got, start)


def test_under_privacy_a_robust_aggregator_is_refused_for_privacy_not_for_its_breakdown_point():
    with pytest.raises(ConfigError, match="'strategy.aggregator' = 'median' cannot be combined with 'privacy.clipping' = 'fixed'"):
        parse_run_config({"privacy.clipping": "fixed", "num-clients": 2, "strategy.aggregator": "median"})


def test_an_average_that_is_not_finite_holds_the_round_and_says_so():
    """Whatever averager runs (one interface), a non-finite average holds the round with θ_t and
    the record names that, not a missing update; no score query goes out."""
    from fedtops_strategy.averaging import Average, WeightedMean

    class Overflowing(WeightedMean):
        def average(self, server_round, updates, theta):
            return Average({k: np.full_like(v, np.inf) for k, v in theta.items()})

    scores = {n: ([0.1] * 6, [0.0] * 6) for n in (1, 2, 3)}
    strategy = FedTOPS(**_common(3))
    strategy.averager = Overflowing()
    grid = FakeGrid({**HONEST, 3: HONEST[2]}, EQUAL, scores)
    new = _run(strategy, grid)
    assert all(np.array_equal(n, t) for n, t in zip(new, THETA))
    record = new.records[1]
    assert record["multiplier"] == 0.0 and record["hold-reason"] == "the averaged adapter is not finite"
    assert len(record["clients"]) == 3 and not any(m.metadata.message_type == "query.score" for m in grid.sent)


@hypothesis_settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(
    st.lists(st.floats(1e-3, 1e3), min_size=2, max_size=8),
    st.integers(0, 6),
    st.floats(1.0, 10.0),
    st.floats(0.0, 1e-9),
)
def test_a_minority_of_zero_or_tiny_updates_cannot_shrink_the_honest_ones(honest, zeros, c, tiny):
    """clip-norm's breakdown point: with fewer than half the updates zero or tiny, every honest
    update keeps at least the smallest honest norm (c >= 1); with exactly half, the bar is theirs."""
    from fedtops_strategy.bounds import clip_scales

    norms = honest + [tiny] * zeros
    scales = clip_scales(norms, c)
    kept = [s * h for s, h in zip(scales, honest)]
    if 2 * zeros < len(norms):
        assert min(kept) >= min(honest) * (1 - 1e-12)
    elif 2 * zeros == len(norms):
        assert min(kept) <= c * tiny * (1 + 1e-12)  # half: the lower median is a tiny norm


PAPER_CANDIDATES = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
AGREEING_J = [0.5, 0.4, 0.3, 0.35, 0.45, 0.6]  # honest clients agree: a = 2
COLLUDING_J = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]  # colluders favour the largest candidate


@pytest.mark.parametrize(
    "aggregate, tolerated",
    [("median", 2), ("trimmed-mean", 1)],  # of n = 5: median f < n/2; trimmed mean β = 0.2: f <= ⌊β n⌋ = 1
)
def test_robust_teacher_scores_hold_up_to_their_stated_number_of_colluders_and_not_one_more(aggregate, tolerated):
    """n = 5 clients, every candidate feasible: with f colluders reporting Ĵ = 0 at a = 10 and 1
    elsewhere, Ĵ's median keeps the honest choice (a = 2) while f <= 2, its trimmed mean (β = 0.2)
    while f <= 1; one more colluder and the largest candidate wins (docs/robustness.md). The mean
    (the paper's) already gives way at f = 2: (3·0.6 + 2·0)/5 = 0.36 < (3·0.3 + 2·1)/5 = 0.58."""
    from fedtops_strategy.selection import select_round

    def chosen(f, how):
        rows = [AGREEING_J] * (5 - f) + [COLLUDING_J] * f
        return select_round(
            PAPER_CANDIDATES, rows, [[0.0] * 6] * 5, [1.0] * 5, 0.05, all_scored=True, score_aggregate=how, trim_fraction=0.2
        ).multiplier

    assert chosen(tolerated, aggregate) == 2.0
    assert chosen(tolerated + 1, aggregate) == 10.0
    assert chosen(2, "mean") == 10.0


# ---------------------------------------------------------------------------------------------
# What a robust Ĵ keeps, exactly, and what it does not (docs/robustness.md, "Ĵ across clients")
SCORE_RULES = [("median", 2, 5), ("trimmed-mean", 1, 5), ("median", 3, 7), ("trimmed-mean", 2, 10)]  # (rule, f it tolerates, n)


@pytest.mark.parametrize("how, tolerated, n", SCORE_RULES)
@hypothesis_settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(data=st.data())
def test_a_robust_j_stays_within_the_honest_rows_at_every_candidate_up_to_its_colluders_and_not_one_more(how, tolerated, n, data):
    """Median of n rows: f < n/2 colluders; trimmed mean (β = 0.2): f <= ⌊β n⌋. With that many
    colluding rows, whatever they report, Ĵ at each candidate lies between the honest rows'
    smallest and largest value there; with one colluder more it leaves them (here: below them all)."""
    from fedtops_strategy.selection import robust_teacher_scores

    cells = st.floats(0.0, 744.0)
    honest = data.draw(st.lists(st.lists(cells, min_size=3, max_size=3), min_size=n - tolerated, max_size=n - tolerated))
    colluding = data.draw(st.lists(st.lists(cells, min_size=3, max_size=3), min_size=tolerated, max_size=tolerated))
    j = robust_teacher_scores(honest + colluding, how, 0.2)
    for c in range(3):
        column = [row[c] for row in honest]
        assert min(column) - 1e-9 <= j[c] <= max(column) + 1e-9
    one_more = [[1.0] * 3] * (n - tolerated - 1) + [[0.0] * 3] * (tolerated + 1)  # honest rows at 1, colluders at 0
    assert all(v < 1.0 for v in robust_teacher_scores(one_more, how, 0.2))


def test_a_round_with_too_few_score_rows_for_the_robust_j_caps_a_at_one():
    """Checked for 5, a round scores 4 rows (an honest node missed the train deadline): a trimmed
    mean of 4 rows cuts none and would be the mean, which one colluder at Ĵ = 0 (a = 10) moves
    to a = 10. The round caps a at 1 instead; the median of 2 rows is capped the same way."""
    from fedtops_strategy.selection import select_round

    def chosen(rows, how):
        return select_round(
            PAPER_CANDIDATES, rows, [[0.0] * 6] * len(rows), [1.0] * len(rows), 0.05, all_scored=True, score_aggregate=how, trim_fraction=0.2
        )

    five = [AGREEING_J] * 4 + [COLLUDING_J]
    assert chosen(five, "trimmed-mean").multiplier == 2.0  # ⌊0.2 × 5⌋ = 1 cut: the honest choice
    four = chosen([AGREEING_J] * 3 + [COLLUDING_J], "trimmed-mean")
    assert (four.selected, four.multiplier, four.cap) == (10.0, 1.0, 1.0) and "cuts none" in four.too_few_rows
    two = chosen([AGREEING_J, COLLUDING_J], "median")
    assert two.multiplier == 1.0 and two.too_few_rows == "the median of 2 score row(s) is their mean"
    assert chosen([AGREEING_J, COLLUDING_J], "mean").too_few_rows is None  # the paper's mean claims nothing


def test_one_client_chooses_among_the_honestly_feasible_candidates_by_vetoing_the_others():
    """The paper's rule (max-vetoes = 0) makes a candidate infeasible when any client's K̂ exceeds
    δ, so one client that vetoes every candidate but its target gets its target whenever the honest
    clients find it feasible, whatever the Ĵ aggregate: a limit, not a breakdown point."""
    from fedtops_strategy.selection import select_round

    honest_k = [0.0] * 6  # every candidate within δ for the honest clients
    for target in range(6):
        veto = [0.0 if j == target else 1.0 for j in range(6)]  # 1.0 > δ = 0.05
        for how in ("mean", "median", "trimmed-mean"):
            rows, k = [AGREEING_J] * 4 + [AGREEING_J], [honest_k] * 4 + [veto]
            got = select_round(PAPER_CANDIDATES, rows, k, [1.0] * 5, 0.05, all_scored=True, score_aggregate=how, trim_fraction=0.2)
            assert got.multiplier == PAPER_CANDIDATES[target]


def test_honest_clients_on_different_scales_let_a_tolerated_number_of_colluders_choose():
    """The bound is per candidate: honest rows whose levels differ (0.065, 0.05, 0.033, as in a
    sandbox run) agree on a = 2 each, but 2 colluders of 5 push the median to the lowest honest
    row at their target and the highest elsewhere, and it picks their target."""
    from fedtops_strategy.selection import select_round

    honest = [[level * (1 + 0.01 * abs(j - 2)) for j in range(6)] for level in (0.065, 0.05, 0.033)]  # each row's minimum: a = 2
    target = 5
    colluding = [[0.0 if j == target else 744.0 for j in range(6)]] * 2
    got = select_round(PAPER_CANDIDATES, honest + colluding, [[0.0] * 6] * 5, [1.0] * 5, 0.05, all_scored=True, score_aggregate="median")
    assert got.multiplier == PAPER_CANDIDATES[target] == 10.0
    alone = select_round(PAPER_CANDIDATES, honest, [[0.0] * 6] * 3, [1.0] * 3, 0.05, all_scored=True, score_aggregate="median")
    assert alone.multiplier == 2.0


def test_a_cap_applies_the_best_feasible_candidate_below_it_or_holds():
    """K̂ in factor coordinates need not grow with a: here a = 1 is outside δ = 0.05 and 0.5, 2
    are inside. A client that did not score caps a at 1; the round applies 0.5, not the vetoed 1
    (the second colluder review: min(selected, 1) applied it), and holds when nothing at most 1
    is feasible."""
    from fedtops_strategy.selection import select_round

    k = [0.01, 0.08, 0.02, 0.09, 0.2, 0.5]
    j = [0.3, 0.2, 0.1, 0.2, 0.3, 0.4]  # the best is a = 2
    free = select_round(PAPER_CANDIDATES, [j], [k], [1.0], 0.05, all_scored=True)
    capped = select_round(PAPER_CANDIDATES, [j], [k], [1.0], 0.05, all_scored=False)
    assert (free.multiplier, capped.selected, capped.cap, capped.multiplier) == (2.0, 2.0, 1.0, 0.5)
    nothing = select_round(PAPER_CANDIDATES, [j], [[0.09, 0.08, 0.02, 0.09, 0.2, 0.5]], [1.0], 0.05, all_scored=False)
    assert (nothing.selected, nothing.multiplier) == (2.0, 0.0)


def test_a_robust_j_keeps_the_tolerance_of_the_planned_round_when_a_row_is_missing():
    """Planned for 5 rows, the median tolerates 2 colluders; with one honest row missing, 2 of 4
    would be half, so the round caps a at 1 (the second colluder review: it applied their a = 10).
    The trimmed mean planned for 5 (f = 1) still cuts 1 at each end of 4 rows and keeps the honest choice."""
    from fedtops_strategy.selection import select_round

    def chosen(rows, how):
        n = len(rows)
        return select_round(
            PAPER_CANDIDATES, rows, [[0.0] * 6] * n, [1.0] * n, 0.05, all_scored=True, score_aggregate=how, trim_fraction=0.2, planned=5
        )

    median = chosen([AGREEING_J] * 2 + [COLLUDING_J] * 2, "median")
    assert median.cap == 1.0 and median.multiplier == 1.0 and "fewer than the 5" in median.too_few_rows
    trimmed = chosen([AGREEING_J] * 3 + [COLLUDING_J], "trimmed-mean")
    assert trimmed.too_few_rows is None and trimmed.multiplier == 2.0


def test_fedtops_scores_with_the_tolerance_of_its_planned_round():
    """Five nodes planned, median Ĵ (f = 2); node 5 misses the train deadline (so every node in
    Δ_t scores: no unscored cap), and 2 of the 4 rows collude: a median of 4 rows would be theirs
    (a = 10); the planned tolerance caps a at 1."""
    updates = {n: HONEST[1] for n in range(1, 6)}
    honest, colluding = ([0.5, 0.4, 0.3, 0.35, 0.45, 0.6], [0.0] * 6), ([1.0] * 5 + [0.0], [0.0] * 6)
    scores = {1: honest, 2: honest, 3: colluding, 4: colluding, 5: honest}
    strategy = FedTOPS(score_aggregate="median", **_common(5))
    new = _run(strategy, FakeGrid(updates, dict.fromkeys(updates, 1), scores, lost={5: ("train", "silent")}))
    record = new.records[1]
    assert record["unscored-node-ids"] == []
    assert record["selected-multiplier"] == 10.0 and record["multiplier-cap"] == 1.0 and record["multiplier"] == 1.0
