"""The strategies driven by hand-made replies through a fake Grid (no models, no Ray), round by
round as the ServerApp's loop drives them: train, then score for a strategy that has that phase."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, Metadata, MetricRecord, RecordDict

from fedopd.config import StrategySettings
from fedtops_strategy import FedTOPS, FixedMultiplier, LoRAFedAvg, make_strategy
from fedtops_strategy.round import play_round


def message(content, message_type: str, *, src: int = 0, dst: int = 0, message_id: str = "m", reply_to: str = "") -> Message:
    """A message as the runtime hands it over (``content``: a RecordDict, or an Error for an error reply)."""
    meta = Metadata(
        run_id=1,
        message_id=message_id,
        src_node_id=src,
        dst_node_id=dst,
        reply_to_message_id=reply_to,
        group_id="",
        created_at=0.0,
        ttl=60.0,
        message_type=message_type,
    )
    return Message(content, metadata=meta)


pytestmark = pytest.mark.usefixtures("task_identity")


THETA = [np.full((2, 3), 0.5, np.float32), np.full((3,), -1.0, np.float32)]
KEYS = ["layer.lora_A.weight", "layer.lora_B.weight"]


def _record(arrays):
    return ArrayRecord({k: Array(np.asarray(a, dtype=np.float32)) for k, a in zip(KEYS, arrays)})


class FakeGrid:
    """Answers train messages with ``updates[node]`` and score queries with ``scores[node]``."""

    def __init__(self, updates, weights, scores=None, reverse=False, lost=None, connected=None, extra=None):
        self.updates, self.weights, self.scores = updates, weights, scores or {}
        # extra[(message type, node)]: more metrics in that node's reply (a norm bit, standard errors)
        self.extra = extra or {}
        self.sent, self.timeouts, self.reverse = [], [], reverse
        # lost[node] = (message type, "silent" | "superlink"): in that phase the node never
        # answers, or the SuperLink answers for it with a Node Unavailable error, as Flower does.
        self.lost = lost or {}
        self.connected = connected  # callable: the node ids connected now (default: all)

    def get_node_ids(self):
        return self.connected() if self.connected else list(self.updates)

    def send_and_receive(self, messages, *, timeout=None):
        self.timeouts.append((sorted({m.metadata.message_type for m in messages}), timeout))
        replies = []
        for msg in messages:
            self.sent.append(msg)
            msg.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"  # as a Grid does when it pushes
            node = msg.metadata.dst_node_id
            phase, how = self.lost.get(node, (None, None))
            if phase == msg.metadata.message_type:
                if how == "superlink":
                    error = Error(code=5, reason="Error: Node Unavailable")
                    replies.append(message(error, phase, src=1, dst=1, message_id=f"e{len(self.sent)}", reply_to=msg.metadata.message_id))
                continue
            if msg.metadata.message_type == "train":
                content = RecordDict(
                    {
                        "arrays": _record(self.updates[node]),
                        "metrics": MetricRecord(
                            {"num-examples": self.weights[node], "kl_before": 1.0, "kl_after": 0.5, **self.extra.get(("train", node), {})}
                        ),
                    }
                )
            elif node in self.scores:
                j, k = self.scores[node]
                extra = self.extra.get(("query.score", node), {})
                content = RecordDict({"scores": MetricRecord({"teacher-scores": j, "change-scores": k, "num-examples": self.weights[node], **extra})})
            else:
                continue  # this node does not answer
            replies.append(message(content, msg.metadata.message_type, src=node, message_id=f"r{len(self.sent)}", reply_to=msg.metadata.message_id))
        return replies[::-1] if self.reverse else replies


class Ran(list):
    """The final global arrays (a list of them, in KEYS' order) and each round's record."""

    records: dict


def _run(strategy, grid, rounds=1):
    """The rounds of ``server_app.app``'s loop (:func:`fedtops_strategy.round.play_round`): the
    final global arrays, with each round's record (:meth:`RoundResult.to_record`) as ``.records``."""
    arrays, records = _record(THETA), {}
    for server_round in range(1, rounds + 1):
        result = play_round(strategy, grid, server_round, arrays, ConfigRecord(), train_timeout=3600.0, score_timeout=600.0)
        records[server_round] = result.to_record()
        arrays = result.step.arrays()
    assert list(arrays.keys()) == KEYS  # so that comparisons over zip(...) cannot be vacuous
    ran = Ran(arrays.to_numpy_ndarrays())
    ran.records = records
    return ran


def _common(n):
    # As make_strategy builds them by default: wait for n nodes, then train every connected one.
    return dict(min_train_nodes=1, min_available_nodes=n)


# Updates chosen so that every value is exact in fp32: weights 1 and 3 give the mean 1.75.
UPDATES = {1: [np.full((2, 3), 1.0), np.full((3,), 0.0)], 2: [np.full((2, 3), 2.0), np.full((3,), 1.0)]}
WEIGHTS = {1: 1, 2: 3}
MEAN = [np.full((2, 3), 1.75, np.float32), np.full((3,), 0.75, np.float32)]
DELTA = [m - t for m, t in zip(MEAN, THETA)]  # 1.25 and 1.75


def test_fedtops_applies_theta_plus_selected_multiplier_times_weighted_delta():
    scores = {
        1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0, 0.01, 0.02, 0.03, 0.2, 0.3]),
        2: ([0.5, 0.4, 0.3, 0.25, 0.1, 0.0], [0.0, 0.01, 0.02, 0.04, 0.04, 0.3]),
    }
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    for n, t, d in zip(new, THETA, DELTA):
        assert np.array_equal(n, t + np.float32(3.0) * d)
    record = new.records[1]
    assert record["multiplier"] == 3.0 and record["fallback"] is False
    assert record["candidates"] == [0.5, 1.0, 2.0, 3.0, 5.0, 10.0]
    assert record["teacher_scores"] == pytest.approx([0.5, 0.4, 0.3, 0.2375, 0.1, 0.0])  # weights 1/4, 3/4
    assert record["change_scores"] == [scores[1][1], scores[2][1]]
    assert record["num-feasible"] == 4


