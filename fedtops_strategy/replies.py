"""The boundary: every reply a client sends becomes a typed value or a :class:`Rejection`, here only.

A reply comes from a host the server does not control (another version of the app, a broken GPU,
a hostile participant). :func:`parse_train`, :func:`parse_score` and :func:`parse_evaluate` turn
one reply into a :class:`TrainReply`, :class:`ScoreReply` or :class:`EvaluateReply`, or into a
:class:`Rejection` that names the node and the reason. They never raise. Nothing downstream
(averaging, privacy, selection, records, logs, figures) reads a raw ``Message``.

What a typed value guarantees:

* **Identity** comes from the message's metadata (the SuperLink sets the sender), never from its
  content: a metric named ``node-id`` (the key the server writes) is refused. ``partition-id`` is
  a claim: two claims of one partition in a phase are both refused (:func:`settle_partition_claims`),
  and the replies count without it.
* **Size** is bounded before anything is decoded, from the lengths of the byte buffers the
  message already holds (no copy): a train reply may hold θ_t's bytes plus :data:`ARRAY_HEADER_BYTES`
  per array and :data:`METRIC_BYTES` of metrics; a score or evaluate reply, :data:`METRIC_BYTES`.
* **Metrics**: at most :data:`MAX_METRICS` keys of at most :data:`MAX_KEY_CHARS` characters from
  :data:`KEY_ALPHABET`, numbers or lists of at most :data:`MAX_LIST` numbers, finite and within
  ±:data:`MAX_MAGNITUDE` (score vectors may hold ±inf and NaN: that candidate is then infeasible
  for the client). The ``num-examples`` weight is a positive integer no larger than what a client
  can hold; ``partition-id`` an integer in [0, n).
* **Arrays** (train): exactly θ_t's keys in θ_t's order, each a NumPy ``.npy`` buffer whose header
  says little-endian float32, C order and θ_t's shape, of exactly that many bytes, every value
  finite. Each is decoded once (a read-only view of the buffer); what was checked is what is averaged.
  Any other dtype, float16 and float64 included, is refused, not converted: the wire format is
  float32 (the app's clients always send it), so another dtype means another version or a fault,
  and a silent conversion would hide it and change what the average means.
* **Scores** (FedTOPS): one Ĵ_i(a) and one K̂_i(a) per candidate. A KL is >= 0 (rounding-level
  negatives down to −:data:`SCORE_NEGATIVE_TOL` are clamped to 0) and, where finite, at most
  :data:`KL_MAX`: the clients compute π̃ in float64, whose smallest positive value is 2^-1074, so
  a finite KL of probability vectors is at most −log 2^-1074 = 1074·ln 2 ≈ 744.44 (KL(q‖p) =
  Σ q log q − Σ q log p <= 0 + max(−log p)). A larger finite value cannot come from the
  computation and refuses the reply; NaN or ±inf makes that candidate infeasible for the client.
* **Text**: a rejection's reason is one line (:func:`fedtops_strategy.text.escape`), at most
  :data:`MAX_REASON_CHARS` characters.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fedtops_strategy.text import escape, is_safe

WEIGHT_KEY = "num-examples"
PARTITION_KEY = "partition-id"
NODE_KEY = "node-id"  # written by the server into each client's record entry: never from a client
ERROR_REPLY = "error reply: "  # the start of a Rejection reason for a client's error reply
TEACHER_SCORES, CHANGE_SCORES, SCORE_SE = "teacher-scores", "change-scores", "teacher-score-se"

MAX_METRICS = 64
MAX_KEY_CHARS = 64
KEY_ALPHABET = "A-Z a-z 0-9 _ - . @"
_KEY = re.compile(r"[A-Za-z0-9_.@-]{1,64}\Z")
MAX_LIST = 64  # and at least the number of candidates (score vectors)
MAX_MAGNITUDE = 1e15  # |x| of any metric: sums over any number of clients stay finite
METRIC_BYTES = 1 << 16  # what a reply's metrics may take besides its arrays
ARRAY_HEADER_BYTES = 1 << 10  # a .npy header (numpy writes 128 bytes for these shapes)
MAX_REASON_CHARS = 500
KL_MAX = 1074 * math.log(2)  # the largest finite KL over float64 probability vectors (module docstring)
SCORE_NEGATIVE_TOL = 1e-6  # a KL is never negative; fp32 rounding can give -1e-9

# What a train reply's metrics hold today (client_app/handlers.py); the ones present must be scalars.
TRAIN_SCALARS = frozenset(
    {
        WEIGHT_KEY,
        PARTITION_KEY,
        "loss",
        "loss_first",
        "loss_last",
        "kl_before",
        "kl_after",
        "response_length",
        "cap_hit_rate",
        "accuracy",
        "cache_teacher_score",
        "steps",
        "tokens",
        "lr_first",
        "lr_last",
        "rollout_s",
        "grade_s",
        "teacher_s",
        "cache_s",
        "opd_s",
        "train_s",
        "total_s",
        "worker-pid",
        "worker-model-loads",
        "worker-rss-mb",
    }
)
EVALUATE_PERCENT_PREFIXES = ("accuracy", "avg@", "pass@")

Metric = int | float | list[int] | list[float]


@dataclass(frozen=True)
class Rejection:
    """A reply left out: the node it came from (metadata) and why (one escaped line)."""

    node_id: int
    reason: str

    def entry(self, prefix: str = "") -> dict[str, Any]:
        """The round record's ``excluded`` entry (``prefix``: e.g. ``score: ``)."""
        return {"node-id": self.node_id, "reason": prefix + self.reason}


