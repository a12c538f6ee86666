"""``resume-from``: a stopped run continues bit-identically; what a stop leaves half-written is
replaced; a resumed run may not change what its results depend on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import TINY
from fedopd.config import ConfigError, parse_run_config
from server_app.run_folder import complete_rounds, config_mismatch

BASE = {
    **TINY,
    "rollout.backend": "hf", "rollout.per-round": 8, "rollout.max-new-tokens": 16, "data.prompts-per-client": 16,
    "train.mini-batch": 4, "train.micro-batch": 2, "num-server-rounds": 4, "eval.every": 0,
}
STRATEGIES = {
    "fedtops": {"strategy.name": "fedtops", "strategy.trust-budget": 0.01},
    "fedavg": {"strategy.name": "fedavg"},
    "fixed": {"strategy.name": "fixed", "strategy.multiplier": 3.0},
    "local": {"strategy.name": "local"},
}
TIMING = {"seconds", "eval_seconds", "score_seconds", "rollout_s", "grade_s", "cache_s", "opd_s", "total_s", "teacher_s", "train_s",
          "worker-pid", "worker-model-loads", "worker-rss-mb", "server-rss-mb"}


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMING}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def _run_stopped_in_round(config: dict, stop_round: int) -> Path:
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
    grid = StoppingGrid(app, cfg.to_run_config(), 3)
    with pytest.raises(Stop):
        run_server(grid, cfg)
    [run] = [p.parent for p in Path(cfg.output_dir).glob("*/config.json")]
    with open(run / "rounds.jsonl", "a") as f:
        f.write('{"round": %d, "multipl' % stop_round)
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

    assert resumed == stopped  # continued in the same folder
    assert _without_timings(_records(resumed)) == _without_timings(_records(full))
    for r in (3, 4):
        adapters = sorted(p.relative_to(full) for p in (full / f"round-{r:03d}").rglob("adapter_model.safetensors"))
        assert adapters == sorted(p.relative_to(resumed) for p in (resumed / f"round-{r:03d}").rglob("adapter_model.safetensors"))
        assert len(adapters) == (3 if name == "local" else 1)
        for a in adapters:
            assert (resumed / a).read_bytes() == (full / a).read_bytes(), f"round {r}: {a} differs"


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
    assert client_state_dir(config, {"client-state-dir": "/state"}, 1) == Path("/state/20261122-170102-fedtops/partition-1")
    assert client_state_dir(config, {"worker": "resident"}, 2) == tmp_path / "cache" / "client-state" / "20261122-170102-fedtops" / "partition-2"
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
    with pytest.raises(FileNotFoundError, match=r"no client state of round <= 1"):
        load_round_state(tmp_path, 1)
