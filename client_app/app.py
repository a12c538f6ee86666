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

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.common.constant import ErrorCode
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedopd.config import parse_run_config

app = ClientApp()

WORKER_MODES = ("in-process", "resident")


def _partition(context: Context) -> tuple[int, int]:
    try:
        pid, num = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except (KeyError, ValueError) as err:
        raise ValueError(
            "node config needs integer 'partition-id' and 'num-partitions' (e.g. flower-supernode --node-config \"partition-id=0 num-partitions=3\")"
        ) from err
    if not 0 <= pid < num:
        raise ValueError(f"node config 'partition-id' = {pid} is not in [0, 'num-partitions' = {num})")
    return pid, num


def worker_mode(node_config) -> str:
    """Node config ``worker``: where the models live (default ``in-process``)."""
    mode = str(node_config.get("worker", "in-process"))
    if mode not in WORKER_MODES:
        raise ValueError(f"node config 'worker' = {mode!r}; allowed: {', '.join(map(repr, WORKER_MODES))}")
    return mode


def handle(kind: str, msg: Message, context: Context) -> Message:
    """Run the ``kind`` handler (``train``, ``score``, ``evaluate``) for ``msg`` and reply."""
    pid, num = _partition(context)
    if worker_mode(context.node_config) == "resident":
        from client_app.resident import call_resident

        content, state = call_resident(kind, msg.content, context.state, pid, num, dict(context.run_config), context.node_config)
        _replace_state(context.state, state)
    else:
        from client_app.handlers import HANDLERS

        cfg = parse_run_config(context.run_config)
        content = HANDLERS[kind](msg.content, context.state, pid, num, cfg, context.node_config)
    return Message(content=content, reply_to=msg)


def _replace_state(state: RecordDict, new: RecordDict) -> None:
    for key in list(state.keys()):
        if key not in new:
            del state[key]
    for key, value in new.items():
        state[key] = value


# privacy.side = 'client': the train message names which of Flower's clipping mods clips the reply
# (fedtops_strategy/privacy.py sets both keys); without them the reply goes out as the handler made it.
CLIPPING_MODS = {"fixed": fixedclipping_mod, "adaptive": adaptiveclipping_mod}


def privacy_clipping_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``fixedclipping_mod`` or ``adaptiveclipping_mod`` when the train config asks for
    client-side clipping (``clipping_norm`` and ``privacy-clipping``), else nothing."""
    asking = [c for c in msg.content.config_records.values() if KEY_CLIPPING_NORM in c]
    if not asking:
        return call_next(msg, context)
    mode = asking[0].get("privacy-clipping")
    if mode not in CLIPPING_MODS:
        reason = f"train config 'privacy-clipping' = {mode!r}: expected one of {', '.join(map(repr, CLIPPING_MODS))}"
        return Message(Error(code=ErrorCode.MOD_FAILED_PRECONDITION, reason=reason), reply_to=msg)
    return CLIPPING_MODS[mode](msg, context, call_next)


@app.train(mods=[privacy_clipping_mod])
def train(msg: Message, context: Context) -> Message:
    return handle("train", msg, context)


@app.query("score")
def score(msg: Message, context: Context) -> Message:
    return handle("score", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return handle("evaluate", msg, context)
