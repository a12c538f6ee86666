"""What a client accepts from the server: a score query's values are read as untrusted input,
bounded before any work, and answered at most once per round trained."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import client_app.handlers as handlers
from client_app.handlers import CACHE, MAX_CANDIDATES, META, THETA, ScoreRequest
from fedopd.config import parse_run_config
from fedopd.core.errors import RequestError

FIXED = settings(max_examples=200, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=3), st.none())


@FIXED
@given(
    st.dictionaries(
        st.sampled_from(["candidates", "server-round", "score-se", "other"]),
        st.one_of(
            numbers,
            st.lists(numbers, max_size=MAX_CANDIDATES + 3),
            st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=MAX_CANDIDATES + 3),
            st.integers(-3, 10),
        ),
    )
)
@example({"server-round": 1, "candidates": [1.0, math.nan]})
@example({"server-round": 1, "candidates": [-0.5]})
@example({"server-round": 1, "candidates": [0.5, math.inf]})
def test_a_score_query_is_a_bounded_request_or_a_clear_refusal(config):
    try:
        request = ScoreRequest.from_config(config)
    except ValueError as err:
        assert str(err).startswith("score query: '")
        return
    assert 1 <= len(request.candidates) <= MAX_CANDIDATES
    assert all(math.isfinite(a) and a >= 0 for a in request.candidates)
    assert isinstance(request.server_round, int)


def test_a_score_query_with_more_candidates_than_the_client_scores_is_refused():
    with pytest.raises(ValueError, match=f"holds {MAX_CANDIDATES + 1}; allowed: a list of 1 to {MAX_CANDIDATES} numbers"):
        ScoreRequest.from_config({"server-round": 1, "candidates": [1.0] * (MAX_CANDIDATES + 1)})
    assert len(ScoreRequest.from_config({"server-round": 1, "candidates": [1.0] * MAX_CANDIDATES}).candidates) == MAX_CANDIDATES


def test_a_client_answers_one_score_query_per_round_it_trained(monkeypatch):
    """A second query for the same round is refused before any work (no model is set up)."""
    calls = []
    student = SimpleNamespace(get_lora_arrays=lambda: {"a": np.zeros(2, np.float32)})
    monkeypatch.setattr(
        handlers.worker, "setup", lambda cfg, pid, num, pooled=False, node=None: (calls.append(pid) or SimpleNamespace(student=student), ["p"] * 4)
    )
    monkeypatch.setattr(handlers.ScoringCache, "from_arrays", staticmethod(lambda arrays: SimpleNamespace()))
    monkeypatch.setattr(
        handlers, "score_round", lambda models, theta, delta, cache, candidates, with_se=False: ([0.1] * len(candidates), [0.0] * len(candidates))
    )
    theta = ArrayRecord({"a": Array(np.zeros(2, np.float32))})
    state = RecordDict({THETA: theta, CACHE: ArrayRecord({"c": Array(np.zeros(1, np.float32))}), META: ConfigRecord({"server-round": 3})})
    query = RecordDict({"increment": theta, "config": ConfigRecord({"server-round": 3, "candidates": [0.5, 1.0]})})
    cfg = parse_run_config({})
    reply = handlers.score(query, state, 1, 2, cfg)
    assert list(reply["scores"]["teacher-scores"]) == [0.1, 0.1] and calls == [1]
    with pytest.raises(RequestError, match="score query for round 3, which this client has already answered"):
        handlers.score(query, state, 1, 2, cfg)
    assert calls == [1]
    # the next round's train resets it: a new cache, a new query
    state[META] = ConfigRecord({"server-round": 4})
    handlers.score(RecordDict({"increment": theta, "config": ConfigRecord({"server-round": 4, "candidates": [1.0]})}), state, 1, 2, cfg)
    assert calls == [1, 1]


@FIXED
@given(st.dictionaries(st.sampled_from(["server-round", "pooled-clients", "learner", "scoring-cache"]), st.one_of(numbers, st.integers(-3, 12))))
def test_a_train_message_is_a_bounded_request_or_a_clear_refusal(config):
    """Rounds within num-server-rounds (here 10) and at most num-partitions (here 4) pooled
    clients: a message cannot make the Centralized learner pool more clients than exist."""
    from client_app.handlers import TrainRequest

    try:
        request = TrainRequest.from_config(config, num_partitions=4, num_rounds=10)
    except ValueError as err:
        assert str(err).startswith("train message: '")
        return
    assert 1 <= request.server_round <= 10 and 0 <= request.pooled_clients <= 4
    assert all(type(config[k]) is int for k in ("server-round", "pooled-clients") if k in config)  # no 2.5, no True


def test_pooling_more_clients_than_partitions_or_a_round_past_the_run_is_refused():
    from client_app.handlers import TrainRequest

    with pytest.raises(ValueError, match=r"'pooled-clients' = 5; allowed: an integer in \[0, 4\]"):
        TrainRequest.from_config({"server-round": 1, "learner": "centralized", "pooled-clients": 5}, num_partitions=4, num_rounds=10)
    with pytest.raises(ValueError, match=r"'server-round' = 11; allowed: an integer in \[1, 10\]"):
        TrainRequest.from_config({"server-round": 11}, num_partitions=4, num_rounds=10)
    assert (
        TrainRequest.from_config({"server-round": 10, "learner": "centralized", "pooled-clients": 4}, num_partitions=4, num_rounds=10).pooled_clients
        == 4
    )


@FIXED
@given(
    st.dictionaries(
        st.sampled_from(["run-dir", "resume-run", "resume-round"]),
        st.one_of(st.text(max_size=60), st.integers(-(2**65), 2**65), st.booleans(), st.floats(allow_nan=True)),
    ),
    st.sampled_from([{"client-state-dir": "/state"}, {"worker": "resident"}]),
    st.integers(0, 2**64 - 1),
    st.booleans(),
)
@example({"run-dir": "runs/..", "resume-run": 5}, {"client-state-dir": "/state"}, 7, True)
def test_a_supernodes_state_folder_is_keyed_by_the_superlinks_run_id_whatever_the_message_says(config, node_config, run_id, resume):
    """On a SuperNode (``client-state-dir``, or a resident worker's host cache) a client's state
    folder is ``<root>/run-<id>/partition-<i>``: the run id the SuperLink assigned, or for a
    resume the integer run id the message names, under the same root; the message's ``run-dir``
    only switches the state on. Anything else is refused as a request error."""
    from pathlib import Path

    from client_app.client_state import client_state_dir
    from fedopd.sandbox.tiny import cache_root

    root = Path("/state") if "client-state-dir" in node_config else cache_root() / "client-state"
    try:
        folder = client_state_dir(config, node_config, 1, run_id, resume=resume)
    except RequestError as err:
        assert str(err).startswith("train message: 'resume-run'") and resume
        return
    if not config.get("run-dir"):
        assert folder is None
        return
    named = config.get("resume-run") if resume else run_id
    assert type(named) is int and folder == root / f"run-{named}" / "partition-1"


def test_a_run_dir_that_would_leave_the_simulations_run_folder_is_refused():
    from client_app.client_state import client_state_dir

    for bad in ("runs/..", "/tmp/.hidden", "runs/x y", "runs/" + "a" * 129):
        with pytest.raises(RequestError, match="not a run folder's name"):
            client_state_dir({"run-dir": bad}, {}, 1)
    assert str(client_state_dir({"run-dir": "/srv/runs/20261127-101500-fedtops"}, {}, 1)) == "/srv/runs/20261127-101500-fedtops.clients/partition-1"
