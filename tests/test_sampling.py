"""Client sampling: which nodes a round trains, scores and evaluates, and how their updates and
scores are weighted when only some clients take part.

The strategies are driven by hand-made replies through the fake Grid of ``test_strategies``
(no models, no Ray). Expected weighted means are computed here in float64 from the formulas
Δ_t = Σ_i w_i θ_{t,i}^+ / Σ_i w_i − θ_t and Ĵ(a) = Σ_i w_i Ĵ_i(a) / Σ_i w_i over the clients of
the round (w_i: their ``num-examples``), never by the code under test.
"""

import random

import numpy as np
import pytest
from client_messages import fake_models
from flwr.app import ConfigRecord

from fedopd.config import StrategySettings
from fedtops_strategy import make_strategy
from fedtops_strategy.references import POOLED_CLIENTS
from server_app.evaluation import evaluation_nodes
from tests.precision import sum_error
from tests.test_strategies import THETA, FakeGrid, _record, _run

pytestmark = pytest.mark.usefixtures("task_identity")

NODES = list(range(1, 13))  # twelve connected clients


def _updates(nodes):
    """Client n returns the constant adapter n (both arrays): Δ's entries are weighted means of n."""
    return {n: [np.full((2, 3), float(n)), np.full((3,), float(n))] for n in nodes}


def _train_targets(strategy, nodes, server_round=1, weights=None):
    grid = FakeGrid(_updates(nodes), weights or {n: 1 for n in nodes})
    messages = strategy.configure_train(server_round, _record(THETA), ConfigRecord(), grid).messages
    return sorted(m.metadata.dst_node_id for m in messages)


def test_a_round_trains_the_fraction_of_connected_nodes_that_flower_samples():
    strategy = make_strategy(StrategySettings(name="fedavg", fraction_train=0.25), num_clients=12, seed=0)
    targets = _train_targets(strategy, NODES)
    assert len(targets) == 3  # int(0.25 * 12)
    assert set(targets) <= set(NODES) and len(set(targets)) == 3


def test_min_train_clients_raises_a_sample_smaller_than_it():
    strategy = make_strategy(StrategySettings(name="fedavg", fraction_train=0.1, min_train_clients=4), num_clients=12, seed=0)
    assert len(_train_targets(strategy, NODES)) == 4  # max(int(0.1 * 12) = 1, 4)


def test_the_draw_depends_only_on_the_seed_and_the_round_and_leaves_global_random_alone():
    def draws(seed):
        strategy = make_strategy(StrategySettings(name="fedavg", fraction_train=0.25), num_clients=12, seed=seed)
        return [_train_targets(strategy, NODES, r) for r in range(1, 6)]

    random.seed(123)
    before = random.random()
    random.seed(123)
    first = draws(0)
    assert random.random() == before  # the strategy's sampling did not consume the global stream
    assert draws(0) == first  # same seed, same rounds: the same clients
    assert len({tuple(t) for t in first}) > 1  # rounds sample different clients
    assert draws(1) != first  # another seed, another draw


def test_the_draw_does_not_depend_on_the_order_in_which_the_grid_lists_nodes():
    strategy = make_strategy(StrategySettings(name="fedavg", fraction_train=0.25), num_clients=12, seed=0)
    forward = _train_targets(strategy, NODES)
    strategy = make_strategy(StrategySettings(name="fedavg", fraction_train=0.25), num_clients=12, seed=0)
    grid = FakeGrid(_updates(NODES), {n: 1 for n in NODES}, connected=lambda: NODES[::-1])
    backward = sorted(m.metadata.dst_node_id for m in strategy.configure_train(1, _record(THETA), ConfigRecord(), grid).messages)
    assert backward == forward


# Unequal client sizes, as a Dirichlet partition makes them (weights 5, 40, 12, ...).
WEIGHTS = {n: w for n, w in zip(NODES, [5, 40, 12, 7, 30, 3, 21, 9, 16, 2, 25, 11])}


def _scores(n):
    """Client n's Ĵ_n(a) = (n, 2n) and K̂_n(a) = (0, 0) for the candidates (1, 2): both feasible."""
    return [float(n), 2.0 * float(n)], [0.0, 0.0]


