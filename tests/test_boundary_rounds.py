"""Whole in-process rounds with one node that sends generated, arbitrary replies (the reply boundary).

SPEC.md, "Where it runs": every message from a client is untrusted input; one node can be
excluded but never crash, stall or corrupt the run, each exclusion is recorded with its node id
and reason, the node id comes from the message's metadata, ``partition-id`` is a claim (two
claims of one partition in a round are both refused), arrays arrive as float32 with θ_t's keys
and shapes, every size a client controls is bounded and client text is escaped before it reaches
the stream or any file.

The app's own ServerApp (``server_app.app.run_server``), strategies and ClientApp run in one
process (``InProcessGrid``) on the tiny preset. Every node's reply is computed for real; node
``FIRST_NODE_ID + 1`` then replaces its reply in one phase with a generated RecordDict or error
(``BoundaryGrid``). Everything is checked through the run folder, the grid's own view of which
messages went where, and the log records: nothing here reads a strategy's internals.

Hypothesis: ``HYPOTHESIS_PROFILE=nightly`` runs many more (random) examples; by default a few
derandomized ones, so that the suite stays short and reproducible.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import unicodedata
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("hypothesis")

from conftest import TINY_RUN  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedopd.config import parse_run_config  # noqa: E402
from server_app.inprocess import FIRST_NODE_ID, InProcessGrid  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]

# ---------------------------------------------------------------------------------------------
# Hypothesis profiles: bounded and derandomized by default, many random examples nightly.
# Named per module so that loading them never changes other modules' Hypothesis tests.
# ---------------------------------------------------------------------------------------------

_SLOW = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large, HealthCheck.large_base_example]
# By default no shrinking either: each example is a whole run (seconds), and a shrink could take dozens.
settings.register_profile(
    "boundary-default",
    max_examples=8,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=_SLOW,
    phases=[Phase.explicit, Phase.generate],
    print_blob=True,
)
settings.register_profile("boundary-nightly", max_examples=200, derandomize=False, deadline=None, database=None, suppress_health_check=_SLOW)
PROFILE = settings.get_profile(
    {"nightly": "boundary-nightly", "default": "boundary-default"}.get(os.environ.get("HYPOTHESIS_PROFILE", "default"), "boundary-default")
)

# ---------------------------------------------------------------------------------------------
# The federation: three nodes, the middle one hostile
# ---------------------------------------------------------------------------------------------

NODES = (FIRST_NODE_ID, FIRST_NODE_ID + 1, FIRST_NODE_ID + 2)
HOSTILE = FIRST_NODE_ID + 1  # partition 1
HONEST = (FIRST_NODE_ID, FIRST_NODE_ID + 2)  # partitions 0 and 2
TRAIN, SCORE, EVALUATE = "train", "query.score", "evaluate"

CONFIG = {**TINY_RUN, "num-server-rounds": 1, "eval.every": 0, "strategy.name": "fedtops", "num-clients": 3}
# The evaluation needs held-out problems: the sandbox models and prompts (as tests/test_hostile_replies.py).
EVALUATION = {
    "model.student": "builtin:sandbox-student",
    "model.teacher": "builtin:sandbox-teacher",
    "data.name": "sandbox",
    "eval.every": 1,
    "eval.prompts-per-client": 2,
    "eval.samples": 1,
    "eval.max-new-tokens": 16,
}

MAX_LINE_BYTES = 1_000_000  # a rounds.jsonl line (one round's record) stays below 1 MB whatever a client sends
FORBIDDEN_CATEGORIES = {"Cc", "Cf", "Zl", "Zp"}  # control, format (U+202E, U+200B, ...), line and paragraph separators


def _round_of(msg: Message) -> int:
    return int(msg.content["config"]["server-round"])


class BoundaryGrid(InProcessGrid):
    """The in-process grid; node HOSTILE's reply to a message of (message type, round) is replaced
    by ``forge[(type, round)](message, honest_reply)`` (``forge[(type, None)]``: every round); in
    the message types of ``silent`` it never answers (it stays connected). Every reply is first
    computed for real. ``sent`` lists (message type, round, destination node) of every message."""

    def __init__(self, *args, forge=None, silent=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.forge = dict(forge or {})
        self.silent = set(silent)
        self.sent: list[tuple[str, int, int]] = []
        self.honest: dict[tuple[str, int, int], Message] = {}  # the real replies, by (type, round, node)

    def _deliver(self, msg: Message) -> Message | None:
        reply = super()._deliver(msg)
        phase, server_round, node = msg.metadata.message_type, _round_of(msg), int(msg.metadata.dst_node_id)
        self.sent.append((phase, server_round, node))
        self.honest[(phase, server_round, node)] = reply
        if node != HOSTILE:
            return reply
        if phase in self.silent:
            return None  # no reply; pull_messages never returns one
        forge = self.forge.get((phase, server_round), self.forge.get((phase, None)))
        return reply if forge is None else forge(msg, reply)

    def pull_messages(self, message_ids):
        return [m for m in super().pull_messages(message_ids) if m is not None]

    def destinations(self, phase: str, server_round: int | None = None) -> list[int]:
        return [n for p, r, n in self.sent if p == phase and (server_round is None or r == server_round)]


def _run(out: Path, forge=None, silent=(), **overrides) -> tuple[Path, BoundaryGrid]:
    from client_app.app import app
    from server_app.app import run_server

    cfg = parse_run_config({**CONFIG, **overrides, "output-dir": str(out)})
    grid = BoundaryGrid(app, cfg.to_run_config(), len(NODES), forge=forge, silent=silent)
    folder = run_server(grid, cfg)  # must return, not raise
    return folder, grid


def _with_content(msg: Message, honest: Message, *, metrics=None, arrays=None) -> Message:
    """The honest reply with its MetricRecords' dicts passed through ``metrics`` and its
    ArrayRecords' numpy arrays through ``arrays`` (arrays in, θ_t -> arrays out)."""
    content = RecordDict()
    for name, record in honest.content.items():
        if isinstance(record, MetricRecord) and metrics is not None:
            record = MetricRecord(metrics(dict(record.items())))
        elif isinstance(record, ArrayRecord) and arrays is not None:
            theta = {k: v.numpy() for k, v in msg.content["arrays"].items()}
            record = ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays({k: v.numpy() for k, v in record.items()}, theta).items()})
        content[name] = record
    return Message(content=content, reply_to=msg)


