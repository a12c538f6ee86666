"""Experiment tracking: TensorBoard, Weights & Biases and MLflow behind one :class:`Tracker`.

Each tracker that its run-config key turns on (``logging.tensorboard``, ``logging.wandb``,
``logging.mlflow``; all off by default) gets

- at the start, the run config as the run folder's ``config.json`` holds it (the flat run-config
  dict and its ``resolved`` facts; TensorBoard leaves it to the run folder),
- after each recorded round, :func:`server_app.progress.round_scalars` of the round record, at step
  = the round number (the scalars of ``progress.png`` and ``rounds.jsonl``; nothing of its own),
- at the end, the run's final status as ``status.json`` says it (``completed``, ``failed``,
  ``budget-spent``).

Where W&B and MLflow write, and with which credentials, comes from their own environment variables
(``WANDB_PROJECT``, ``WANDB_MODE``, ``WANDB_DIR``, ``WANDB_API_KEY`` / ``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_NAME``, ...), never from the run config; the project / experiment defaults to
``fedtops`` and the run's name is the run folder's name. docs/tracking.md.

Tracking never stops a run: a tracker that cannot start is reported (ERROR, naming its key) and
left out; one that raises later is warned about once and dropped for the rest of the run.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from logging import ERROR, WARNING
from pathlib import Path
from typing import Any, Protocol

from flwr.common.logger import log

from server_app.progress import TensorBoardLog, round_scalars

DEFAULT_PROJECT = "fedtops"  # W&B project and MLflow experiment when their variables are unset
SUCCESS = ("completed", "budget-spent")  # final statuses of a run that ended as planned


class Tracker(Protocol):
    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run config, once, before round 1."""

    def log_round(self, record: Mapping[str, Any]) -> None:
        """One round record (``rounds.jsonl``), after it is written."""

    def close(self, status: str) -> None:
        """The run's final status (``status.json``); nothing is logged after it."""


class WandbTracker:
    """A W&B run named after the run folder, in ``WANDB_PROJECT`` (default ``fedtops``)."""

    def __init__(self, run_name: str) -> None:
        import wandb  # needs the 'wandb' extra

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=run_name, reinit="create_new")

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_round(self, record: Mapping[str, Any]) -> None:
        self.run.log(round_scalars(record), step=int(record["round"]))

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
    """An MLflow run named after the run folder, in ``MLFLOW_EXPERIMENT_NAME`` (default ``fedtops``)
    on ``MLFLOW_TRACKING_URI``; the config as params, the final status as the tag ``fedtops.status``."""

    def __init__(self, run_name: str) -> None:
        from mlflow import MlflowClient  # needs the 'mlflow' extra

        self.client = MlflowClient()  # MLFLOW_TRACKING_URI, or MLflow's default
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, mlflow_param(value)) for key, value in config.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log_round(self, record: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["round"])
        metrics = [Metric(mlflow_name(key), value, now, step) for key, value in round_scalars(record).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self.client.set_tag(self.run_id, "fedtops.status", status)
        self.client.set_terminated(self.run_id, "FINISHED" if status in SUCCESS else "FAILED")


class Trackers:
    """The run's trackers as one: each call goes to every tracker still on; one that raises is
    warned about once and dropped, and the run goes on."""

    def __init__(self, trackers: Mapping[str, Tracker] | None = None) -> None:
        self.active: dict[str, Tracker] = dict(trackers or {})  # by run-config key
        self.dropped: dict[str, Tracker] = {}  # raised once: still closed with the run's final status

    def _each(self, method: str, *args: Any) -> None:
        for key, tracker in list(self.active.items()):
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
        """Every tracker's final status, those dropped after an error included (best effort: a run
        left RUNNING in MLflow after one failed upload would say nothing of how the run ended)."""
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
    "logging.wandb": ("Weights & Biases", "WANDB_PROJECT, WANDB_MODE, WANDB_DIR, WANDB_API_KEY"),
    "logging.mlflow": ("MLflow", "MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME"),
}


def open_trackers(enabled: Mapping[str, bool], run_path: Path, factories: Mapping[str, Callable[[Path], Tracker]] | None = None) -> Trackers:
    """The trackers whose key is true in ``enabled`` (run-config key -> bool), for the run folder
    ``run_path``; one that cannot start is reported (ERROR, with its key and variables) and left out."""
    factories = {**FACTORIES, **(factories or {})}
    trackers: dict[str, Tracker] = {}
    for key, on in enabled.items():
        if not on:
            continue
        what, where = TRACKERS[key]
        try:
            trackers[key] = factories[key](run_path)
        except Exception as err:  # noqa: BLE001 - tracking must never stop a run
            log(
                ERROR,
                "run config '%s' = true: %s could not start, this run goes on without it: %s: %s (check %s; docs/tracking.md)",
                key,
                what,
                type(err).__name__,
                error_text(err),
                where,
            )
    return Trackers(trackers)


FACTORIES: dict[str, Callable[[Path], Tracker]] = {
    "logging.tensorboard": lambda path: TensorBoardLog(path / "tensorboard"),
    "logging.wandb": lambda path: WandbTracker(path.name),
    "logging.mlflow": lambda path: MlflowTracker(path.name),
}


def run_trackers(cfg, run_path: Path) -> Trackers:
    """:func:`open_trackers` for a run config (its ``logging.*`` keys)."""
    return open_trackers({key: getattr(cfg.logging, key.split(".", 1)[1]) for key in TRACKERS}, run_path)
