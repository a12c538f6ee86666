"""``resume-from``: a stopped run continues bit-identically; what a stop leaves half-written is
replaced; a resumed run may not change what its results depend on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from client_messages import fake_models
from conftest import TINY_RUN

from fedopd.config import ConfigError, parse_run_config
from fedopd.core.errors import LocalError
from server_app.run_folder import complete_rounds, config_mismatch
from tests.golden.record import without_timings  # timings, process ids and bytes sent (they carry the run folder's path)

BASE = {
    **TINY_RUN,
    "num-server-rounds": 4,
    "eval.every": 0,
}
STRATEGIES = {
    "fedtops": {"strategy.name": "fedtops", "strategy.trust-budget": 0.01},
    "fedavg": {"strategy.name": "fedavg"},
    "fixed": {"strategy.name": "fixed", "strategy.multiplier": 3.0},
    "local": {"strategy.name": "local"},
}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def _run_stopped_in_round(config: dict, stop_round: int, run_id: int = 1, node_configs: dict | None = None) -> Path:
    """A run that stops (raises) during round ``stop_round``, after its clients trained and saved
    their state, before the server wrote the round; then a stop-torn tail is added: half a record
    line and the round's adapter folder, as a crash between the two writes leaves them."""
    from client_app.app import app
    from server_app.app import run_server
    from server_app.inprocess import InProcessGrid

    class Stop(Exception):
        pass

    class StoppingGrid(InProcessGrid):
        def push_messages(self, messages):
            messages = list(messages)
            ids = super().push_messages(messages)
            if any(m.metadata.message_type == "train" and m.content["config"]["server-round"] == stop_round for m in messages):
                raise Stop
            return ids

    cfg = parse_run_config(config)
    grid = StoppingGrid(app, cfg.to_run_config(), 3, run_id, node_configs)
    with pytest.raises(Stop):
        run_server(grid, cfg)
    [run] = [p.parent for p in Path(cfg.output_dir).glob("*/config.json")]
    with open(run / "rounds.jsonl", "a") as f:
        f.write(f'{{"round": {stop_round}, "multipl')
    shutil.copytree(run / f"round-{stop_round - 1:03d}", run / f"round-{stop_round:03d}")
    return run


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_run_stopped_in_round_three_and_resumed_equals_the_uninterrupted_run(tmp_path, name):
    from server_app.inprocess import run_in_process

    config = {**BASE, **STRATEGIES[name]}
    full = run_in_process({**config, "output-dir": str(tmp_path / "full")})
    stopped = _run_stopped_in_round({**config, "output-dir": str(tmp_path / "stopped")}, 3)
    resumed = run_in_process({**config, "output-dir": str(tmp_path / "elsewhere"), "resume-from": str(stopped)})

    _same_from_round_three(full, stopped, resumed, name)


def _same_from_round_three(full: Path, stopped: Path, resumed: Path, name: str) -> None:
    assert resumed == stopped  # continued in the same folder
    assert without_timings(_records(resumed)) == without_timings(_records(full))
    for r in (3, 4):
        adapters = sorted(p.relative_to(full) for p in (full / f"round-{r:03d}").rglob("adapter_model.safetensors"))
        assert adapters == sorted(p.relative_to(resumed) for p in (resumed / f"round-{r:03d}").rglob("adapter_model.safetensors"))
        assert len(adapters) == (3 if name == "local" else 1)
        for a in adapters:
            assert (resumed / a).read_bytes() == (full / a).read_bytes(), f"round {r}: {a} differs"


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
def test_supernodes_resume_from_the_state_they_keep_under_the_superlinks_run_id(tmp_path):
    """On SuperNodes (node config ``client-state-dir``) the state is kept under the run id the
    SuperLink assigned; the resumed run (a new run id) continues from the stopped run's, which the
    server names by its run id: Local, whose clients keep their own adapters, equals the
    uninterrupted run, and no state folder is named after the run folder."""
    from server_app.inprocess import run_in_process

    config = {**BASE, **STRATEGIES["local"]}
    nodes = {i: {"client-state-dir": str(tmp_path / f"host-{i}")} for i in range(3)}
    full = run_in_process({**config, "output-dir": str(tmp_path / "full")}, run_id=10, node_configs=nodes)
    stopped = _run_stopped_in_round({**config, "output-dir": str(tmp_path / "stopped")}, 3, run_id=11, node_configs=nodes)
    resumed = run_in_process({**config, "output-dir": str(tmp_path / "elsewhere"), "resume-from": str(stopped)}, run_id=12, node_configs=nodes)
    _same_from_round_three(full, stopped, resumed, "local")
    assert sorted(p.name for p in (tmp_path / "host-1" / "node-1002").iterdir()) == ["run-10", "run-11", "run-12"]
    assert json.loads((stopped / "status.json").read_text())["flower-runs"] == [[1, 11], [3, 12]]


