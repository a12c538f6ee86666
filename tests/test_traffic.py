"""Communication cost: each round records the bytes sent to and received from each client, by
phase (train, score query, evaluate), measured on the messages' contents; the round line, the
run summary and the figure show them (server_app/traffic.py, server_app/grid.py)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from server_app.grid import PromptGrid
from server_app.inprocess import FIRST_NODE_ID, InProcessGrid
from server_app.traffic import (
    content_bytes,
    human_bytes,
    message_bytes,
    phase_traffic,
    round_communication,
    run_traffic,
    sent_bytes,
)

pytestmark = pytest.mark.usefixtures("task_identity")


def _arrays(n: int) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.arange(n, dtype=np.float32))})


def test_a_message_measures_its_content_as_flower_serializes_it():
    # RecordDict{"arrays": ArrayRecord{"w": 1000 float32}}, protobuf by hand (tag 1 byte each):
    #   Array: dtype "float32" 1+1+7 = 9, shape [1000] 1+1+2 = 4, stype "numpy.ndarray" 1+1+13 = 15,
    #          data (.npy: 128-byte header + 4000 bytes) 1+2+4128 = 4131             -> 4159
    #   ArrayRecord.Item: key "w" 1+1+1, value 1+2+4159                             -> 4165
    #   ArrayRecord: items 1+2+4165                                                   -> 4168
    #   RecordDict.Item: key "arrays" 1+1+6, array_record 1+2+4168                    -> 4179
    #   RecordDict: items 1+2+4179                                                    -> 4182
    msg = Message(RecordDict({"arrays": _arrays(1000)}), dst_node_id=5, message_type="train")
    assert message_bytes(msg) == 4182
    assert 4 * 1000 <= message_bytes(msg) <= 4 * 1000 + 128 + 64  # the payload, the .npy header, a few names
    assert message_bytes(Message(RecordDict(), dst_node_id=5, message_type="train")) == 0


def test_an_error_reply_counts_zero():
    request = Message(RecordDict({"arrays": _arrays(10)}), dst_node_id=5, message_type="train")
    reply = Message(Error(code=2, reason="RuntimeError: disk full"), reply_to=request)
    assert not reply.has_content() and message_bytes(reply) == 0


def test_a_content_shared_by_several_messages_is_measured_for_each():
    content = RecordDict({"increment": _arrays(100), "config": ConfigRecord({"server-round": 1})})
    messages = [Message(content, dst_node_id=n, message_type="query.score") for n in (3, 1, 2)]
    assert sent_bytes(messages) == [content_bytes(content)] * 3


def _pushed(messages):
    for i, m in enumerate(messages):
        m.metadata.__dict__["_message_id"] = f"id-{i}"  # what the grid does when it pushes them
    return messages


def test_phase_traffic_is_per_node_sorted_and_a_node_without_reply_received_nothing():
    sent = _pushed(
        [Message(RecordDict({"arrays": _arrays(n)}), dst_node_id=node, message_type="train") for node, n in ((30, 10), (10, 20), (20, 30))]
    )
    reply_10 = Message(RecordDict({"m": MetricRecord({"x": 1.0})}), reply_to=sent[1])
    error_30 = Message(Error(code=2, reason="x"), reply_to=sent[0])
    got = phase_traffic(sent, [error_30, reply_10])  # node 20 did not reply
    assert got == [
        {"node-id": 10, "sent": message_bytes(sent[1]), "received": message_bytes(reply_10)},
        {"node-id": 20, "sent": message_bytes(sent[2]), "received": 0},
        {"node-id": 30, "sent": message_bytes(sent[0]), "received": 0},
    ]
    assert message_bytes(reply_10) > 0
    # sizes measured before the push are the ones recorded; two messages to one node add up
    assert [e["sent"] for e in phase_traffic(sent, [], [7, 8, 9])] == [8, 9, 7]
    twice = _pushed([Message(RecordDict(), dst_node_id=10, message_type="train") for _ in range(2)])
    assert phase_traffic(twice, [], [5, 6]) == [{"node-id": 10, "sent": 11, "received": 0}]


def test_a_reply_counts_for_the_node_it_answers_for_even_when_the_superlink_wrote_it():
    [sent] = _pushed([Message(RecordDict({"arrays": _arrays(4)}), dst_node_id=42, message_type="train")])
    lost = Message(Error(code=3, reason="node lost"), reply_to=sent)
    lost.metadata.__dict__["_src_node_id"] = 1  # the SuperLink, not node 42
    assert phase_traffic([sent], [lost]) == [{"node-id": 42, "sent": message_bytes(sent), "received": 0}]


def test_a_round_totals_its_phases_and_a_run_its_rounds():
    train = [{"node-id": 1, "sent": 100, "received": 90}, {"node-id": 2, "sent": 100, "received": 0}]
    score = [{"node-id": 1, "sent": 120, "received": 7}]
    evaluate = [{"node-id": 1, "sent": 110, "received": 5}, {"node-id": 2, "sent": 110, "received": 5}]
    communication = round_communication({"evaluate": evaluate, "train": train, "score": score})
    assert list(communication) == ["train", "score", "evaluate", "sent", "received"]
    assert (communication["sent"], communication["received"]) == (100 + 100 + 120 + 110 + 110, 90 + 7 + 5 + 5)
    assert round_communication({"train": train}) == {"train": train, "sent": 200, "received": 90}
    records = [{"round": 0, "communication": round_communication({"evaluate": evaluate})}, {"round": 1, "communication": communication}, {"round": 2}]
    assert run_traffic(records) == {
        "evaluate": {"sent": 440, "received": 20},
        "train": {"sent": 200, "received": 90},
        "score": {"sent": 120, "received": 7},
        "total": {"sent": 760, "received": 117},
    }
    assert run_traffic([{"round": 1}]) == {}


class _Clients(InProcessGrid):
    """Node 1001 answers with a metric, 1002 raises (an error reply), 1003's reply never arrives."""

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        for i in ids:
            if self._replies[i].metadata.src_node_id == FIRST_NODE_ID + 2:
                del self._replies[i]
        return ids