def test_fedtops_scores_only_the_sampled_clients_and_weighs_delta_and_j_by_their_num_examples():
    strategy = make_strategy(StrategySettings(name="fedtops", fraction_train=0.25, candidates=(1.0, 2.0)), num_clients=12, seed=3)
    grid = FakeGrid(_updates(NODES), WEIGHTS, {n: _scores(n) for n in NODES})
    new = _run(strategy, grid)
    record = new.records[1]
    sampled = record["sampled-node-ids"]
    assert len(sampled) == 3 and record["trained-node-ids"] == sampled
    queries = [m for m in grid.sent if m.metadata.message_type == "query.score"]
    assert sorted(m.metadata.dst_node_id for m in queries) == sampled  # nobody else is asked
    assert sorted(record["scored-node-ids"]) == sampled

    w = np.array([WEIGHTS[n] for n in sampled], dtype=np.float64)
    x = np.array(sampled, dtype=np.float64)
    mean_update = float((w * x).sum() / w.sum())
    expected_j = [float((w * x).sum() / w.sum()), float((w * 2 * x).sum() / w.sum())]
    assert record["teacher_scores"] == pytest.approx(expected_j, rel=1e-12)  # float64 scalars on the server
    # Ĵ falls nowhere (it rises with a), so a = 1 wins: θ_{t+1} = θ_t + Δ_t = the weighted mean.
    assert record["multiplier"] == 1.0
    # fp32 on the way: 3 weight normalisations, 3 products, 2 sums, − θ, × a, + θ, the cast:
    # 12 roundings, each relative to a magnitude <= the largest update (<= 12)
    atol = sum_error(12) * max(sampled)
    for got, theta in zip(new, THETA):
        np.testing.assert_allclose(got, np.full(theta.shape, mean_update), rtol=0, atol=atol)


def test_unequal_sizes_move_the_average_away_from_the_plain_mean():
    """A hand case: nodes 2 and 5 sampled with num-examples 40 and 30 (of 70): the average of
    the constant updates 2 and 5 is (40·2 + 30·5) / 70 = 230/70, not their plain mean 3.5."""
    strategy = make_strategy(StrategySettings(name="fedavg"), num_clients=2, seed=0)
    grid = FakeGrid(_updates([2, 5]), {2: 40, 5: 30})
    new = _run(strategy, grid)
    for got in new:  # 2 normalisations, 2 products, 1 sum, − θ, + θ, the cast; magnitudes <= 5
        np.testing.assert_allclose(got, 230.0 / 70.0, rtol=0, atol=sum_error(8) * 5)


def test_centralized_trains_one_learner_with_the_rollouts_of_the_sampled_clients():
    strategy = make_strategy(StrategySettings(name="centralized", fraction_train=0.25), num_clients=12, seed=0)
    grid = FakeGrid(_updates(NODES), {n: 1 for n in NODES})
    train_round = strategy.configure_train(1, _record(THETA), ConfigRecord(), grid)
    [message], sampled = train_round.messages, train_round.sampled
    assert len(sampled) == 3
    assert message.metadata.dst_node_id == min(sampled)
    assert int(message.content["config"][POOLED_CLIENTS]) == 3


def test_the_centralized_learner_takes_pooled_clients_times_the_rollouts_per_round(monkeypatch):
    """BASE-like config: 8 rollouts per round, mini-batch 4, 4 rounds. Two pooled clients give
    16 rollouts per round, ceil(16 / 4) = 4 steps a round and 16 over the run."""
    from types import SimpleNamespace

    from flwr.app import Array, ArrayRecord, RecordDict

    import client_app.handlers as handlers
    from fedopd.config import parse_run_config

    seen = {}

    def fake_train_round(models, theta, prompts, plan, **kwargs):
        seen.update(per_round=plan.rollout.per_round, total_steps=plan.total_steps, step_offset=plan.step_offset)
        return SimpleNamespace(arrays=dict(theta), cache=None, metrics={}, optimizer_state={})

    monkeypatch.setattr(handlers.worker, "setup", lambda cfg, pid, num, pooled=False, node=None: (fake_models(), ["prompt"] * 4))
    monkeypatch.setattr(handlers, "train_round", fake_train_round)
    cfg = parse_run_config(
        {
            "rollout.per-round": 8,
            "train.mini-batch": 4,
            "train.micro-batch": 4,
            "num-server-rounds": 4,
            "train.optimizer-state": "reset",
            "cache.rollouts": 4,
        }
    )
    config = ConfigRecord({"server-round": 2, "learner": "centralized", "build-scoring-cache": False, POOLED_CLIENTS: 2})
    content = RecordDict({"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": config})
    handlers.train(content, RecordDict(), 0, 12, cfg)
    assert seen == {"per_round": 16, "total_steps": 16, "step_offset": 4}