@dataclass(frozen=True)
class TrainReply:
    """A checked train reply. ``arrays``: θ_t's keys and shapes, float32, finite (read-only)."""

    node_id: int
    num_examples: int
    partition_id: int | None
    arrays: dict[str, np.ndarray]
    metrics: dict[str, Metric] = field(default_factory=dict)

    def client_entry(self) -> dict[str, Any]:
        """The round record's ``clients`` entry: the node id (from metadata), then the metrics."""
        return {NODE_KEY: self.node_id, **{k: list(v) if isinstance(v, list) else v for k, v in self.metrics.items()}}


@dataclass(frozen=True)
class ScoreReply:
    """A checked score reply: Ĵ_i and K̂_i per candidate, in [0, KL_MAX] or inf (infeasible);
    ``se``: the standard errors of Ĵ_i (a variant asks for them; None when absent or invalid)."""

    node_id: int
    teacher_scores: list[float]
    change_scores: list[float]
    se: list[float] | None = None
    metrics: dict[str, Metric] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluateReply:
    """A checked evaluate reply: every metric a finite number; percentages in [0, 100]."""

    node_id: int
    num_examples: int
    partition_id: int | None
    metrics: dict[str, int | float] = field(default_factory=dict)

    def client_entry(self) -> dict[str, Any]:
        return {NODE_KEY: self.node_id, **self.metrics}


@dataclass(frozen=True)
class Progress:
    """A reply as it arrives, checked for its progress line only: its node (metadata), the
    partition it claims (an int in [0, ``MAX_PARTITION_ID``)) and its metrics (names, numbers and
    magnitudes checked, :func:`_metrics`). The phase's own parser still decides whether it counts."""

    node_id: int
    partition_id: int
    metrics: dict[str, Metric]


@dataclass(frozen=True)
class Expected:
    """What a phase's replies may hold, from what the server knows: θ_t's shapes (train), the
    candidates (score), the federation's size and what a client can hold."""

    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    num_partitions: int | None = None
    max_examples: int | None = None
    num_candidates: int = 0
    # metrics every reply of the phase must hold (evaluate: accuracy, avg@k and pass@k of eval.samples)
    required: tuple[str, ...] = ()

    @property
    def max_bytes(self) -> int:
        """The most bytes a reply may hold: θ_t's float32 arrays with their headers, and the metrics."""
        arrays = sum(4 * math.prod(s) + ARRAY_HEADER_BYTES for s in self.shapes.values())
        return arrays + METRIC_BYTES

    @classmethod
    def for_train(cls, theta: Mapping[str, np.ndarray], num_partitions: int | None, max_examples: int | None) -> Expected:
        return cls({k: tuple(np.shape(v)) for k, v in theta.items()}, num_partitions, max_examples)