def _client(message, context):
    if context.node_id == FIRST_NODE_ID + 1:
        raise RuntimeError("disk full")
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 16})}), reply_to=message)


def test_the_grid_records_each_phase_per_node():
    grid = PromptGrid(_Clients(_client, {}, 3))
    content = RecordDict({"arrays": _arrays(256), "config": ConfigRecord({"server-round": 1})})
    messages = [Message(content, dst_node_id=n, message_type="train") for n in grid.get_node_ids()]
    replies = grid.send_and_receive(messages, timeout=0.2)
    assert len(replies) == 2
    size = content_bytes(content)
    metric = content_bytes(RecordDict({"metrics": MetricRecord({"num-examples": 16})}))
    assert grid.last_traffic == [
        {"node-id": FIRST_NODE_ID, "sent": size, "received": metric},
        {"node-id": FIRST_NODE_ID + 1, "sent": size, "received": 0},  # error reply
        {"node-id": FIRST_NODE_ID + 2, "sent": size, "received": 0},  # no reply
    ]
    grid.send_and_receive([], timeout=0.1)
    assert grid.last_traffic == []  # the last call's, not an accumulation


class _Forgetful(InProcessGrid):
    """Drops each message's content once it is pushed (a grid may release what it sent)."""

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for m in messages:
            m.content = RecordDict()
        return ids


def test_the_grid_measures_what_it_sends_before_the_push():
    grid = PromptGrid(_Forgetful(lambda m, c: Message(RecordDict(), reply_to=m), {}, 2))
    content = RecordDict({"arrays": _arrays(64)})
    grid.send_and_receive([Message(content, dst_node_id=n, message_type="evaluate") for n in grid.get_node_ids()])
    assert [e["sent"] for e in grid.last_traffic] == [content_bytes(content)] * 2


class _Broken(InProcessGrid):
    def push_messages(self, messages):
        raise ConnectionError("SuperLink gone")


