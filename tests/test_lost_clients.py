"""A client that fails or vanishes in ``train`` or ``query.score`` is left out of that round only.

Simulation through the app's own ServerApp, strategies and ClientApp (``InProcessGrid``); faults
are injected per (partition, message type, round): ``raise`` (the ClientApp raises: an error
reply) or ``vanish`` (no reply ever arrives: the phase timeout ends the wait).
"""

from __future__ import annotations

import pytest
from flwr.app import Message

from conftest import TINY
from fedopd.config import parse_run_config
from server_app.inprocess import FIRST_NODE_ID, InProcessGrid

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("task_identity")]

CONFIG = {
    **TINY, "rollout.backend": "hf", "rollout.per-round": 8, "rollout.max-new-tokens": 16, "data.prompts-per-client": 16,
    "train.mini-batch": 4, "train.micro-batch": 2, "num-server-rounds": 2, "eval.every": 0,
    "strategy.name": "fedtops", "strategy.trust-budget": 0.01, "timeout.train": 1.0, "timeout.score": 1.0,
}


class FaultyGrid(InProcessGrid):
    def __init__(self, *args, faults, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults  # (partition, message type, round) -> "raise" | "vanish"

    def _deliver(self, msg: Message) -> Message:
        key = (int(msg.metadata.dst_node_id) - FIRST_NODE_ID, msg.metadata.message_type, int(msg.content["config"]["server-round"]))
        fault = self.faults.get(key)
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


def _run(tmp_path, faults):
    from client_app.app import app
    from server_app.app import run_server
    from server_app.run_folder import read_rounds

    cfg = parse_run_config({**CONFIG, "output-dir": str(tmp_path)})
    return read_rounds(run_server(FaultyGrid(app, cfg.to_run_config(), 3, faults=faults), cfg))


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


def test_the_phase_timeouts_are_run_config_recorded_in_config_json(tmp_path):
    import json

    from server_app.inprocess import run_in_process

    run = run_in_process({**CONFIG, "num-server-rounds": 1, "output-dir": str(tmp_path), "timeout.train": 7.5, "timeout.score": 2.5})
    config = json.loads((run / "config.json").read_text())
    assert (config["timeout.train"], config["timeout.score"], config["timeout.evaluate"]) == (7.5, 2.5, 3600.0)
