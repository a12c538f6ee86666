"""A node's bounds on what one message may make it do (``client_app/limits.py``): checked before
any work, against the run config the server sent."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import client_app.handlers as handlers
from client_app.limits import MAX_TOKENS, NodeLimits, message_tokens
from fedopd.config import parse_run_config
from fedopd.core.errors import LocalError, RequestError

FIXED = settings(
    max_examples=80, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
SMALL = {
    "data.prompts-per-client": 10,
    "rollout.per-round": 8,
    "rollout.max-new-tokens": 16,
    "data.max-prompt-tokens": 32,
    "cache.rollouts": 4,
    "cache.positions": 2,
    "cache.top-k": 1,
    "train.mini-batch": 4,
}


def test_a_train_messages_cost_is_its_rollouts_generated_and_run_through_both_models_its_cache_and_its_pool():
    # the cache: 4 sequences of 32 + 16 through both models, and 4 x 2 positions x (2 x 1 + 1) stored values
    cache = 4 * 48 + 4 * 2 * 3
    # 8 x 16 generated + 2 x 8 x (32 + 16) through student and teacher + 2 x the cache + 10 rows x (32 + 128) read and rendered
    assert message_tokens(parse_run_config(SMALL), "train", prompt_pool=10) == 128 + 768 + 2 * cache + 1600 == 2928
    # the Centralized learner pooling 3 clients: 3 x 8 rollouts
    assert message_tokens(parse_run_config(SMALL), "train", partitions=3) == 3 * 128 + 3 * 768 + 2 * cache
    # a score query: each of 5 candidates is one pass over the cache with both models
    assert message_tokens(parse_run_config(SMALL), "score", candidates=5) == 5 * 2 * cache
    # a larger cache.top-k costs more, even with no more tokens (the attacker's finding)
    assert message_tokens(parse_run_config({**SMALL, "cache.top-k": 100}), "score", candidates=1) == 2 * (4 * 48 + 4 * 2 * 201)
    # evaluate: 2 problems x (1 greedy + 3 samples) x (32 + 8)
    cfg = parse_run_config({**SMALL, "eval.prompts-per-client": 2, "eval.samples": 3, "eval.max-new-tokens": 8})
    assert message_tokens(cfg, "evaluate") == 2 * 4 * 40


def test_the_default_bound_takes_the_paper_presets_largest_message_five_times_over():
    """The largest: the Centralized learner's train message, pooling 3 clients' rollouts."""
    from fedopd.config.presets import app_defaults, load_preset

    merged = app_defaults()
    merged.update(load_preset("configs/paper-1.7b.toml"))
    cfg = parse_run_config(merged)
    largest = max(
        message_tokens(cfg, "train", partitions=3, prompt_pool=3 * cfg.data.prompts_per_client),
        message_tokens(cfg, "evaluate", prompt_pool=3 * cfg.data.prompts_per_client),
    )
    assert 4 * largest < MAX_TOKENS < 6 * largest


def _train(monkeypatch, run_config: dict, node_config: dict, **message: object):
    """The train handler with ``run_config``; ('setup', cfg) if it got as far as loading anything."""
    called = []

    def fake_setup(cfg, pid, num, pooled=False, node=None):
        called.append(cfg)
        raise RuntimeError("stop here")

    monkeypatch.setattr(handlers.worker, "setup", fake_setup)
    config = ConfigRecord({"server-round": 1, **message})
    content = RecordDict({"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": config})
    try:
        handlers.train(content, RecordDict(), 0, 3, parse_run_config(run_config), {"partition-id": 0, "num-partitions": 3, **node_config})
    except RuntimeError:
        return called
    return called


def test_a_message_past_the_nodes_bound_is_refused_before_anything_is_loaded(monkeypatch):
    with pytest.raises(RequestError, match=r"would cost about 6,128 tokens .* above this node's bound \(node config 'max-tokens'\)"):
        _train(monkeypatch, SMALL, {"max-tokens": 6127})
    with pytest.raises(RequestError, match=r"lora.rank = 512 is above this node's bound \(node config 'max-lora-rank'\)"):
        _train(monkeypatch, {**SMALL, "lora.rank": 512}, {})
    with pytest.raises(RequestError, match=r"model.student = 'builtin:sandbox-student' is not among this node's allowed models"):
        _train(monkeypatch, SMALL, {"allowed-models": "builtin:tiny-student builtin:tiny-teacher"})
    assert len(_train(monkeypatch, SMALL, {"max-tokens": 6128})) == 1  # 1,328 + its pool of 3 x 10 rows x (32 + 128) fits exactly
    # the Centralized learner pooling 3 clients: 3 x (128 + 768) + 432 + 4,800 = 7,920
    with pytest.raises(RequestError, match=r"about 7,920 tokens"):
        _train(monkeypatch, SMALL, {"max-tokens": 7919}, learner="centralized", **{"pooled-clients": 3})
    assert len(_train(monkeypatch, SMALL, {"max-tokens": 7920}, learner="centralized", **{"pooled-clients": 3})) == 1


def test_a_node_limit_that_is_not_a_positive_integer_is_refused_naming_it():
    for node_config, key in (({"max-tokens": 0}, "max-tokens"), ({"max-lora-rank": "8"}, "max-lora-rank"), ({"allowed-models": 3}, "allowed-models")):
        with pytest.raises(LocalError, match=f"node config '{key}'"):
            NodeLimits.from_node_config(node_config)


@FIXED
@given(
    st.integers(1, 10**7),
    st.integers(1, 10**6),
    st.integers(1, 10**5),
    st.integers(1, 10**6),
    st.integers(1, 64),
    st.sampled_from(["federated", "centralized"]),
)
def test_no_train_message_the_node_takes_generates_more_tokens_than_its_bound(monkeypatch, per_round, new_tokens, prompts, pool, cache, learner):
    """Whatever sizes the run config asks for, the handler either refuses before any work (a
    request error naming 'max-tokens') or gets to work on at most the bound's tokens: at least its
    rollouts x response cap."""
    monkeypatch.setattr(handlers.worker, "setup", lambda cfg, pid, num, pooled=False, node=None: (_ for _ in ()).throw(KeyboardInterrupt))
    run_config = {
        "rollout.per-round": per_round,
        "rollout.max-new-tokens": new_tokens,
        "data.max-prompt-tokens": prompts,
        "data.prompts-per-client": pool,
        "cache.rollouts": cache,
        "train.mini-batch": 1,
        "train.micro-batch": 1,
    }
    try:
        cfg = parse_run_config(run_config)
    except ValueError:
        return
    config = ConfigRecord({"server-round": 1, "learner": learner, "pooled-clients": 3 if learner == "centralized" else 0})
    content = RecordDict({"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": config})
    try:
        handlers.train(content, RecordDict(), 0, 3, cfg, {"partition-id": 0, "num-partitions": 3})
    except RequestError as err:
        assert "node config 'max-tokens'" in str(err)
        return
    except KeyboardInterrupt:  # got to work
        pooled = 3 if learner == "centralized" else 1
        assert per_round * pooled * new_tokens <= MAX_TOKENS
        return
    raise AssertionError("the handler neither refused nor started")