def test_a_failed_phase_leaves_no_traffic_of_an_earlier_one():
    grid = PromptGrid(_Clients(_client, {}, 3))
    grid.send_and_receive([Message(RecordDict(), dst_node_id=FIRST_NODE_ID, message_type="train")], timeout=0.1)
    assert grid.last_traffic
    grid.grid = _Broken(_client, {}, 3)
    with pytest.raises(ConnectionError):
        grid.send_and_receive([Message(RecordDict(), dst_node_id=FIRST_NODE_ID, message_type="train")])
    assert grid.last_traffic == []


class _TooLarge(InProcessGrid):
    def push_messages(self, messages):
        return []  # Flower's deployment Grid, when the SuperLink refuses the payload


def test_messages_that_were_not_pushed_are_not_counted():
    grid = PromptGrid(_TooLarge(_client, {}, 2))
    messages = [Message(RecordDict({"arrays": _arrays(8)}), dst_node_id=n, message_type="train") for n in grid.get_node_ids()]
    assert grid.send_and_receive(messages, timeout=5.0) == [] and grid.last_traffic == []


def test_the_round_line_and_the_run_summary_show_the_bytes(tmp_path):
    from server_app.log_lines import round_summary
    from server_app.progress import run_summary

    evaluate = [{"node-id": 1, "sent": 2_000_000, "received": 700}]
    train = [{"node-id": 1, "sent": 2_000_000, "received": 2_000_500}]
    score = [{"node-id": 1, "sent": 2_000_000, "received": 300}]
    records = [
        {"round": 0, "strategy": "fedtops", "communication": round_communication({"evaluate": evaluate})},
        {
            "round": 1,
            "strategy": "fedtops",
            "multiplier": 1.0,
            "seconds": 2.0,
            "clients": [],
            "communication": round_communication({"train": train, "score": score}),
        },
    ]
    assert round_summary(records[0], 1).endswith("initial adapter | 2.00 MB sent, 700 B received")
    assert "| 4.00 MB sent, 2.00 MB received | 2.0 s" in round_summary(records[1], 1)
    assert "sent" not in round_summary({"round": 1, "strategy": "fedavg", "clients": []}, 1)
    lines = run_summary(records, "fedtops", tmp_path, 3.0)
    assert lines[2:4] == [
        "  communication: 6.00 MB sent to clients, 2.00 MB received from them",
        "    by phase (sent / received): train 2.00 MB / 2.00 MB, score 2.00 MB / 300 B, evaluate 2.00 MB / 700 B",
    ]


def test_the_figure_plots_the_cumulative_bytes(tmp_path):
    from server_app.progress import FIGURE, draw, figure_series, round_scalars

    records = [
        {"round": 0, "strategy": "fedavg", "communication": round_communication({"evaluate": [{"node-id": 1, "sent": 1_000_000, "received": 0}]})},
        {"round": 1, "strategy": "fedavg", "communication": round_communication({"train": [{"node-id": 1, "sent": 2_000_000, "received": 500_000}]})},
    ]
    assert round_scalars(records[1]) == {"comm/sent_mb": 2.0, "comm/received_mb": 0.5, "comm/train_mb": 2.5}
    assert round_scalars(records[0]) == {"comm/sent_mb": 1.0, "comm/received_mb": 0.0, "comm/evaluate_mb": 1.0}
    rows = [(r["round"], round_scalars(r)) for r in records + [{"round": 2}]]
    assert figure_series(rows, "comm/sent_mb") == ([0, 1], [1.0, 3.0])  # cumulative over the run
    assert figure_series(rows, "comm/received_mb") == ([0, 1], [0.0, 0.5])
    assert figure_series(rows, "comm/train_mb") == ([1], [2.5])  # per round
    assert draw(records, tmp_path / FIGURE, "t").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 999, 1000, 51_234, 999_499, 3_470_000, 12_345_678, 250e6, 1.25e9, 2.5e12)] == [
        "0 B",
        "999 B",
        "1.00 kB",
        "51.2 kB",
        "999 kB",
        "3.47 MB",
        "12.3 MB",
        "250 MB",
        "1.25 GB",
        "2500 GB",
    ]


