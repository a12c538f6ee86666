"""eval/collusion.py's colluders: every reply computed for real, then a colluder's train reply
replays its round-1 adapter and its score reply favours the largest candidate."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from eval.collusion import COLLUDERS, CollusionGrid

pytestmark = pytest.mark.usefixtures("task_identity")


def honest_client(msg, context):
    """A client whose adapter is its round number, and whose scores are all 0.5."""
    server_round = int(msg.content["config"]["server-round"])
    if msg.metadata.message_type == "train":
        arrays = ArrayRecord({"a": Array(np.full(2, float(server_round), np.float32))})
        return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 4})}), reply_to=msg)
    return Message(RecordDict({"scores": MetricRecord({"teacher-scores": [0.5] * 3, "change-scores": [0.5] * 3})}), reply_to=msg)


def _ask(grid, node, kind, server_round):
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": server_round})}), dst_node_id=node, message_type=kind)
    [reply] = grid.send_and_receive([msg])
    return reply


def test_a_colluder_replays_its_round_one_adapter_and_favours_the_largest_candidate_and_the_others_are_honest():
    grid = CollusionGrid(honest_client, {}, 5)
    colluder, honest = COLLUDERS[0], COLLUDERS[0] - 1
    for server_round in (1, 2, 3):
        assert _ask(grid, colluder, "train", server_round).content["arrays"]["a"].numpy().tolist() == [1.0, 1.0]
        assert _ask(grid, honest, "train", server_round).content["arrays"]["a"].numpy().tolist() == [float(server_round)] * 2
    scores = _ask(grid, colluder, "query.score", 3).content["scores"]
    assert list(scores["teacher-scores"]) == [1.0, 1.0, 0.0] and list(scores["change-scores"]) == [0.0, 0.0, 0.0]
    assert list(_ask(grid, honest, "query.score", 3).content["scores"]["teacher-scores"]) == [0.5] * 3


def test_only_runs_the_named_settings_and_refuses_an_unknown_one(monkeypatch, tmp_path, capsys):
    import sys

    import eval.collusion as collusion

    ran = []
    monkeypatch.setattr(
        collusion, "run", lambda config, out, attacked: ran.append((config["strategy.name"], config.get("strategy.aggregator"))) or out
    )
    monkeypatch.setattr(
        collusion, "summary", lambda folder, honest: {"multipliers": [], "steps": [0.0], "distance-from-honest": 0.0, "heldout-accuracy": 0.0}
    )
    monkeypatch.setattr(sys, "argv", ["collusion", str(tmp_path), "--only", "fedtops, median aggregator"])
    collusion.main()
    assert ran == [("fedtops", "median"), ("fedtops", "median")]  # its honest and its attacked run
    monkeypatch.setattr(sys, "argv", ["collusion", str(tmp_path), "--only", "krum"])
    with pytest.raises(SystemExit):
        collusion.main()
    assert "--only 'krum': allowed: 'fedavg'" in capsys.readouterr().err