def test_fedtops_driven_by_flowers_start_runs_its_score_phase():
    """Flower's contract: FedTOPS.start (Strategy.start's arguments and Result) moves by the
    selected a_t, not by FedAvg's a = 1."""
    scores = {
        1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0, 0.01, 0.02, 0.03, 0.2, 0.3]),
        2: ([0.5, 0.4, 0.3, 0.25, 0.1, 0.0], [0.0, 0.01, 0.02, 0.04, 0.04, 0.3]),
    }
    grid = FakeGrid(UPDATES, WEIGHTS, scores)
    result = FedTOPS(trust_budget=0.05, **_common(2)).start(grid, _record(THETA), num_rounds=1, timeout=60.0)
    assert list(result.arrays.keys()) == KEYS
    for n, t, d in zip(result.arrays.to_numpy_ndarrays(), THETA, DELTA):
        assert np.array_equal(n, t + np.float32(3.0) * d)
    assert result.train_metrics_clientapp[1]["multiplier"] == 3.0
    assert sorted(m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "query.score") == [1, 2]


def test_fedtops_start_and_the_apps_loop_give_the_same_rounds():
    # node 2 vetoes a >= 5 in round 1; three rounds, so θ moves from the first round's result
    scores = {1: ([0.3, 0.2, 0.1, 0.05, 0.01, 0.0], [0.0] * 6), 2: ([0.3, 0.2, 0.1, 0.05, 0.01, 0.0], [0.0, 0.0, 0.0, 0.0, 0.1, 0.1])}
    by_loop, by_start = FedTOPS(**_common(2)), FedTOPS(**_common(2))
    looped = _run(by_loop, FakeGrid(UPDATES, WEIGHTS, scores), rounds=3)
    seen = []
    result = by_start.start(FakeGrid(UPDATES, WEIGHTS, scores), _record(THETA), num_rounds=3, timeout=60.0, on_round=seen.append)
    started = result.arrays.to_numpy_ndarrays()
    assert all(np.array_equal(a, b) for a, b in zip(looped, started))
    by_start_records = {r.server_round: r.to_record() for r in seen}
    assert [by_start_records[t]["multiplier"] for t in (1, 2, 3)] == [looped.records[t]["multiplier"] for t in (1, 2, 3)] == [3.0] * 3
    assert all(by_start_records[t].keys() == looped.records[t].keys() for t in (1, 2, 3))


