"""A SuperNode's own data (node config ``data-path``...): the server never names a file on a
client, and nothing of a client's files reaches the server in an error reply."""

from __future__ import annotations

import json
import logging

import pytest
from client_messages import OVERRIDES, client_context, initial_theta, train_message
from conftest import TINY_RUN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client_app.worker import node_rows
from fedopd.config import parse_run_config
from fedopd.core.errors import LocalError, RequestError
from fedopd.data.node_data import NODE_DATA_KEYS, NodeData, check_server_named_files

FIXED = settings(max_examples=60, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _jsonl(path, problems):
    path.write_text("".join(json.dumps({"problem": p, "answer": str(i)}) + "\n" for i, p in enumerate(problems)))
    return path


def test_a_node_with_its_own_data_trains_on_its_files_problems_and_never_opens_the_run_configs_file(tmp_path):
    """20 problems, one in five held out (4), a sample of data.prompts-per-client = 8 of the other
    16; the run config's data.path does not exist and is never read."""
    problems = [f"Compute {i} + {i}." for i in range(20)]
    node = NodeData(path=str(_jsonl(tmp_path / "ours.jsonl", problems)))
    cfg = parse_run_config({"data.name": "prompts", "data.path": "/nowhere/servers.jsonl", "data.partitioner": "iid", "data.prompts-per-client": 8})
    train = [r["problem"] for r in node_rows(cfg, "train", 2, 3, node)]
    held = [r["problem"] for r in node_rows(parse_run_config({**cfg.to_run_config(), "eval.prompts-per-client": 10}), "heldout", 2, 3, node)]
    assert len(train) == 8 and len(set(train)) == 8 and len(held) == 4
    assert set(train) | set(held) <= set(problems) and not set(train) & set(held)
    with pytest.raises(LocalError, match="data.path = '/nowhere/servers.jsonl' does not exist"):
        node_rows(cfg, "train", 2, 3, None)  # without data of its own: the run config's file


def test_a_nodes_own_held_out_file_is_its_held_out_set(tmp_path):
    own = _jsonl(tmp_path / "ours.jsonl", [f"Compute {i} + 1." for i in range(12)])
    held = _jsonl(tmp_path / "held.jsonl", [f"Compute {i} * 2." for i in range(5)])
    node = NodeData.from_node_config({"data-path": str(own), "eval-path": str(held)})
    cfg = parse_run_config({"data.prompts-per-client": 50, "eval.prompts-per-client": 5})
    assert len(node_rows(cfg, "train", 0, 1, node)) == 12  # no share held out of data-path
    assert sorted(r["problem"] for r in node_rows(cfg, "heldout", 0, 1, node)) == sorted(f"Compute {i} * 2." for i in range(5))


def test_a_node_data_key_without_data_path_or_of_the_wrong_type_is_refused_naming_it():
    assert NodeData.from_node_config({"partition-id": 0}) is None
    with pytest.raises(LocalError, match="node config 'eval-path' is set, but node config 'data-path' is not"):
        NodeData.from_node_config({"eval-path": "/data/held.jsonl"})
    with pytest.raises(LocalError, match="node config 'problem-column' = 3: expected a non-empty string"):
        NodeData.from_node_config({"data-path": "/data/ours.jsonl", "problem-column": 3})


@FIXED
@given(
    st.dictionaries(
        st.sampled_from(list(NODE_DATA_KEYS) + ["partition-id"]), st.one_of(st.text(max_size=20), st.integers(), st.booleans(), st.none())
    )
)
def test_any_node_config_gives_its_own_data_or_a_refusal_that_names_one_of_its_keys(node_config):
    try:
        node = NodeData.from_node_config(node_config)
    except LocalError as err:
        assert err.key.startswith("node config '") and err.key[len("node config '") : -1] in NODE_DATA_KEYS
        return
    if node is None:
        assert not set(node_config) & set(NODE_DATA_KEYS)
    else:
        assert node.path == node_config["data-path"] and isinstance(node.path, str) and node.path.strip()


def test_a_deployment_node_without_its_own_data_reads_no_data_source_the_server_names(tmp_path):
    """Neither a local file nor a hub id: the refusal reads the same whether or not the path exists
    (telling them apart would test the host's files, the hostile-server review's finding)."""
    local = _jsonl(tmp_path / "servers-choice.jsonl", ["Compute 1 + 1."])
    reasons = set()
    for data in (
        {"data.path": str(local)},
        {"data.path": str(tmp_path / "missing.jsonl")},
        {"data.path": "home/.ssh"},
        {"data.path": "owner/set"},
        {"data.path": "owner/set", "data.eval-path": "/etc/x.csv"},
    ):
        cfg = parse_run_config({"data.name": "prompts", "data.partitioner": "iid", **data})
        with pytest.raises(RequestError, match="names a data source; a deployment node reads only the one its own node config names") as err:
            check_server_named_files(cfg.data, deployment=True)
        reasons.add(str(err.value).replace(repr(cfg.data.path[:200]), "PATH"))
        check_server_named_files(cfg.data, deployment=False)  # simulation: one file system, one operator
    assert len(reasons) == 1
    check_server_named_files(parse_run_config({}).data, deployment=True)  # a built-in set
    check_server_named_files(
        parse_run_config({"data.name": "math", "data.partitioner": "groups", "eval.every": 0}).data, deployment=True
    )  # MATH's own hub source


def test_which_nodes_are_deployment_nodes():
    from fedopd.data.node_data import deployment_node

    assert not deployment_node({"partition-id": 0, "num-partitions": 3})  # what Flower's simulation sets
    for extra in ({"worker": "resident"}, {"data-path": "/data/x.jsonl"}, {"client-state-dir": "/state"}):
        assert deployment_node({"partition-id": 0, "num-partitions": 3, **extra})


@pytest.mark.parametrize(
    "content, key, kind",
    [
        ("SECRET-PATIENT-ROW-1,secret answer 7\nSECRET-PATIENT-ROW-2,secret answer 8\n", "node config 'problem-column'", "not a column of the file"),
        ("problem,answer\nSECRET-PATIENT-ROW-1,\n", "node config 'answer-column'", "no answer in some rows"),
    ],
    ids=["csv-without-header", "empty-answer"],
)
def test_a_nodes_file_error_reaches_the_server_as_its_key_and_kind_and_its_log_keeps_the_rest(tmp_path, caplog, content, key, kind):
    """The ClientApp's reply to a train message when the node's own CSV is unusable: the reason
    names the node config key and the kind of problem, never a cell, a column or the path; the
    node's log has the full error."""
    from client_app.app import train as train_entry

    secret = tmp_path / "SECRET-FOLDER" / "patients.csv"
    secret.parent.mkdir()
    secret.write_text(content)
    cfg = parse_run_config(OVERRIDES)
    context = client_context(cfg)
    context.node_config["data-path"] = str(secret)
    with caplog.at_level(logging.ERROR, logger="flwr"):
        reply = train_entry(train_message(initial_theta(cfg), 1), context)
    assert reply.has_error()
    reason = reply.error.reason
    assert reason == f"LocalError: {key}: {kind} (details in this node's log)"
    assert "SECRET" in caplog.text and str(secret) in caplog.text


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
def test_a_federation_of_nodes_with_their_own_files_runs_on_them(tmp_path):
    """Three in-process SuperNodes, each naming its own file (the tiny preset's partitions,
    exported); the run config names none: each client's weight is its own file's size, and
    the run's records say so."""
    from fedopd.data.__main__ import export_partitions
    from server_app.inprocess import run_in_process

    cfg = parse_run_config({**TINY_RUN, "num-server-rounds": 2})
    files = export_partitions(cfg, 3, tmp_path / "data")
    sizes = [len(f.read_text().splitlines()) for f in files]
    nodes = {i: {"data-path": str(f)} for i, f in enumerate(files)}
    own_sizes = {0: 5, 1: 9, 2: 16}  # each node trims its file to its own size: its weight follows
    for i, f in enumerate(files):
        f.write_text("".join(f.read_text().splitlines(keepends=True)[: own_sizes[i]]))
    run = run_in_process({**TINY_RUN, "num-server-rounds": 2, "output-dir": str(tmp_path / "runs"), "data.path": ""}, node_configs=nodes)
    records = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert sizes == [16, 16, 16] and len(records) == 2
    for record in records:
        assert {c["partition-id"]: c["num-examples"] for c in record["clients"]} == {i: n - n // 5 for i, n in own_sizes.items()}


def test_a_clientapp_in_flowers_deployment_runtime_is_a_deployment_node_whatever_its_node_config(monkeypatch):
    """A SuperNode started the plain Flower way (only partition-id and num-partitions) must not
    read the server's files (the second hostile-server review): the flwr-clientapp process has
    Flower's deployment runtime loaded, a simulation does not."""
    import sys
    import types

    from fedopd.data.node_data import DEPLOYMENT_RUNTIME, deployment_node

    assert DEPLOYMENT_RUNTIME not in sys.modules  # pytest, like Flower's simulation, never loads it
    monkeypatch.setitem(sys.modules, DEPLOYMENT_RUNTIME, types.ModuleType(DEPLOYMENT_RUNTIME))
    assert deployment_node({"partition-id": 0, "num-partitions": 3})
