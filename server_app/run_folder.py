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
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.common.logger import log

from fedopd.config import RunConfig
from fedopd.models.lora import save_adapter
from fedtops_strategy.record import publishable
from fedtops_strategy.text import escape
from server_app.error_lines import KEPT_CHARS, root_cause

EVALUATED = "evaluated"  # round-NNN/evaluated/: the adapter a round evaluated in place of its global one


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

    def __init__(
        self, path: Path, cfg: RunConfig, lora_config, resolved: Mapping[str, Any] | None = None, *, flower_run_id: int = 0, first_round: int = 1
    ) -> None:
        self.path = path
        self.lora_config = lora_config
        # Which Flower run (the SuperLink's run id) played which rounds: a SuperNode keeps its
        # state under that id, and a resumed run names the one whose state its clients restore.
        earlier = read_status(path).get("flower-runs", []) if (path / STATUS).is_file() else []
        self.flower_runs = [r for r in earlier if r[0] < first_round] + [[first_round, int(flower_run_id)]]
        self.private = cfg.privacy.clipping != "off"
        config = cfg.to_run_config()
        if resolved:  # what the run config resolved to on this run's models, e.g. the stop token ids
            config[RESOLVED] = dict(resolved)
        (path / "config.json").write_text(json.dumps(_jsonable(config), indent=2, sort_keys=True) + "\n")

    def flower_run_of(self, server_round: int) -> int | None:
        """The Flower run id that played ``server_round`` (None: before this folder recorded them)."""
        ids = [run_id for first, run_id in self.flower_runs[:-1] if first <= server_round]
        return ids[-1] if ids else None

    def adapter_dir(self, server_round: int, client: int | None = None) -> Path:
        """``round-NNN/`` (global adapter) or ``round-NNN/client-<partition-id>/`` (Local)."""
        path = self.path / f"round-{server_round:03d}"
        return path if client is None else path / f"client-{client}"

    def save_adapter(self, server_round: int, arrays: Mapping[str, np.ndarray], client: int | None = None) -> Path:
        return save_adapter(self.adapter_dir(server_round, client), arrays, self.lora_config)

    def save_evaluated(self, server_round: int, arrays: Mapping[str, np.ndarray]) -> Path:
        """``round-NNN/evaluated/``: what the round's evaluation read in place of θ_{t+1} (FedExP's
        average of the last two iterates)."""
        return save_adapter(self.adapter_dir(server_round) / EVALUATED, arrays, self.lora_config)

    def write_status(self, status: str, rounds_done: int | None = None, error: str | None = None) -> None:
        """``status.json``: ``running`` (with the last complete round), ``completed``, ``failed``
        (with the error) or ``budget-spent`` (a private run stopped before a round that would
        exceed ``privacy.max-epsilon``; ``error`` says by how much), so a script can tell how a run
        ended (``python -m server_app.run_status``)."""
        state = {"status": status, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if rounds_done is not None:
            state["rounds-done"] = rounds_done
        elif (self.path / STATUS).is_file():
            state["rounds-done"] = read_status(self.path).get("rounds-done", 0)
        if error is not None:
            state["error"] = error
        state["flower-runs"] = self.flower_runs
        tmp = self.path / f".{STATUS}.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.path / STATUS)

    def log_client_error(self, server_round: int | None, node_id: int, phase: str, reason: str) -> None:
        """Append one client error reply to ``client-errors.log``: a header line (UTC time, round,
        node id, phase: the message type, and the root cause's line that ``status.json``,
        ``rounds.jsonl`` and the log lines show), then the reason as the runtime delivered it
        (in simulation: Ray's traceback), then a blank line.

        The header is the server's: only it starts with ``=== ``. The reason is the client's, so
        each of its lines is written after :data:`BODY_MARK`, escaped
        (:func:`fedtops_strategy.text.escape`: control and format characters and the backslash as
        visible escapes), and the log is capped: at most :data:`ENTRY_BODY_BYTES` of body per
        entry (a longer one ends in a line saying how many characters were left out; ``reason``
        may be a :class:`server_app.error_lines.ClientText`, the text's head with its full length),
        at most :data:`NODE_LOG_BYTES` per node and :data:`RUN_LOG_BYTES` per run (this process's
        entries and what the file held when it started). Once a cap is reached one line says so
        and that node's (or every node's) further errors are only counted
        (:attr:`client_errors`). A failed write is logged, never raised."""
        try:
            self._log_client_error(server_round, node_id, phase, reason)
        except Exception as err:  # noqa: BLE001 - whatever the client's text, the run goes on
            log(WARNING, "could not log a client error in %s: %s: %s", self.path / CLIENT_ERRORS, type(err).__name__, escape(err, 200))

    @property
    def client_errors(self) -> ClientErrorLog:
        """What :meth:`log_client_error` wrote and counted so far in this process."""
        state = self.__dict__.get("_client_errors")
        if state is None:
            file = self.path / CLIENT_ERRORS
            state = self.__dict__["_client_errors"] = ClientErrorLog(run_bytes=file.stat().st_size if file.exists() else 0)
        return state

    def _log_client_error(self, server_round: int | None, node_id: int, phase: str, reason: str) -> None:
        state = self.client_errors
        node = int(node_id)
        if state.run_full or node in state.full_nodes:
            state.not_logged[node] = state.not_logged.get(node, 0) + 1
            return
        length = getattr(reason, "length", None)
        line = getattr(reason, "line", None)
        text = reason if type(reason) is str else str(reason)
        length = len(text) if not isinstance(length, int) else length
        line = root_cause(text if not isinstance(line, str) else line)  # a ClientText's: of the whole text
        text = text[:ENTRY_BODY_BYTES]  # each character takes one byte or more: all a body can hold
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        where = f"round {int(server_round) if server_round is not None else '?'} node {node}"
        header = f"=== {stamp} {where} {escape(phase, 100)}: {line}\n"
        entry = header + client_text_body(text, length, ENTRY_BODY_BYTES) + "\n"
        size = len(entry.encode("utf-8"))
        node_bytes = state.node_bytes.get(node, 0)
        if state.run_bytes + size + CAP_NOTICE_BYTES > RUN_LOG_BYTES:
            state.run_full = True
            state.not_logged[node] = state.not_logged.get(node, 0) + 1
            entry = f"=== {stamp} {where}: client-errors.log reached {RUN_LOG_BYTES} bytes; further client errors of this run are not logged in full, only counted\n\n"
            log(WARNING, "client-errors.log reached its cap (%d bytes): further client errors are only counted", RUN_LOG_BYTES)
        elif node_bytes + size + CAP_NOTICE_BYTES > NODE_LOG_BYTES:
            state.full_nodes.add(node)
            state.not_logged[node] = state.not_logged.get(node, 0) + 1
            entry = f"=== {stamp} {where}: node {node}'s errors reached {NODE_LOG_BYTES} bytes; its further errors are not logged in full, only counted\n\n"
            log(WARNING, "client-errors.log: node %d's errors reached their cap (%d bytes): further ones are only counted", node, NODE_LOG_BYTES)
        file = self.path / CLIENT_ERRORS
        first = not file.exists()
        data = entry.encode("utf-8")
        try:
            with open(file, "ab") as f:
                f.write(data)
        except OSError as err:
            log(WARNING, "could not write %s: %s", file, err)
            return
        state.run_bytes += len(data)
        state.node_bytes[node] = node_bytes + len(data)
        if first:
            log(INFO, "the full text of client errors: %s", file.resolve())

    def append_round(self, record: dict[str, Any]) -> None:
        with open(self.path / "rounds.jsonl", "a") as f:
            f.write(json.dumps(_jsonable(record), sort_keys=True) + "\n")
        if self.private:
            self.write_published()

    def write_published(self) -> None:
        """``published.jsonl`` (a private run): what each complete round may publish
        (:func:`fedtops_strategy.record.publishable`), rewritten whole from ``rounds.jsonl``, so
        that it never holds a round that ``rounds.jsonl`` does not."""
        lines = [json.dumps(publishable(r), sort_keys=True) + "\n" for r in read_rounds(self.path) if r.get("round", 0) > 0]
        tmp = self.path / f".{PUBLISHED}.tmp"
        tmp.write_text("".join(lines))
        os.replace(tmp, self.path / PUBLISHED)


def read_rounds(path: str | Path) -> list[dict[str, Any]]:
    """The records of a run folder's ``rounds.jsonl``."""
    with open(Path(path) / "rounds.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


STATUS = "status.json"
PUBLISHED = "published.jsonl"  # a private run: what may be published of each round (docs/privacy.md)
CLIENT_ERRORS = "client-errors.log"  # the clients' error replies in full, one entry per reply
BODY_MARK = "  | "  # starts each line of a client's text in client-errors.log (a header starts with '=== ')
ENTRY_BODY_BYTES = KEPT_CHARS  # 64 KiB: the most bytes of one entry's body (the client's text, escaped)
NODE_LOG_BYTES = 1 << 20  # 1 MiB: the most bytes of client-errors.log about one node
RUN_LOG_BYTES = 1 << 24  # 16 MiB: the most bytes of client-errors.log in all
CAP_NOTICE_BYTES = 1 << 10  # kept free under each cap for the line that says it was reached


@dataclass
class ClientErrorLog:
    """What ``client-errors.log`` holds: ``run_bytes`` in all, ``node_bytes`` per node, the nodes
    whose errors are no longer logged in full (``full_nodes``; ``run_full``: no node's), and
    ``not_logged``: per node, the errors only counted."""

    run_bytes: int = 0
    node_bytes: dict[int, int] = field(default_factory=dict)
    full_nodes: set[int] = field(default_factory=set)
    run_full: bool = False
    not_logged: dict[int, int] = field(default_factory=dict)


def client_text_body(text: str, length: int, limit: int) -> str:
    """``text`` (the first characters of a client's text ``length`` characters long) as the body of
    a ``client-errors.log`` entry of at most ``limit`` bytes (UTF-8): each of its lines after
    :data:`BODY_MARK`, escaped; if the text does not fit, a last line (``  [… N more characters
    of the client's text not logged]``, outside the cap) says how much was left out."""
    whole = length <= len(text)
    text = text.rstrip("\n")  # a whole text's trailing line breaks: not part of what it says
    length = len(text) if whole else length
    if not text and whole:
        return ""
    out, size, shown = [], 0, 0
    for line in text.split("\n"):
        written = BODY_MARK + escape(line, 10 * len(line) + 10) + "\n"  # the limit: never cut (each escape <= 10 characters)
        n = len(written.encode("utf-8"))
        if size + n <= limit:
            out.append(written)
            size, shown = size + n, shown + len(line) + 1
            continue
        room = limit - size - len(BODY_MARK) - 1  # as much of the line as fits
        pieces = []
        for ch in line:
            piece = escape(ch)
            room -= len(piece.encode("utf-8"))
            if room < 0:
                break
            pieces.append(piece)
        if pieces:
            out.append(BODY_MARK + "".join(pieces) + "\n")
        shown += len(pieces)
        break
    left = length - min(shown, len(text))
    if left > 0:
        out.append(f"  [… {left} more characters of the client's text not logged]\n")
    return "".join(out)


def read_status(path: str | Path) -> dict[str, Any]:
    """A run folder's ``status.json`` ({} when the run predates it or never started)."""
    file = Path(path) / STATUS
    return json.loads(file.read_text()) if file.is_file() else {}
