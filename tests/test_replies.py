"""The boundary (fedtops_strategy/replies.py), attacked with generated replies.

Hypothesis builds arbitrary RecordDicts per phase: metric keys of any text (newlines, ANSI, bidi
overrides, 10,000 characters), values of every kind Flower's MetricRecord carries (±1e308, NaN,
inf, lists up to 200 long), arrays of any dtype and shape, and arrays whose metadata lies about
their buffer. Properties: the parser never raises; a rejection names the node and gives one safe
line; what it accepts is exactly what the schema allows (the accepted values are re-checked here
by hand, independently of the parser); an honest reply is accepted with its values unchanged.

The default suite runs a fixed, bounded number of examples (derandomized); set
``HYPOTHESIS_PROFILE=nightly`` for a longer run.
"""

from __future__ import annotations

import math
import os
import re
import unicodedata

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_strategies import message

from fedtops_strategy.replies import (
    KL_MAX,
    MAX_MAGNITUDE,
    MAX_REASON_CHARS,
    EvaluateReply,
    Expected,
    Rejection,
    ScoreReply,
    TrainReply,
    parse_evaluate,
    parse_score,
    parse_train,
    settle_partition_claims,
)

# This module's settings (not a global profile: loading one would change other modules' tests).
NIGHTLY = os.environ.get("HYPOTHESIS_PROFILE") == "nightly"
PROFILE = settings(
    max_examples=5000 if NIGHTLY else 150, derandomize=not NIGHTLY, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)

pytestmark = pytest.mark.usefixtures("task_identity")

NODE = 1002
THETA = {"l.lora_A.weight": np.zeros((2, 3), np.float32), "l.lora_B.weight": np.zeros((3, 2), np.float32)}
TRAIN = Expected.for_train(THETA, num_partitions=3, max_examples=1000)
SCORE = Expected(num_candidates=6)
EVALUATE = Expected(num_partitions=3, max_examples=100)
UNSAFE = {"Cc", "Cf", "Cs", "Zl", "Zp"}
KEY = re.compile(r"[A-Za-z0-9_.@-]{1,64}\Z")

# -- generators --------------------------------------------------------------------------------

hostile_text = st.one_of(
    st.text(max_size=80),
    st.sampled_from(["node-id", "partition-id", "num-examples", "a\n\x1b[31mINFO forged", "\u202eevil", "x" * 10_000, ""]),
)
numbers = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 1e16, 0.0, -0.0, 1.0]),
)
metric_values = st.one_of(
    numbers, st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=200), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200)
)


@st.composite
def metric_records(draw, required: dict | None = None):
    items = draw(st.dictionaries(hostile_text, metric_values, max_size=8))
    if required is not None and draw(st.booleans()):
        items = {**required, **items} if draw(st.booleans()) else {**items, **required}
    try:
        return MetricRecord(items)
    except Exception:  # noqa: BLE001 - Flower refuses it: no host can send it
        return MetricRecord({})


@st.composite
def arrays(draw):
    """Any numpy array: dtypes a client might send by mistake or on purpose, any small shape."""
    dtype = draw(st.sampled_from([np.float32, np.float16, np.float64, np.complex64, np.int32, np.bool_, np.dtype("U2"), np.dtype(">f4")]))
    shape = draw(st.sampled_from([(2, 3), (3, 2), (6,), (2, 3, 1), ()]))
    return draw(hnp.arrays(dtype, shape))


@st.composite
def lying_array(draw):
    """An Array whose metadata and buffer disagree (a hand-made wire message)."""
    real = draw(arrays())
    data = Array(real).data
    cut = draw(st.integers(0, len(data)))
    return Array(
        dtype=draw(st.sampled_from(["float32", str(real.dtype)])),
        shape=draw(st.sampled_from([(2, 3), (3, 2), tuple(real.shape)])),
        stype=draw(st.sampled_from(["numpy.ndarray", "torch.Tensor"])),
        data=draw(st.sampled_from([data, data[:cut], data + b"\0" * 4, b"not numpy"])),
    )


