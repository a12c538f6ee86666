"""ClientApp: a thin shell over the ``train``, ``query.score`` and ``evaluate`` handlers.

Each handler unpacks the message, runs the client's work (:mod:`client_app.handlers`) where the
models live, and wraps the result in a reply. Where that is depends on the node config key
``worker``:

- ``"in-process"`` (default; simulation): in this process, whose base models are loaded once and
  shared by every logical client it serves (:mod:`client_app.worker`);
- ``"resident"`` (deployment): in the host's resident worker, a detached Ray actor that outlives
  the messages (:mod:`client_app.resident`). Flower's deployment runtime starts a fresh ClientApp
  process per message, so this module imports neither torch nor the models: it only forwards
  the content, the client's ``context.state`` and the run config, and takes back the reply and
  the new state.

Per-client state (θ_t, the scoring cache, the optimizer state) lives in ``context.state`` in
both modes: per client and per run, never in the worker.

What a client does differently for a strategy (build a scoring cache, learn alone as Local, learn
from the pooled prompts as Centralized) comes from the train message's config, never from the
strategy's name (:mod:`client_app.handlers`).
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
import time
import traceback
from logging import ERROR
from pathlib import Path

from flwr.app import Array, ArrayRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, KEY_NORM_BIT

from fedopd.config import parse_run_config
from fedopd.core.errors import LocalError, public_reason

app = ClientApp()

WORKER_MODES = ("in-process", "resident")


def _partition(context: Context) -> tuple[int, int]:
    values = [context.node_config.get(k) for k in ("partition-id", "num-partitions")]
    if not all(isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str) and v.isdigit() for v in values):
        raise LocalError(
            "node config needs integer 'partition-id' and 'num-partitions' (e.g. flower-supernode --node-config \"partition-id=0 num-partitions=3\")",
            "node config 'partition-id', 'num-partitions'",
            "missing or not integers",
        )
    pid, num = (int(v) for v in values)
    if not 0 <= pid < num:
        raise LocalError(
            f"node config 'partition-id' = {pid} is not in [0, 'num-partitions' = {num})", "node config 'partition-id'", "not in [0, num-partitions)"
        )
    return pid, num


def worker_mode(node_config) -> str:
    """Node config ``worker``: where the models live (default ``in-process``)."""
    mode = str(node_config.get("worker", "in-process"))
    if mode not in WORKER_MODES:
        raise LocalError(
            f"node config 'worker' = {mode!r}; allowed: {', '.join(map(repr, WORKER_MODES))}", "node config 'worker'", "not a worker mode"
        )
    return mode


def handle(kind: str, msg: Message, context: Context) -> Message:
    """Run the ``kind`` handler (``train``, ``score``, ``evaluate``) for ``msg`` and reply.

    A handler that raises becomes an error reply whose reason is
    :func:`~fedopd.core.errors.public_reason`'s: the text of an error about the message itself,
    the key and kind of one about the node's own files or settings, the type of any other. The
    full error, which may quote the node's paths, columns or rows, goes to this node's log only."""
    try:
        pid, num = _partition(context)
        if worker_mode(context.node_config) == "resident":
            from client_app.requests import check_message
            from client_app.resident import call_resident

            # Before any worker is started or stopped: a message the node refuses touches none.
            check_message(kind, msg.content, context.state, num, parse_run_config(context.run_config), context.node_config)

            content, state = call_resident(
                kind, msg.content, context.state, pid, num, dict(context.run_config), context.node_config, context.run_id, context.node_id
            )
            _replace_state(context.state, state)
        else:
            from client_app.handlers import HANDLERS

            cfg = parse_run_config(context.run_config)
            content = HANDLERS[kind](msg.content, context.state, pid, num, cfg, context.node_config, context.run_id, context.node_id)
    except Exception as err:  # noqa: BLE001 - every failure is a reply; its details stay here
        log_failure(kind, err, context)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=public_reason(err, kind)), reply_to=msg)
    return Message(content=content, reply_to=msg)


def trace_file(run_id: int, node_id: int) -> Path:
    """Where a simulated client keeps the tracebacks of its failures: the system's temporary folder,
    ``fedtops-client-errors-<uid>/run-<run id>/node-<node id>.log`` (this user's own folder)."""
    return Path(tempfile.gettempdir()) / f"fedtops-client-errors-{os.getuid()}" / f"run-{int(run_id)}" / f"node-{int(node_id)}.log"


def _append_private(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` in folders only this user may enter (0700, checked), never
    through a symbolic link."""
    root = path.parents[1]
    for folder in (root, path.parent):
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(f"{folder} is not a private folder of this user")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8", errors="backslashreplace") as f:
        f.write(text)


def log_failure(what: str, err: BaseException, context: Context | None) -> None:
    """A failure in this ClientApp, in this node's log. A deployment node's log is its own: the
    whole traceback goes there. A simulated client's log is the run's stream, shared by every client
    and the server: one line (the exception's type and the first line of its text) that names the
    file holding the traceback (:func:`trace_file`)."""
    from fedopd.data.node_data import deployment_node
    from fedtops_strategy.text import escape

    trace = "".join(traceback.format_exception(err)).rstrip()
    if context is None or deployment_node(context.node_config):
        log(ERROR, "%s failed on this node: %s", what, trace)
        return
    first = (str(err).strip().splitlines() or [""])[0]
    line = escape(f"{type(err).__name__}: {first}" if first else type(err).__name__, 300)
    path = trace_file(context.run_id, context.node_id)
    try:
        _append_private(path, f"{what} failed at {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()}):\n{trace}\n\n")
    except OSError as write_err:  # the file is not there to hold it: the stream gets the whole traceback
        log(ERROR, "%s failed on this node (traceback not saved to %s: %s): %s", what, path, type(write_err).__name__, trace)
        return
    log(ERROR, "%s failed on this node: %s (traceback in %s)", what, line, path)


def _replace_state(state: RecordDict, new: RecordDict) -> None:
    for key in list(state.keys()):
        if key not in new:
            del state[key]
    for key, value in new.items():
        state[key] = value


# privacy.side = 'client': the train message carries C and the kind of clipping (fixed, adaptive);
# fedtops_strategy/privacy.py sets both keys. Without them the reply goes out as the handler made it.
CLIPPING_MODES = ("fixed", "adaptive")


def _mod_error(msg: Message, reason: str) -> Message:
    return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=f"privacy_clipping_mod: {reason}"), reply_to=msg)


def privacy_clipping_mod(msg: Message, context: Context, call_next) -> Message:
    """:func:`clip_reply`, whose own failures (an array it cannot read) reply as a handler's do."""
    try:
        return clip_reply(msg, context, call_next)
    except Exception as err:  # noqa: BLE001 - the message's arrays are the server's: any failure is a reply
        log_failure("the privacy clipping mod", err, context)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=public_reason(err, "train")), reply_to=msg)


def clip_reply(msg: Message, context: Context, call_next) -> Message:
    """Client-side clipping when the train config asks for it (``clipping_norm`` and
    ``privacy-clipping``): the reply's update θ_{t,i}^+ − θ_t clipped to norm C
    (:func:`fedtops_strategy.privacy.clip_update`, which keeps a zero update as it is: Flower's
    ``fixedclipping_mod`` divides by its norm); adaptive: the norm bit ``norm_bit`` (1: clipped)
    in the reply's metrics, as Flower's ``adaptiveclipping_mod`` sends it. Else nothing."""
    asking = [c for c in msg.content.config_records.values() if KEY_CLIPPING_NORM in c]
    if not asking:
        return call_next(msg, context)
    from fedtops_strategy.privacy import KEY_CLIPPING_MODE, clip_update

    mode, clip_norm = asking[0].get(KEY_CLIPPING_MODE), asking[0][KEY_CLIPPING_NORM]
    if mode not in CLIPPING_MODES:
        return _mod_error(msg, f"train config '{KEY_CLIPPING_MODE}' = {mode!r}: expected one of {', '.join(map(repr, CLIPPING_MODES))}")
    if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)) or not (math.isfinite(clip_norm) and clip_norm > 0):
        return _mod_error(msg, f"train config '{KEY_CLIPPING_NORM}' = {clip_norm!r}: expected a finite number > 0")
    if len(msg.content.array_records) != 1:
        return _mod_error(msg, f"the train message holds {len(msg.content.array_records)} array records, expected 1 (θ_t)")
    theta = {k: v.numpy() for k, v in next(iter(msg.content.array_records.values())).items()}
    out = call_next(msg, context)
    if out.has_error():
        return out
    if len(out.content.array_records) != 1 or len(out.content.metric_records) != 1:
        return _mod_error(msg, "the reply must hold one array record and one metric record")
    key, record = next(iter(out.content.array_records.items()))
    if list(record.keys()) != list(theta):
        return _mod_error(msg, "the reply's arrays are not θ_t's")
    clipped, was_clipped = clip_update(theta, {k: v.numpy() for k, v in record.items()}, float(clip_norm))
    out.content.array_records[key] = ArrayRecord({k: Array(clipped[k]) for k in theta})
    if mode == "adaptive":
        next(iter(out.content.metric_records.values()))[KEY_NORM_BIT] = int(was_clipped)
    return out


@app.train(mods=[privacy_clipping_mod])
def train(msg: Message, context: Context) -> Message:
    return handle("train", msg, context)


@app.query("score")
def score(msg: Message, context: Context) -> Message:
    return handle("score", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return handle("evaluate", msg, context)