# -------------------------------------------------------------------------------------------------
# The three phases
# -------------------------------------------------------------------------------------------------


class _Refused(Exception):
    """Raised inside a parser only, caught at its top: the reason a reply is refused."""


class _guarded:  # noqa: N801 - used as a decorator
    """A parser that returns a :class:`Rejection` for whatever goes wrong, never raises."""

    def __init__(self, parse: Callable[..., Any]) -> None:
        self.parse = parse
        self.__doc__, self.__name__ = parse.__doc__, parse.__name__

    def __call__(self, message, node_id: int, expected: Expected):
        try:
            return self.parse(message, int(node_id), expected)
        except _Refused as why:  # its client-made parts were escaped where it was written
            reason = str(why)
            return Rejection(int(node_id), reason if is_safe(reason) and len(reason) <= MAX_REASON_CHARS else escape(reason, MAX_REASON_CHARS))
        except Exception as err:  # noqa: BLE001 - a reply no check foresaw is still only a bad reply
            return Rejection(int(node_id), escape(f"the reply cannot be read ({type(err).__name__}: {err})", MAX_REASON_CHARS))


@_guarded
def parse_train(message, node_id: int, expected: Expected) -> TrainReply | Rejection:
    """One train reply: an ArrayRecord with θ_t's float32 arrays and a MetricRecord (train schema)."""
    _check_error(message)
    content = message.content
    _check_size(content, expected.max_bytes)
    arrays_records, metric_records = list(content.array_records.values()), list(content.metric_records.values())
    if len(arrays_records) != 1 or len(metric_records) != 1 or len(content.config_records) != 0:
        raise _Refused(f"expected one ArrayRecord and one MetricRecord, got {len(arrays_records)} and {len(metric_records)}" + _others(content))
    metrics = _metrics(metric_records[0], expected, vectors=())
    weight, partition = _weight_and_partition(metrics, expected)
    for key in sorted(TRAIN_SCALARS & set(metrics)):
        if isinstance(metrics[key], list):
            raise _Refused(f"metric '{key}' is a list: expected a number")
    arrays = _arrays(arrays_records[0], expected.shapes)
    return TrainReply(node_id, weight, partition, arrays, metrics)


@_guarded
def parse_score(message, node_id: int, expected: Expected) -> ScoreReply | Rejection:
    """One score reply: a MetricRecord with one Ĵ_i(a) and one K̂_i(a) per candidate."""
    metrics = _only_metrics(message, expected, vectors=(TEACHER_SCORES, CHANGE_SCORES, SCORE_SE))
    k = expected.num_candidates
    j, c = metrics.get(TEACHER_SCORES), metrics.get(CHANGE_SCORES)
    if not isinstance(j, list) or not isinstance(c, list) or len(j) != k or len(c) != k:
        raise _Refused(f"expected {k} teacher and change scores")
    if WEIGHT_KEY in metrics:  # never read (Ĵ is weighted by the train reply), but it must be a weight
        _weight_and_partition({WEIGHT_KEY: metrics[WEIGHT_KEY]}, Expected(), what="(or none: Ĵ is weighted by the train reply)")
    teacher = _kl_values(j, "teacher scores")
    change = _kl_values(c, "change scores")
    for a in range(k):  # a candidate a client cannot score is infeasible for it, on both counts
        if math.isinf(teacher[a]) or math.isinf(change[a]):
            teacher[a] = change[a] = math.inf
    others = {key: v for key, v in metrics.items() if key not in (TEACHER_SCORES, CHANGE_SCORES, SCORE_SE)}
    return ScoreReply(node_id, teacher, change, _standard_errors(metrics.get(SCORE_SE), k), others)