@st.composite
def array_records(draw):
    keys = draw(st.sampled_from([list(THETA), list(THETA)[::-1], list(THETA)[:1], [*THETA, "extra"]]))
    return ArrayRecord({k: draw(st.one_of(arrays().map(Array), lying_array())) for k in keys})


@st.composite
def contents(draw, phase: str):
    records = {}
    for i in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["arrays", "metrics", "config"]))
        if kind == "arrays":
            records[f"r{i}"] = draw(array_records())
        elif kind == "metrics":
            records[f"r{i}"] = draw(metric_records({"num-examples": 5, "partition-id": 1}))
        else:
            records[f"r{i}"] = ConfigRecord({"note": draw(hostile_text)})
    return RecordDict(records)


def _reply(content, phase: str) -> Message:
    return message(content, phase, src=NODE, message_id="r1", reply_to="m1")


def _error(reason: str, phase: str) -> Message:
    return _reply(Error(code=2, reason=reason), phase)


def _safe(line: str) -> bool:
    return not any(unicodedata.category(c) in UNSAFE for c in line)


def _check_rejection(result) -> None:
    event("rejected")  # --hypothesis-show-statistics: how the examples split
    assert isinstance(result, Rejection)
    assert result.node_id == NODE
    assert result.reason and len(result.reason) <= MAX_REASON_CHARS and _safe(result.reason)


def _metrics_allowed(metrics: dict, vectors=()) -> bool:
    """The schema's metric rules, written out here: key alphabet and length, numbers or lists of
    at most 64, finite and within ±1e15 (score vectors may hold non-finite values)."""
    for k, v in metrics.items():
        if not KEY.match(k) or k == "node-id":
            return False
        values = v if isinstance(v, list) else [v]
        if isinstance(v, list) and len(v) > 64:
            return False
        if k not in vectors and not all(math.isfinite(x) and abs(x) <= MAX_MAGNITUDE for x in values):
            return False
    return True


# -- train --------------------------------------------------------------------------------------


def _train_content(arrays: dict, **metrics) -> RecordDict:
    """A train reply's content: ``arrays`` (numpy arrays or ready Flower Arrays, by key; θ's own
    for the keys left out, in θ's order unless ``arrays`` gives every key) and ``num-examples`` 5
    with ``metrics``."""
    keys = list(arrays) if set(arrays) >= set(THETA) else list(THETA)
    record = {k: arrays.get(k, THETA.get(k)) for k in keys}
    items = {k: v if isinstance(v, Array) else Array(np.asarray(v)) for k, v in record.items()}
    return RecordDict({"arrays": ArrayRecord(items), "metrics": MetricRecord({"num-examples": 5, **metrics})})


@st.composite
def near_valid_train(draw):
    """θ_t's keys and shapes in float32 (values anywhere, non-finite included), and metrics that are
    mostly the app's own keys with plausible values: the accepting side of the schema gets examples."""
    arrays = {k: draw(hnp.arrays(np.float32, v.shape, elements=st.floats(width=32, allow_nan=True, allow_infinity=True))) for k, v in THETA.items()}
    keys = st.one_of(st.sampled_from(["loss", "steps", "total_s", "accuracy", "extra.metric@2", "partition-id"]), hostile_text)
    values = st.one_of(st.integers(0, 10**6), st.floats(-1e16, 1e16), st.lists(st.floats(-10.0, 10.0), max_size=70), numbers)
    weight = draw(st.one_of(st.integers(1, 1000), st.integers(-5, 2000), st.floats(0.5, 2000.0)))
    metrics = {"num-examples": weight, **draw(st.dictionaries(keys, values, max_size=5))}
    try:
        record = MetricRecord(metrics)
    except Exception:  # noqa: BLE001 - not sendable
        record = MetricRecord({"num-examples": 5})
    return RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}), "metrics": record})


