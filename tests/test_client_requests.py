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
from client_app.requests import CACHE, MAX_CANDIDATES, META, THETA, ScoreRequest
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
    student = SimpleNamespace(factor_parameters=lambda: {"a": np.zeros(2, np.float32)})
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
    from client_app.requests import TrainRequest

    try:
        request = TrainRequest.from_config(config, num_partitions=4, num_rounds=10)
    except ValueError as err:
        assert str(err).startswith("train message: '")
        return
    assert 1 <= request.server_round <= 10 and 0 <= request.pooled_clients <= 4
    assert all(type(config[k]) is int for k in ("server-round", "pooled-clients") if k in config)  # no 2.5, no True


def test_pooling_more_clients_than_partitions_or_a_round_past_the_run_is_refused():
    from client_app.requests import TrainRequest

    with pytest.raises(ValueError, match=r"'pooled-clients' = 5; allowed: an integer from 0 to the number of partitions"):  # not this node's count
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
        st.one_of(
            st.text(max_size=60), st.integers(-(2**65), 2**65), st.integers(-(2**65), 2**65).map(str), st.booleans(), st.floats(allow_nan=True)
        ),
    ),
    st.sampled_from([{"client-state-dir": "/state"}, {"worker": "resident"}]),
    st.integers(0, 2**64 - 1),
    st.booleans(),
)
@example({"run-dir": "runs/..", "resume-run": "5"}, {"client-state-dir": "/state"}, 7, True)
@example({"run-dir": "r", "resume-run": str(2**64 - 1)}, {"worker": "resident"}, 7, True)
@example({"run-dir": "r", "resume-run": str(2**64)}, {"worker": "resident"}, 7, True)
@example({"run-dir": "r", "resume-run": 5}, {"worker": "resident"}, 7, True)
def test_a_supernodes_state_folder_is_keyed_by_the_superlinks_run_id_whatever_the_message_says(config, node_config, run_id, resume):
    """On a SuperNode (``client-state-dir``, or a resident worker's host cache) a client's state
    folder is ``<root>/node-<id>/run-<id>/partition-<i>``: the ids the SuperLink assigned, or for a
    resume the integer run id the message names, under the same root; the message's ``run-dir``
    only switches the state on. Anything else is refused as a request error."""
    from pathlib import Path

    from client_app.client_state import client_state_dir
    from fedopd.sandbox.tiny import cache_root

    root = Path("/state") if "client-state-dir" in node_config else cache_root() / "client-state"
    try:
        folder = client_state_dir(config, node_config, 1, run_id, node_id=9, resume=resume)
    except RequestError as err:
        assert str(err).startswith("train message: 'resume-run'") and resume
        return
    if not config.get("run-dir"):
        assert folder is None
        return
    named = config.get("resume-run") if resume else str(run_id)
    assert type(named) is str and folder == root / "node-9" / f"run-{int(named)}" / "partition-1"


def test_a_run_dir_that_would_leave_the_simulations_run_folder_is_refused():
    from client_app.client_state import client_state_dir

    for bad in ("runs/..", "/tmp/.hidden", "runs/x y", "runs/" + "a" * 129):
        with pytest.raises(RequestError, match="not a run folder's name"):
            client_state_dir({"run-dir": bad}, {}, 1)
    assert str(client_state_dir({"run-dir": "/srv/runs/20261127-101500-fedtops"}, {}, 1)) == "/srv/runs/20261127-101500-fedtops.clients/partition-1"


# ---------------------------------------------------------------------------------------------
# The hostile-server review's findings, each pinned


def test_a_train_message_for_a_round_this_client_already_trained_is_refused():
    """A repeated (or older) round would rebuild the same scoring cache and reset its one score query."""
    from client_app.requests import check_message

    cfg = parse_run_config({})
    content = RecordDict({"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": ConfigRecord({"server-round": 3})})
    state = RecordDict({META: ConfigRecord({"server-round": 3, "scored": True})})
    with pytest.raises(RequestError, match="train message for round 3, but this client already trained round 3"):
        check_message("train", content, state, 2, cfg, {"partition-id": 0, "num-partitions": 2})
    content["config"] = ConfigRecord({"server-round": 4})
    assert check_message("train", content, state, 2, cfg, {"partition-id": 0, "num-partitions": 2}).request.server_round == 4


