"""A client that fails or vanishes in ``train`` or ``query.score`` is left out of that round only.

Simulation through the app's own ServerApp, strategies and ClientApp (``InProcessGrid``); faults
are injected per (partition, message type, round): ``raise`` (the ClientApp raises: an error
reply), ``vanish`` (no reply ever arrives: the phase timeout ends the wait) or ``forget`` (the
client's ``context.state`` is lost before the message). A run in which no client can work fails.
"""

from __future__ import annotations

import pytest
from conftest import TINY_RUN
from flwr.app import Message

from fedopd.config import parse_run_config
from server_app.inprocess import FIRST_NODE_ID, InProcessGrid

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]

CONFIG = {
    **TINY_RUN,
    "num-server-rounds": 2,
    "eval.every": 0,
    "strategy.name": "fedtops",
    "strategy.trust-budget": 0.01,
    "timeout.train": 1.0,
    "timeout.score": 1.0,
}


class FaultyGrid(InProcessGrid):
    def __init__(self, *args, faults, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults  # (partition, message type, round) -> "raise" | "vanish" | "forget"

    def _deliver(self, msg: Message) -> Message:
        key = (int(msg.metadata.dst_node_id) - FIRST_NODE_ID, msg.metadata.message_type, int(msg.content["config"]["server-round"]))
        fault = self.faults.get(key)
        if fault == "forget":  # the client comes back with an empty context.state
            state = self.contexts[int(msg.metadata.dst_node_id)].state
            for name in list(state.keys()):
                del state[name]
        if fault == "raise":

            def broken(message, context):
                raise RuntimeError("disk full")

            real, self.client_app = self.client_app, broken
            try:
                return super()._deliver(msg)
            finally:
                self.client_app = real
        reply = super()._deliver(msg)
        return None if fault == "vanish" else reply

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        for i in ids:
            if self._replies.get(i) is None:
                self._replies.pop(i, None)  # a vanished reply is never pulled
        return ids


def _run_folder(tmp_path, faults, **overrides):
    from client_app.app import app
    from server_app.app import run_server

    cfg = parse_run_config({**CONFIG, **overrides, "output-dir": str(tmp_path)})
    return run_server(FaultyGrid(app, cfg.to_run_config(), 3, faults=faults), cfg)


def _run(tmp_path, faults):
    from server_app.run_folder import read_rounds

    return read_rounds(_run_folder(tmp_path, faults))


@pytest.mark.parametrize(
    "fault, reason",
    [("raise", "error reply: RuntimeError: disk full"), ("vanish", "train: no reply before the timeout")],
)
def test_a_client_lost_in_train_is_left_out_of_that_round_and_rejoins_the_next(tmp_path, fault, reason):
    first, second = _run(tmp_path, {(1, "train", 1): fault})
    assert [c["partition-id"] for c in first["clients"]] == [0, 2]
    assert first["excluded"] == [{"node-id": FIRST_NODE_ID + 1, "reason": reason}]
    assert first["scored-node-ids"] == [FIRST_NODE_ID, FIRST_NODE_ID + 2]  # scores from those who trained
    assert first["multiplier"] in first["candidates"]
    assert [c["partition-id"] for c in second["clients"]] == [0, 1, 2] and second["excluded"] == []


@pytest.mark.parametrize(
    "fault, reason",
    [("raise", "score: error reply: RuntimeError: disk full"), ("vanish", "score: no reply before the timeout")],
)
def test_a_client_lost_in_the_score_query_is_left_out_of_the_selection_and_rejoins(tmp_path, fault, reason):
    first, second = _run(tmp_path, {(2, "query.score", 1): fault})
    assert [c["partition-id"] for c in first["clients"]] == [0, 1, 2]  # its update is in the average
    assert first["excluded"] == [{"node-id": FIRST_NODE_ID + 2, "reason": reason}]
    assert first["scored-node-ids"] == [FIRST_NODE_ID, FIRST_NODE_ID + 1]  # the constraint is over those who answered
    assert len(first["client_teacher_scores"]) == 2
    assert second["scored-node-ids"] == [FIRST_NODE_ID, FIRST_NODE_ID + 1, FIRST_NODE_ID + 2] and second["excluded"] == []


def test_each_phase_waits_at_most_its_timeout_from_the_run_config_recorded_in_config_json(tmp_path, monkeypatch):
    import json

    from server_app.grid import PromptGrid
    from server_app.inprocess import run_in_process

    waits, send_and_receive = [], PromptGrid.send_and_receive

    def recording(self, messages, *, timeout=None):
        messages = list(messages)
        waits.append((sorted({m.metadata.message_type for m in messages}), timeout))
        return send_and_receive(self, messages, timeout=timeout)

    monkeypatch.setattr(PromptGrid, "send_and_receive", recording)
    run = run_in_process({**CONFIG, "num-server-rounds": 1, "output-dir": str(tmp_path), "timeout.train": 7.5, "timeout.score": 2.5})
    config = json.loads((run / "config.json").read_text())
    assert (config["timeout.train"], config["timeout.score"], config["timeout.evaluate"]) == (7.5, 2.5, 3600.0)
    assert waits == [(["train"], 7.5), (["query.score"], 2.5)]


@pytest.mark.parametrize("strategy", ["local"])  # its three per-client adapters show the client's own continuation
def test_a_client_that_loses_its_state_mid_run_continues_from_its_saved_state(tmp_path, strategy):
    # Partition 1's context.state is lost before round 3: it must continue from its saved round 2
    # (its optimizer state; Local: its own adapter), so the run equals the uninterrupted one bit
    # for bit. Which round it restored, and Local's adapter, are pinned in test_resume.py.
    full = _run_folder(tmp_path / "full", {}, **{"strategy.name": strategy, "num-server-rounds": 3})
    forgot = _run_folder(tmp_path / "forgot", {(1, "train", 3): "forget"}, **{"strategy.name": strategy, "num-server-rounds": 3})
    adapters = sorted(p.relative_to(full) for p in (full / "round-003").rglob("adapter_model.safetensors"))
    assert len(adapters) == (3 if strategy == "local" else 1)
    for a in adapters:
        assert (forgot / a).read_bytes() == (full / a).read_bytes(), f"{a} differs"


def _failing_train(monkeypatch, rounds, error):
    """Every client's train handler raises ``error`` in ``rounds``; returns the rounds it was called in."""
    from client_app.handlers import HANDLERS

    real, called = HANDLERS["train"], []

    def train(content, state, *args, **kwargs):
        server_round = int(content["config"]["server-round"])
        called.append(server_round)
        if server_round in rounds:
            raise error
        return real(content, state, *args, **kwargs)

    monkeypatch.setitem(HANDLERS, "train", train)
    return called


def _folder(root):
    [run] = [p.parent for p in root.glob("*/config.json")]
    return run


def test_a_run_in_which_no_client_can_train_in_round_one_fails_with_the_clients_message(tmp_path, monkeypatch, caplog):
    import logging

    from fedopd.core.errors import LocalError
    from server_app.app import RunFailed
    from server_app.run_folder import read_rounds, read_status

    refusal = LocalError("node config 'data-path' = '/srv/secret.csv' does not exist", "node config 'data-path'", "does not exist")
    called = _failing_train(monkeypatch, {1, 2}, refusal)
    expected = (  # the reply's public reason: the key and the kind, not the path (docs/deployment.md)
        "no client returned a valid update in round 1: node 1001, 1002, 1003: "
        "LocalError: node config 'data-path': does not exist (details in this node's log)"
    )
    caplog.set_level(logging.INFO, logger="flwr")
    with pytest.raises(RunFailed) as raised:
        _run_folder(tmp_path, {})
    assert str(raised.value) == expected
    for node in (1001, 1002, 1003):  # each client's error: one line of the stream (the grid's), not another warning
        lines = [r.getMessage() for r in caplog.records if f"node {node}" in r.getMessage() and "no client returned" not in r.getMessage()]
        assert lines == [f"  node {node}: train failed: LocalError: node config 'data-path': does not exist (details in this node's log)"], lines
    run = _folder(tmp_path)
    status = read_status(run)
    assert status["status"] == "failed" and status["error"] == expected
    assert called == [1, 1, 1]  # no later round ran
    [record] = read_rounds(run)
    assert record["round"] == 1 and record["clients"] == [] and sorted(e["node-id"] for e in record["excluded"]) == [1001, 1002, 1003]


def test_a_run_stops_failed_after_max_failed_rounds_consecutive_rounds_without_an_update(tmp_path, monkeypatch):
    from server_app.app import RunFailed
    from server_app.run_folder import read_rounds, read_status

    called = _failing_train(monkeypatch, {2, 3, 4}, RuntimeError("disk full"))
    with pytest.raises(RunFailed, match="no client returned a valid update in 3 consecutive rounds"):
        _run_folder(tmp_path, {}, **{"strategy.name": "fedavg", "num-server-rounds": 6, "max-failed-rounds": 3})
    run = _folder(tmp_path)
    assert [r["round"] for r in read_rounds(run)] == [1, 2, 3, 4] and max(called) == 4
    status = read_status(run)
    assert status["status"] == "failed" and status["rounds-done"] == 4
    assert status["error"] == (
        "no client returned a valid update in 3 consecutive rounds (2-4); in round 4: node 1001, 1002, 1003: "
        "RuntimeError in the client's train (details in this node's log)"
    )


def test_one_round_without_an_update_after_round_one_is_held_and_the_run_goes_on(tmp_path, monkeypatch):
    from server_app.run_folder import read_rounds, read_status

    _failing_train(monkeypatch, {2}, RuntimeError("disk full"))
    run = _run_folder(tmp_path, {}, **{"strategy.name": "fedavg", "num-server-rounds": 3})
    rounds = read_rounds(run)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert rounds[1]["clients"] == [] and rounds[1]["multiplier"] == 0.0
    assert [c["partition-id"] for c in rounds[2]["clients"]] == [0, 1, 2]
    assert read_status(run)["status"] == "completed"