@PROFILE
@given(
    content=st.one_of(
        contents("train"),
        st.builds(lambda a, m: RecordDict({"arrays": a, "metrics": m}), array_records(), metric_records({"num-examples": 5})),
        near_valid_train(),
    )
)
def test_the_train_parser_never_raises_and_accepts_only_what_the_schema_allows(content):
    result = parse_train(_reply(content, "train"), NODE, TRAIN)
    if isinstance(result, Rejection):
        return _check_rejection(result)
    event("accepted")
    assert isinstance(result, TrainReply) and result.node_id == NODE
    assert list(result.arrays) == list(THETA)
    for k, a in result.arrays.items():
        assert a.dtype == np.float32 and a.shape == THETA[k].shape and np.isfinite(a).all()
    assert 1 <= result.num_examples <= 1000 and result.partition_id in (None, 0, 1, 2)
    assert _metrics_allowed(result.metrics)


@PROFILE
@given(values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=12, max_size=12), weight=st.integers(1, 1000), pid=st.integers(0, 2))
def test_an_honest_train_reply_is_accepted_with_its_values_unchanged(values, weight, pid):
    arrays = {"l.lora_A.weight": np.array(values[:6], np.float32).reshape(2, 3), "l.lora_B.weight": np.array(values[6:], np.float32).reshape(3, 2)}
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
            "metrics": MetricRecord({"num-examples": weight, "partition-id": pid, "loss": 0.5}),
        }
    )
    result = parse_train(_reply(content, "train"), NODE, TRAIN)
    assert isinstance(result, TrainReply)
    assert all(np.array_equal(result.arrays[k], v) for k, v in arrays.items())
    assert (result.num_examples, result.partition_id) == (weight, pid)
    assert result.client_entry() == {"node-id": NODE, "num-examples": weight, "partition-id": pid, "loss": 0.5}


@pytest.mark.parametrize(
    "dtype",
    [np.float16, np.float64, np.complex64, np.int32, np.dtype("U2"), np.dtype(">f4")],
)
def test_arrays_of_any_dtype_but_little_endian_float32_are_refused(dtype):
    arrays = {k: np.ones(v.shape).astype(dtype) for k, v in THETA.items()}
    result = parse_train(_reply(_train_content(arrays), "train"), NODE, TRAIN)
    assert isinstance(result, Rejection) and "expected" in result.reason and "float32" in result.reason


def test_an_array_whose_header_lies_about_its_shape_is_refused_before_decoding():
    a = Array(np.ones((3, 2), np.float32))
    a.shape = (2, 3)  # the metadata says θ's shape; the .npy header says (3, 2)
    result = parse_train(_reply(_train_content({"l.lora_A.weight": a}), "train"), NODE, TRAIN)
    assert isinstance(result, Rejection) and "(3, 2)" in result.reason


def test_a_reply_larger_than_theta_allows_is_refused_without_decoding_it():
    # θ: 12 float32 = 48 bytes; the bound is 48 + 2 headers of 1 KiB + 64 KiB of metrics = 67,632.
    assert TRAIN.max_bytes == 48 + 2 * 1024 + 65536
    big = Array(dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=b"\0" * 100_000)
    result = parse_train(_reply(_train_content({"l.lora_A.weight": big}), "train"), NODE, TRAIN)
    assert isinstance(result, Rejection) and "more than this phase allows (67632)" in result.reason


def test_a_node_id_in_the_metrics_is_refused_whatever_its_value():
    for value in ([1, 2], 1001.0, 1003):
        result = parse_train(_reply(_train_content({}, **{"node-id": value}), "train"), NODE, TRAIN)
        assert isinstance(result, Rejection) and "'node-id' is reserved" in result.reason


def _claims(pairs) -> tuple[dict, list]:
    replies, disputes = settle_partition_claims([TrainReply(n, 5, p, dict(THETA), {"partition-id": p, "loss": 0.5}) for n, p in pairs])
    return {r.node_id: (r.partition_id, r.metrics) for r in replies}, [(d["node-id"], d["reason"]) for d in disputes]


