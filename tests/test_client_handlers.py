"""The ClientApp's three entry points (``train``, ``query.score``, ``evaluate``) driven with hostile
messages, as a server that is not to be trusted could send them: each ends in a correct answer or
an error reply whose reason is the public one (a request error's own text, or a local error's key
and kind), within a bounded time, and a refused message changes nothing in the client's state."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from client_messages import OVERRIDES, initial_theta
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, Metadata, MetricRecord, RecordDict
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fedopd.config import parse_run_config

pytestmark = pytest.mark.slow  # the tiny models answer the messages that pass the checks

COUNT = 30  # examples per entry point, derandomized
FIXED = settings(max_examples=COUNT, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
MAX_SECONDS = 60.0  # one tiny round or evaluation takes a few seconds on 2 cores; a message must not buy more
CONFIG = {**OVERRIDES, "eval.prompts-per-client": 2, "eval.samples": 1, "eval.max-new-tokens": 8}
PUBLIC = ("RequestError: train message", "RequestError: score query", "RequestError: evaluate message", "LocalError: ")

_CFG = parse_run_config(CONFIG)
THETA = initial_theta(_CFG)
NAMES = list(THETA)

values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.lists(st.floats(-20, 20), max_size=80),
)
configs = st.dictionaries(
    st.sampled_from(
        [
            "server-round",
            "learner",
            "pooled-clients",
            "scoring-cache",
            "build-scoring-cache",
            "run-dir",
            "resume-round",
            "resume-run",
            "candidates",
            "score-se",
        ]
    ),
    values,
    max_size=6,
)


def _arrays(draw, honest: bool):
    if honest:
        return ArrayRecord({k: Array(v.copy()) for k, v in THETA.items()})
    names = draw(st.lists(st.sampled_from([*NAMES[:3], "x.lora_A.weight"]), max_size=3, unique=True))
    shape = draw(st.sampled_from([None, (2,), (3, 4)]))
    fill = draw(st.sampled_from([0.0, 1.0, float("nan"), float("inf"), 1e30]))
    return ArrayRecord({n: Array(np.full(THETA[n].shape if shape is None and n in THETA else shape or (1,), fill, np.float32)) for n in names})


@st.composite
def contents(draw, array_name: str):
    """A message content: its config (random keys and values, or a plausible one) and its adapter
    (θ's factors, or wrong names, shapes and values), or records of the wrong kind."""
    config = draw(configs)
    if draw(st.booleans()):
        config = {"server-round": draw(st.integers(0, 3)), **config} if draw(st.booleans()) else {**config, "server-round": draw(st.integers(0, 3))}
    record = {}
    shape = draw(st.sampled_from(["right", "config-missing", "arrays-missing", "swapped"]))
    clean = {k: v for k, v in config.items() if v is not None}
    if shape != "config-missing":
        record["config"] = ConfigRecord(clean) if shape != "swapped" else MetricRecord({"server-round": 1.0})
    if shape != "arrays-missing":
        record[array_name] = _arrays(draw, draw(st.booleans()))
    return RecordDict(record)


def _message(content: RecordDict, kind: str) -> Message:
    meta = Metadata(
        run_id=1, message_id="m", src_node_id=0, dst_node_id=7, reply_to_message_id="", group_id="1", created_at=0.0, ttl=600.0, message_type=kind
    )
    return Message(content=content, metadata=meta)


@pytest.fixture(scope="module")
def own_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "ours.jsonl"
    path.write_text("".join(json.dumps({"problem": f"Compute {i} + {i}.", "answer": str(2 * i)}) + "\n" for i in range(20)))
    return str(path)


def _context(own_data: str) -> Context:
    node = {"partition-id": 0, "num-partitions": 3, "data-path": own_data}
    return Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config=_CFG.to_run_config())


def _check(reply: Message, started: float, answer_keys: set[str]) -> None:
    assert time.perf_counter() - started < MAX_SECONDS
    if reply.has_error():
        assert reply.error.reason.startswith(PUBLIC), reply.error.reason
    else:
        assert set(reply.content.keys()) == answer_keys


def _state_bytes(context: Context) -> dict:
    return {k: {n: a.numpy().tobytes() for n, a in v.items()} if isinstance(v, ArrayRecord) else dict(v) for k, v in context.state.items()}


@FIXED
@given(contents("arrays"))
@example(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in THETA.items()}), "config": ConfigRecord({"server-round": 1})}))
def test_any_train_message_is_answered_or_refused_in_public_terms(own_data, content):
    from client_app.app import train

    started = time.perf_counter()
    _check(train(_message(content, "train"), _context(own_data)), started, {"arrays", "metrics"})


@pytest.fixture(scope="module")
def trained_state(own_data):
    """A client's state after it trained round 1 with a scoring cache."""
    from client_app.app import train

    context = _context(own_data)
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in THETA.items()}), "config": ConfigRecord({"server-round": 1})})
    assert not train(_message(content, "train"), context).has_error()
    return context.state


@FIXED
@given(contents("increment"))
@example(
    RecordDict(
        {
            "increment": ArrayRecord({k: Array(np.zeros_like(v)) for k, v in THETA.items()}),
            "config": ConfigRecord({"server-round": 1, "candidates": [1.0, 2.0]}),
        }
    )
)
def test_any_score_query_is_answered_or_refused_in_public_terms_and_a_refusal_leaves_the_state(own_data, trained_state, content):
    from client_app.app import score

    context = _context(own_data)
    context.state = RecordDict({k: v for k, v in trained_state.items()})
    context.state["meta"] = ConfigRecord(dict(trained_state["meta"]))
    before = _state_bytes(context)
    started = time.perf_counter()
    reply = score(_message(content, "query.score"), context)
    _check(reply, started, {"scores"})
    if reply.has_error():
        assert _state_bytes(context) == before


@FIXED
@given(contents("arrays"))
@example(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in THETA.items()}), "config": ConfigRecord({"server-round": 0})}))
@example(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in THETA.items()}), "config": ConfigRecord({"server-round": "1"})}))
@example(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in THETA.items()}), "config": ConfigRecord({"server-round": -(2**40)})}))
def test_any_evaluate_message_is_answered_or_refused_in_public_terms(own_data, content):
    from client_app.app import evaluate

    started = time.perf_counter()
    _check(evaluate(_message(content, "evaluate"), _context(own_data)), started, {"metrics"})
