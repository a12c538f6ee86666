"""Experiment tracking: TensorBoard, Weights & Biases and MLflow behind one :class:`Tracker`.

Each tracker that its run-config key turns on (``logging.tensorboard``, ``logging.wandb``,
``logging.mlflow``; all off by default) gets

- at the start, the run config as the run folder's ``config.json`` holds it (the flat run-config
  dict and its ``resolved`` facts; TensorBoard: as hyperparameters),
- after each recorded round, :func:`server_app.progress.round_scalars` of the round record and
  :func:`client_scalars` (each client's series), at step = the round number,
- at the end, ``logging.artifacts`` (the run folder's records, and optionally its adapters; W&B and
  MLflow) and the run's final status as ``status.json`` says it (``completed``, ``failed``,
  ``budget-spent``).

Where W&B and MLflow write (:func:`destinations`): the ``logging.wandb-*`` / ``logging.mlflow-*``
keys of the run config, else the tools' own variables (``WANDB_PROJECT``, ``WANDB_MODE``,
``WANDB_DIR`` / ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``) in the ServerApp's
environment, else inside the run folder (W&B offline files in ``RUN/wandb``, MLflow in
``sqlite:///RUN/mlflow.db``), never the working directory. The stream says where each one writes.
Credentials never come from the run config. docs/tracking.md.

Tracking never stops a run: a tracker that cannot start is reported (ERROR, naming its key) and
left out; one that raises later is warned about once and dropped for the rest of the run.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any, Protocol

from flwr.common.logger import log

from server_app.progress import round_scalars

DEFAULT_PROJECT = "fedtops"  # W&B project and MLflow experiment when their variables are unset
SUCCESS = ("completed", "budget-spent")  # final statuses of a run that ended as planned


class Tracker(Protocol):
    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run config, once, before round 1."""

    def log_round(self, record: Mapping[str, Any]) -> None:
        """One round record (``rounds.jsonl``), after it is written."""

    def close(self, status: str) -> None:
        """The run's final status (``status.json``); nothing is logged after it."""


# A tracker may also have ``log_artifacts(files)``: ``files`` are (local file, name in the tracker)
# pairs (:func:`artifact_files`), sent once, just before ``close``.


@dataclass(frozen=True)
class Destinations:
    """Where W&B and MLflow write, resolved (:func:`destinations`)."""

    run_name: str
    wandb_project: str
    wandb_mode: str
    wandb_dir: Path
    mlflow_uri: str
    mlflow_experiment: str


def destinations(settings, env: Mapping[str, str], run_path: Path) -> Destinations:
    """The run config's ``logging.*`` destination (``settings``: its LoggingSettings), else the
    tool's variable in ``env``, else the default: project / experiment ``fedtops``, W&B offline
    with its files in the run folder, MLflow in ``sqlite:///RUN_FOLDER/mlflow.db``."""
    run_path = Path(run_path).absolute()
    return Destinations(
        run_name=settings.run_name or run_path.name,
        wandb_project=settings.wandb_project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        wandb_mode=settings.wandb_mode or env.get("WANDB_MODE") or "offline",
        wandb_dir=Path(settings.wandb_dir or env.get("WANDB_DIR") or run_path).expanduser(),
        mlflow_uri=settings.mlflow_uri or env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_path / 'mlflow.db'}",
        mlflow_experiment=settings.mlflow_experiment or env.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT,
    )


def _client_id(client: Mapping[str, Any]) -> str | None:
    pid = client.get("partition-id")
    if isinstance(pid, int) and not isinstance(pid, bool):
        return f"client-{pid}"
    node = client.get("node-id")
    return f"node-{node}" if isinstance(node, int) and not isinstance(node, bool) else None


def _finite(value: Any) -> float | None:
    import math

    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


# (key of a client's train metrics, its series name, scale): the reward is a fraction there, % here
CLIENT_TRAIN_SERIES = (("loss_first", "loss_first", 1.0), ("loss_last", "loss_last", 1.0), ("accuracy", "train_reward", 100.0),
                       ("response_length", "response_length", 1.0), ("total_s", "train_seconds", 1.0))  # fmt: skip