def test_a_partial_last_line_and_the_folders_after_the_last_complete_round_are_removed(tmp_path):
    run = tmp_path / "run"
    for r in range(4):
        (run / f"round-{r:03d}").mkdir(parents=True)
    (run / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}\n{"round": 3, "multi')
    assert [r["round"] for r in complete_rounds(run)] == [1, 2]
    assert (run / "rounds.jsonl").read_text() == '{"round": 1}\n{"round": 2}\n'
    assert sorted(p.name for p in run.glob("round-*")) == ["round-000", "round-001", "round-002"]


def test_a_last_line_without_its_newline_is_not_complete(tmp_path):
    (tmp_path / "rounds.jsonl").write_text('{"round": 1}\n{"round": 2}')  # the newline is written last
    assert [r["round"] for r in complete_rounds(tmp_path)] == [1]


def test_only_keys_that_change_no_result_may_differ_on_resume():
    original = parse_run_config(BASE).to_run_config()
    free = {"num-server-rounds": 9, "output-dir": "x", "resume-from": "y", "timeout.train": 5.0, "timeout.score": 5.0, "timeout.evaluate": 5.0}
    assert config_mismatch(original, {**original, **free}) == []
    assert config_mismatch(original, {**original, "train.lr": 1e-3, "seed": 1}) == ["seed", "train.lr"]


@pytest.mark.slow
@pytest.mark.usefixtures("task_identity")
def test_resuming_with_another_learning_rate_is_refused_naming_the_key_and_nothing_changes(tmp_path):
    from server_app.inprocess import run_in_process

    config = {**BASE, "num-server-rounds": 1}
    run = run_in_process({**config, "output-dir": str(tmp_path)})
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=r"'train.lr' \(0.002 -> 0.001\)"):
        run_in_process({**config, "num-server-rounds": 2, "train.lr": 1e-3, "resume-from": str(run)})
    with pytest.raises(ConfigError, match="already completed its 1 rounds"):
        run_in_process({**config, "resume-from": str(run)})
    with pytest.raises(ConfigError, match="no run folder there"):
        run_in_process({**config, "num-server-rounds": 2, "resume-from": str(tmp_path / "nothing")})
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    # A run of 3 rounds stopped after round 1 may not be resumed as a run of 2.
    (run / "config.json").write_text(json.dumps({**json.loads((run / "config.json").read_text()), "num-server-rounds": 3}))
    with pytest.raises(ConfigError, match="'num-server-rounds' = 2 is below the resumed run's 3; it may only grow"):
        run_in_process({**config, "num-server-rounds": 2, "resume-from": str(run)})


def test_the_client_state_folder_is_beside_the_run_in_simulation_and_on_the_host_in_deployment(tmp_path, monkeypatch):
    from client_app.client_state import client_state_dir

    monkeypatch.setenv("FEDTOPS_CACHE", str(tmp_path / "cache"))
    config = {"run-dir": "/data/runs/20261122-170102-fedtops"}
    assert client_state_dir(config, {}, 1) == Path("/data/runs/20261122-170102-fedtops.clients/partition-1")
    assert client_state_dir(config, {"client-state-dir": "/state"}, 1, 77, node_id=5) == Path("/state/node-5/run-77/partition-1")
    assert (
        client_state_dir(config, {"worker": "resident"}, 2, 77, node_id=5)
        == tmp_path / "cache" / "client-state" / "node-5" / "run-77" / "partition-2"
    )
    # a node with data of its own is a deployment node: its state is under its own root, whatever run-dir says
    assert (
        client_state_dir(config, {"data-path": "/data/ours.jsonl"}, 2, 77, node_id=5)
        == tmp_path / "cache" / "client-state" / "node-5" / "run-77" / "partition-2"
    )
    resumed = {**config, "resume-run": "76"}
    assert client_state_dir(resumed, {"client-state-dir": "/state"}, 1, 77, node_id=5, resume=True) == Path("/state/node-5/run-76/partition-1")
    assert client_state_dir({}, {}, 0) is None


