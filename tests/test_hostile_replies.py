"""A client that sends malformed metrics cannot crash the run (issue: the schema gate per phase).

The app's own ServerApp, strategies and ClientApp in one process (``InProcessGrid``); a hostile
client rewrites its reply's metrics in one phase and round (``tamper``). Before the schema gate
each of these ended the ServerApp: ``int()`` of a list or NaN ``partition-id`` in the progress
line, Flower's ``InconsistentMessageReplies`` for an extra, missing or renamed metric key, and
``float()`` of a list ``accuracy`` in the evaluation. Now the run completes, the global adapter
stays finite, and the record names the node and the reason (or, for a newer client's extra key,
keeps the reply and the key).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import TINY
from flwr.app import Message, MetricRecord, RecordDict

from fedopd.config import parse_run_config
from server_app.inprocess import FIRST_NODE_ID, InProcessGrid

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]

CONFIG = {
    **TINY,
    "rollout.backend": "hf",
    "rollout.per-round": 8,
    "rollout.max-new-tokens": 16,
    "data.prompts-per-client": 16,
    "train.mini-batch": 4,
    "train.micro-batch": 2,
    "num-server-rounds": 1,
    "eval.every": 0,
    "strategy.name": "fedtops",
}
HOSTILE = 1  # the partition whose node sends the crafted replies
NODE = FIRST_NODE_ID + HOSTILE


class HostileGrid(InProcessGrid):
    """Replies of partition HOSTILE in (message type, round) get their metrics rewritten."""

    def __init__(self, *args, tamper, **kwargs):
        super().__init__(*args, **kwargs)
        self.tamper = tamper  # (message type, round) -> metrics dict -> metrics dict

    def _deliver(self, msg: Message) -> Message:
        reply = super()._deliver(msg)
        key = (msg.metadata.message_type, int(msg.content["config"]["server-round"]))
        if int(msg.metadata.dst_node_id) != NODE or key not in self.tamper or reply.has_error():
            return reply
        content = RecordDict()
        for name, record in reply.content.items():
            content[name] = MetricRecord(self.tamper[key](dict(record.items()))) if isinstance(record, MetricRecord) else record
        return Message(content=content, reply_to=msg)


def _run(tmp_path, tamper, **overrides):
    from client_app.app import app
    from server_app.app import run_server
    from server_app.run_folder import read_rounds

    cfg = parse_run_config({**CONFIG, **overrides, "output-dir": str(tmp_path)})
    folder = run_server(HostileGrid(app, cfg.to_run_config(), 3, tamper=tamper), cfg)
    return folder, read_rounds(folder)


def _finite_adapter(folder, server_round):
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / f"round-{server_round:03d}" / "adapter_model.safetensors"))
    return all(np.isfinite(t).all() for t in tensors.values())


def _set(key, value):
    return lambda metrics: {**metrics, key: value}


@pytest.mark.parametrize(
    "value, reason",
    [
        ([1, 2], "'partition-id' is [1, 2]: expected an integer >= 0, < 3"),
        (math.nan, "metric 'partition-id' is nan: expected a finite number or a list of them"),
        (math.inf, "metric 'partition-id' is inf: expected a finite number or a list of them"),
        (7, "'partition-id' is 7: expected an integer >= 0, < 3"),
        (0.5, "'partition-id' is 0.5: expected an integer >= 0, < 3"),
    ],
    ids=["list", "nan", "inf", "out-of-range", "fraction"],
)
def test_a_train_reply_with_a_bad_partition_id_is_left_out_and_the_run_goes_on(tmp_path, value, reason):
    """Before: the progress line's int() raised out of the grid's reply hook and ended the ServerApp."""
    folder, [record] = _run(tmp_path, {("train", 1): _set("partition-id", value)})
    assert [c["partition-id"] for c in record["clients"]] == [0, 2]
    assert record["excluded"] == [{"node-id": NODE, "reason": reason}]
    assert _finite_adapter(folder, 1)


def test_a_newer_clients_extra_metrics_are_kept_and_never_reach_flowers_aggregation(tmp_path):
    """Before: Flower's validate_message_reply_consistency raised InconsistentMessageReplies."""
    folder, [record] = _run(tmp_path, {("train", 1): lambda m: {**m, "new-metric": 0.25, "new-histogram": [1.0, 2.0]}})
    assert [c["partition-id"] for c in record["clients"]] == [0, 1, 2] and record["excluded"] == []
    hostile = record["clients"][1]
    assert hostile["new-metric"] == 0.25 and hostile["new-histogram"] == [1.0, 2.0]
    assert _finite_adapter(folder, 1)