def test_a_round_plan_from_the_run_config_places_the_learner_in_its_schedule():
    """A client's round 3 of 4 with 8 rollouts and mini-batch 4: 2 steps a round, 4 before it and 8
    over the run; a learner on 2 pooled partitions doubles the rollouts and the steps."""
    import dataclasses

    from fedopd.config import parse_run_config
    from fedopd.engine.round import RoundPlan

    cfg = parse_run_config({"rollout.per-round": 8, "train.mini-batch": 4, "train.micro-batch": 4, "num-server-rounds": 4, "model.teacher-batch": 2})
    plan = RoundPlan.from_config(cfg, 3, seed=7)
    assert (plan.server_round, plan.seed, plan.rollout, plan.step_offset, plan.total_steps) == (3, 7, cfg.rollout, 4, 8)
    assert (plan.cache, plan.train, plan.teacher_batch, plan.build_cache, plan.cache_source) == (cfg.cache, cfg.train, 2, True, "round")
    pooled = RoundPlan.from_config(cfg, 3, seed=7, partitions=2, build_cache=False)
    assert (pooled.rollout.per_round, pooled.step_offset, pooled.total_steps, pooled.build_cache) == (16, 8, 16, False)
    assert pooled.rollout == dataclasses.replace(cfg.rollout, per_round=16)
    with pytest.raises(ValueError, match="cache_source = 'future'; allowed: 'round', 'untrained'"):
        dataclasses.replace(plan, cache_source="future")


def test_evaluation_samples_a_fraction_of_the_nodes_and_all_of_them_by_default():
    assert evaluation_nodes(NODES[::-1], 1.0, seed=0, server_round=4) == NODES
    drawn = evaluation_nodes(NODES, 0.25, seed=0, server_round=4)
    assert len(drawn) == 3 and drawn == sorted(set(drawn)) and set(drawn) <= set(NODES)  # int(0.25 * 12)
    assert evaluation_nodes(NODES[::-1], 0.25, seed=0, server_round=4) == drawn  # the grid's order does not matter
    assert evaluation_nodes(NODES, 0.01, seed=0, server_round=4) != []  # at least one node
    assert len({tuple(evaluation_nodes(NODES, 0.25, seed=0, server_round=r)) for r in range(8)}) > 1


def test_local_clients_train_only_when_sampled_and_keep_their_own_adapter_between():
    """Round 1 trains some clients, round 2 others: a client's round-2 message carries its own
    round-1 adapter if it trained then, else the shared initial one."""
    strategy = make_strategy(StrategySettings(name="local", fraction_train=0.5), num_clients=4, seed=0)
    nodes = [1, 2, 3, 4]
    grid = FakeGrid(_updates(nodes), {n: 1 for n in nodes})
    rounds = []
    for server_round in (1, 2, 3):
        train_round = strategy.configure_train(server_round, _record(THETA), ConfigRecord(), grid)
        sent = {m.metadata.dst_node_id: m.content["arrays"].to_numpy_ndarrays()[0] for m in train_round.messages}
        strategy.step(strategy.aggregate_train(train_round, grid.send_and_receive(train_round.messages)), None)
        rounds.append(sent)
    trained_before: set[int] = set()
    for sent in rounds:
        assert len(sent) == 2  # int(0.5 * 4)
        for node, first_array in sent.items():
            expected = float(node) if node in trained_before else THETA[0][0, 0]
            assert np.all(first_array == expected)
        trained_before |= set(sent)
    assert len(trained_before) > 2  # the rounds sampled different clients, so both cases occurred


def test_unequal_dirichlet_client_sizes_are_the_weights_of_delta_and_j():
    """Four sandbox clients of a Dirichlet(0.3) partition hold different numbers of prompts (their
    ``num-examples``). Client n returns the constant update n and Ĵ_n = (n, 2n): Δ_t and Ĵ are
    the size-weighted means Σ s_n n / Σ s_n, computed here in float64."""
    from fedopd.config import DataSettings
    from fedopd.data import partitions

    data = DataSettings(partitioner="dirichlet", dirichlet_alpha=0.3, prompts_per_client=16)
    sizes = [len(p) for p in partitions(data, 4)]
    assert sum(sizes) == 64 and len(set(sizes)) > 1  # 16 x 4 prompts, split unequally
    nodes = [1, 2, 3, 4]
    weights = dict(zip(nodes, sizes))
    strategy = make_strategy(StrategySettings(name="fedtops", candidates=(1.0, 2.0)), num_clients=4, seed=0)
    new = _run(strategy, FakeGrid(_updates(nodes), weights, {n: _scores(n) for n in nodes}))
    s, x = np.array(sizes, dtype=np.float64), np.array(nodes, dtype=np.float64)
    weighted = float((s * x).sum() / s.sum())
    assert abs(weighted - x.mean()) > 0.1  # the sizes matter: the plain mean would be 2.5
    assert new.records[1]["teacher_scores"] == pytest.approx([weighted, 2 * weighted], rel=1e-12)
    for got in new:
        np.testing.assert_allclose(got, weighted, rtol=0, atol=sum_error(16) * 4)