def test_a_round_that_builds_no_scoring_cache_drops_the_last_one(monkeypatch):
    """Else round 1's cache would answer a score query for round 2 (and 3, ...)."""
    from client_messages import fake_models

    monkeypatch.setattr(handlers.worker, "setup", lambda cfg, pid, num, pooled=False, node=None: (fake_models(), ["p"] * 4))
    monkeypatch.setattr(
        handlers,
        "train_round",
        lambda models, theta, prompts, plan, **kw: SimpleNamespace(arrays=dict(theta), cache=None, metrics={}, optimizer_state={}),
    )
    theta = ArrayRecord({"a": Array(np.zeros(2, np.float32))})
    state = RecordDict({THETA: theta, CACHE: ArrayRecord({"c": Array(np.zeros(1, np.float32))}), META: ConfigRecord({"server-round": 1})})
    config = ConfigRecord({"server-round": 2, "build-scoring-cache": False})
    handlers.train(RecordDict({"arrays": theta, "config": config}), state, 0, 2, parse_run_config({"train.optimizer-state": "reset"}))
    assert CACHE not in state
    query = RecordDict({"increment": theta, "config": ConfigRecord({"server-round": 2, "candidates": [1.0]})})
    with pytest.raises(RequestError, match="score query for round 2, but this client has no scoring cache of that round"):
        handlers.score(query, state, 0, 2, parse_run_config({}))


def test_a_deployment_node_loads_no_model_folder_the_server_names_unless_its_operator_allows_it():
    from client_app.limits import NodeLimits

    for model in ("/srv/private-model", "~/models/x", "./x", "home/.ssh", "a/b/c"):
        cfg = parse_run_config({"model.teacher": model})
        with pytest.raises(RequestError, match="is neither a built-in model nor a hub id"):
            NodeLimits().check(cfg, "evaluate", deployment=True)
        NodeLimits().check(cfg, "evaluate", deployment=False)  # a simulation's node: the operator's own machine
        NodeLimits(allowed_models=(model, "builtin:sandbox-student")).check(cfg, "evaluate", deployment=True)
    NodeLimits().check(parse_run_config({"model.teacher": "Qwen/Qwen3-1.7B"}), "evaluate", deployment=True)


def test_a_resident_nodes_shell_refuses_a_message_before_it_starts_or_stops_any_worker(monkeypatch):
    """The shell checks the message and the node's bounds itself: a refused run config must not
    stop the host's worker (as starting a worker for other models does)."""
    from flwr.app import Context, Message, Metadata

    import client_app.resident as resident
    from client_app.app import handle

    touched = []
    monkeypatch.setattr(resident, "call_resident", lambda *args, **kwargs: touched.append(args))
    cfg = parse_run_config({})
    node = {"partition-id": 0, "num-partitions": 2, "worker": "resident", "max-tokens": 10}
    context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config=cfg.to_run_config())
    content = RecordDict({"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": ConfigRecord({"server-round": 1})})
    meta = Metadata(
        run_id=1, message_id="m", src_node_id=0, dst_node_id=7, reply_to_message_id="", group_id="1", created_at=0.0, ttl=600.0, message_type="train"
    )
    reply = handle("train", Message(content=content, metadata=meta), context)
    assert reply.has_error() and reply.error.reason.startswith("RequestError: this train message would cost about") and touched == []


def test_the_privacy_mods_own_failure_is_a_reply_with_a_public_reason():
    from flwr.app import Message, Metadata
    from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

    from client_app.app import privacy_clipping_mod
    from fedtops_strategy.privacy import KEY_CLIPPING_MODE

    garbage = Array(dtype="float32", shape=(2,), stype="numpy.ndarray", data=b"not an array")
    content = RecordDict({"arrays": ArrayRecord({"a": garbage}), "config": ConfigRecord({KEY_CLIPPING_NORM: 1.0, KEY_CLIPPING_MODE: "fixed"})})
    meta = Metadata(
        run_id=1, message_id="m", src_node_id=0, dst_node_id=7, reply_to_message_id="", group_id="1", created_at=0.0, ttl=600.0, message_type="train"
    )
    reply = privacy_clipping_mod(Message(content=content, metadata=meta), None, lambda msg, ctx: pytest.fail("the handler ran"))
    assert reply.has_error() and reply.error.reason.endswith("in the client's train (details in this node's log)")


def test_a_problem_too_long_for_any_tokenizer_is_dropped_before_it_is_rendered():
    from fedopd.data.prompts import MAX_CHARS_PER_TOKEN, encode_prompts

    rendered = []

    class Tokenizer:
        def apply_chat_template(self, messages, **kwargs):
            rendered.append(messages[0]["content"])
            return messages[0]["content"]

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text) // 100))}

    limit = 10
    rows = [{"problem": "x" * (MAX_CHARS_PER_TOKEN * limit + 1), "answer": "1"}, {"problem": "short", "answer": "2"}]
    prompts = encode_prompts(Tokenizer(), rows, limit)
    assert [p.problem for p in prompts] == ["short"] and len(rendered) == 1