def test_fedtops_step_is_a_value_of_the_score_rows_and_the_settings():
    """FedTOPS.select: the selection and the record's fields from the rows alone; nothing is kept."""
    rows = [
        (1, [0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0, 0.01, 0.02, 0.03, 0.2, 0.3]),  # vetoes a = 5, 10 at δ = 0.05
        (2, [0.5, 0.4, 0.3, 0.25, 0.1, 0.0], [0.0, 0.01, 0.02, 0.04, 0.04, 0.3]),  # vetoes a = 10
    ]
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    selection, fields = strategy.select(rows, {1: 1.0, 2: 3.0}, [], all_scored=True)
    assert selection.multiplier == 3.0 and fields["num-feasible"] == 4 and fields["veto-counts"] == [2, 1]
    assert fields["teacher_scores"] == pytest.approx([0.5, 0.4, 0.3, 0.2375, 0.1, 0.0])  # weights 1/4, 3/4
    assert "hold-reason" not in fields and vars(strategy).keys() == vars(FedTOPS(trust_budget=0.05, **_common(2))).keys()
    # δ = 0.005: node 1's K̂ (0.01 at every a) vetoes every candidate, so the round holds naming it
    vetoing = [(1, rows[0][1], [0.01] * 6), (2, rows[1][1], [0.0] * 6)]
    selection, fields = FedTOPS(trust_budget=0.005, **_common(2)).select(vetoing, {1: 1.0, 2: 3.0}, [], all_scored=True)
    assert selection.multiplier == 0.0 and fields["hold-node-ids"] == [1] and fields["veto-counts"] == [6, 0]
    assert fields["hold-reason"] == "no feasible candidate (δ = 0.005, 0 veto(es) allowed); K̂ at a = 1 exceeded δ at node(s) 1"


def test_fedtops_sends_the_increment_and_candidates_only_to_clients_that_trained():
    scores = {n: ([0.1] * 6, [0.0] * 6) for n in (1, 2)}
    grid = FakeGrid(UPDATES, WEIGHTS, scores)
    _run(FedTOPS(**_common(2)), grid)
    queries = [m for m in grid.sent if m.metadata.message_type == "query.score"]
    assert sorted(m.metadata.dst_node_id for m in queries) == [1, 2]
    sent_delta = {k: v.numpy() for k, v in queries[0].content["increment"].items()}
    assert list(sent_delta) == KEYS
    assert all(np.array_equal(sent_delta[k], d) for k, d in zip(KEYS, DELTA))
    assert int(queries[0].content["config"]["server-round"]) == 1
    assert list(queries[0].content["config"]["candidates"]) == [0.5, 1.0, 2.0, 3.0, 5.0, 10.0]


def test_fedtops_falls_back_to_a_equal_one_when_no_client_scored():
    strategy = FedTOPS(**_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores={}))
    record = new.records[1]
    assert record["fallback"] is True and record["multiplier"] == 1.0
    assert record["teacher_scores"] is None
    assert record["unscored-node-ids"] == [1, 2] and record["multiplier-cap"] is None  # a fallback, not a cap
    assert all(np.array_equal(n, t + d) for n, t, d in zip(new, THETA, DELTA))


# Node 1 alone would allow a = 10 (its Ĵ falls to 0 and K̂ stays 0): the uncapped choice is 10.
OPEN = ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0] * 6)