def test_a_reply_missing_a_metric_other_clients_send_is_averaged(tmp_path):
    folder, [record] = _run(tmp_path, {("train", 1): lambda m: {k: v for k, v in m.items() if k != "loss"}})
    assert [c["partition-id"] for c in record["clients"]] == [0, 1, 2] and record["excluded"] == []
    assert "loss" not in record["clients"][1]


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (lambda m: {("weight" if k == "num-examples" else k): v for k, v in m.items()}, "'num-examples' is None: expected a positive integer"),
        (_set("num-examples", 2.5), "'num-examples' is 2.5: expected a positive integer"),
        (_set("loss", [0.1, 0.2]), "metric 'loss' is a list: expected a number"),
        (_set("loss", math.nan), "metric 'loss' is nan: expected a finite number or a list of them"),
    ],
    ids=["renamed-weight", "fractional-weight", "list-for-a-scalar", "nan-metric"],
)
def test_a_train_reply_that_breaks_the_schema_is_left_out_naming_the_key(tmp_path, tamper, reason):
    folder, [record] = _run(tmp_path, {("train", 1): tamper})
    assert [c["partition-id"] for c in record["clients"]] == [0, 2]
    assert record["excluded"] == [{"node-id": NODE, "reason": reason}]
    assert _finite_adapter(folder, 1)


def test_a_score_reply_with_a_list_partition_id_does_not_stop_the_run(tmp_path):
    """Before: the progress line's int() of the partition id raised out of the grid's reply hook."""
    folder, [record] = _run(tmp_path, {("query.score", 1): _set("partition-id", [1, 2])})
    assert record["multiplier"] in record["candidates"] + [0.0]
    assert _finite_adapter(folder, 1)


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (_set("accuracy", [50.0, 60.0]), "metric 'accuracy' is a list: evaluation metrics are averaged over clients, expected a number"),
        (_set("accuracy", 150.0), "metric 'accuracy' is 150.0: expected a percentage in [0, 100]"),
        (_set("partition-id", math.inf), "metric 'partition-id' is inf: expected a finite number or a list of them"),
    ],
    ids=["list-accuracy", "accuracy-above-100", "inf-partition-id"],
)
def test_an_evaluate_reply_that_breaks_the_schema_is_left_out_of_the_evaluation(tmp_path, tamper, reason):
    """Before: float() of a list accuracy crashed the ServerApp in the evaluation."""
    sandbox = {"model.student": "builtin:sandbox-student", "model.teacher": "builtin:sandbox-teacher", "data.name": "sandbox"}
    evaluation = {"eval.every": 1, "eval.prompts-per-client": 4, "eval.samples": 2, "eval.max-new-tokens": 32}
    folder, [first, record] = _run(tmp_path, {("evaluate", 1): tamper}, **sandbox, **evaluation)
    evaluation = record["evaluation"]
    assert sorted(c["partition-id"] for c in evaluation["clients"]) == [0, 2]
    assert evaluation["excluded"] == [{"node-id": NODE, "reason": reason}]
    assert evaluation["accuracy"] == pytest.approx(sum(c["accuracy"] for c in evaluation["clients"]) / 2)
    assert first["round"] == 0 and len(first["evaluation"]["clients"]) == 3


def test_a_logging_hook_that_raises_never_stops_the_run(tmp_path, monkeypatch):
    """The grid calls the progress-line hook on every reply; whatever makes it fail is logged."""
    import server_app.app as server

    def broken(msg):
        raise ValueError("cannot convert float NaN to integer")

    monkeypatch.setattr(server, "log_reply", broken)
    folder, [record] = _run(tmp_path, {})
    assert [c["partition-id"] for c in record["clients"]] == [0, 1, 2] and _finite_adapter(folder, 1)


@pytest.mark.parametrize("value", [[1, 2], math.nan, math.inf], ids=["list", "nan", "inf"])
def test_the_progress_line_of_a_reply_with_a_bad_partition_id_is_none(value):
    from server_app.log_lines import reply_summary

    reply = Message(content=RecordDict({"metrics": MetricRecord({"partition-id": value, "accuracy": 1.0})}), dst_node_id=1, message_type="evaluate")
    assert reply_summary(reply) is None
