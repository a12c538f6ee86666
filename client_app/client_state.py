"""A client's state at the end of each round, kept on the client's side for ``resume-from``.

After every train round a client writes what it needs to continue bit-identically, and nothing
else: its optimizer state (AdamW moments and step counts, with ``train.optimizer-state =
'persistent'``) and, for Local, its own adapter. The schedule position and the prompt order are
functions of the round number and need no saving. Nothing here travels to the server.

Folder, on a SuperNode: ``<client-state-dir>/node-<node id>/run-<run id>/partition-<i>/round-NNN/``,
with the node id and run id the SuperLink assigned and node config ``client-state-dir`` (without
it, on a deployment node, ``$FEDTOPS_CACHE/client-state/``, default
``~/.cache/fedtops/client-state/``). Nothing the server sends names or places it: two federations
on one host, or two runs, never share a folder, and a resumed run restores only a run of the
same node id. In
simulation (server and clients share a file system): ``<run folder>.clients/partition-<i>/round-NNN/``
beside the run folder. The last two rounds are kept: a stop during round t+1 may leave that
round's state behind, and the resumed run needs t's.

A client restores it whenever it trains without state of its own (no ``meta`` in
``context.state``) in a round > 1: the first round of a resumed run, a client that joins after
it, or one that comes back with an empty ``context.state``. It continues from its latest saved
round before the current one: this run's, else (a SuperNode in the first round of a resumed run)
that of the run the server resumes, whose run id the train config's ``resume-run`` gives.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedopd.core.errors import LocalError, RequestError

OPTIMIZER_FILE, ADAPTER_FILE = "optimizer.safetensors", "adapter.safetensors"
KEEP = 2


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")  # a run folder's name, as new_run_dir makes them
MAX_RUN_ID = (1 << 64) - 1  # Flower's run ids are unsigned 64-bit integers


def node_state_root(node_config: Mapping[str, Any]) -> Path | None:
    """The node's own root for client state: node config ``client-state-dir``, else on a
    deployment node (:func:`fedopd.data.node_data.deployment_node`) the host's cache; None in
    simulation (the state goes beside the run folder)."""
    from fedopd.data.node_data import deployment_node

    base = node_config.get("client-state-dir")
    if not base and deployment_node(node_config):
        # A SuperNode host need not see the server's file system: keep it in the host's cache.
        from fedopd.sandbox.tiny import cache_root

        base = cache_root() / "client-state"
    return Path(str(base)).expanduser() if base else None


def client_state_dir(
    config: Mapping[str, Any], node_config: Mapping[str, Any], partition_id: int | str, run_id: int = 0, *, node_id: int = 0, resume: bool = False
) -> Path | None:
    """Where this client's per-round state goes; None when the server asked for none (no ``run-dir``).

    On a node with a state root of its own (:func:`node_state_root`: a SuperNode) the folder is
    keyed by the node id and the run id that the SuperLink assigned (``node-<id>/run-<id>``),
    never by a name the server sends; ``resume``: the folder of the run the server resumes (the
    train config's ``resume-run``, a run id, under this node id: a server can point only at a run
    this node took part in under its SuperLink, not at another federation's).
    In simulation (server and clients on one file system) it is beside the server's run folder,
    named by the folder's last part (a run folder's name: letters, digits, ``.``, ``_``, ``-``)."""
    run_dir = config.get("run-dir")
    if not run_dir:
        return None
    root = node_state_root(node_config)
    if root is not None:
        if resume:
            named = config.get("resume-run")  # a decimal string: run ids are unsigned 64-bit, past a ConfigRecord's int64
            if not (isinstance(named, str) and named.isascii() and named.isdigit() and len(named) <= 20 and int(named) <= MAX_RUN_ID):
                raise RequestError(f"train message: 'resume-run' = {named!r}; allowed: a run id, a decimal string of an integer in [0, 2**64)")
            run_id = int(named)
        return root / f"node-{int(node_id)}" / f"run-{int(run_id)}" / f"partition-{partition_id}"
    run = Path(str(run_dir))
    if not RUN_NAME.match(run.name):
        raise RequestError(f"train message: 'run-dir' ends in {run.name[:40]!r}, which is not a run folder's name (letters, digits, '.', '_', '-')")
    return run.parent / f"{run.name}.clients" / f"partition-{partition_id}"


KEEP_RUNS = 4  # a node's newest run folders kept (a resumed run needs the one before it)


def prune_runs(folder: Path, keep: int = KEEP_RUNS) -> list[Path]:
    """On a SuperNode's own root, remove all but this node's ``keep`` newest run folders
    (``<root>/node-<id>/run-<id>/``; ``folder`` is a partition folder inside one), so that a
    server cannot fill the host's disk one run id at a time. Returns what it removed."""
    node = folder.parent.parent
    if not re.fullmatch(r"node-\d+", node.name):
        return []  # the simulation's layout: beside the server's run folder
    runs = sorted((p for p in node.iterdir() if re.fullmatch(r"run-\d+", p.name) and p.is_dir()), key=lambda p: p.stat().st_mtime)
    removed = [p for p in runs[:-keep] if p != folder.parent]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


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
        raise LocalError(f"resume: no client state of round <= {server_round} in {where}", "client state", f"none saved of round <= {server_round}")
    path = _round_dirs(folder)[max(rounds)]
    optimizer = load_file(str(path / OPTIMIZER_FILE)) if (path / OPTIMIZER_FILE).exists() else None
    adapter = load_file(str(path / ADAPTER_FILE)) if (path / ADAPTER_FILE).exists() else None
    return optimizer, adapter