@pytest.mark.parametrize("how", ["error", "silent", "malformed"])
def test_a_client_that_trained_without_valid_scores_caps_the_multiplier_at_one(how):
    scores = {1: OPEN, 2: ([0.5] * 6, [0.0] * 5) if how == "malformed" else OPEN}
    lost = {2: ("query.score", "superlink" if how == "error" else "silent")} if how != "malformed" else {}
    strategy = FedTOPS(**_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores, lost=lost))
    assert all(np.array_equal(n, t + d) for n, t, d in zip(new, THETA, DELTA))  # θ + 1·Δ, both updates in Δ
    record = new.records[1]
    assert record["scored-node-ids"] == [1] and record["unscored-node-ids"] == [2]
    assert record["selected-multiplier"] == 10.0 and record["multiplier-cap"] == 1.0 and record["multiplier"] == 1.0
    assert record["fallback"] is False


def test_when_every_client_that_trained_scored_nothing_is_capped():
    scores = {1: OPEN, 2: OPEN}
    strategy = FedTOPS(**_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    assert all(np.array_equal(n, t + np.float32(10.0) * d) for n, t, d in zip(new, THETA, DELTA))
    record = new.records[1]
    assert record["unscored-node-ids"] == [] and record["multiplier-cap"] is None
    assert record["selected-multiplier"] == record["multiplier"] == 10.0


@pytest.mark.parametrize("change, selected", [([1.0] * 6, 0.0), ([0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.5)])
def test_the_cap_leaves_a_hold_and_a_half_step_as_they_are(change, selected):
    scores = {1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], change)}  # node 2 trained but never scores
    strategy = FedTOPS(**_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    record = new.records[1]
    assert record["multiplier-cap"] == 1.0 and record["selected-multiplier"] == record["multiplier"] == selected
    assert all(np.array_equal(n, t + np.float32(selected) * d) for n, t, d in zip(new, THETA, DELTA))


def test_fedtops_holds_when_no_candidate_is_feasible():
    scores = {n: ([0.1] * 6, [1.0] * 6) for n in (1, 2)}
    strategy = FedTOPS(**_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    assert new.records[1]["multiplier"] == 0.0
    assert all(np.array_equal(n, t) for n, t in zip(new, THETA))


def test_teacher_score_is_the_num_examples_weighted_mean_over_clients():
    # Client weights 1 and 3. Unweighted, candidate 2 would win (0.30 vs 0.325 for a = 3);
    # weighted, a = 3 wins (0.2875 vs 0.3).
    scores = {
        1: ([0.5, 0.5, 0.3, 0.4, 0.9, 0.9], [0.0] * 6),
        2: ([0.5, 0.5, 0.3, 0.25, 0.9, 0.9], [0.0] * 6),
    }
    weights = {1: 1, 2: 3}
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    ran = _run(strategy, FakeGrid(UPDATES, weights, scores))
    record = ran.records[1]
    assert record["teacher_scores"] == pytest.approx([0.5, 0.5, 0.3, 0.2875, 0.9, 0.9], abs=1e-12)
    assert record["multiplier"] == 3.0


def test_a_score_a_rounding_error_below_zero_is_clamped_and_the_client_kept():
    scores = {
        1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [-1e-9, 0.01, 0.02, 0.03, 0.2, 0.3]),
        2: ([0.5, 0.4, 0.3, 0.2, 0.1, -3e-9], [-2e-9, 0.01, 0.02, 0.03, 0.04, 0.3]),
    }
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    record = ran.records[1]
    assert record["excluded"] == [] and record["scored-node-ids"] == [1, 2]
    assert record["change_scores"][0][0] == 0.0 and record["change_scores"][1][0] == 0.0
    assert record["client_teacher_scores"][1][5] == 0.0
    assert record["multiplier"] == 3.0 and not record["fallback"]  # client 1's constraint still binds at 5


def test_a_clearly_negative_score_invalidates_that_reply():
    scores = {
        1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [0.0, 0.01, 0.02, 0.03, 0.04, 0.3]),
        2: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [0.0, 0.01, 0.02, 0.03, -1e-3, 0.01]),
    }
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    record = ran.records[1]
    assert record["scored-node-ids"] == [1]
    assert [e["node-id"] for e in record["excluded"]] == [2] and "negative beyond rounding" in record["excluded"][0]["reason"]
    assert record["selected-multiplier"] == 5.0  # selected over client 1 alone
    assert record["multiplier"] == 1.0  # and capped: client 2's update is in Δ, its constraint unknown


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("which", [0, 1])  # Ĵ_2(5) or K̂_2(5)
def test_a_non_finite_score_makes_that_candidate_infeasible_for_that_client_which_still_counts_as_scored(bad, which):
    # Client 1 vetoes a = 10 (K̂ 0.3 > δ); client 2's non-finite value at a = 5 vetoes a = 5. Of the
    # feasible 0.5, 1, 2, 3 the common Ĵ is lowest at 3 (0.2), and no cap: both scored.
    j2, k2 = [0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [0.0, 0.01, 0.02, 0.03, 0.04, 0.01]
    (j2 if which == 0 else k2)[4] = bad
    scores = {1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [0.0, 0.01, 0.02, 0.03, 0.04, 0.3]), 2: (j2, k2)}
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    record = ran.records[1]
    assert record["scored-node-ids"] == [1, 2] and record["unscored-node-ids"] == [] and record["excluded"] == []
    assert record["num-feasible"] == 4 and record["veto-counts"] == [1, 1]
    assert record["selected-multiplier"] == record["multiplier"] == 3.0
    assert record["change_scores"][1][4] is None and record["client_teacher_scores"][1][4] is None  # JSON has no inf
    assert record["teacher_scores"][4] is None  # the weighted Ĵ(5) is inf: it can never win