@_guarded
def parse_evaluate(message, node_id: int, expected: Expected) -> EvaluateReply | Rejection:
    """One evaluate reply: a MetricRecord of finite numbers with ``accuracy`` and the weight."""
    metrics = _only_metrics(message, expected, vectors=())
    for key in ("accuracy", *expected.required):
        if key not in metrics:
            # a client that leaves a metric out would otherwise drop it from the federation's aggregate
            raise _Refused(f"'{key}' is missing")
    weight, partition = _weight_and_partition(metrics, expected)
    for key, value in metrics.items():
        if isinstance(value, list):
            raise _Refused(f"metric '{key}' is a list: evaluation metrics are averaged over clients, expected a number")
        if key.startswith(EVALUATE_PERCENT_PREFIXES) and not 0.0 <= value <= 100.0:
            raise _Refused(f"metric '{key}' is {_show(value)}: expected a percentage in [0, 100]")
    return EvaluateReply(node_id, weight, partition, metrics)


def settle_partition_claims(replies: Sequence) -> tuple[list, list[dict[str, Any]]]:
    """(the replies, those whose ``partition-id`` claim was refused without it; one
    ``disputed-partitions`` entry per refused claim: node, partition, reason).

    A partition id is a claim the server cannot verify. Within one phase of a round, a partition
    claimed by two or more nodes is refused for all of them, naming every one. A refused claim
    costs the reply its partition, never its update: the average, the evaluation and Local's
    per-node adapters still count it as the node's own (its node id comes from the metadata). So
    copying an honest client's partition id gains a node nothing and pushes nobody out; no claim
    is remembered across rounds (a first-come binding would let a node that answers first, or
    while the honest one is away, take the partition for good).
    """
    nodes: dict[int, list[int]] = {}
    for r in replies:
        if r.partition_id is not None:
            nodes.setdefault(r.partition_id, []).append(r.node_id)
    out, disputes = [], []
    for r in replies:
        claimants = nodes.get(r.partition_id, []) if r.partition_id is not None else []
        if len(claimants) > 1:
            reason = f"'{PARTITION_KEY}' {r.partition_id} is claimed by nodes {', '.join(map(str, sorted(claimants)))} in this round"
            disputes.append({"node-id": r.node_id, PARTITION_KEY: r.partition_id, "reason": reason})
            r = replace(r, partition_id=None, metrics={k: v for k, v in r.metrics.items() if k != PARTITION_KEY})
        out.append(r)
    return out, sorted(disputes, key=lambda d: (d[PARTITION_KEY], d["node-id"]))


# -------------------------------------------------------------------------------------------------
# The checks
# -------------------------------------------------------------------------------------------------


def _check_error(message) -> None:
    if message.has_error():
        raise _Refused(f"{ERROR_REPLY}{escape(message.error.reason, MAX_REASON_CHARS)}")


def _only_metrics(message, expected: Expected, vectors: Sequence[str]) -> dict[str, Metric]:
    """The checked metrics of a reply that must hold one MetricRecord and nothing else (score,
    evaluate): not an error, within :data:`METRIC_BYTES`, then :func:`_metrics`."""
    _check_error(message)
    content = message.content
    _check_size(content, METRIC_BYTES)
    records = list(content.metric_records.values())
    if len(records) != 1 or len(content.array_records) or len(content.config_records):
        raise _Refused("expected one MetricRecord" + _others(content))
    return _metrics(records[0], expected, vectors=vectors)


MAX_PARTITION_ID = 1 << 20  # a progress line's partition-id is below it


@_guarded
def parse_progress(message, node_id: int, expected: Expected) -> Progress | Rejection:
    """A reply that is not an error, with one MetricRecord of checked metrics (score vectors of at
    most ``expected.num_candidates``, non-finite allowed) and a partition id in [0, MAX_PARTITION_ID).
    Its arrays are not read here: the phase's parser checks them."""
    _check_error(message)
    records = list(message.content.metric_records.values())
    if len(records) != 1:
        raise _Refused(f"expected one MetricRecord, got {len(records)}")
    metrics = _metrics(records[0], expected, vectors=(TEACHER_SCORES, CHANGE_SCORES, SCORE_SE))
    partition = metrics.get(PARTITION_KEY)
    if not (_integer(partition) and 0 <= partition < MAX_PARTITION_ID):
        raise _Refused(f"'{PARTITION_KEY}' is {_show(partition)}: expected an integer in [0, {MAX_PARTITION_ID})")
    return Progress(node_id, int(partition), metrics)


