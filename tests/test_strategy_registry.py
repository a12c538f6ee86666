"""A strategy is one builder registered by name; what its clients do differently comes from its
train messages' config (``learner``, ``build-scoring-cache``), never from its name."""

from __future__ import annotations

import numpy as np
import pytest
from client_messages import fake_models
from conftest import TINY
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedopd.config import parse_run_config
from fedopd.models.lora import from_record
from fedtops_strategy.base import ServerStrategy
from fedtops_strategy.round import apply_step

SMALL = {
    **TINY,
    "num-server-rounds": 2,
    "data.prompts-per-client": 16,
    "rollout.per-round": 8,
    "rollout.max-new-tokens": 12,
    "train.mini-batch": 4,
    "train.micro-batch": 4,
}


class HalfStep(ServerStrategy):
    """FedAvg with a server step of half the averaged increment: θ_{t+1} = θ_t + 0.5·Δ_t."""

    strategy_name = "half-step"

    def step(self, train, scores):
        return apply_step(train, 0.5)


@pytest.fixture()
def half_step():
    from fedtops_strategy.factory import CAPABILITIES, STRATEGIES, register_strategy

    register_strategy("half-step", lambda cfg, common: HalfStep(**common))
    yield "half-step"
    STRATEGIES.pop("half-step")
    CAPABILITIES.pop("half-step")


@pytest.fixture()
def registered():
    """Register builders with declared capabilities for one test; removed afterwards."""
    from fedtops_strategy.factory import CAPABILITIES, STRATEGIES, register_strategy

    names = []

    def register(name, capabilities):
        register_strategy(name, lambda cfg, common: HalfStep(**common), capabilities)
        names.append(name)
        return name

    yield register
    for name in names:
        STRATEGIES.pop(name)
        CAPABILITIES.pop(name)


def test_the_run_config_refuses_what_a_strategy_declares_it_does_not_support(registered):
    from fedopd.config import ConfigError
    from fedtops_strategy.factory import Capabilities

    plain = registered("plain-average", Capabilities())
    solo = registered("no-average", Capabilities(averages=False, private=False))
    scoring = registered("scoring-variant", Capabilities(score_phase=True))
    # An averaging strategy takes the robustness keys, whatever its name; one that declares no average does not.
    assert parse_run_config({"strategy.name": plain, "strategy.clip-norm": 2.0}).strategy.clip_norm == 2.0
    with pytest.raises(ConfigError, match="'strategy.clip-norm' = 2.0 acts on the average of client updates, which 'strategy.name' = 'no-average'"):
        parse_run_config({"strategy.name": solo, "strategy.clip-norm": 2.0})
    # The score keys follow the declared score phase, not the name 'fedtops'.
    assert parse_run_config({"strategy.name": scoring, "strategy.max-vetoes": 1}).strategy.max_vetoes == 1
    with pytest.raises(ConfigError, match="'strategy.max-vetoes' = 1 acts on FedTOPS's score replies"):
        parse_run_config({"strategy.name": plain, "strategy.max-vetoes": 1})
    # Privacy follows the declaration too.
    private = {"privacy.clipping": "fixed", "privacy.noise-multiplier": 1.0, "num-clients": 3}
    assert parse_run_config({"strategy.name": plain, **private}).privacy.clipping == "fixed"
    with pytest.raises(ConfigError, match="'strategy.name' = 'no-average'"):
        parse_run_config({"strategy.name": solo, **private})


def test_every_built_in_strategy_declares_its_capabilities():
    from fedtops_strategy.factory import CAPABILITIES, STRATEGIES

    assert set(CAPABILITIES) == set(STRATEGIES)
    assert [n for n in STRATEGIES if CAPABILITIES[n].score_phase] == ["fedtops", "fedtops-se", "fedtops-heldout-cache"]
    assert [n for n in STRATEGIES if CAPABILITIES[n].per_client_adapters] == ["local"]
    assert not CAPABILITIES["fedtops-se"].private  # its standard errors travel unprotected


@pytest.mark.slow
def test_a_strategy_registered_in_a_test_runs_through_the_app_with_its_own_server_step(half_step, tmp_path, monkeypatch):
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    from fedopd.models import load_adapter
    from server_app.inprocess import InProcessGrid, run_in_process
    from server_app.run_folder import read_rounds

    train_rounds: dict[str, int] = {}  # train message id -> its round
    train_replies: dict[int, list[RecordDict]] = {}  # round -> the train replies' contents
    push, pull = InProcessGrid.push_messages, InProcessGrid.pull_messages

    def recording_push(self, messages):
        messages = list(messages)
        ids = list(push(self, messages))
        for m, i in zip(messages, ids):
            if m.metadata.message_type == "train":
                train_rounds[i] = int(m.content["config"]["server-round"])
        return ids

    def recording_pull(self, message_ids):
        replies = list(pull(self, message_ids))
        for r in replies:
            if r.metadata.reply_to_message_id in train_rounds and not r.has_error():
                train_replies.setdefault(train_rounds[r.metadata.reply_to_message_id], []).append(r.content)
        return replies

    monkeypatch.setattr(InProcessGrid, "push_messages", recording_push)
    monkeypatch.setattr(InProcessGrid, "pull_messages", recording_pull)
    run = run_in_process({**SMALL, "strategy.name": half_step, "output-dir": str(tmp_path)})

    rounds = read_rounds(run)
    assert [(r["round"], r["strategy"], r["multiplier"]) for r in rounds] == [(1, "half-step", 0.5), (2, "half-step", 0.5)]
    assert all("cache_teacher_score" not in c for r in rounds for c in r["clients"])  # no scoring cache asked for
    for server_round in (1, 2):
        theta = load_adapter(run / f"round-{server_round - 1:03d}")
        # FedAvg over the replies in the order the strategy averages them (by partition)
        replies = sorted(train_replies[server_round], key=lambda c: c["metrics"]["partition-id"])
        assert len(replies) == 3
        mean = from_record(aggregate_arrayrecords(replies, "num-examples"))
        expected = {k: t + np.float32(0.5) * (mean[k] - t) for k, t in theta.items()}  # θ + 0.5·Δ
        saved = load_adapter(run / f"round-{server_round:03d}")
        assert saved.keys() == expected.keys()
        assert all(np.array_equal(saved[k], expected[k]) for k in expected)
        assert not all(np.array_equal(saved[k], mean[k]) for k in expected)  # not FedAvg's step