def test_fixed_multiplier_three_applies_exactly_three_delta():
    strategy = FixedMultiplier(3.0, **_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    assert all(np.array_equal(n, t + np.float32(3.0) * d) for n, t, d in zip(new, THETA, DELTA))
    assert new.records[1]["multiplier"] == 3.0


def test_fedavg_applies_the_weighted_mean():
    strategy = LoRAFedAvg(**_common(2))
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    assert all(np.array_equal(n, m) for n, m in zip(new, MEAN))
    assert new.records[1]["multiplier"] == 1.0


@pytest.mark.parametrize(
    "bad, reason",
    [
        ([np.full((2, 3), np.nan), np.zeros(3)], "holds values that are not finite"),
        ([np.full((2, 3), np.inf), np.zeros(3)], "holds values that are not finite"),
        ([np.zeros((3, 2)), np.zeros(3)], "has shape (3, 2): the global adapter's is (2, 3)"),
    ],
)
def test_a_bad_update_is_left_out_of_the_average_and_recorded(bad, reason):
    updates = {**UPDATES, 3: bad}
    weights = {**WEIGHTS, 3: 100}
    strategy = LoRAFedAvg(**_common(3))
    new = _run(strategy, FakeGrid(updates, weights))
    assert all(np.array_equal(n, m) for n, m in zip(new, MEAN))  # node 3 never reaches the adapter
    excluded = new.records[1]["excluded"]
    assert [e["node-id"] for e in excluded] == [3] and reason in excluded[0]["reason"]


def test_clients_lost_in_train_are_recorded_under_their_own_node_and_the_rest_are_averaged():
    updates = {**UPDATES, 3: [np.full((2, 3), 9.0), np.zeros(3)], 4: [np.full((2, 3), 9.0), np.zeros(3)]}
    weights = {**WEIGHTS, 3: 100, 4: 100}
    strategy = LoRAFedAvg(**_common(4))
    lost = {3: ("train", "silent"), 4: ("train", "superlink")}
    new = _run(strategy, FakeGrid(updates, weights, lost=lost))
    assert all(np.array_equal(n, m) for n, m in zip(new, MEAN))  # nodes 1 and 2 only
    assert new.records[1]["excluded"] == [
        {"node-id": 3, "reason": "train: no reply before the timeout"},
        {"node-id": 4, "reason": "error reply: Error: Node Unavailable"},  # the SuperLink's reply, not node 1's
    ]


@pytest.mark.parametrize(
    "how, reason", [("silent", "score: no reply before the timeout"), ("superlink", "score: error reply: Error: Node Unavailable")]
)
def test_a_client_lost_in_the_score_query_is_recorded_and_fedtops_selects_over_the_others(how, reason):
    # Node 1 alone allows a = 5 (its Ĵ falls to 0.1 and K̂ stays within δ up to a = 5).
    scores = {
        1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0, 0.0, 0.01, 0.02, 0.03, 0.3]),
        2: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0, 0.9, 0.9, 0.9, 0.9, 0.9]),
    }
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores, lost={2: ("query.score", how)}))
    record = ran.records[1]
    assert record["excluded"] == [{"node-id": 2, "reason": reason}]
    assert record["scored-node-ids"] == [1] and record["selected-multiplier"] == 5.0 and record["multiplier"] == 1.0


