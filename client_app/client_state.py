"""A client's state at the end of each round, kept on the client's side for ``resume-from``.

After every train round a client writes what it needs to continue bit-identically, and nothing
else: its optimizer state (AdamW moments and step counts, with ``train.optimizer-state =
'persistent'``) and, for Local, its own adapter. The schedule position and the prompt order are
functions of the round number and need no saving. Nothing here travels to the server.

Folder: ``<client-state-dir>/<run name>/partition-<i>/round-NNN/`` with node config
``client-state-dir``; without it, on a SuperNode with a resident worker (deployment)
``$FEDTOPS_CACHE/client-state/`` (default ``~/.cache/fedtops/client-state/``) in its place, and in
simulation ``<run folder>.clients/partition-<i>/round-NNN/`` beside the run folder (server and
clients share a file system there). The last two rounds are
kept: a stop during round t+1 may leave that round's state behind, and the resumed run needs t's.

A client restores it whenever it trains without state of its own (no ``meta`` in
``context.state``) in a round > 1: the first round of a resumed run, a client that joins after
it, or one that comes back with an empty ``context.state``. It continues from its latest saved
round before the current one.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

OPTIMIZER_FILE, ADAPTER_FILE = "optimizer.safetensors", "adapter.safetensors"
KEEP = 2


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # a run folder's name, as new_run_dir makes them


def client_state_dir(config: Mapping[str, Any], node_config: Mapping[str, Any], partition_id: int | str) -> Path | None:
    """Where this client's per-round state goes; None when the server named no run folder.

    The server's ``run-dir`` only names the run (its last part, a run folder's name: letters,
    digits, ``.``, ``_``, ``-``, not starting with a dot): under ``client-state-dir`` or the
    host's cache, nothing the server sends can place the state, or its clean-up, elsewhere."""
    run_dir = config.get("run-dir")
    if not run_dir:
        return None
    run = Path(str(run_dir))
    if not RUN_NAME.match(run.name):
        raise ValueError(f"train message: 'run-dir' ends in {run.name[:40]!r}, which is not a run folder's name (letters, digits, '.', '_', '-')")
    base = node_config.get("client-state-dir")
    if not base and node_config.get("worker") == "resident":
        # A SuperNode host need not see the server's file system: keep it in the host's cache.
        from fedopd.sandbox.tiny import cache_root

        base = cache_root() / "client-state"
    root = Path(str(base)).expanduser() / run.name if base else run.parent / f"{run.name}.clients"
    return root / f"partition-{partition_id}"


def _round_dirs(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): p for p in folder.iterdir() if (m := re.fullmatch(r"round-(\d{3,})", p.name)) and p.is_dir()}


def save_round_state(folder: Path, server_round: int, optimizer: Mapping[str, np.ndarray] | None, adapter: Mapping[str, np.ndarray] | None) -> Path:
    """Write round ``server_round``'s state (atomically: a temp folder renamed into place)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    final, tmp = folder / f"round-{server_round:03d}", folder / f".round-{server_round:03d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if optimizer is not None:
        save_file({k: np.ascontiguousarray(v) for k, v in optimizer.items()}, str(tmp / OPTIMIZER_FILE))
    if adapter is not None:
        save_file({k: np.ascontiguousarray(v) for k, v in adapter.items()}, str(tmp / ADAPTER_FILE))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for r, path in _round_dirs(folder).items():
        if r <= server_round - KEEP or r > server_round:  # older ones, and leftovers of a stopped run
            shutil.rmtree(path, ignore_errors=True)
    return final


def latest_saved_round(folder: Path | None, server_round: int) -> int | None:
    """The latest round <= ``server_round`` whose state this client saved, or None."""
    rounds = [r for r in _round_dirs(folder) if r <= server_round] if folder is not None else []
    return max(rounds) if rounds else None


def load_round_state(folder: Path | None, server_round: int) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray] | None]:
    """(optimizer state, own adapter) saved at the end of the client's latest round <= ``server_round``."""
    from safetensors.numpy import load_file

    rounds = [r for r in _round_dirs(folder) if r <= server_round] if folder is not None else []
    if not rounds:
        where = folder if folder is not None else "(no client state folder: the server named no run folder)"
        raise FileNotFoundError(f"resume: no client state of round <= {server_round} in {where}")
    path = _round_dirs(folder)[max(rounds)]
    optimizer = load_file(str(path / OPTIMIZER_FILE)) if (path / OPTIMIZER_FILE).exists() else None
    adapter = load_file(str(path / ADAPTER_FILE)) if (path / ADAPTER_FILE).exists() else None
    return optimizer, adapter
