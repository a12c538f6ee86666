"""The run folder: ``config.json``, ``rounds.jsonl``, ``status.json``, ``round-NNN/`` PEFT adapters
and ``client-errors.log`` (the full text of the clients' error replies).

One folder per run under ``output-dir``; an existing folder is never reused or overwritten.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log

from fedopd.config import RunConfig
from fedopd.models.lora import save_adapter
from server_app.error_lines import root_cause


def _jsonable(value: Any) -> Any:
    """JSON without NaN/Infinity literals: non-finite floats become strings."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def new_run_dir(output_dir: str | Path, label: str) -> Path:
    """A fresh folder ``output_dir/<YYYYmmdd-HHMMSS>-<label>[-k]``."""
    root = Path(output_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        path = root / (f"{stamp}-{label}" + (f"-{k}" if k else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a new run folder under {root}")


RESOLVED = "resolved"  # config.json: values the run config resolved to (not run-config keys)


def read_run_config(folder: str | Path) -> dict[str, Any]:
    """The run-config keys of a run folder's ``config.json`` (without its ``resolved`` facts)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    config.pop(RESOLVED, None)
    if config.get("privacy.clipping", "off") == "off":
        # Without privacy the other privacy keys had no effect: they are not part of what the run
        # was, and a later change of their defaults must not make the folder unreadable.
        config = {k: v for k, v in config.items() if not k.startswith("privacy.") or k == "privacy.clipping"}
    return config


def config_mismatch(original: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The run-config keys whose values differ and that a resumed run may not change."""
    from fedopd.config import RESUME_FREE_KEYS, parse_run_config

    before = parse_run_config({k: v for k, v in original.items() if k in current}).to_run_config()
    after = parse_run_config(dict(current)).to_run_config()
    return [k for k in after if k not in RESUME_FREE_KEYS and before.get(k) != after[k]]


def complete_rounds(path: Path) -> list[dict[str, Any]]:
    """The records of the rounds a run folder completed, after removing what a stop left half-written.

    A round is complete when its line in ``rounds.jsonl`` is whole (valid JSON ending in a
    newline); it is written after the round's adapters. A partial last line is cut off, and the
    folders of rounds after the last complete one (adapters written before the stop) are removed.
    """
    file = path / "rounds.jsonl"
    data = file.read_bytes() if file.exists() else b""
    records, keep = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
        keep += len(line)
    if keep != len(data):
        with open(file, "r+b") as f:
            f.truncate(keep)
    last = max((r["round"] for r in records), default=-1)
    for folder in path.glob("round-[0-9][0-9][0-9]"):
        if int(folder.name[6:]) > max(last, 0):
            shutil.rmtree(folder)
    return records


class RunFolder:
    """Writes one run's files as the run goes (a resumed run: appends to its folder)."""

    def __init__(self, path: Path, cfg: RunConfig, lora_config, resolved: Mapping[str, Any] | None = None) -> None:
        self.path = path
        self.lora_config = lora_config
        config = cfg.to_run_config()
        if resolved:  # what the run config resolved to on this run's models, e.g. the stop token ids
            config[RESOLVED] = dict(resolved)
        (path / "config.json").write_text(json.dumps(_jsonable(config), indent=2, sort_keys=True) + "\n")

    def adapter_dir(self, server_round: int, client: int | None = None) -> Path:
        """``round-NNN/`` (global adapter) or ``round-NNN/client-<partition-id>/`` (Local)."""
        path = self.path / f"round-{server_round:03d}"
        return path if client is None else path / f"client-{client}"

    def save_adapter(self, server_round: int, arrays: Mapping[str, np.ndarray], client: int | None = None) -> Path:
        return save_adapter(self.adapter_dir(server_round, client), arrays, self.lora_config)

    def write_status(self, status: str, rounds_done: int | None = None, error: str | None = None) -> None:
        """``status.json``: ``running`` (with the last complete round), ``completed`` or ``failed``
        (with the error), so a script can tell how a run ended (``python -m server_app.run_status``)."""
        state = {"status": status, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if rounds_done is not None:
            state["rounds-done"] = rounds_done
        elif (self.path / STATUS).is_file():
            state["rounds-done"] = read_status(self.path).get("rounds-done", 0)
        if error is not None:
            state["error"] = error
        tmp = self.path / f".{STATUS}.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.path / STATUS)

    def log_client_error(self, server_round: int | None, node_id: int, phase: str, reason: str) -> None:
        """Append one client error reply to ``client-errors.log``: a header line (UTC time, round,
        node id, phase: the message type, and the root cause's line that ``status.json``,
        ``rounds.jsonl`` and the log lines show), then the reason whole, as the runtime delivered it
        (in simulation: Ray's traceback), then a blank line. A failed write is logged, never raised."""
        file = self.path / CLIENT_ERRORS
        first = not file.exists()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        text = str(reason).rstrip("\n")
        entry = f"=== {stamp} round {server_round if server_round is not None else '?'} node {node_id} {phase}: {root_cause(text)}\n{text}\n\n"
        try:
            with open(file, "a", encoding="utf-8", errors="replace") as f:
                f.write(entry)
        except OSError as err:
            log(WARNING, "could not write %s: %s", file, err)
            return
        if first:
            log(INFO, "the full text of client errors: %s", file.resolve())

    def append_round(self, record: dict[str, Any]) -> None:
        with open(self.path / "rounds.jsonl", "a") as f:
            f.write(json.dumps(_jsonable(record), sort_keys=True) + "\n")


def read_rounds(path: str | Path) -> list[dict[str, Any]]:
    """The records of a run folder's ``rounds.jsonl``."""
    with open(Path(path) / "rounds.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


STATUS = "status.json"
CLIENT_ERRORS = "client-errors.log"  # the clients' error replies in full, one entry per reply


def read_status(path: str | Path) -> dict[str, Any]:
    """A run folder's ``status.json`` ({} when the run predates it or never started)."""
    file = Path(path) / STATUS
    return json.loads(file.read_text()) if file.is_file() else {}