def test_after_round_one_a_round_trains_the_clients_still_connected():
    calls = {"n": 0}

    def connected():
        calls["n"] += 1
        if calls["n"] > 10:
            raise RuntimeError("the strategy kept waiting for a lost node")
        return [1, 2] if not any(m.metadata.message_type == "train" for m in grid.sent) else [1]  # node 2 is gone after round 1

    strategy = LoRAFedAvg(**_common(2))
    grid = FakeGrid(UPDATES, WEIGHTS, connected=connected)
    ran = _run(strategy, grid, rounds=2)
    assert [c["node-id"] for c in ran.records[1]["clients"]] == [1, 2]
    assert [c["node-id"] for c in ran.records[2]["clients"]] == [1]


def test_factory_builds_each_strategy_from_the_config():
    assert isinstance(make_strategy(StrategySettings(name="fedavg"), num_clients=3), LoRAFedAvg)
    fixed = make_strategy(StrategySettings(name="fixed", multiplier=3.0), num_clients=3)
    assert isinstance(fixed, FixedMultiplier) and fixed.default_multiplier == 3.0
    fedtops = make_strategy(StrategySettings(name="fedtops", trust_budget=0.02, candidates=(1.0, 2.0)), num_clients=3)
    assert isinstance(fedtops, FedTOPS) and fedtops.trust_budget == 0.02 and fedtops.candidates == (1.0, 2.0)


def test_fedtops_aggregate_train_sends_nothing_and_returns_the_weighted_increment():
    grid = FakeGrid(UPDATES, WEIGHTS, {n: ([0.1] * 6, [0.0] * 6) for n in (1, 2)})
    strategy = FedTOPS(**_common(2))
    sent = strategy.configure_train(1, _record(THETA), ConfigRecord(), grid)
    train = strategy.aggregate_train(sent, grid.send_and_receive(sent.messages))
    assert [m.metadata.message_type for m in grid.sent] == ["train", "train"]  # no score query from in there
    assert all(np.array_equal(m, e) for m, e in zip(train.mean.values(), MEAN))  # FedAvg's θ_t + Δ_t
    assert all(np.array_equal(d, e) for d, e in zip(train.delta.values(), DELTA))
    assert train.weights == {1: 1.0, 2: 3.0} and [r.node_id for r in train.kept] == [1, 2]


@pytest.mark.parametrize(
    "strategy, learner, cache",
    [
        ("fedtops", "federated", True),
        ("fedavg", "federated", False),
        ("fixed", "federated", False),
        ("local", "local", False),
        ("centralized", "centralized", False),
    ],
)
def test_the_train_message_says_what_the_client_learns_from_and_whether_it_builds_a_scoring_cache(strategy, learner, cache):
    settings = StrategySettings(name=strategy, multiplier=3.0)
    grid = FakeGrid(UPDATES, WEIGHTS)
    [first, *_] = make_strategy(settings, num_clients=2).configure_train(1, _record(THETA), ConfigRecord(), grid).messages
    config = first.content["config"]
    assert (config["learner"], config["build-scoring-cache"]) == (learner, cache)


def test_score_replies_are_recorded_in_node_order_whatever_order_they_arrive_in():
    scores = {1: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0] * 6), 2: ([0.6, 0.4, 0.3, 0.2, 0.1, 0.0], [0.01] * 6)}
    strategy = FedTOPS(**_common(2))
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores, reverse=True))
    record = ran.records[1]
    assert record["scored-node-ids"] == [1, 2]
    assert record["client_teacher_scores"] == [scores[1][0], scores[2][0]]
    assert record["change_scores"] == [scores[1][1], scores[2][1]]


