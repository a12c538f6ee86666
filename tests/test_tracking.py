"""logging.wandb / logging.mlflow (server_app/tracking.py): what a real run sends to Weights & Biases
and MLflow, read back with the tools' own readers, against the run folder; and the rules that keep
tracking from ever stopping a run.

The expected values come from the run folder (``rounds.jsonl``, ``config.json``, ``status.json``),
computed here from the records' raw fields, never with the tracker code or ``round_scalars``.
"""

from __future__ import annotations

import json
import logging
import struct
import sys
import zlib
from pathlib import Path

import pytest
from conftest import TINY_RUN

from fedopd.config import ConfigError, check_server_requirements, parse_run_config

# ---------------------------------------------------------------------------------------------
# Readers of what the tools wrote
# ---------------------------------------------------------------------------------------------


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B transaction log (``run-<id>.wandb``), read with wandb's own
    schema (``wandb.proto.wandb_internal_pb2.Record``). wandb >= 0.19 has no Python reader of the
    file left; its framing is LevelDB's log format: a 7-byte header (``:W&B``, magic, version),
    then 32 KiB blocks of chunks, each ``crc32 (4) | length (2) | type (1) | data``, type 1 a
    whole record, 2 / 3 / 4 its first / middle / last part. Every chunk's CRC is checked."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: bad chunk CRC at byte {pos}"
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _item_key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def wandb_run(wandb_dir: Path) -> dict:
    """The one offline run under ``wandb_dir``: its name and project, config, history rows by step,
    summary and exit code."""
    logs = list(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(logs) == 1, f"expected one offline W&B run under {wandb_dir}, found {logs}"
    out = {"config": {}, "history": {}, "summary": {}, "exit_code": None, "artifacts": {}}
    for record in wandb_records(logs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["project"] = record.run.display_name, record.run.project
            updates = record.run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            row = {_item_key(i): json.loads(i.value_json) for i in record.history.item}
            out["history"][row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
            continue
        elif kind == "summary":
            out["summary"].update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
            continue
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
            continue
        elif kind == "artifact":  # the files of a logged artifact, by name
            out["artifacts"][record.artifact.name] = [entry.path for entry in record.artifact.manifest.contents]
            continue
        else:
            continue
        out["config"].update({_item_key(i): json.loads(i.value_json) for i in updates if _item_key(i) != "_wandb"})
    return out


def mlflow_runs(uri: str, experiment: str = "fedtops") -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


# ---------------------------------------------------------------------------------------------
# The expected scalars, from a round record's raw fields
# ---------------------------------------------------------------------------------------------


def expected_scalars(record: dict) -> dict[str, float]:
    """What a round of the tiny FedTOPS run must show: the clients' mean losses, the selected a and
    its Ĵ, the averaging errors in %, the step's cosine to Δ_t, the round's seconds and its MB per
    direction and phase."""
    clients = record["clients"]
    out = {f"clients/{k}": sum(c[k] for c in clients) / len(clients) for k in ("loss", "loss_first", "loss_last")}
    a = record["multiplier"]
    out["server/multiplier"] = a
    out["server/teacher_score_selected"] = record["teacher_scores"][record["candidates"].index(a)]
    out["server/aggregation_error"] = 100 * record["aggregation-error"]
    out["server/aggregation_error_applied"] = 100 * record["aggregation-error-applied"]
    out["server/step_cosine"] = record["step-cosine"]  # FedTOPS steps along Δ_t: 1 to fp32 rounding
    out["server/round_seconds"] = record["seconds"]
    comm = record["communication"]
    out["comm/sent_mb"], out["comm/received_mb"] = comm["sent"] / 1e6, comm["received"] / 1e6
    for phase in ("train", "score"):
        out[f"comm/{phase}_mb"] = sum(n["sent"] + n["received"] for n in comm[phase]) / 1e6
    for c in clients:  # each client's series, the training reward in %
        who = f"client-{c['partition-id']}"
        out |= {f"{who}/loss_first": c["loss_first"], f"{who}/loss_last": c["loss_last"], f"{who}/train_reward": 100 * c["accuracy"]}
        out |= {f"{who}/response_length": c["response_length"], f"{who}/train_seconds": c["total_s"]}
    return out


# ---------------------------------------------------------------------------------------------
# Real runs of the tiny preset, in process
# ---------------------------------------------------------------------------------------------


class _RaisesInRound:
    """Stands in for TensorBoard in the tracked run: raises in its first log_round."""

    calls: list[str] = []

    def log_config(self, config):
        self.calls.append("log_config")

    def log_round(self, record):
        self.calls.append(f"log_round {record['round']}")
        raise RuntimeError("tracker broke")

    def close(self, status):
        self.calls.append("close")


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _tiny_run(out: Path, env: dict[str, str], rounds: int, nodes: int, **keys) -> tuple[Path, list[logging.LogRecord]]:
    """A tiny in-process run with ``env`` as the only tracking variables, in ``out`` as the working directory."""
    from client_app.app import app
    from server_app import tracking
    from server_app.app import run_server
    from server_app.inprocess import InProcessGrid, task_identity

    cfg = parse_run_config({**TINY_RUN, "num-server-rounds": rounds, "output-dir": str(out / "runs"), **keys})
    capture = _Capture()
    flwr_logger = logging.getLogger("flwr")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("WANDB_PROJECT", "WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        mp.chdir(out)
        _RaisesInRound.calls = []
        mp.setitem(tracking.FACTORIES, "logging.tensorboard", lambda path, where: _RaisesInRound())
        flwr_logger.addHandler(capture)
        try:
            with task_identity():
                folder = run_server(InProcessGrid(app, cfg.to_run_config(), nodes), cfg)
        finally:
            flwr_logger.removeHandler(capture)
            if "wandb" in sys.modules:  # W&B reads its variables once per process, at setup: the next run's anew
                sys.modules["wandb"].teardown()
    return folder, capture.records


def _env(root: Path) -> dict[str, str]:
    (root / "wandb").mkdir(parents=True)
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(root / "wandb"),
        "WANDB_SILENT": "true",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
    }


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Two rounds with logging.wandb and logging.mlflow on, and a TensorBoard stand-in that raises.
    W&B's destination from the run config over a variable that says otherwise, its project from a
    variable; MLflow's from nothing (the run folder); the adapters as artifacts."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    root = tmp_path_factory.mktemp("tracked")
    (root / "wandb").mkdir()
    env = {"WANDB_MODE": "online", "WANDB_DIR": str(root / "not-here"), "WANDB_PROJECT": "from-env", "WANDB_SILENT": "true"}
    keys = {"logging.wandb-mode": "offline", "logging.wandb-dir": str(root / "wandb"), "logging.artifacts": "adapters"}
    folder, logs = _tiny_run(root, env, 2, 2, **{"logging.wandb": True, "logging.mlflow": True, "logging.tensorboard": True}, **keys)
    rounds = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    return {
        "root": root,
        "folder": folder,
        "rounds": rounds,
        "config": json.loads((folder / "config.json").read_text()),
        "status": json.loads((folder / "status.json").read_text())["status"],
        "wandb": wandb_run(root / "wandb"),
        "mlflow": mlflow_runs(uri),
        "uri": uri,
        "logs": logs,
    }


@pytest.mark.slow
def test_wandb_gets_every_rounds_scalars_of_rounds_jsonl_at_step_round(tracked):
    w = tracked["wandb"]
    assert [r["round"] for r in tracked["rounds"]] == [1, 2]
    assert sorted(w["history"]) == [1, 2]
    for record in tracked["rounds"]:
        assert w["history"][record["round"]] == pytest.approx(expected_scalars(record), rel=1e-12), f"round {record['round']}"


@pytest.mark.slow
def test_wandb_gets_the_config_json_and_the_final_status_under_the_run_folders_name(tracked):
    w = tracked["wandb"]
    assert (w["name"], w["project"]) == (tracked["folder"].name, "from-env")
    assert w["config"] == tracked["config"]
    assert tracked["status"] == "completed"
    assert (w["summary"]["status"], w["exit_code"]) == ("completed", 0)


@pytest.mark.slow
def test_mlflow_gets_every_rounds_scalars_of_rounds_jsonl_at_step_round(tracked):
    from mlflow import MlflowClient

    (run,) = tracked["mlflow"]
    client = MlflowClient(tracking_uri=tracked["uri"])
    expected = {r["round"]: expected_scalars(r) for r in tracked["rounds"]}
    assert set(run.data.metrics) == set(expected[1]) == set(expected[2])
    for key in run.data.metrics:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(n, pytest.approx(expected[n][key], rel=1e-12)) for n in (1, 2)], key


@pytest.mark.slow
def test_trackers_write_where_the_run_config_says_else_in_the_run_folder_never_the_working_directory(tracked):
    root, folder = tracked["root"], tracked["folder"]
    assert not (root / "not-here").exists()  # logging.wandb-dir beats WANDB_DIR
    assert sorted(p.name for p in root.iterdir()) == ["runs", "wandb"]  # no mlflow.db, mlruns or wandb/ in the working directory
    assert (folder / "mlflow.db").is_file()
    lines = [r.getMessage() for r in tracked["logs"] if r.getMessage().startswith(("logging.wandb:", "logging.mlflow:"))]
    assert lines == [
        f"logging.wandb: W&B run '{folder.name}' in project 'from-env', mode offline, files in {root / 'wandb' / 'wandb'}; "
        f"upload later: wandb sync {root / 'wandb' / 'wandb'}/offline-run-*",
        f"logging.mlflow: MLflow run '{folder.name}' in experiment 'fedtops' at {tracked['uri']} (view: mlflow ui --backend-store-uri {tracked['uri']})",
    ]


@pytest.mark.slow
def test_mlflow_gets_the_run_folders_records_and_every_adapter_as_artifacts(tracked):
    from mlflow import MlflowClient

    (run,) = tracked["mlflow"]
    client = MlflowClient(tracking_uri=tracked["uri"])
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"config.json", "rounds.jsonl", "status.json", "progress.png", "round-000", "round-001", "round-002"}
    for n in (0, 1, 2):
        files = {a.path.split("/")[-1] for a in client.list_artifacts(run.info.run_id, f"round-{n:03d}")}
        assert files == {p.name for p in (tracked["folder"] / f"round-{n:03d}").iterdir()}
    local = Path(client.download_artifacts(run.info.run_id, "rounds.jsonl", str(tracked["root"] / "dl")))
    assert local.read_bytes() == (tracked["folder"] / "rounds.jsonl").read_bytes()
    assert str(tracked["folder"]) in run.info.artifact_uri  # beside the store, not ./mlruns
    assert run.data.tags["fedtops.run-folder"] == str(tracked["folder"])


@pytest.mark.slow
def test_wandb_gets_the_records_and_the_adapters_as_two_artifacts(tracked):
    folder = tracked["folder"]
    names = sorted(a for a in tracked["wandb"]["artifacts"])
    assert names == [f"{folder.name}-adapters", f"{folder.name}-records"]
    assert set(tracked["wandb"]["artifacts"][f"{folder.name}-records"]) == {"config.json", "rounds.jsonl", "status.json", "progress.png"}
    adapter_files = {f.relative_to(folder).as_posix() for f in folder.glob("round-*/**/*") if f.is_file()}
    assert set(tracked["wandb"]["artifacts"][f"{folder.name}-adapters"]) == adapter_files


@pytest.mark.slow
def test_mlflow_gets_the_config_json_as_params_and_the_final_status(tracked):
    (run,) = tracked["mlflow"]
    assert run.info.run_name == tracked["folder"].name
    params, config = run.data.params, tracked["config"]
    assert set(params) == set(config)
    for key, value in config.items():  # strings as they are, other values as JSON
        assert (params[key] if isinstance(value, str) else json.loads(params[key])) == value, key
    assert run.data.tags["fedtops.status"] == tracked["status"] == "completed"
    assert run.info.status == "FINISHED"


@pytest.mark.slow
def test_a_tracker_that_raises_mid_run_is_warned_about_once_and_dropped_and_the_run_completes(tracked):
    # the stand-in for TensorBoard raised in round 1: not called again but to close it at the end
    assert _RaisesInRound.calls == ["log_config", "log_round 1", "close"]
    warnings = [r.getMessage() for r in tracked["logs"] if r.levelno == logging.WARNING and "tracker broke" in r.getMessage()]
    assert warnings == [
        "run config 'logging.tensorboard' = true: its log_round failed, RuntimeError: tracker broke; it is off for the rest of this run"
    ]
    assert tracked["status"] == "completed" and sorted(tracked["wandb"]["history"]) == [1, 2]  # the others went on


@pytest.mark.slow
def test_nothing_is_tracked_with_the_keys_false(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    mlflow = pytest.importorskip("mlflow")
    started = []
    monkeypatch.setattr(wandb, "init", lambda *a, **k: started.append("wandb") or pytest.fail("wandb.init called"))
    monkeypatch.setattr(mlflow, "MlflowClient", lambda *a, **k: started.append("mlflow") or pytest.fail("MlflowClient created"))
    env = _env(tmp_path)
    folder, _ = _tiny_run(tmp_path, env, 1, 1, **{"strategy.name": "fedavg"})
    assert started == []
    assert json.loads((folder / "status.json").read_text())["status"] == "completed"
    assert list((tmp_path / "wandb").iterdir()) == []
    assert not (tmp_path / "mlflow.db").exists()
    assert _RaisesInRound.calls == []  # logging.tensorboard false: not even created


# ---------------------------------------------------------------------------------------------
# The rules, without a run
# ---------------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self, fail_in: str = ""):
        self.fail_in, self.calls = fail_in, []

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name == self.fail_in:
            raise OSError(f"{name} failed")

    def log_config(self, config):
        self._call("log_config", dict(config))

    def log_round(self, record):
        self._call("log_round", record["round"])

    def close(self, status):
        self._call("close", status)


def _flwr_caplog(caplog):
    caplog.set_level(logging.DEBUG, logger="flwr")
    return caplog


def test_a_tracker_that_raises_is_dropped_with_one_warning_and_the_others_go_on(caplog):
    from server_app.tracking import Trackers

    caplog = _flwr_caplog(caplog)
    good, bad = _Recorder(), _Recorder(fail_in="log_round")
    trackers = Trackers({"logging.wandb": bad, "logging.mlflow": good})
    trackers.log_config({"seed": 1})
    for n in (1, 2, 3):
        trackers.log_round({"round": n})
    trackers.close("completed")
    assert bad.calls == [("log_config", {"seed": 1}), ("log_round", 1), ("close", "completed")]  # closed with the final status
    assert good.calls == [("log_config", {"seed": 1}), ("log_round", 1), ("log_round", 2), ("log_round", 3), ("close", "completed")]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["run config 'logging.wandb' = true: its log_round failed, OSError: log_round failed; it is off for the rest of this run"]


def test_a_tracker_that_raises_on_close_does_not_raise(caplog):
    from server_app.tracking import Trackers

    caplog = _flwr_caplog(caplog)
    Trackers({"logging.mlflow": _Recorder(fail_in="close")}).close("failed")
    assert "'logging.mlflow' = true: its close failed" in caplog.text


def test_a_tracker_that_cannot_start_is_reported_with_its_key_and_left_out(caplog, tmp_path):
    from server_app.tracking import open_trackers

    caplog = _flwr_caplog(caplog)

    def broken(path, where):
        raise ConnectionError("no route to tracking server")

    good = _Recorder()
    trackers = open_trackers(
        {"logging.tensorboard": False, "logging.wandb": True, "logging.mlflow": True},
        tmp_path / "run",
        factories={"logging.wandb": lambda path, where: good, "logging.mlflow": broken},
    )
    assert trackers.active == {"logging.wandb": good}
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert error.startswith("run config 'logging.mlflow' = true: MLflow could not start, this run goes on without it")
    assert "ConnectionError: no route to tracking server" in error and "MLFLOW_TRACKING_URI" in error


@pytest.mark.parametrize("key, module", [("logging.wandb", "wandb"), ("logging.mlflow", "mlflow"), ("logging.tensorboard", "tensorboard")])
def test_a_tracking_key_without_its_package_is_refused_before_round_1(monkeypatch, key, module):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else find_spec(name, *a))
    cfg = parse_run_config({key: True})
    with pytest.raises(ConfigError) as err:
        check_server_requirements(cfg)
    assert str(err.value) == (
        f"run config '{key}' = true needs the {module} package on the ServerApp's host; allowed: false, or install it with pip install -e '.[{module}]'"
    )
    check_server_requirements(parse_run_config({}))  # off: nothing needed


def test_mlflow_metric_names_keep_the_scalar_names_and_spell_out_at():
    pytest.importorskip("mlflow")
    from mlflow.utils.validation import _validate_metric_name

    from server_app.tracking import mlflow_name

    assert mlflow_name("clients/loss_first") == "clients/loss_first"
    assert mlflow_name("heldout/avg@8") == "heldout/avg_at_8"
    for name in ("heldout/avg@8", "heldout/pass@16", "comm/sent_mb", "privacy/epsilon"):
        _validate_metric_name(mlflow_name(name))  # raises on a name MLflow refuses


def test_a_trackers_error_is_one_line_without_the_urls_credentials(caplog):
    """MLflow repeats MLFLOW_TRACKING_URI in its errors; a token in it must not reach the log."""
    from server_app.tracking import Trackers

    caplog = _flwr_caplog(caplog)

    class Leaky:
        def log_round(self, record):
            raise ConnectionError("API request to http://alice:s3cr3t-token@10.0.0.9:5000/api/2.0/mlflow/runs/log-batch failed\nINFO forged")

    Trackers({"logging.mlflow": Leaky()}).log_round({"round": 1})
    [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "s3cr3t" not in line and "alice" not in line and "http://***@10.0.0.9:5000/api" in line
    assert "\n" not in line and "\\nINFO forged" in line


def test_wandb_and_mlflow_are_refused_in_a_private_run_and_tensorboard_is_not():
    """Their rounds carry client losses, held-out accuracy and timings, which the privacy guarantee
    does not cover (docs/privacy.md), to a third-party service."""
    from fedopd.config import ConfigError, parse_run_config
    from fedopd.config.presets import app_defaults

    private = {**app_defaults(), "num-clients": 3, "privacy.clipping": "fixed"}
    for key in ("logging.wandb", "logging.mlflow"):
        with pytest.raises(ConfigError, match=rf"run config '{key}' = true with 'privacy.clipping' = 'fixed' would send"):
            parse_run_config({**private, key: True})
    assert parse_run_config({**private, "logging.tensorboard": True}).logging.tensorboard


# ---------------------------------------------------------------------------------------------
# Destinations, each client's series, artifacts, TensorBoard's hyperparameters
# ---------------------------------------------------------------------------------------------


def _logging(**keys):
    return parse_run_config({f"logging.{k.replace('_', '-')}": v for k, v in keys.items()}).logging


def test_a_destination_in_the_run_config_beats_the_variable_and_the_variable_beats_the_run_folder(tmp_path):
    from server_app.tracking import destinations

    env = {
        "WANDB_PROJECT": "p-env",
        "WANDB_MODE": "online",
        "WANDB_DIR": "/env/dir",
        "MLFLOW_TRACKING_URI": "http://env:5000",
        "MLFLOW_EXPERIMENT_NAME": "e-env",
    }
    keys = dict(wandb_project="p-cfg", wandb_mode="offline", wandb_dir="/cfg/dir", mlflow_uri="sqlite:////cfg/m.db", mlflow_experiment="e-cfg")
    run = tmp_path / "runs" / "r1"
    got = destinations(_logging(**keys), env, run)
    assert (got.wandb_project, got.wandb_mode, got.wandb_dir, got.mlflow_uri, got.mlflow_experiment) == (
        "p-cfg", "offline", Path("/cfg/dir"), "sqlite:////cfg/m.db", "e-cfg",
    )  # fmt: skip
    got = destinations(_logging(), env, run)
    assert (got.wandb_project, got.wandb_mode, got.wandb_dir, got.mlflow_uri, got.mlflow_experiment) == (
        "p-env", "online", Path("/env/dir"), "http://env:5000", "e-env",
    )  # fmt: skip
    assert destinations(_logging(run_name="fedavg seed 0"), env, run).run_name == "fedavg seed 0"
    got = destinations(_logging(), {}, run)
    assert got.run_name == "r1"  # the run folder's name
    assert (got.wandb_project, got.wandb_mode, got.wandb_dir, got.mlflow_uri, got.mlflow_experiment) == (
        "fedtops", "offline", run, f"sqlite:///{run}/mlflow.db", "fedtops",
    )  # fmt: skip


@pytest.mark.parametrize(
    "uri", ["http://alice:token@host:5000", "https://tok@host", "databricks://u:p@ws", " https://u:p@h", "https://u:p\r@h", "https://u:p\t@h"]
)
def test_an_mlflow_uri_with_credentials_is_refused_naming_the_key(uri):
    with pytest.raises(ConfigError, match="run config 'logging.mlflow-uri'.*without credentials"):
        parse_run_config({"logging.mlflow-uri": uri})
    assert parse_run_config({"logging.mlflow-uri": "http://host:5000/path@x"}).logging.mlflow_uri.endswith("@x")  # '@' after the host is a path


def test_an_mlflow_uri_with_whitespace_or_a_control_character_is_refused():
    for uri in ("http://host:5000/a b", "sqlite:////tmp/m.db\x00", "http://host\x7f:5000"):  # parsers drop or stop at them
        with pytest.raises(ConfigError, match="logging.mlflow-uri"):
            parse_run_config({"logging.mlflow-uri": uri})


def test_each_clients_series_is_named_by_partition_with_the_reward_in_percent():
    from server_app.tracking import client_scalars

    record = {
        "clients": [
            {"partition-id": 2, "node-id": 99, "loss_first": 0.5, "loss_last": 0.25, "accuracy": 0.125, "response_length": 40.0, "total_s": 3.0},
            {"node-id": 7, "loss_first": float("nan"), "loss_last": True, "accuracy": 0.5},  # no partition id; nan and a bool left out
            {"loss_first": 1.0},  # neither: left out
        ],
        "evaluation": {"accuracy": 40.0, "clients": [{"partition-id": 2, "accuracy": 37.5, "avg@8": 20.0, "pass@8": 60.0, "eval_s": 2.0}]},
    }
    assert client_scalars(record) == {
        "client-2/loss_first": 0.5, "client-2/loss_last": 0.25, "client-2/train_reward": 12.5, "client-2/response_length": 40.0,
        "client-2/train_seconds": 3.0, "node-7/train_reward": 50.0,
        "client-2/heldout_greedy": 37.5, "client-2/heldout_avg@8": 20.0, "client-2/heldout_pass@8": 60.0,
    }  # fmt: skip


def test_the_artifacts_are_the_records_that_exist_and_with_adapters_every_rounds_files(tmp_path):
    from server_app.tracking import artifact_files

    for name in ("config.json", "rounds.jsonl", "status.json", "mlflow.db"):
        (tmp_path / name).write_text("x")
    for folder in ("round-000", "round-001/client-0", "tensorboard"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "adapter_model.safetensors").write_text("x")
    assert artifact_files(tmp_path, "none") == []
    records = [(tmp_path / n, n) for n in ("config.json", "rounds.jsonl", "status.json")]  # no progress.png yet
    assert artifact_files(tmp_path, "records") == records
    assert artifact_files(tmp_path, "adapters") == records + [
        (tmp_path / "round-000/adapter_model.safetensors", "round-000/adapter_model.safetensors"),
        (tmp_path / "round-001/client-0/adapter_model.safetensors", "round-001/client-0/adapter_model.safetensors"),
    ]


def test_artifacts_go_before_the_final_status_and_only_to_trackers_that_take_them():
    from server_app.tracking import Trackers

    calls = []

    class Takes(_Recorder):
        def log_artifacts(self, files):
            calls.append(("artifacts", files))

        def close(self, status):
            calls.append(("close", status))

    plain = _Recorder()
    Trackers({"logging.mlflow": Takes(), "logging.tensorboard": plain}, artifacts=lambda: [(Path("a"), "a")]).close("completed")
    assert calls == [("artifacts", [(Path("a"), "a")]), ("close", "completed")]
    assert plain.calls == [("close", "completed")]


def test_tensorboard_gets_the_config_as_hyperparameters_and_the_runs_end(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    from server_app.tracking import TensorBoardTracker, hparams_of

    config = {
        "train.lr": 0.003,
        "seed": 4,
        "strategy.name": "fedtops",
        "logging.wandb": False,
        "resolved": {"stop-tokens": [1, 2], "dtype": "float32"},
        "x": None,
    }
    assert hparams_of(config) == {
        "train.lr": 0.003, "seed": 4, "strategy.name": "fedtops", "logging.wandb": False, "resolved.stop-tokens": "[1, 2]", "resolved.dtype": "float32", "x": "null",
    }  # fmt: skip
    tb = TensorBoardTracker(tmp_path)
    tb.log_config(config)
    tb.close("failed")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    data = {k: plugin_data_pb2.HParamsPluginData.FromString(v) for k, v in events.PluginTagToContent("hparams").items()}
    start = data["_hparams_/session_start_info"].session_start_info.hparams
    assert start["train.lr"].number_value == 0.003 and start["strategy.name"].string_value == "fedtops" and start["logging.wandb"].bool_value is False
    assert start["resolved.stop-tokens"].string_value == "[1, 2]"
    assert [m.name.tag for m in data["_hparams_/experiment"].experiment.metric_infos] == ["heldout/greedy", "clients/loss_last", "server/multiplier"]
    assert data["_hparams_/session_end_info"].session_end_info.status == 2  # STATUS_FAILURE


def test_a_long_or_non_ascii_run_name_gives_a_w_and_b_artifact_name_within_its_limit():
    from server_app.tracking import artifact_prefix

    assert artifact_prefix("fedavg seed 0") == "fedavg-seed-0"
    assert artifact_prefix("δ=0.05 seed 1") == "0.05-seed-1"
    long_a, long_b = "x" * 150 + " a", "x" * 150 + " b"
    assert len(artifact_prefix(long_a)) == 128 - len("-adapters") and artifact_prefix(long_a) != artifact_prefix(long_b)
