"""A client that sends malformed metrics cannot crash the run (issue: the schema gate per phase).

The app's own ServerApp, strategies and ClientApp in one process (``InProcessGrid``); a hostile
client rewrites its reply's metrics in one phase and round (``tamper``). Before the schema gate
each of these ended the ServerApp: ``int()`` of a list or NaN ``partition-id`` in the progress
line, Flower's ``InconsistentMessageReplies`` for an extra, missing or renamed metric key, and
``float()`` of a list ``accuracy`` in the evaluation. Now the run completes, the global adapter
stays finite, and the record names the node and the reason (or, for a newer client's extra key,
keeps the reply and the key).

The attacks on the average, the selection and the clock run the same way at the end of the file
(the defences' arithmetic is in tests/test_robustness.py).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from conftest import TINY_RUN
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from fedopd.config import parse_run_config
from server_app.inprocess import FIRST_NODE_ID, InProcessGrid

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]

CONFIG = {
    **TINY_RUN,
    "num-server-rounds": 1,
    "eval.every": 0,
    "strategy.name": "fedtops",
    "num-clients": 3,  # as a deployment sets it: the schema's ranges need the federation's size
}
HOSTILE = 1  # the partition whose node sends the crafted replies
NODE = FIRST_NODE_ID + HOSTILE


class HostileGrid(InProcessGrid):
    """Replies of partition HOSTILE in (message type, round) get their metrics rewritten
    (``tamper``) or their arrays (``tamper_arrays``: named numpy arrays -> named numpy arrays);
    in the message types of ``silent`` it never answers (it stays connected)."""

    def __init__(self, *args, tamper, tamper_arrays=None, silent=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.tamper = tamper  # (message type, round) -> metrics dict -> metrics dict
        self.tamper_arrays = tamper_arrays or {}
        self.silent = set(silent)

    def _deliver(self, msg: Message) -> Message:
        reply = super()._deliver(msg)
        key = (msg.metadata.message_type, int(msg.content["config"]["server-round"]))
        if int(msg.metadata.dst_node_id) != NODE or reply.has_error():
            return reply
        if key[0] in self.silent:
            return None  # no reply; pull_messages never returns one
        if key not in self.tamper and key not in self.tamper_arrays:
            return reply
        content = RecordDict()
        for name, record in reply.content.items():
            if isinstance(record, MetricRecord) and key in self.tamper:
                record = MetricRecord(self.tamper[key](dict(record.items())))
            elif isinstance(record, ArrayRecord) and key in self.tamper_arrays:
                arrays = self.tamper_arrays[key]({k: v.numpy() for k, v in record.items()})
                record = ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})
            content[name] = record
        return Message(content=content, reply_to=msg)

    def pull_messages(self, message_ids):
        return [m for m in super().pull_messages(message_ids) if m is not None]


def _run(tmp_path, tamper, tamper_arrays=None, silent=(), num_nodes=3, **overrides):
    from client_app.app import app
    from server_app.app import run_server
    from server_app.run_folder import read_rounds

    cfg = parse_run_config({**CONFIG, **overrides, "output-dir": str(tmp_path)})
    grid = HostileGrid(app, cfg.to_run_config(), num_nodes, tamper=tamper, tamper_arrays=tamper_arrays, silent=silent)
    folder = run_server(grid, cfg)
    return folder, read_rounds(folder)


def _every_round(phase, rounds, fn):
    return {(phase, r): fn for r in range(1, rounds + 1)}


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
        (math.nan, "metric 'partition-id' is nan: expected a finite number within ±1e+15"),
        (math.inf, "metric 'partition-id' is inf: expected a finite number within ±1e+15"),
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
        (_set("loss", math.nan), "metric 'loss' is nan: expected a finite number within ±1e+15"),
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
        (_set("partition-id", math.inf), "metric 'partition-id' is inf: expected a finite number within ±1e+15"),
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

    def broken(*args):
        raise ValueError("cannot convert float NaN to integer")

    monkeypatch.setattr(server, "log_reply", broken)
    folder, [record] = _run(tmp_path, {})
    assert [c["partition-id"] for c in record["clients"]] == [0, 1, 2] and _finite_adapter(folder, 1)


@pytest.mark.parametrize("value", [[1, 2], math.nan, math.inf], ids=["list", "nan", "inf"])
def test_the_progress_line_of_a_reply_with_a_bad_partition_id_is_none(value):
    from server_app.log_lines import reply_summary

    reply = Message(content=RecordDict({"metrics": MetricRecord({"partition-id": value, "accuracy": 1.0})}), dst_node_id=1, message_type="evaluate")
    assert reply_summary(reply) is None


# ---------------------------------------------------------------------------------------------
# Poison, stall and silence through the whole app
# ---------------------------------------------------------------------------------------------


def _adapter(folder, server_round):
    from safetensors.numpy import load_file

    return load_file(str(folder / f"round-{server_round:03d}" / "adapter_model.safetensors"))


def _moved(folder, server_round):
    """‖θ_t − θ_0‖ over all arrays."""
    start, now = _adapter(folder, 0), _adapter(folder, server_round)
    return math.sqrt(sum(float(np.sum((now[k].astype(np.float64) - start[k]) ** 2)) for k in start))


@pytest.mark.parametrize("num_clients", [3, 0], ids=["num-clients-3", "num-clients-0"])
def test_a_claimed_weight_beyond_the_prompt_pool_is_left_out(tmp_path, num_clients):
    """Before: num-examples = 1e9 made this client's update the whole average; with num-clients =
    0 (the nodes connected at the start, here 3) it still did (the colluding-clients review)."""
    folder, [record] = _run(tmp_path, {("train", 1): _set("num-examples", 10**9)}, **{"num-clients": num_clients})
    assert [c["partition-id"] for c in record["clients"]] == [0, 2]
    assert record["excluded"] == [{"node-id": NODE, "reason": "'num-examples' is 1000000000: more than a client can hold (48)"}]  # 16 x 3
    assert _finite_adapter(folder, 1)


def test_factors_a_million_times_larger_move_the_adapter_unless_clipped(tmp_path):
    """One client scales its factors by 1e6: FedAvg moves by ~1e5 without clipping; with
    strategy.clip-norm = 2 its update is scaled to twice the median norm (the record says so)."""
    huge = {("train", 1): lambda arrays: {k: v * 1e6 for k, v in arrays.items()}}
    plain, _ = _run(tmp_path / "plain", {}, tamper_arrays=huge, **{"strategy.name": "fedavg"})
    clipped, [record] = _run(tmp_path / "clipped", {}, tamper_arrays=huge, **{"strategy.name": "fedavg", "strategy.clip-norm": 2.0})
    honest, _ = _run(tmp_path / "honest", {}, **{"strategy.name": "fedavg"})
    assert _moved(plain, 1) > 1e4 * _moved(honest, 1)
    bounded = {b["node-id"]: b for b in record["bounded"]}
    assert bounded[NODE]["scale"] < 1e-4 and all(b["scale"] == 1.0 for n, b in bounded.items() if n != NODE)
    assert _finite_adapter(clipped, 1) and _moved(clipped, 1) < 3 * _moved(honest, 1)


def test_a_client_that_vetoes_every_round_holds_the_run_visibly_and_max_held_rounds_ends_it(tmp_path, caplog):
    """Before: every round held, nothing was logged at WARNING, and the run ended 'completed' with
    the initial adapter. Now each hold is a WARNING naming the node, the record counts its vetoes,
    and max-held-rounds = 2 ends the run as failed, naming it."""
    import json

    from server_app.app import RunFailed

    veto = _every_round("query.score", 3, _set("change-scores", [700.0] * 6))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        folder, records = _run(tmp_path / "held", veto, **{"num-server-rounds": 3})
    assert [r["multiplier"] for r in records] == [0.0, 0.0, 0.0]
    assert all(r["hold-node-ids"] == [NODE] and r["veto-counts"][HOSTILE] == 6 for r in records)
    assert sum("holds (a = 0)" in m and f"node(s) {NODE}" in m for m in caplog.messages) == 3
    start, end = _adapter(folder, 0), _adapter(folder, 3)
    assert all(np.array_equal(start[k], end[k]) for k in start)  # θ never moved

    with pytest.raises(RunFailed, match=rf"held \(a = 0, θ unchanged\) in 2 consecutive rounds .*node\(s\) {NODE}"):
        _run(tmp_path / "ended", veto, **{"num-server-rounds": 3, "max-held-rounds": 2})
    [run] = (tmp_path / "ended").glob("*-fedtops")
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and f"node(s) {NODE}" in status["error"]

    _, records = _run(tmp_path / "vetoes", veto, **{"num-server-rounds": 3, "strategy.max-vetoes": 1})
    assert all(r["multiplier"] > 0 for r in records)  # the other two choose


def test_a_node_that_stays_connected_but_never_answers_sits_out(tmp_path):
    """Before: sampled every round, each waiting the full timeout.train."""
    folder, records = _run(tmp_path, {}, silent={"train"}, **{"num-server-rounds": 4, "timeout.train": 1.0, "timeout.skip-after": 1})
    assert [NODE in r["sampled-node-ids"] for r in records] == [True, False, True, False]
    assert [r.get("skipped-node-ids", []) for r in records] == [[], [NODE], [], [NODE]]
    assert records[0]["excluded"] == [{"node-id": NODE, "reason": "train: no reply before the timeout"}]
    assert all(sorted(c["partition-id"] for c in r["clients"]) == [0, 2] for r in records)
    assert _finite_adapter(folder, 4)


def test_a_run_that_cannot_see_its_nodes_fails_at_the_start_deadline(tmp_path):
    """Before: Flower's sample_nodes waited forever for num-clients nodes."""
    import json

    from server_app.app import RunFailed

    with pytest.raises(RunFailed, match=r"round 1 waited \d+ s \(timeout.start = 0.5\) for 4 connected node\(s\) and saw 3"):
        _run(tmp_path, {}, **{"num-clients": 4, "timeout.start": 0.5})
    [run] = tmp_path.glob("*-fedtops")
    assert json.loads((run / "status.json").read_text())["status"] == "failed"


def test_the_stop_rules_count_consecutive_rounds_only():
    """max-held-rounds = 2 and max-failed-rounds = 2: held, not held, held never stops the run;
    two held rounds in a row do; a round with updates resets the failed count."""
    from server_app.stop_rules import StopRules

    held = {"clients": [{"node-id": 1}], "hold-reason": "no feasible candidate"}
    moved = {"clients": [{"node-id": 1}]}
    rules = StopRules(max_failed_rounds=2, max_held_rounds=2)
    assert [rules.after(t, r) for t, r in ((1, held), (2, moved), (3, held))] == [None, None, None]
    assert "held (a = 0, θ unchanged) in 2 consecutive rounds (3-4" in str(rules.after(4, held))
    rules = StopRules(max_failed_rounds=2, max_held_rounds=0)
    assert [rules.after(t, r) for t, r in ((1, moved), (2, {}), (3, moved), (4, {}))] == [None, None, None, None]
    assert "no client returned a valid update in 2 consecutive rounds (4-5)" in str(rules.after(5, {}))