def test_two_claims_of_one_partition_are_both_refused_and_the_replies_stay_without_it():
    kept, refused = _claims([(1001, 0), (1002, 1), (1003, 1)])
    assert kept == {1001: (0, {"partition-id": 0, "loss": 0.5}), 1002: (None, {"loss": 0.5}), 1003: (None, {"loss": 0.5})}
    assert refused == [(n, "'partition-id' 1 is claimed by nodes 1002, 1003 in this round") for n in (1002, 1003)]


def test_claims_are_settled_per_round_and_never_remembered():
    # A node that claimed a partition first holds nothing afterwards: no first-come binding.
    assert _claims([(1002, 0)])[1] == []
    assert _claims([(1001, 0)]) == ({1001: (0, {"partition-id": 0, "loss": 0.5})}, [])


@PROFILE
@given(reason=st.one_of(hostile_text, st.just("x\n=== 2026-01-01T00:00:00Z round 1 node 1001 train: forged\n" * 1000)))
def test_an_error_reply_is_a_rejection_with_one_safe_bounded_line(reason):
    for phase, parse, expected in (("train", parse_train, TRAIN), ("query.score", parse_score, SCORE), ("evaluate", parse_evaluate, EVALUATE)):
        result = parse(_error(reason, phase), NODE, expected)
        _check_rejection(result)
        assert result.reason.startswith("error reply: ")


# -- score --------------------------------------------------------------------------------------

_score = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, 744.0, 745.0, -1e-7, -1e-5, 0.0]), st.floats(0.0, 5.0))
score_values = st.one_of(st.lists(_score, min_size=6, max_size=6), st.lists(_score, max_size=8))


@PROFILE
@given(j=score_values, k=score_values, extra=st.dictionaries(hostile_text, metric_values, max_size=3))
def test_the_score_parser_never_raises_and_keeps_every_score_a_kl_can_be(j, k, extra):
    try:
        record = MetricRecord({**extra, "teacher-scores": j, "change-scores": k})
    except Exception:  # noqa: BLE001 - not sendable
        return
    result = parse_score(_reply(RecordDict({"scores": record}), "query.score"), NODE, SCORE)
    if isinstance(result, Rejection):
        return _check_rejection(result)
    event("accepted")
    assert isinstance(result, ScoreReply) and len(result.teacher_scores) == len(result.change_scores) == 6
    for value in result.teacher_scores + result.change_scores:
        assert value == math.inf or 0.0 <= value <= KL_MAX
    # Accepted means: every finite input was within [-1e-6, 1074 ln 2]
    assert all(not math.isfinite(x) or -1e-6 <= x <= KL_MAX for x in j + k)


def test_the_kl_bound_is_the_largest_kl_float64_probabilities_can_give():
    # KL(q ‖ p) <= -log(min positive p): a point mass q against p = 2^-1074 at that point.
    q, p = 1.0, np.nextafter(0.0, 1.0)  # 2^-1074
    assert float(q * (np.log(q) - np.log(p))) == pytest.approx(KL_MAX, rel=1e-12)
    assert KL_MAX == pytest.approx(744.44007, abs=1e-5)


def test_a_teacher_score_of_1e308_refuses_the_reply():
    record = MetricRecord({"teacher-scores": [1e308] * 6, "change-scores": [0.0] * 6})
    result = parse_score(_reply(RecordDict({"scores": record}), "query.score"), NODE, SCORE)
    assert isinstance(result, Rejection) and "exceeds 744.44" in result.reason


# -- evaluate -----------------------------------------------------------------------------------