def client_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Each client's series of one round record: ``client-<partition-id>/<name>`` (``node-<id>``
    where a client has no partition id), from its train metrics (:data:`CLIENT_TRAIN_SERIES`; the
    training reward in %) and its held-out evaluation (``heldout_greedy``, ``heldout_avg@k``,
    ``heldout_pass@k``, in %); absent or non-finite values are left out."""
    out: dict[str, float] = {}
    for client in record.get("clients") or []:
        who = _client_id(client) if isinstance(client, Mapping) else None
        for key, name, scale in CLIENT_TRAIN_SERIES if who else ():
            value = _finite(client.get(key))
            if value is not None:
                out[f"{who}/{name}"] = scale * value
    for client in (record.get("evaluation") or {}).get("clients") or []:
        who = _client_id(client) if isinstance(client, Mapping) else None
        for key, value in client.items() if who else ():
            if key == "accuracy" or key.startswith(("avg@", "pass@")):
                value = _finite(value)
                if value is not None:
                    out[f"{who}/heldout_{'greedy' if key == 'accuracy' else key}"] = value
    return out


def tracked_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """What a tracker logs for one round: :func:`round_scalars` and :func:`client_scalars`."""
    return {**round_scalars(record), **client_scalars(record)}


RECORD_FILES = ("config.json", "rounds.jsonl", "status.json", "progress.png")


def artifact_files(run_path: Path, what: str) -> list[tuple[Path, str]]:
    """(file, name) pairs of ``logging.artifacts``: ``records`` the run folder's
    :data:`RECORD_FILES` that exist, ``adapters`` those and every file of every ``round-NNN``
    adapter folder (``round-NNN/...``), ``none`` nothing."""
    if what == "none":
        return []
    files = [(run_path / name, name) for name in RECORD_FILES if (run_path / name).is_file()]
    if what == "adapters":
        for folder in sorted(p for p in run_path.glob("round-[0-9][0-9][0-9]") if p.is_dir()):
            files += [(f, f.relative_to(run_path).as_posix()) for f in sorted(folder.rglob("*")) if f.is_file()]
    return files


def hparams_of(config: Mapping[str, Any]) -> dict[str, bool | int | float | str]:
    """The run config as TensorBoard hyperparameters: nested dicts (``resolved``) flattened with
    ``.``, numbers, booleans and strings as they are, anything else (lists, None) as JSON."""
    out: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update({f"{key}.{k}": v for k, v in hparams_of(value).items()})
        elif isinstance(value, bool | int | float | str):
            out[key] = value
        else:
            out[key] = json.dumps(value, sort_keys=True)
    return out


HPARAM_METRICS = ("heldout/greedy", "clients/loss_last", "server/multiplier")  # the HParams dashboard's columns


class TensorBoardTracker:
    """TensorBoard events in ``<run>/tensorboard``: the config as hyperparameters (HParams
    dashboard), :func:`tracked_scalars` one step per round, the final status as the session's end."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the 'tensorboard' extra

        self.writer = SummaryWriter(log_dir=str(folder))

    def log_config(self, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        experiment, start, _ = hparams(hparams_of(config), dict.fromkeys(HPARAM_METRICS, 0.0))
        for summary in (experiment, start):
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log_round(self, record: Mapping[str, Any]) -> None:
        for key, value in tracked_scalars(record).items():
            self.writer.add_scalar(key, value, global_step=int(record["round"]))
        self.writer.flush()

    def close(self, status: str = "") -> None:
        self.writer.file_writer.add_summary(session_end(status in SUCCESS))
        self.writer.close()


def session_end(success: bool):
    """The HParams plugin's end-of-session summary, STATUS_SUCCESS or STATUS_FAILURE (what
    ``torch.utils.tensorboard.summary.hparams`` builds, always with success)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams.api_pb2 import Status
    from tensorboard.plugins.hparams.metadata import PLUGIN_DATA_VERSION, PLUGIN_NAME, SESSION_END_INFO_TAG
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    info = SessionEndInfo(status=Status.Value("STATUS_SUCCESS" if success else "STATUS_FAILURE"))
    content = HParamsPluginData(session_end_info=info, version=PLUGIN_DATA_VERSION)
    metadata = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag=SESSION_END_INFO_TAG, metadata=metadata)])


def artifact_prefix(run_name: str, limit: int = 128 - len("-adapters")) -> str:
    """A W&B artifact name's stem from a run name: ASCII letters, digits, ``-``, ``_``, ``.``
    (anything else becomes ``-``), at most ``limit`` characters (W&B takes 128 in all): a longer
    one is cut and ends in 8 hex digits of its hash, so two long names stay apart."""
    import hashlib

    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", run_name).strip("-") or "run"
    if len(stem) <= limit:
        return stem
    return f"{stem[: limit - 9]}-{hashlib.sha256(run_name.encode()).hexdigest()[:8]}"


class WandbTracker:
    """A W&B run named after the run folder, where :class:`Destinations` says."""

    def __init__(self, run_name: str, where: Destinations) -> None:
        import wandb  # needs the 'wandb' extra

        where.wandb_dir.mkdir(parents=True, exist_ok=True)
        self.run_name = run_name
        self.artifact_prefix = artifact_prefix(run_name)
        self.run = wandb.init(project=where.wandb_project, name=run_name, mode=where.wandb_mode, dir=str(where.wandb_dir), reinit="create_new")

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_round(self, record: Mapping[str, Any]) -> None:
        self.run.log(tracked_scalars(record), step=int(record["round"]))

    def log_artifacts(self, files: list[tuple[Path, str]]) -> None:
        import wandb

        records = [(f, n) for f, n in files if "/" not in n]
        adapters = [(f, n) for f, n in files if "/" in n]
        for suffix, kind, group in (("records", "run-records", records), ("adapters", "model", adapters)):
            if group:
                artifact = wandb.Artifact(f"{self.artifact_prefix}-{suffix}", type=kind)
                for path, name in group:
                    artifact.add_file(str(path), name=name)
                self.run.log_artifact(artifact)

    def close(self, status: str) -> None:
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status in SUCCESS else 1)


def mlflow_name(key: str) -> str:
    """A scalar's name as MLflow accepts it (letters, digits, ``_ - . / : space``): ``@`` -> ``_at_``."""
    return re.sub(r"[^\w\-./: ]", "_", key.replace("@", "_at_"))


def mlflow_param(value: Any) -> str:
    """A config value as an MLflow param (a string): strings as they are, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


class MlflowTracker:
    """An MLflow run named after the run folder, where :class:`Destinations` says; the config as
    params, the final status as the tag ``fedtops.status``. An experiment it creates in a local
    store (``sqlite:///PATH``) keeps its artifacts beside the store (``mlartifacts/``), not in
    MLflow's default ``./mlruns`` of the working directory."""

    def __init__(self, run_name: str, where: Destinations, run_folder: Path | None = None) -> None:
        self.client, experiment_id = mlflow_experiment(where.mlflow_uri, where.mlflow_experiment)
        tags = {"fedtops.run-folder": str(run_folder)} if run_folder is not None else None
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, mlflow_param(value)) for key, value in config.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log_round(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["round"])
        metrics = [Metric(mlflow_name(key), value, now, step) for key, value in tracked_scalars(record).items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def log_artifacts(self, files: list[tuple[Path, str]]) -> None:
        for path, name in files:
            folder = name.rpartition("/")[0]
            self.client.log_artifact(self.run_id, str(path), artifact_path=folder or None)

    def close(self, status: str) -> None:
        self.client.set_tag(self.run_id, "fedtops.status", status)
        self.client.set_terminated(self.run_id, "FINISHED" if status in SUCCESS else "FAILED")


def mlflow_experiment(uri: str, name: str):
    """(an MlflowClient on ``uri``, the id of experiment ``name``, created where missing: artifacts
    beside a local store, :func:`local_artifact_location`). Opening a new sqlite store creates its
    tables: runs that share a store in parallel (``eval.variants --jobs 2``) open it once first."""
    from mlflow import MlflowClient  # needs the 'mlflow' extra

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return client, experiment.experiment_id
    try:
        return client, client.create_experiment(name, artifact_location=local_artifact_location(uri))
    except Exception:  # another run created it between the two calls (runs sharing a store)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return client, experiment.experiment_id


def local_artifact_location(uri: str) -> str | None:
    """``mlartifacts/`` beside a local sqlite store (``sqlite:///PATH``) as a file URI; None
    (the store's own default) for any other store."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or uri == prefix + ":memory:":
        return None
    return (Path(uri[len(prefix) :]).absolute().parent / "mlartifacts").as_uri()  # as SQLAlchemy reads it: no ~


class Trackers:
    """The run's trackers as one: each call goes to every tracker still on; one that raises is
    warned about once and dropped, and the run goes on. ``artifacts()``: the (file, name) pairs to
    send at the end, to the trackers that take them."""

    def __init__(self, trackers: Mapping[str, Tracker] | None = None, artifacts: Callable[[], list[tuple[Path, str]]] | None = None) -> None:
        self.active: dict[str, Tracker] = dict(trackers or {})  # by run-config key
        self.dropped: dict[str, Tracker] = {}  # raised once: still closed with the run's final status
        self.artifacts = artifacts

    def _each(self, method: str, *args: Any) -> None:
        for key, tracker in list(self.active.items()):
            if not hasattr(tracker, method):
                continue
            try:
                getattr(tracker, method)(*args)
            except Exception as err:  # noqa: BLE001 - tracking must never stop a run
                self.dropped[key] = self.active.pop(key)
                log(
                    WARNING,
                    "run config '%s' = true: its %s failed, %s: %s; it is off for the rest of this run",
                    key,
                    method,
                    type(err).__name__,
                    error_text(err),
                )

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._each("log_config", config)

    def log_round(self, record: Mapping[str, Any]) -> None:
        self._each("log_round", record)

    def close(self, status: str) -> None:
        """The artifacts, then every tracker's final status, those dropped after an error included
        (best effort: a run left RUNNING in MLflow after one failed upload would say nothing of how
        the run ended)."""
        if self.artifacts is not None and any(hasattr(t, "log_artifacts") for t in self.active.values()):
            try:
                files = self.artifacts()
            except OSError as err:
                log(WARNING, "logging.artifacts: the run folder's files could not be listed, none sent: %s", error_text(err))
                files = []
            if files:
                self._each("log_artifacts", files)
        self._each("close", status)
        for key, tracker in self.dropped.items():
            if key in self.active or not hasattr(tracker, "close"):
                continue
            try:
                tracker.close(status)
            except Exception:  # noqa: BLE001 - it failed already and was reported then
                pass
        self.active.clear()
        self.dropped.clear()


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")


def error_text(err: BaseException) -> str:
    """A tracker's error as one escaped line of at most 500 characters, with any credentials of a
    URL (``https://user:token@host``, as MLflow's messages repeat ``MLFLOW_TRACKING_URI``) replaced
    by ``***``."""
    from fedtops_strategy.text import escape

    return escape(_USERINFO.sub(r"\1***@", str(err)), 500)


# run-config key -> (what it is, where its destination is set), for the messages
TRACKERS: dict[str, tuple[str, str]] = {
    "logging.tensorboard": ("TensorBoard", "the run folder's tensorboard/"),
    "logging.wandb": ("Weights & Biases", "logging.wandb-project / -mode / -dir, WANDB_PROJECT, WANDB_MODE, WANDB_DIR, WANDB_API_KEY"),
    "logging.mlflow": ("MLflow", "logging.mlflow-uri / -experiment, MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME"),
}


def where_text(key: str, run_path: Path, where: Destinations) -> str:
    """The stream's line saying where a tracker writes and how to look (credentials of a URL as ``***``)."""
    if key == "logging.tensorboard":
        return f"logging.tensorboard: TensorBoard events in {run_path / 'tensorboard'} (view: tensorboard --logdir {run_path.parent})"
    if key == "logging.wandb":
        files = where.wandb_dir / "wandb"
        later = f"; upload later: wandb sync {files}/offline-run-*" if where.wandb_mode == "offline" else ""
        return f"logging.wandb: W&B run {where.run_name!r} in project {where.wandb_project!r}, mode {where.wandb_mode}, files in {files}{later}"
    uri = _USERINFO.sub(r"\1***@", where.mlflow_uri)
    return f"logging.mlflow: MLflow run {where.run_name!r} in experiment {where.mlflow_experiment!r} at {uri} (view: mlflow ui --backend-store-uri {uri})"


def open_trackers(
    enabled: Mapping[str, bool],
    run_path: Path,
    where: Destinations | None = None,
    factories: Mapping[str, Callable[[Path, Destinations], Tracker]] | None = None,
    artifacts: Callable[[], list[tuple[Path, str]]] | None = None,
) -> Trackers:
    """The trackers whose key is true in ``enabled`` (run-config key -> bool), for the run folder
    ``run_path``, writing where ``where`` says (default: :func:`destinations` of no keys and this
    process's environment); one that cannot start is reported (ERROR, with its key and variables)
    and left out, one that starts is announced with where it writes (INFO)."""
    from fedopd.core.settings import LoggingSettings

    factories = {**FACTORIES, **(factories or {})}
    where = where or destinations(LoggingSettings(), os.environ, run_path)
    trackers: dict[str, Tracker] = {}
    for key, on in enabled.items():
        if not on:
            continue
        what, variables = TRACKERS[key]
        try:
            trackers[key] = factories[key](run_path, where)
        except Exception as err:  # noqa: BLE001 - tracking must never stop a run
            log(
                ERROR,
                "run config '%s' = true: %s could not start, this run goes on without it: %s: %s (check %s; docs/tracking.md)",
                key,
                what,
                type(err).__name__,
                error_text(err),
                variables,
            )
            continue
        log(INFO, "%s", where_text(key, run_path, where))
    return Trackers(trackers, artifacts)


FACTORIES: dict[str, Callable[[Path, Destinations], Tracker]] = {
    "logging.tensorboard": lambda path, where: TensorBoardTracker(path / "tensorboard"),
    "logging.wandb": lambda path, where: WandbTracker(where.run_name, where),
    "logging.mlflow": lambda path, where: MlflowTracker(where.run_name, where, path),
}


def run_trackers(cfg, run_path: Path) -> Trackers:
    """:func:`open_trackers` for a run config: its ``logging.*`` keys, destinations and artifacts."""
    enabled = {key: getattr(cfg.logging, key.split(".", 1)[1]) for key in TRACKERS}
    where = destinations(cfg.logging, os.environ, run_path)
    return open_trackers(enabled, run_path, where, artifacts=lambda: artifact_files(run_path, cfg.logging.artifacts))