@pytest.mark.slow
def test_a_run_records_each_phase_per_client_with_the_adapter_in_every_message(tmp_path):
    """FedTOPS, 3 clients, 1 round, evaluated in rounds 0 and 1: every phase's bytes per client in
    the round records, as large as the adapter's factors wherever the adapter travels."""
    from conftest import TINY

    from fedopd.models import load_adapter
    from server_app.inprocess import run_in_process
    from server_app.run_folder import read_rounds

    config = {
        **TINY,
        "data.name": "sandbox",
        "num-server-rounds": 1,
        "data.prompts-per-client": 8,
        "rollout.per-round": 4,
        "rollout.max-new-tokens": 8,
        "train.mini-batch": 4,
        "train.micro-batch": 4,
        "eval.every": 1,
        "eval.prompts-per-client": 2,
        "eval.samples": 1,
        "eval.max-new-tokens": 4,
        "strategy.name": "fedtops",
    }
    run = run_in_process({**config, "output-dir": str(tmp_path)})
    zero, one = read_rounds(run)
    nodes = [FIRST_NODE_ID + i for i in range(3)]
    initial = load_adapter(run / "round-000")
    factor_bytes = sum(a.nbytes for a in initial.values())
    adapter = ArrayRecord({k: Array(v) for k, v in initial.items()})

    # round 0: the initial adapter out to each client, its metrics back
    assert set(zero["communication"]) == {"evaluate", "sent", "received"}
    expected = content_bytes(RecordDict({"arrays": adapter, "config": ConfigRecord({"server-round": 0})}))
    assert [e["node-id"] for e in zero["communication"]["evaluate"]] == nodes
    assert all(e["sent"] == expected and 0 < e["received"] < 2000 for e in zero["communication"]["evaluate"])

    # round 1: θ_t out and θ_{t,i}^+ back; Δ_t and the candidates out, scores back; the new adapter out
    communication = one["communication"]
    assert set(communication) == {"train", "score", "evaluate", "sent", "received"}
    for phase in ("train", "score", "evaluate"):
        assert [e["node-id"] for e in communication[phase]] == nodes
        assert all(factor_bytes <= e["sent"] <= factor_bytes + 200 * len(initial) + 2000 for e in communication[phase])
    assert all(factor_bytes <= e["received"] <= factor_bytes + 200 * len(initial) + 4000 for e in communication["train"])
    assert all(0 < e["received"] < 4000 for phase in ("score", "evaluate") for e in communication[phase])
    # Δ_t has the adapter's names and shapes: the score query's size follows from the record
    score = RecordDict({"increment": adapter, "config": ConfigRecord({"candidates": one["candidates"], "server-round": 1})})
    assert all(e["sent"] == content_bytes(score) for e in communication["score"])
    evaluate = RecordDict({"arrays": adapter, "config": ConfigRecord({"server-round": 1})})
    assert all(e["sent"] == content_bytes(evaluate) for e in communication["evaluate"])
    assert communication["sent"] == sum(e["sent"] for p in ("train", "score", "evaluate") for e in communication[p])
    assert communication["received"] == sum(e["received"] for p in ("train", "score", "evaluate") for e in communication[p])


def test_a_reply_beyond_the_serialization_bound_is_counted_from_its_buffers_without_a_copy(monkeypatch):
    import server_app.traffic as traffic

    monkeypatch.setattr(traffic, "SERIALIZE_AT_MOST", 1000)  # a small bound, so that the test stays small
    big = Message(RecordDict({"arrays": _arrays(1000)}), dst_node_id=7, message_type="train")
    data = len(Array(np.arange(1000, dtype=np.float32)).data)  # 4,000 bytes of data + the .npy header
    monkeypatch.setattr(traffic, "content_bytes", lambda content: pytest.fail("serialized a reply beyond the bound"))
    # the buffer's length, the key "w", the dtype "float32" and 8 bytes per shape entry
    assert message_bytes(big) == data + len("w") + len("float32") + 8