def _client_train(monkeypatch, message_config, **overrides):
    """The client's ``train`` handler (partition 0 of 3) on a message with ``message_config``, with
    the models and the round's work faked: (what setup and train_round were given, the state folder)."""
    from types import SimpleNamespace

    import client_app.handlers as handlers

    given = {}

    def fake_setup(cfg, pid, num, pooled=False, node=None):
        given["pooled"] = pooled
        return fake_models(), ["prompt"] * (3 * 16 if pooled else 16)

    def fake_train_round(models, theta, prompts, plan, **kwargs):
        given.update(vars(plan), **kwargs)
        return SimpleNamespace(arrays=dict(theta), cache=None, metrics={}, optimizer_state={})

    folders = []
    real_dir = handlers.client_state_dir
    monkeypatch.setattr(
        handlers, "client_state_dir", lambda config, node, who, run_id=0, **kw: folders.append(who) or real_dir(config, node, who, run_id, **kw)
    )
    monkeypatch.setattr(handlers.worker, "setup", fake_setup)
    monkeypatch.setattr(handlers, "train_round", fake_train_round)
    cfg = parse_run_config({**SMALL, **overrides})
    content = RecordDict(
        {"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": ConfigRecord({"server-round": 1, **message_config})}
    )
    handlers.train(content, RecordDict(), 0, 3, cfg)
    return given, folders


@pytest.mark.parametrize("name", ["fedtops", "fedavg"])
@pytest.mark.parametrize("flag", [True, False])
def test_the_message_not_the_strategy_name_decides_whether_the_client_builds_a_scoring_cache(monkeypatch, name, flag):
    given, _ = _client_train(monkeypatch, {"learner": "federated", "build-scoring-cache": flag}, **{"strategy.name": name})
    assert given["build_cache"] is flag


def test_a_centralized_learner_message_pools_every_partition_whatever_the_strategy_name(monkeypatch, half_step):
    from fedopd.engine.round import derive_seed

    given, folders = _client_train(monkeypatch, {"learner": "centralized", "build-scoring-cache": False}, **{"strategy.name": half_step})
    assert given["pooled"] is True
    assert given["rollout"].per_round == 3 * 8  # the three clients' rollouts, the same mini-batch of 4
    assert given["total_steps"] == 2 * 6  # 6 steps a round over 2 rounds
    assert given["seed"] == derive_seed(42, 3)  # the pool is one more partition (3 of 0..2), whichever node runs it
    assert folders == ["central"]


def test_a_federated_learner_message_trains_on_its_own_partition(monkeypatch):
    given, folders = _client_train(monkeypatch, {"learner": "federated", "build-scoring-cache": False}, **{"strategy.name": "fedavg"})
    assert given["pooled"] is False and given["rollout"].per_round == 8 and given["total_steps"] == 2 * 2
    assert folders == [0]


def test_a_train_message_with_an_unknown_learner_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="'learner' = 'swarm'; allowed: 'federated', 'local', 'centralized'"):
        _client_train(monkeypatch, {"learner": "swarm"})


def test_a_strategy_registered_without_the_score_phase_it_has_is_refused():
    """Privacy accounts the score rows' release, and the run config checks the score keys, from
    the declaration: a builder whose strategy has a score phase it does not declare is refused."""
    from fedopd.config import StrategySettings
    from fedopd.core.strategies import Capabilities
    from fedtops_strategy import FedTOPS, make_strategy
    from fedtops_strategy.factory import CAPABILITIES, STRATEGIES, register_strategy

    register_strategy("fedtops-undeclared", lambda cfg, common: FedTOPS(**common))
    register_strategy("fedtops-declared", lambda cfg, common: FedTOPS(**common), Capabilities(score_phase=True))
    try:
        with pytest.raises(ValueError, match=r"has score phase, but is registered with Capabilities\(score_phase=False\)"):
            make_strategy(StrategySettings(name="fedtops-undeclared"), num_clients=2)
        assert make_strategy(StrategySettings(name="fedtops-declared"), num_clients=2).score_phase
    finally:
        for name in ("fedtops-undeclared", "fedtops-declared"):
            STRATEGIES.pop(name), CAPABILITIES.pop(name)