@pytest.mark.parametrize(
    "reply, reason",
    [
        (([0.5] * 6, [0.0] * 5), "expected 6 teacher and change scores"),
        (([0.5] * 5, [0.0] * 6), "expected 6 teacher and change scores"),
        ((0.5, [0.0] * 6), "expected 6 teacher and change scores"),
    ],
)
def test_a_malformed_score_reply_is_left_out_even_when_it_arrives_first(reply, reason):
    scores = {1: reply, 2: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.05], [0.0, 0.01, 0.02, 0.03, 0.04, 0.3])}
    strategy = FedTOPS(trust_budget=0.05, **_common(2))
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores))
    record = ran.records[1]
    assert record["scored-node-ids"] == [2]
    assert [e["node-id"] for e in record["excluded"]] == [1] and reason in record["excluded"][0]["reason"]
    assert record["selected-multiplier"] == 5.0 and record["multiplier"] == 1.0


@pytest.mark.parametrize("weight", [0, -1, float("inf"), float("nan")])
def test_a_score_reply_without_a_positive_finite_weight_is_left_out(weight):
    from fedtops_strategy.fedtops import parse_score_reply

    content = RecordDict({"scores": MetricRecord({"teacher-scores": [0.1] * 2, "change-scores": [0.0] * 2, "num-examples": weight})})
    problem, parsed = parse_score_reply(message(content, "query.score", src=3, message_id="x"), 2)
    assert parsed is None and "'num-examples'" in problem


def test_fedtops_refuses_a_negative_or_nan_trust_budget_and_accepts_zero_and_inf():
    for bad in (-0.01, float("nan"), float("-inf")):
        with pytest.raises(ValueError, match="trust_budget must be a number >= 0 or inf"):
            FedTOPS(trust_budget=bad, **_common(2))
    assert FedTOPS(trust_budget=0.0, **_common(2)).trust_budget == 0.0
    assert FedTOPS(trust_budget=float("inf"), **_common(2)).trust_budget == float("inf")
    with pytest.raises(ValueError, match="at least one candidate"):
        FedTOPS(candidates=(), **_common(2))


def test_fedtops_passes_its_tolerances_to_the_selection_rule():
    scores = {n: ([0.5, 0.4, 0.3, 0.2, 0.1, 0.0], [0.0, 0.0, 0.05 + 5e-9, 0.06, 0.06, 0.06]) for n in (1, 2)}
    strict = FedTOPS(trust_budget=0.05, feasibility_tol=0.0, **_common(2))
    strict = _run(strict, FakeGrid(UPDATES, WEIGHTS, scores))
    assert strict.records[1]["multiplier"] == 1.0 and strict.records[1]["num-feasible"] == 2
    default = FedTOPS(trust_budget=0.05, **_common(2))
    default = _run(default, FakeGrid(UPDATES, WEIGHTS, scores))
    assert default.records[1]["multiplier"] == 2.0 and default.records[1]["num-feasible"] == 3
    ties = {n: ([0.5, 0.4, 0.4 - 1e-10, 0.9, 0.9, 0.9], [0.0] * 6) for n in (1, 2)}
    loose = FedTOPS(trust_budget=0.05, score_tol=0.0, **_common(2))
    loose = _run(loose, FakeGrid(UPDATES, WEIGHTS, ties))
    assert loose.records[1]["multiplier"] == 2.0