@PROFILE
@given(
    content=st.one_of(
        contents("evaluate"),
        metric_records({"num-examples": 5, "accuracy": 50.0}).map(lambda m: RecordDict({"metrics": m})),
        st.builds(
            lambda acc, extra: RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": acc, **extra})}),
            st.floats(-10.0, 110.0),
            st.dictionaries(st.sampled_from(["avg@8", "pass@8", "eval_s", "response_length"]), st.floats(-10.0, 200.0), max_size=4),
        ),
    )
)
def test_the_evaluate_parser_never_raises_and_accepts_only_percentages_and_finite_scalars(content):
    result = parse_evaluate(_reply(content, "evaluate"), NODE, EVALUATE)
    if isinstance(result, Rejection):
        return _check_rejection(result)
    event("accepted")
    assert isinstance(result, EvaluateReply) and "accuracy" in result.metrics
    assert 1 <= result.num_examples <= 100
    for k, v in result.metrics.items():
        assert not isinstance(v, list) and math.isfinite(v)
        if k.startswith(("accuracy", "avg@", "pass@")):
            assert 0.0 <= v <= 100.0
    assert _metrics_allowed(result.metrics)


def test_a_fortran_ordered_array_is_refused():
    arrays = {k: np.asfortranarray(np.ones(v.shape, np.float32)) for k, v in THETA.items()}
    result = parse_train(_reply(_train_content(arrays), "train"), NODE, TRAIN)
    assert isinstance(result, Rejection) and "in C order" in result.reason


def test_an_array_with_bytes_beyond_its_shape_is_refused():
    a = Array(THETA["l.lora_A.weight"])
    a.data = a.data + b"\0" * 4  # header (2, 3) float32: 24 bytes; 28 follow it
    result = parse_train(_reply(_train_content({"l.lora_A.weight": a}), "train"), NODE, TRAIN)
    assert isinstance(result, Rejection) and "holds 28 bytes of data: (2, 3) float32 takes 24" in result.reason


def test_arrays_in_another_order_than_thetas_are_refused():
    arrays = dict(reversed(list(THETA.items())))
    result = parse_train(_reply(_train_content(arrays), "train"), NODE, TRAIN)
    assert isinstance(result, Rejection) and "in another order" in result.reason


def test_a_list_metric_of_64_is_kept_and_of_65_refused():
    kept = parse_train(_reply(_train_content(dict(THETA), extra=[0.5] * 64), "train"), NODE, TRAIN)
    assert isinstance(kept, TrainReply) and kept.metrics["extra"] == [0.5] * 64
    refused = parse_train(_reply(_train_content(dict(THETA), extra=[0.5] * 65), "train"), NODE, TRAIN)
    assert isinstance(refused, Rejection) and refused.reason == "metric 'extra' is a list of 65: at most 64 allowed"


@pytest.mark.parametrize("accuracy, kept", [(0.0, True), (100.0, True), (100.5, False), (-0.5, False)])
def test_an_evaluation_percentage_outside_0_100_is_refused(accuracy, kept):
    content = RecordDict({"metrics": MetricRecord({"num-examples": 5, "accuracy": accuracy})})
    result = parse_evaluate(_reply(content, "evaluate"), NODE, EVALUATE)
    assert isinstance(result, EvaluateReply) == kept


def test_an_evaluate_reply_without_a_required_metric_is_refused():
    # The aggregate keeps the metrics all clients share: one client leaving avg@8 out would drop it.
    expected = Expected(num_partitions=3, max_examples=100, required=("avg@8", "pass@8"))
    full = {"num-examples": 5, "accuracy": 50.0, "avg@8": 40.0, "pass@8": 70.0}
    assert isinstance(parse_evaluate(_reply(RecordDict({"metrics": MetricRecord(full)}), "evaluate"), NODE, expected), EvaluateReply)
    partial = {k: v for k, v in full.items() if k != "avg@8"}
    result = parse_evaluate(_reply(RecordDict({"metrics": MetricRecord(partial)}), "evaluate"), NODE, expected)
    assert isinstance(result, Rejection) and result.reason == "'avg@8' is missing"