def content_bytes(content) -> int:
    """The bytes a RecordDict holds, from the lengths of its buffers (nothing is copied): array
    data, 8 per number, and the characters of keys, strings and bytes."""
    total = 0
    for record in content.values():
        for key, value in record.items():
            total += len(key)
            data = getattr(value, "data", None)
            if isinstance(data, (bytes, bytearray, memoryview)):
                total += len(data) + len(getattr(value, "dtype", "")) + 8 * len(getattr(value, "shape", ()))
            elif isinstance(value, (str, bytes)):
                total += len(value)
            elif isinstance(value, list):
                total += sum(len(v) if isinstance(v, (str, bytes)) else 8 for v in value)
            else:
                total += 8
    return total


def _check_size(content, limit: int) -> None:
    size = content_bytes(content)
    if size > limit:
        raise _Refused(f"the reply holds {size} bytes, more than this phase allows ({limit})")


def _others(content) -> str:
    extra = len(content.config_records)
    return f" (and {extra} ConfigRecord(s))" if extra else ""


def _metrics(record, expected: Expected, vectors: Sequence[str]) -> dict[str, Metric]:
    """A MetricRecord's items, checked: count, keys, types, list lengths, magnitudes. The keys in
    ``vectors`` may hold non-finite numbers (scores: infeasible), bounded in length by the candidates."""
    if len(record) > MAX_METRICS:
        raise _Refused(f"{len(record)} metrics: at most {MAX_METRICS} allowed")
    out: dict[str, Metric] = {}
    max_list = max(MAX_LIST, expected.num_candidates)
    for key, value in record.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise _Refused(f"metric key '{escape(key, 80)}': expected 1-{MAX_KEY_CHARS} characters of {KEY_ALPHABET}")
        if key == NODE_KEY:
            raise _Refused(f"metric '{NODE_KEY}' is reserved: the server takes a node's id from the message, not its content")
        if isinstance(value, list):
            if len(value) > max_list:
                raise _Refused(f"metric '{key}' is a list of {len(value)}: at most {max_list} allowed")
            if not all(_real(v) for v in value):
                raise _Refused(f"metric '{key}' holds a value that is not a number")
            if key not in vectors and not all(_bounded(v) for v in value):
                raise _Refused(f"metric '{key}' is {_show(value)}: expected finite numbers within ±{MAX_MAGNITUDE:g}")
            out[key] = [v if isinstance(v, int) else float(v) for v in value]
        elif _real(value):
            if not _bounded(value):
                raise _Refused(f"metric '{key}' is {_show(value)}: expected a finite number within ±{MAX_MAGNITUDE:g}")
            out[key] = value if isinstance(value, int) else float(value)
        else:
            raise _Refused(f"metric '{key}' is a {type(value).__name__}: expected a number or a list of numbers")
    return out


def _weight_and_partition(metrics: Mapping[str, Metric], expected: Expected, what: str = "") -> tuple[int, int | None]:
    weight = metrics.get(WEIGHT_KEY)
    if not (_integer(weight) and weight > 0):
        raise _Refused(f"'{WEIGHT_KEY}' is {_show(weight)}: expected a positive integer" + (f" {what}" if what else ""))
    if expected.max_examples and weight > expected.max_examples:
        raise _Refused(f"'{WEIGHT_KEY}' is {_show(weight)}: more than a client can hold ({expected.max_examples})")
    partition = metrics.get(PARTITION_KEY)
    if partition is not None:
        n = expected.num_partitions
        if not (_integer(partition) and partition >= 0 and (not n or partition < n)):
            upper = f", < {n}" if n else ""
            raise _Refused(f"'{PARTITION_KEY}' is {_show(partition)}: expected an integer >= 0{upper}")
        partition = int(partition)
    return int(weight), partition