# ---------------------------------------------------------------------------------------------
# What the run folder and the log must show, whatever the hostile node sent
# ---------------------------------------------------------------------------------------------


def _reject_constant(name):
    raise ValueError(f"rounds.jsonl holds the non-JSON constant {name}")


def _strict_records(folder: Path) -> list[dict]:
    """rounds.jsonl, each line strict JSON (no NaN / Infinity) and below MAX_LINE_BYTES."""
    records = []
    for number, line in enumerate((folder / "rounds.jsonl").read_bytes().splitlines(), 1):
        assert len(line) < MAX_LINE_BYTES, f"rounds.jsonl line {number} is {len(line)} bytes (bound {MAX_LINE_BYTES})"
        records.append(json.loads(line, parse_constant=_reject_constant))
    return records


def _status(folder: Path) -> dict:
    return json.loads((folder / "status.json").read_text())


def _adapter(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def _global_adapter(folder: Path, server_round: int) -> dict[str, np.ndarray]:
    return _adapter(folder / f"round-{server_round:03d}" / "adapter_model.safetensors")


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _walk(value, key: str):
    """Every value under ``key`` anywhere in a record (nested dicts and lists)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v, key)


def _clean(text: str) -> bool:
    return not any(unicodedata.category(ch) in FORBIDDEN_CATEGORIES for ch in text)


def _check_logs(caplog) -> None:
    for record in caplog.records:
        try:
            message = record.getMessage()
        except Exception as err:  # noqa: BLE001 - a message that cannot be formatted is a finding too
            pytest.fail(f"a log record cannot be formatted: {err!r} ({record.msg!r})")
        for line in message.splitlines() or [""]:
            assert "\x1b" not in line and "\u202e" not in line, f"log line with ESC or U+202E: {line[:200]!r}"
    text = caplog.text  # with the formatted tracebacks
    assert "\x1b" not in text and "\u202e" not in text, "the captured log holds an ESC or a U+202E"


def _check_run(folder: Path, caplog, *, timed_out=(), collided=(), honest_in_clients=True) -> list[dict]:
    """The boundary's promises for a run with node HOSTILE sending whatever it liked.

    ``timed_out``: nodes that may be excluded for silence; ``collided``: honest nodes whose
    partition id the hostile node claimed (both claims are refused, so they may be excluded).
    """
    assert _status(folder)["status"] == "completed", _status(folder)
    adapters = sorted(folder.glob("round-*/**/adapter_model.safetensors"))
    assert adapters, "no adapter saved"
    for path in adapters:
        for name, tensor in _adapter(path).items():
            assert tensor.dtype == np.float32, f"{path.relative_to(folder)}: {name} is {tensor.dtype}"
            assert np.isfinite(tensor).all(), f"{path.relative_to(folder)}: {name} is not finite"
    records = _strict_records(folder)
    may_be_excluded = {HOSTILE, *timed_out}  # a refused partition claim never excludes an honest node
    for record in records:
        for excluded in _walk(record, "excluded"):
            assert isinstance(excluded, list), excluded
            for entry in excluded:
                node = entry.get("node-id")
                assert type(node) is int and node in may_be_excluded, f"round {record.get('round')}: excluded {entry!r}"
                reason = entry.get("reason")
                assert isinstance(reason, str) and reason.strip(), f"round {record.get('round')}: excluded without a reason: {entry!r}"
                assert _clean(reason), f"round {record.get('round')}: a control or format character in the reason {reason[:300]!r}"
        for clients in _walk(record, "clients"):
            if not isinstance(clients, list):  # the privacy field's count of clients
                continue
            ids = [c.get("node-id") for c in clients]
            assert all(type(n) is int and n in NODES for n in ids), f"round {record.get('round')}: client node ids {ids!r}"
            assert len(ids) == len(set(ids)), f"round {record.get('round')}: a node id twice in {ids!r}"
            if honest_in_clients:
                missing = set(HONEST) - set(timed_out) - set(ids)
                assert not missing, f"round {record.get('round')}: honest node(s) {sorted(missing)} missing from the clients {ids!r}"
    _check_logs(caplog)
    return records


# ---------------------------------------------------------------------------------------------
# Generated replies
# ---------------------------------------------------------------------------------------------

FORGED_HEADER = "=== 2026-01-01 00:00:00 UTC round 1 node 1001 train: forged"
NASTY_TEXT = [
    "line\nbreak",
    "cr\r\nlf",
    "\x1b[31mred\x1b[0m",
    "\u202eevil",
    FORGED_HEADER,
    "\x00nul",
    "\u2028sep\u2029",
    "\ufeffbom",
    "\u200bzero-width",
    "\x9b31mC1",
    "tab\there",
    "node-id",
    "partition-id",
    "",
    " ",
]
FLOAT_EXTREMES = [0.0, -0.0, 1.0, -1.0, 1e38, -1e38, 3.5e38, 1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324]
INT_EXTREMES = [0, 1, 2, 3, -1, 16, 1001, 1002, 1003, 2**31, -(2**63), 2**63 - 1]


def _repeat(piece: str, n: int) -> str:
    return (piece * (n // max(1, len(piece)) + 1))[:n]


text = st.one_of(
    st.sampled_from(NASTY_TEXT),
    st.text(max_size=30),
    st.builds(_repeat, st.sampled_from(["k", "\x1b[31m", "\u202e", "é\n"]), st.integers(1, 10_000)),  # keys up to 10k characters
)
floats = st.one_of(st.sampled_from(FLOAT_EXTREMES), st.floats())
ints = st.one_of(st.sampled_from(INT_EXTREMES), st.integers(-(2**63), 2**63 - 1))


def _lists(elements):
    return st.one_of(st.lists(elements, max_size=6), st.builds(lambda v, n: [v] * n, elements, st.integers(0, 10_000)))


metric_values = st.one_of(ints, floats, _lists(ints), _lists(floats))
partition_claims = st.sampled_from([0, 2, 1, 0.0, 2.0, 1.5, [0], [0, 2], [0.0], 3, -1, math.nan, math.inf, 2**63 - 1])
node_claims = st.sampled_from([FIRST_NODE_ID, FIRST_NODE_ID + 2, HOSTILE, 1001.0, 1003.0, 7.5, [1001], [1001, 1003], -1, 0, 2**63 - 1, math.nan])
known_keys = st.sampled_from(["num-examples", "loss", "accuracy", "avg@1", "pass@1", "teacher-scores", "change-scores", "score_s", "steps"])
metric_ops = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.one_of(known_keys, text), metric_values),
        st.tuples(st.just("set"), st.just("partition-id"), partition_claims),
        st.tuples(st.just("set"), st.just("node-id"), node_claims),
        st.tuples(st.just("del"), st.one_of(known_keys, st.just("partition-id")), st.none()),
    ),
    max_size=4,
)
config_values = st.one_of(text, st.lists(text, max_size=4))
extra_records = st.lists(
    st.one_of(
        st.tuples(
            st.just("metrics"),
            st.one_of(st.sampled_from(["metrics", "scores"]), text),
            st.dictionaries(st.one_of(text, known_keys), metric_values, max_size=4),
        ),
        st.tuples(st.just("config"), st.one_of(st.sampled_from(["config", "metrics"]), text), st.dictionaries(text, config_values, max_size=4)),
        st.tuples(st.just("arrays"), st.one_of(st.sampled_from(["arrays", "extra"]), text), st.integers(0, 1_000_000)),
    ),
    max_size=3,
)
ODD_DTYPES = ["float16", "float64", "complex64", "int32", "bool", "unicode", "unicode-scalar"]
array_ops = st.lists(
    st.one_of(
        st.tuples(st.just("dtype"), st.sampled_from(ODD_DTYPES), st.booleans(), st.integers(0, 99)),
        st.tuples(st.just("shape"), st.sampled_from(["transpose", "flat", "drop-row", "add-dim", "empty"]), st.booleans(), st.integers(0, 99)),
        st.tuples(st.just("extra"), text, st.integers(0, 1_000_000), st.integers(0, 99)),  # a named extra array, up to 4 MB
        st.tuples(st.just("missing"), st.none(), st.booleans(), st.integers(0, 99)),
        st.tuples(st.just("value"), st.sampled_from(FLOAT_EXTREMES), st.booleans(), st.integers(0, 99)),
        st.tuples(st.just("scale"), st.sampled_from([1e6, 1e30, -1.0, 0.0]), st.booleans(), st.integers(0, 99)),
        st.tuples(st.just("theta"), st.none(), st.booleans(), st.integers(0, 99)),
    ),
    max_size=3,
)
error_reasons = st.one_of(
    st.sampled_from(NASTY_TEXT + [FORGED_HEADER + "\nTraceback (most recent call last):\n  forged\x1b[2J"]),
    st.text(max_size=200),
    st.builds(_repeat, st.sampled_from(["x", "\x1b[31mred\n", "\u202e", FORGED_HEADER + "\n"]), st.integers(1, 1_000_000)),  # up to 1 MB
)
errors = st.fixed_dictionaries({"kind": st.just("error"), "code": st.integers(-(2**31), 2**31 - 1), "reason": error_reasons})
empty = st.just({"kind": "empty"})
SCORE_VALUES = [1e308, -1e308, -1.0, math.nan, math.inf, -math.inf, 0.0, 1e-300, 0.5, 1e3, -1e-12]
score_vectors = st.one_of(
    st.tuples(st.just("right"), st.lists(st.sampled_from(SCORE_VALUES), min_size=1, max_size=12)),  # one value per candidate
    st.tuples(st.just("length"), st.integers(0, 10_000)),  # the wrong number of values
    st.tuples(st.just("honest"), st.none()),
)


def _content_plans(**parts):
    return st.fixed_dictionaries(
        {
            "kind": st.just("content"),
            "metrics": metric_ops,
            "extra": extra_records,
            "drop": st.sampled_from([None, None, "arrays", "metrics", "scores"]),
            **parts,
        }
    )


train_plans = st.one_of(errors, empty, _content_plans(arrays=array_ops))
score_plans = st.one_of(errors, empty, _content_plans(teacher=score_vectors, change=score_vectors))
evaluate_plans = st.one_of(
    errors,
    empty,
    _content_plans(accuracy=st.one_of(st.none(), st.sampled_from([math.nan, math.inf, -1.0, 150.0, 1e308, 50.0, [50.0, 60.0], 0, 100]))),
)


def _odd_dtype(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "unicode":
        return np.full(a.shape, "a")
    if dtype == "unicode-scalar":
        return np.array(["a"])
    with np.errstate(all="ignore"):
        return a.astype(dtype)


def _reshaped(a: np.ndarray, how: str) -> np.ndarray:
    return {
        "transpose": lambda: a.T.copy(),
        "flat": lambda: a.reshape(-1),
        "drop-row": lambda: a[:-1].copy(),
        "add-dim": lambda: a[None].copy(),
        "empty": lambda: np.zeros((0,), np.float32),
    }[how]()


def _apply_arrays(ops, arrays: dict[str, np.ndarray], theta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    arrays, names = dict(arrays), list(arrays)
    for kind, arg, every, index in ops:  # (what, its argument, every array or one, which one)
        name = names[index % len(names)]
        targets = [n for n in (names if every else [name]) if n in arrays]
        with np.errstate(all="ignore"):
            if kind == "dtype":
                arrays.update({n: _odd_dtype(arrays[n], arg) for n in targets})
            elif kind == "shape":
                arrays.update({n: _reshaped(arrays[n], arg) for n in targets})
            elif kind == "extra":
                arrays[arg] = np.full(every, 1.0, np.float32)  # here ``every`` is the extra array's size
            elif kind == "missing":
                arrays.pop(name, None)
            elif kind == "value":
                for n in targets:
                    a = np.array(arrays[n], copy=True)
                    if a.dtype.kind in "fc" and a.size:
                        if every:
                            a[...] = arg
                        else:
                            a.flat[0] = arg
                    arrays[n] = a
            elif kind == "scale":
                arrays.update({n: arrays[n] * np.float32(arg) if arrays[n].dtype.kind in "fc" else arrays[n] for n in targets})
            elif kind == "theta":
                arrays = dict(theta)
    return arrays


def _apply_metrics(ops, metrics: dict) -> dict:
    metrics = dict(metrics)
    for kind, key, value in ops:
        if kind == "set":
            metrics[key] = value
        else:
            metrics.pop(key, None)
    return metrics


def _score_vector(spec, honest_values, n: int):
    kind, arg = spec
    if kind == "right":
        return [float(arg[i % len(arg)]) for i in range(n)]
    if kind == "length":
        return [0.0] * (arg if arg != n else n + 1)
    return honest_values


def _extra_record(kind: str, payload):
    if kind == "metrics":
        return MetricRecord(dict(payload))
    if kind == "config":
        return ConfigRecord(dict(payload))
    return ArrayRecord({"extra": Array(np.full(payload, 0.5, np.float32))})


def _forger(plan, claims: list):
    """A forge function for BoundaryGrid from a drawn plan; every 'partition-id' the forged reply
    claims is appended to ``claims``."""

    def forge(msg: Message, honest: Message) -> Message:
        if honest.has_error():
            return honest
        if plan["kind"] == "error":
            claims.append(None)
            return Message(Error(code=plan["code"], reason=plan["reason"]), reply_to=msg)
        if plan["kind"] == "empty":
            return Message(content=RecordDict(), reply_to=msg)
        content = RecordDict()
        for name, record in honest.content.items():
            if name == plan["drop"]:
                continue
            if isinstance(record, ArrayRecord) and "arrays" in plan:
                theta = {k: v.numpy() for k, v in msg.content["arrays"].items()}
                arrays = _apply_arrays(plan["arrays"], {k: v.numpy() for k, v in record.items()}, theta)
                record = ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})
            elif isinstance(record, MetricRecord):
                metrics = dict(record.items())
                if "teacher" in plan:
                    n = len(list(msg.content["config"]["candidates"]))
                    metrics["teacher-scores"] = _score_vector(plan["teacher"], metrics.get("teacher-scores"), n)
                    metrics["change-scores"] = _score_vector(plan["change"], metrics.get("change-scores"), n)
                if plan.get("accuracy") is not None:
                    metrics["accuracy"] = plan["accuracy"]
                record = MetricRecord(_apply_metrics(plan["metrics"], metrics))
            content[name] = record
        for kind, name, payload in plan["extra"]:
            content[name] = _extra_record(kind, payload)
        for record in content.values():
            if isinstance(record, (MetricRecord, ConfigRecord)) and "partition-id" in record:
                claims.append(record["partition-id"])
        return Message(content=content, reply_to=msg)

    return forge


def _collided(claims: list) -> set[int]:
    """The honest nodes whose partition id a forged reply claimed (as a number)."""
    out = set()
    for claim in claims:
        for partition in (0, 2):
            try:
                if not isinstance(claim, (list, bool)) and float(claim) == partition:
                    out.add(FIRST_NODE_ID + partition)
            except (TypeError, ValueError):
                pass
    return out


def _example_dir(tmp_path: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=tmp_path))


def _capture(caplog) -> None:
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="flwr")


# ---------------------------------------------------------------------------------------------
# Properties: one phase of one round, any reply
# ---------------------------------------------------------------------------------------------


def _one_generated_reply(tmp_path, caplog, phase, plan, **overrides) -> list[dict]:
    """A run in which node HOSTILE answers ``phase`` (of round 1; evaluate: every evaluation) with
    ``plan``'s reply; the boundary's promises checked on it (:func:`_check_run`)."""
    _capture(caplog)
    claims: list = []
    key = (phase, None if phase == EVALUATE else 1)
    folder, _ = _run(_example_dir(tmp_path), {key: _forger(plan, claims)}, **overrides)
    return _check_run(folder, caplog, collided=_collided(claims))


@settings(PROFILE)
@given(plan=train_plans)
def test_any_train_reply_of_one_node_leaves_the_round_complete_and_the_record_clean(tmp_path, caplog, plan):
    _one_generated_reply(tmp_path, caplog, TRAIN, plan)


@settings(PROFILE)
@given(plan=score_plans)
def test_any_score_reply_of_one_node_leaves_the_round_complete_and_the_record_clean(tmp_path, caplog, plan):
    _one_generated_reply(tmp_path, caplog, SCORE, plan)


@settings(PROFILE)
@given(plan=evaluate_plans)
def test_any_evaluate_reply_of_one_node_leaves_the_round_complete_and_the_record_clean(tmp_path, caplog, plan):
    records = _one_generated_reply(tmp_path, caplog, EVALUATE, plan, **EVALUATION)
    assert [r["round"] for r in records] == [0, 1] and all("evaluation" in r for r in records)


# ---------------------------------------------------------------------------------------------
# Regressions: one reported case each
# ---------------------------------------------------------------------------------------------


def _set_metric(key, value):
    return lambda msg, honest: _with_content(msg, honest, metrics=lambda m: {**m, key: value})


@pytest.mark.parametrize("claim", [[1001, 1003], 1003.0, FIRST_NODE_ID], ids=["list", "float", "another-nodes-id"])
def test_a_node_id_in_train_metrics_never_replaces_the_senders_identity_and_the_score_query_goes_to_the_averaged_nodes(tmp_path, caplog, claim):
    _capture(caplog)
    folder, grid = _run(tmp_path, {(TRAIN, 1): _set_metric("node-id", claim)})
    [record] = _check_run(folder, caplog)
    ids = [c["node-id"] for c in record["clients"]]
    assert ids.count(FIRST_NODE_ID) == 1 and ids.count(FIRST_NODE_ID + 2) == 1, ids
    assert set(HONEST) <= set(record["scored-node-ids"]) <= set(NODES), record["scored-node-ids"]
    assert sorted(grid.destinations(SCORE, 1)) == sorted(ids), (grid.destinations(SCORE, 1), ids)


def test_two_first_claims_of_one_partition_are_both_refused_and_both_nodes_still_count(tmp_path, caplog):
    _capture(caplog)
    folder, _ = _run(tmp_path, {(TRAIN, 1): _set_metric("partition-id", 0)})
    [record] = _check_run(folder, caplog)
    assert record["excluded"] == []
    claim = "'partition-id' 0 is claimed by nodes 1001, 1002 in this round"
    assert record["disputed-partitions"] == [{"node-id": n, "partition-id": 0, "reason": claim} for n in (FIRST_NODE_ID, HOSTILE)]
    clients = {c["node-id"]: c for c in record["clients"]}
    assert sorted(clients) == list(NODES)  # both updates still averaged, as the nodes' own
    assert "partition-id" not in clients[FIRST_NODE_ID] and "partition-id" not in clients[HOSTILE]
    assert clients[FIRST_NODE_ID + 2]["partition-id"] == 2


def test_a_copied_partition_id_in_a_later_round_refuses_both_claims_and_keeps_both_updates(tmp_path, caplog):
    _capture(caplog)
    folder, _ = _run(tmp_path, {(TRAIN, 2): _set_metric("partition-id", 0)}, **{"num-server-rounds": 2})
    records = _check_run(folder, caplog)
    claim = "'partition-id' 0 is claimed by nodes 1001, 1002 in this round"
    assert records[1]["disputed-partitions"] == [{"node-id": n, "partition-id": 0, "reason": claim} for n in (FIRST_NODE_ID, HOSTILE)]
    assert records[1]["excluded"] == [] and sorted(c["node-id"] for c in records[1]["clients"]) == list(NODES)


def test_under_local_a_claimed_partition_never_replaces_that_clients_saved_adapter(tmp_path, caplog):
    _capture(caplog)
    forged = {}

    def shifted(arrays, theta):
        forged.update({k: (v + np.float32(0.25)).astype(np.float32) for k, v in arrays.items()})
        return forged

    # Round 1: every node trains its own partition. Round 2: node 1002 claims partition 0 too: both
    # claims are refused, both nodes keep training their own adapters, and each folder keeps the
    # partition its node last claimed without dispute (client-0: node 1001, client-1: node 1002).
    claim = {(TRAIN, 2): lambda msg, honest: _with_content(msg, honest, metrics=lambda m: {**m, "partition-id": 0}, arrays=shifted)}
    folder, grid = _run(tmp_path, claim, **{"strategy.name": "local", "num-server-rounds": 2})
    records = _check_run(folder, caplog)
    saved = _adapter(folder / "round-002" / "client-0" / "adapter_model.safetensors")
    assert forged and not _same(saved, forged), "client 0's saved adapter is the one node 1002 sent under its partition id"
    honest = {k: v.numpy() for k, v in grid.honest[(TRAIN, 2, FIRST_NODE_ID)].content["arrays"].items()}
    assert _same(saved, honest)
    assert _same(_adapter(folder / "round-002" / "client-1" / "adapter_model.safetensors"), forged)  # node 1002's own
    assert records[1]["excluded"] == [] and [d["node-id"] for d in records[1]["disputed-partitions"]] == [FIRST_NODE_ID, HOSTILE]


@pytest.mark.parametrize("dtype", ["str", "complex64", "float16"])
def test_arrays_of_another_dtype_are_refused_and_the_global_adapter_stays_float32(tmp_path, caplog, dtype):
    _capture(caplog)

    def cast(arrays, theta):
        return {k: np.full(v.shape, "a") if dtype == "str" else v.astype(dtype) for k, v in arrays.items()}

    folder, _ = _run(tmp_path, {(TRAIN, 1): lambda msg, honest: _with_content(msg, honest, arrays=cast)})
    [record] = _check_run(folder, caplog)  # float32 and finite everywhere
    assert [e["node-id"] for e in record["excluded"]] == [HOSTILE], record["excluded"]
    assert [c["node-id"] for c in record["clients"]] == list(HONEST)


def test_a_teacher_score_of_1e308_at_every_candidate_keeps_the_record_and_figure_going(tmp_path, caplog):
    _capture(caplog)

    def huge(msg, honest):
        n = len(list(msg.content["config"]["candidates"]))
        return _with_content(msg, honest, metrics=lambda m: {**m, "teacher-scores": [1e308] * n})

    folder, _ = _run(tmp_path, {(SCORE, 1): huge}, **{"logging.tensorboard": True})
    [record] = _check_run(folder, caplog)
    scores = record["teacher_scores"]
    assert scores and all(type(s) in (int, float) and math.isfinite(s) for s in scores), scores
    figure, adapter = folder / "progress.png", folder / "round-001" / "adapter_model.safetensors"
    assert figure.exists() and figure.stat().st_mtime_ns >= adapter.stat().st_mtime_ns, "progress.png was not drawn after round 1"


def test_a_fixed_step_that_overflows_in_round_1_does_not_hold_the_later_honest_rounds(tmp_path, caplog):
    _capture(caplog)
    # 3.3e38 is finite in fp32 (max 3.4e38); the mean of three is ~1.1e38 and θ_1 + 5 Δ ~5.5e38 is
    # not: round 1 holds. Flower's FedAvgM had stored that non-finite step as its model.
    overflow = {(TRAIN, 1): lambda msg, honest: _with_content(msg, honest, arrays=lambda a, t: {k: np.full_like(v, 3.3e38) for k, v in a.items()})}
    folder, _ = _run(tmp_path, overflow, **{"strategy.name": "fixed", "strategy.multiplier": 5.0, "num-server-rounds": 3})
    assert _status(folder)["status"] == "completed", _status(folder)
    records = _strict_records(folder)
    assert [r["round"] for r in records] == [1, 2, 3]
    later = [(r.get("multiplier"), r.get("hold-reason"), r.get("excluded")) for r in records[1:]]
    assert records[0]["multiplier"] == 0.0 and records[0]["hold-reason"] == "θ_t + 5 Δ_t is not finite"
    assert [r.get("multiplier") for r in records[1:]] == [5.0, 5.0], later
    first = _global_adapter(folder, 1)
    assert not _same(_global_adapter(folder, 2), first) and not _same(_global_adapter(folder, 3), first), "rounds 2 and 3 kept round 1's adapter"
    _check_run(folder, caplog)


def test_a_node_that_never_answers_evaluate_sits_out_instead_of_costing_the_timeout_every_round(tmp_path, caplog):
    _capture(caplog)
    overrides = {**EVALUATION, "num-server-rounds": 3, "timeout.evaluate": 2.0, "timeout.skip-after": 1}
    folder, grid = _run(tmp_path, silent={EVALUATE}, **overrides)
    records = _check_run(folder, caplog, timed_out={HOSTILE})
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert any(HOSTILE in r.get("skipped-node-ids", []) for r in records), [r.get("skipped-node-ids") for r in records]
    asked = grid.destinations(EVALUATE).count(HOSTILE)
    assert asked < len(records), f"node {HOSTILE} was asked to evaluate in all {asked} evaluations and never answered"


def test_server_side_privacy_with_a_zero_update_completes(tmp_path, caplog):
    _capture(caplog)
    zero = {(TRAIN, 1): lambda msg, honest: _with_content(msg, honest, arrays=lambda a, theta: dict(theta))}
    privacy = {
        "privacy.clipping": "fixed",
        "privacy.side": "server",
        "privacy.noise-multiplier": 1.0,
        "strategy.name": "fedavg",
        "num-clients": 3,
    }
    folder, _ = _run(tmp_path, zero, **privacy)
    _check_run(folder, caplog)