def test_a_round_is_its_values_a_fresh_strategy_steps_the_same_from_them():
    """Nothing of a round is left on the strategy: FedTOPS's step from round 2's aggregate and
    score rows is the same on a strategy that never ran a round, and each phase's value says what
    the next one takes (Δ_t = mean − θ_t, the weights of the train replies)."""
    scores = {1: ([0.3, 0.2, 0.1, 0.05, 0.01, 0.0], [0.0] * 6), 2: ([0.3, 0.2, 0.1, 0.05, 0.01, 0.0], [0.0, 0.0, 0.0, 0.0, 0.1, 0.1])}
    grid, strategy = FakeGrid(UPDATES, WEIGHTS, scores), FedTOPS(**_common(2))
    first = play_round(strategy, grid, 1, _record(THETA), ConfigRecord(), train_timeout=None, score_timeout=None)
    second = play_round(strategy, grid, 2, first.step.arrays(), ConfigRecord(), train_timeout=None, score_timeout=None)
    train, rows = second.train, second.scores
    assert train.weights == {1: 1.0, 2: 3.0} and [r for r, _, _ in rows.rows] == [1, 2]
    assert all(np.array_equal(train.delta[k], train.mean[k] - train.theta[k]) for k in KEYS)
    fresh = FedTOPS(**_common(2)).step(train, rows)
    assert fresh.multiplier == second.step.multiplier == 3.0 and fresh.details == second.step.details
    assert all(np.array_equal(fresh.theta[k], second.step.theta[k]) for k in KEYS)


@pytest.mark.parametrize("name", ["fedavg", "fixed", "fedtops", "fedtops-se", "fedtops-heldout-cache", "local", "centralized"])
def test_no_strategy_is_a_flower_strategy_that_flower_could_run_as_fedavg(name):
    """Flower's contract: a strategy here is not a Flower Strategy (whose start would run FedAvg's
    aggregation); its own start takes Strategy.start's arguments and runs its rounds."""
    from flwr.serverapp.strategy import Strategy

    strategy = make_strategy(StrategySettings(name=name, multiplier=3.0), num_clients=2)
    assert not isinstance(strategy, Strategy)
    result = strategy.start(FakeGrid(UPDATES, WEIGHTS, {n: ([0.1] * 6, [0.0] * 6) for n in (1, 2)}), _record(THETA), num_rounds=1, timeout=60.0)
    assert 1 in result.train_metrics_clientapp


def test_centralized_takes_its_one_learners_adapter_as_the_global_one():
    strategy = make_strategy(StrategySettings(name="centralized"), num_clients=2)
    grid = FakeGrid(UPDATES, WEIGHTS)
    new = _run(strategy, grid)
    # one train message, to node 1 (the smallest sampled id); its adapter is θ_1 as sent (a = 1)
    assert [m.metadata.dst_node_id for m in grid.sent] == [1]
    assert all(np.array_equal(n, np.asarray(u, np.float32)) for n, u in zip(new, UPDATES[1]))
    assert new.records[1]["multiplier"] == 1.0 and new.records[1]["trained-node-ids"] == [1]
    assert new.records[1]["sampled-node-ids"] == [1, 2]


def test_the_score_query_is_timed_in_the_record_of_a_strategy_that_has_one():
    scores = {n: ([0.1] * 6, [0.0] * 6) for n in (1, 2)}
    fedtops = _run(FedTOPS(**_common(2)), FakeGrid(UPDATES, WEIGHTS, scores)).records[1]
    assert isinstance(fedtops["score_seconds"], float) and 0.0 <= fedtops["score_seconds"] < 60.0
    assert "score_seconds" not in _run(LoRAFedAvg(**_common(2)), FakeGrid(UPDATES, WEIGHTS)).records[1]


def test_start_runs_one_federation_per_strategy_and_sends_no_unchecked_evaluation():
    """Flower's start: no federated evaluation round (its replies would go unchecked to Flower's
    aggregate), the sampling settings as built after the run, and a second start on the same
    instance refused (silence, the sampler's first round and Local's adapters are the run's)."""
    strategy, grid = LoRAFedAvg(**_common(2)), FakeGrid(UPDATES, WEIGHTS)
    seen = []
    strategy.start(grid, _record(THETA), num_rounds=2, timeout=60.0, evaluate_fn=lambda t, arrays: seen.append(t))
    assert {m.metadata.message_type for m in grid.sent} == {"train"} and seen == [0, 1, 2]
    assert (strategy.flower.min_available_nodes, strategy.flower.min_train_nodes) == (2, 1)
    with pytest.raises(RuntimeError, match="already ran a federation"):
        strategy.start(grid, _record(THETA), num_rounds=1)
