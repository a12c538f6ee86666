"""Flower's ``Grid`` over ClientApp handlers called in this process: many short runs, no runtime.

``flwr run`` and ``run_simulation`` start a SuperLink, SuperNodes and Ray workers for every run;
for a grid of dozens of short CPU runs (``python -m eval.sandbox``) that start-up would cost more
than the runs. :class:`InProcessGrid` implements the same ``Grid`` API that the ServerApp and the
strategies use, and delivers each message to the app's own ClientApp (``client_app.app:app``)
with a per-node :class:`~flwr.app.Context` (node config ``partition-id`` / ``num-partitions``,
persistent ``state``), one message at a time, exactly like a simulation with one worker. A
handler that raises becomes an error reply, as in Flower's runtimes. Nothing of the method is
re-implemented: the ServerApp's :func:`~server_app.app.run_server`, the strategies and the
ClientApp handlers are the ones ``flwr run`` uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid

SERVER_NODE_ID = 1
FIRST_NODE_ID = 1001


class InProcessGrid(Grid):
    """``num_nodes`` logical clients (partition ``i`` of ``num_nodes``) served by ``client_app``."""

    def __init__(
        self, client_app, run_config: Mapping[str, Any], num_nodes: int, run_id: int = 1, node_configs: Mapping[int, Mapping[str, Any]] | None = None
    ) -> None:
        """``node_configs``: node config keys of partition ``i`` beside ``partition-id`` and
        ``num-partitions`` (a SuperNode's own, e.g. its ``data-path``)."""
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self.client_app = client_app
        self.run_id = run_id
        self.contexts = {
            FIRST_NODE_ID + i: Context(
                run_id=run_id,
                node_id=FIRST_NODE_ID + i,
                node_config={**(node_configs or {}).get(i, {}), "partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for i in range(num_nodes)
        }
        self._replies: dict[str, Message] = {}
        self._run = None

    # -- the Grid API ------------------------------------------------------------------------
    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        """The run set with :meth:`set_run`, else one with this grid's run id (as a SuperLink's)."""
        from types import SimpleNamespace

        return self._run if self._run is not None else SimpleNamespace(run_id=self.run_id)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = message_id = str(uuid4())
            self._replies[message_id] = self._deliver(msg)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(messages)))

    # -- delivery ----------------------------------------------------------------------------
    def _deliver(self, msg: Message) -> Message:
        from flwr.supercore.task_identity import TaskIdentity

        node = int(msg.metadata.dst_node_id)
        if node not in self.contexts:
            return Message(Error(code=1, reason=f"no node {node}"), reply_to=msg)
        saved = TaskIdentity._node_id
        TaskIdentity.node_id = node
        try:
            return self.client_app(msg, self.contexts[node])
        except Exception as err:  # noqa: BLE001 - a failing ClientApp is an error reply, as in Flower
            return Message(Error(code=2, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
        finally:
            TaskIdentity._node_id = saved


@contextlib.contextmanager
def task_identity(run_id: int = 1) -> Iterator[None]:
    """The process identity that Flower's runtime sets and messages read their sender from."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SERVER_NODE_ID, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def run_in_process(
    run_config: Mapping[str, Any], num_clients: int = 3, *, run_id: int = 1, node_configs: Mapping[int, Mapping[str, Any]] | None = None
) -> Path:
    """One run of the app (``run_config`` validated, missing keys at the app's defaults); its run
    folder. ``run_id`` and ``node_configs``: as :class:`InProcessGrid` takes them."""
    from client_app.app import app as client_app
    from fedopd.config import parse_run_config
    from server_app.app import run_server

    cfg = parse_run_config(dict(run_config))
    grid = InProcessGrid(client_app, cfg.to_run_config(), num_clients, run_id, node_configs)
    with task_identity(run_id):
        return run_server(grid, cfg)