def test_a_worker_keeps_one_runs_encoded_prompt_pools(monkeypatch):
    """A new run's data settings replace the last run's pools: a host's runs do not add up."""
    from client_app import worker

    monkeypatch.setattr(worker, "_load", lambda cfg, models, kind, pid, num, node: (cfg.data.seed, kind, pid))
    monkeypatch.setattr(worker, "_PROMPTS", {})
    for seed in range(5):
        cfg = parse_run_config({"data.seed": seed})
        for pid in range(3):
            worker._encoded(cfg, None, "train", pid, 3)
            worker._encoded(cfg, None, "heldout", pid, 3)
    assert sorted(worker._PROMPTS.values()) == sorted((4, kind, pid) for kind in ("train", "heldout") for pid in range(3))


def _failing_handle(monkeypatch, tmp_path, node_config):
    from flwr.app import Context, Message, Metadata

    import client_app.app as client_app
    from client_app.handlers import HANDLERS

    def train(*args):
        raise ValueError("rollout.backend = 'vllm' needs vLLM\nsecond line of the message")

    monkeypatch.setitem(HANDLERS, "train", train)
    monkeypatch.setattr(client_app.tempfile, "gettempdir", lambda: str(tmp_path))
    context = Context(run_id=5, node_id=7, node_config=node_config, state=RecordDict(), run_config=parse_run_config({}).to_run_config())
    meta = Metadata(
        run_id=5, message_id="m", src_node_id=0, dst_node_id=7, reply_to_message_id="", group_id="1", created_at=0.0, ttl=600.0, message_type="train"
    )
    content = RecordDict({"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": ConfigRecord({"server-round": 1})})
    return client_app.handle("train", Message(content=content, metadata=meta), context)


def test_a_simulated_clients_failure_is_one_line_in_the_stream_and_its_traceback_a_file(monkeypatch, tmp_path, caplog):
    import logging
    import os

    caplog.set_level(logging.DEBUG, logger="flwr")
    reply = _failing_handle(monkeypatch, tmp_path, {"partition-id": 0, "num-partitions": 2})
    trace = tmp_path / f"fedtops-client-errors-{os.getuid()}" / "run-5" / "node-7.log"
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line == f"train failed on this node: ValueError: rollout.backend = 'vllm' needs vLLM (traceback in {trace})"
    text = trace.read_text()
    assert text.startswith("train failed at ") and "\nTraceback (most recent call last):" in text and "second line of the message" in text
    assert oct(trace.parent.stat().st_mode & 0o777) == "0o700" and oct(trace.stat().st_mode & 0o777) == "0o600"
    assert reply.error.reason == "ValueError in the client's train (details in this node's log)"  # the reply is unchanged


def test_a_deployment_nodes_failure_keeps_the_whole_traceback_in_its_own_log(monkeypatch, tmp_path, caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="flwr")
    _failing_handle(monkeypatch, tmp_path, {"partition-id": 0, "num-partitions": 2, "client-state-dir": str(tmp_path / "state")})
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("train failed on this node: Traceback (most recent call last):") and "second line of the message" in line
    assert not list(tmp_path.glob("fedtops-client-errors*"))


def test_a_traceback_file_that_is_not_private_is_not_written_and_the_stream_gets_the_traceback(monkeypatch, tmp_path, caplog):
    import logging
    import os

    caplog.set_level(logging.DEBUG, logger="flwr")
    shared = tmp_path / f"fedtops-client-errors-{os.getuid()}"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)  # another user could plant files in it
    _failing_handle(monkeypatch, tmp_path, {"partition-id": 0, "num-partitions": 2})
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith("train failed on this node (traceback not saved to") and "PermissionError" in line and "second line of the message" in line
    assert not (shared / "run-5").exists()


def test_a_symbolic_link_in_place_of_the_traceback_file_is_not_followed(monkeypatch, tmp_path, caplog):
    import logging
    import os

    caplog.set_level(logging.DEBUG, logger="flwr")
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    folder = tmp_path / f"fedtops-client-errors-{os.getuid()}" / "run-5"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder.parent, 0o700)
    (folder / "node-7.log").symlink_to(target)
    _failing_handle(monkeypatch, tmp_path, {"partition-id": 0, "num-partitions": 2})
    assert target.read_text() == "keep"
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "traceback not saved to" in line and "second line of the message" in line