def test_a_client_keeps_its_last_two_rounds_and_resumes_from_the_latest_not_after_the_stop(tmp_path):
    import numpy as np

    from client_app.client_state import load_round_state, save_round_state

    for r in (5, 1, 2, 3):  # round 5: the leftover of an earlier, stopped attempt
        save_round_state(tmp_path, r, {"step": np.array([r], np.int64)}, {"a": np.full(2, r, np.float32)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-002", "round-003"]
    optimizer, adapter = load_round_state(tmp_path, 2)
    assert optimizer["step"].tolist() == [2] and adapter["a"].tolist() == [2.0, 2.0]
    assert load_round_state(tmp_path, 4)[0]["step"].tolist() == [3]  # a client lost in round 4: its round 3
    with pytest.raises(LocalError, match=r"no client state of round <= 1"):
        load_round_state(tmp_path, 1)


class _JoiningGrid:
    """Node 11 is connected from the start; nodes 12 and 13 connect after a few polls."""

    def __init__(self):
        self.polls, self.later = 0, [11]

    def get_node_ids(self):
        self.polls += 1
        if self.polls > 50:
            raise RuntimeError("still waiting")
        return [11] if self.polls <= 3 else self.later


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("name", ["fedavg", "fedtops", "local"])
def test_the_first_round_of_a_resumed_run_waits_for_num_clients_nodes_and_later_rounds_do_not(monkeypatch, name):
    import flwr.serverapp.strategy.strategy_utils as flwr_sampling
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from fedopd.config import StrategySettings
    from fedtops_strategy import make_strategy

    monkeypatch.setattr(flwr_sampling, "sleep", lambda seconds: None)
    arrays = ArrayRecord({"a": Array(np.zeros(2, np.float32))})
    strategy = make_strategy(StrategySettings(name=name), num_clients=3)
    grid = _JoiningGrid()
    grid.later = [11, 12, 13]
    first = strategy.configure_train(3, arrays, ConfigRecord({"resume-round": 2}), grid).messages  # resumed after round 2
    assert sorted(m.metadata.dst_node_id for m in first) == [11, 12, 13] and grid.polls > 3
    grid.polls, grid.later = 4, [11]  # nodes 12 and 13 are lost again
    second = strategy.configure_train(4, arrays, ConfigRecord(), grid).messages
    assert [m.metadata.dst_node_id for m in second] == [11]


def _client_round(monkeypatch, tmp_path, learner, server_round, extra_config=None, state=None):
    """Run the client's ``train`` handler for ``server_round`` of a train message for ``learner``
    with the models and the round's work faked: returns (what train_round was given, the log lines)."""
    import logging
    from types import SimpleNamespace

    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    import client_app.handlers as handlers

    given = {}

    def fake_train_round(models, theta, prompts, plan, **kwargs):
        given.update(theta=theta, optimizer_state=kwargs["optimizer_state"])
        return SimpleNamespace(arrays=dict(theta), cache=None, metrics={}, optimizer_state={"step": np.array([plan.server_round], np.int64)})

    monkeypatch.setattr(handlers.worker, "setup", lambda cfg, pid, num, pooled=False, node=None: (fake_models(), ["prompt"] * 4))
    monkeypatch.setattr(handlers, "train_round", fake_train_round)
    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger, handler = logging.getLogger("flwr"), Lines()
    logger.addHandler(handler)
    config = ConfigRecord(
        {"server-round": server_round, "run-dir": str(tmp_path / "run"), "learner": learner, "build-scoring-cache": False, **(extra_config or {})}
    )
    content = RecordDict({"arrays": ArrayRecord({"a": Array(np.zeros(2, np.float32))}), "config": config})
    cfg = parse_run_config({**BASE, "num-server-rounds": 8})  # a client takes rounds up to num-server-rounds
    try:
        handlers.train(content, RecordDict() if state is None else state, 1, 3, cfg)
    finally:
        logger.removeHandler(handler)
    return given, lines


@pytest.mark.parametrize("learner", ["federated", "local"])
@pytest.mark.parametrize("extra_config", [{}, {"resume-round": 3}], ids=["late-or-lost", "resume-round"])
def test_a_client_without_state_of_its_own_after_round_one_continues_from_its_latest_saved_round(monkeypatch, tmp_path, learner, extra_config):
    import numpy as np

    from client_app.client_state import save_round_state

    folder = tmp_path / "run.clients" / "partition-1"
    for r in (2, 3):
        save_round_state(folder, r, {"step": np.array([r], np.int64)}, {"a": np.full(2, r, np.float32)} if learner == "local" else None)
    given, lines = _client_round(monkeypatch, tmp_path, learner, 5 if not extra_config else 4, extra_config)
    assert given["optimizer_state"]["step"].tolist() == [3]  # its own latest round, not a fresh optimizer
    assert given["theta"]["a"].tolist() == ([3.0, 3.0] if learner == "local" else [0.0, 0.0])  # Local: its own adapter
    assert any("restored its saved state of round 3" in line for line in lines)


def test_a_client_new_to_a_new_run_after_round_one_starts_fresh_and_says_so(monkeypatch, tmp_path):
    given, lines = _client_round(monkeypatch, tmp_path, "local", 3)
    assert given["optimizer_state"] is None and given["theta"]["a"].tolist() == [0.0, 0.0]  # the server's adapter
    assert any("client 1: no saved state before round 3; a client new to this run starts fresh" in line for line in lines)


def test_a_client_without_saved_state_in_the_first_round_of_a_resumed_run_fails(monkeypatch, tmp_path):
    with pytest.raises(LocalError, match=r"no client state of round <= 2"):
        _client_round(monkeypatch, tmp_path, "federated", 3, {"resume-round": 2})


def test_a_client_with_state_of_its_own_does_not_restore_a_saved_round(monkeypatch, tmp_path):
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from client_app.client_state import save_round_state

    save_round_state(tmp_path / "run.clients" / "partition-1", 2, {"step": np.array([2], np.int64)}, None)
    state = RecordDict({"meta": ConfigRecord({"server-round": 2}), "optimizer": ArrayRecord({"step": Array(np.array([9], np.int64))})})
    given, _ = _client_round(monkeypatch, tmp_path, "federated", 3, state=state)
    assert given["optimizer_state"]["step"].tolist() == [9]