def _arrays(record, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """θ_t's arrays from an ArrayRecord: keys, dtype, shape and byte count checked before decoding,
    then decoded once (a read-only view of the message's buffer) and checked finite."""
    keys = list(record.keys())
    if keys != list(shapes):
        return _refuse_keys(keys, list(shapes))
    out = {}
    for key, shape in shapes.items():
        array = record[key]
        if getattr(array, "stype", None) != "numpy.ndarray" or getattr(array, "dtype", None) != "float32":
            raise _Refused(
                f"array '{key}' is {escape(str(getattr(array, 'dtype', '?')), 40)}: expected float32 (the wire format; nothing is converted)"
            )
        if tuple(getattr(array, "shape", ())) != tuple(shape):
            raise _Refused(f"array '{key}' has shape {escape(str(tuple(array.shape)), 60)}: the global adapter's is {tuple(shape)}")
        out[key] = _decode(key, array.data, shape)
    for key, value in out.items():
        if not np.isfinite(value).all():
            raise _Refused(f"array '{key}' holds values that are not finite")
    return out


def _decode(key: str, data, shape: tuple[int, ...]) -> np.ndarray:
    """A .npy buffer as a read-only float32 array, after checking its own header: little-endian
    float32, C order, ``shape``, and exactly the bytes that holds."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise _Refused(f"array '{key}' has no byte buffer")
    stream = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        header = read(stream, max_header_size=ARRAY_HEADER_BYTES)
    except (ValueError, SyntaxError, TypeError) as err:
        raise _Refused(f"array '{key}' is not a NumPy array buffer ({escape(str(err), 100)})") from None
    got_shape, fortran, dtype = header
    if dtype != np.dtype("<f4") or fortran or tuple(got_shape) != tuple(shape):
        raise _Refused(
            f"array '{key}' holds {escape(str(dtype), 40)} {escape(str(got_shape), 60)}: expected little-endian float32 {tuple(shape)} in C order"
        )
    offset, count = stream.tell(), math.prod(shape)
    if len(data) - offset != 4 * count:
        raise _Refused(f"array '{key}' holds {len(data) - offset} bytes of data: {tuple(shape)} float32 takes {4 * count}")
    return np.frombuffer(data, dtype="<f4", count=count, offset=offset).reshape(shape)


def _refuse_keys(got: list[str], want: list[str]) -> dict:
    missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
    detail = f"missing {escape(missing[0], 80)}" if missing else (f"unexpected {escape(extra[0], 80)}" if extra else "in another order")
    raise _Refused(f"its array keys differ from the global adapter's ({len(got)} against {len(want)}; {detail})")


def _kl_values(values: Sequence[float], what: str) -> list[float]:
    """KL values as the selection reads them: clamped at 0 against rounding, inf for NaN/±inf."""
    out = []
    for x in values:
        if not math.isfinite(x):
            out.append(math.inf)
        elif x < -SCORE_NEGATIVE_TOL:
            raise _Refused(f"{what}: score {_show(x)} is negative beyond rounding (tolerance {SCORE_NEGATIVE_TOL:g}); a KL is >= 0")
        elif x > KL_MAX:
            raise _Refused(f"{what}: score {_show(x)} exceeds {KL_MAX:.2f}, the largest finite KL over float64 probabilities")
        else:
            out.append(max(float(x), 0.0))
    return out


def _standard_errors(values, k: int) -> list[float] | None:
    """k standard errors of Ĵ_i, each in [0, KL_MAX] or inf; None when absent or invalid (NaN,
    negative, a finite value no standard error of KLs in [0, KL_MAX] can have)."""
    if not isinstance(values, list) or len(values) != k:
        return None
    if not all(v >= 0 and (math.isinf(v) or v <= KL_MAX) for v in values):  # NaN fails v >= 0
        return None
    return [float(v) for v in values]


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bounded(value: Any) -> bool:
    return _real(value) and math.isfinite(value) and abs(value) <= MAX_MAGNITUDE


def _integer(value: Any) -> bool:
    return _real(value) and math.isfinite(value) and float(value).is_integer()


def _show(value: Any) -> str:
    """A value as a reason shows it: short and on one line, whatever it is."""
    return escape(repr(value), 60)
